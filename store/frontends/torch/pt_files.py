"""Reading other frameworks' pickled ``.pt`` files without running their code.

DeepSpeed's checkpoints are ``torch.save`` archives whose pickles name a few
DeepSpeed classes (``ZeroStageEnum``, ``LossScaler``, ``fragment_address``).
:func:`load_pt` reads them with ``torch.load(weights_only=True)``, torch's own
restricted unpickler (the one the DCP import uses for its items): tensors,
storages, plain containers and ``torch.Size`` only. Every other global the
pickle names must fall under the caller's prefixes (``"deepspeed."``); each
becomes an inert :class:`Stub` that keeps the constructor arguments and state it
was given and runs nothing. Any other name is refused before a byte is
unpickled (:func:`torch.serialization.get_unsafe_globals_in_checkpoint`).

torch is imported inside the functions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from reshard.layouts.errors import FormatError


class Stub:
    """An inert stand-in for a framework class named in a pickle: its ``args`` and ``state``, nothing run."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Stub:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args: tuple[Any, ...]
        self.state: Any

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, position: int) -> Any:
        """A field by name from its state (dataclass, plain object), or by position from its arguments
        (named tuple, enum value)."""
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if (isinstance(self.state, tuple) and len(self.state) == 2 and isinstance(self.state[1], dict)
                and name in self.state[1]):  # (dict state, slots state)
            return self.state[1][name]
        if len(self.args) > position:
            return self.args[position]
        raise FormatError(f"{self.qualname} holds no {name!r}")

    def __repr__(self) -> str:
        return f"<stub {self.qualname} args={self.args!r} state={self.state!r}>"


@functools.lru_cache(maxsize=256)
def stub_class(qualname: str) -> type[Stub]:
    """The :class:`Stub` subclass standing in for the class ``qualname`` (one per name)."""
    return type(qualname.rsplit(".", 1)[-1], (Stub,), {"qualname": qualname})


def load_pt(path: str, prefixes: tuple[str, ...] = ("deepspeed.",)) -> Any:
    """Read a ``torch.save`` file at local ``path`` with torch's restricted unpickler (see the module).

    Raises
    ------
    FormatError
        Not a torch archive, or it names a global outside torch's allowed set
        that is not under ``prefixes``.
    """
    import torch

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch's scan of the pickle refuses opcodes with UnpicklingError, and more
        raise FormatError(f"{path} is not a torch.save archive reshard reads ({type(e).__name__}: {e})") from None
    foreign = sorted(n for n in names if not n.startswith(prefixes))
    if foreign:
        raise FormatError(f"{path} pickles {foreign}, which reshard does not load (only tensors, plain containers "
                          f"and inert stand-ins for {list(prefixes)})")
    stubs: list[Any] = [(stub_class(n), n) for n in names]
    try:
        with torch.serialization.safe_globals(stubs):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # whatever a hostile pickle makes the restricted unpickler raise
        raise FormatError(f"{path}: cannot decode it with the restricted unpickler ({type(e).__name__}: {e})"
                          ) from None


def plain(value: Any) -> Any:
    """A pickled value as JSON-able data: 0-d tensors become numbers, stand-ins their fields; larger tensors
    are refused (TypeError)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return value.item()
        raise TypeError(f"a tensor of shape {list(value.shape)}")
    if isinstance(value, Stub):
        return {"stub": value.qualname, "args": plain(list(value.args)), "state": plain(value.state)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__}")

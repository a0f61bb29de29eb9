"""DCP metadata written by Python 3.11.2 (Debian 12's python3) imports too.

That release pickles an enum member as ``getattr(EnumClass, "NAME")``, so DCP's
``.metadata`` names ``builtins.getattr`` for ``_MEM_FORMAT_ENCODING``; reshard's
restricted unpickler refused it (found testing the ``[torch]`` range, issue 14
item 5). It now resolves ``getattr`` for members of the allowed enums only.
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import reshard.store as rs

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from reshard.store.frontends.torch.dcp import read_dcp_metadata  # noqa: E402


class _ByName(pickle.Pickler):
    """Pickle enum members the way Python 3.11.2 does: ``getattr(cls, name)``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _by_name(obj: Any) -> bytes:
    buf = io.BytesIO()
    _ByName(buf, protocol=4).dump(obj)
    return buf.getvalue()


def test_dcp_metadata_with_enum_members_by_getattr(tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)},
                 checkpoint_id=str(tmp_path / "dcp"))
    meta = tmp_path / "dcp" / ".metadata"
    rewritten = _by_name(pickle.loads(meta.read_bytes()))  # our own file, written just above
    assert b"getattr" in rewritten
    meta.write_bytes(rewritten)
    from reshard.store.frontends.torch.dcp import import_dcp

    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"))
    got = rs.open(str(tmp_path / "ck"))["w"].read()
    assert got.astype("float32").tolist() == [[0, 1, 2], [3, 4, 5]]


class _Color(enum.Enum):
    RED = 1


class _Attr:
    """Pickles as ``getattr(target, name)``."""

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name

    def __reduce__(self) -> tuple[Any, ...]:
        return getattr, (self.target, self.name)


def test_getattr_stays_refused_for_anything_else() -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    with pytest.raises(rs.FormatError, match="_Color"):
        read_dcp_metadata(_by_name({"c": _Color.RED}))  # an enum DCP's metadata does not use
    with pytest.raises(rs.FormatError, match="getattr"):  # an allowed enum, but not a member
        read_dcp_metadata(pickle.dumps(_Attr(_MEM_FORMAT_ENCODING, "mro")))
    with pytest.raises(rs.FormatError, match="getattr"):  # an allowed class that is no enum
        read_dcp_metadata(pickle.dumps(_Attr(torch.Size, "count")))

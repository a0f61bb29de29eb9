"""Sub-tree views of a checkpoint: ``ck["model"]`` is the part of the state under ``model.``.

A :class:`SubTree` is a lazy mapping like :class:`~reshard.store.read.checkpoint.Checkpoint`
itself, keyed by the tensors' names relative to its prefix: ``ck["model"]["layers.0.w"]``
is ``ck["model.layers.0.w"]``. It reads nothing until asked (``load``, ``read_all``
or a tensor's ``read``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from reshard.layouts.errors import TensorNotFoundError

from ..format.meta import ArrayMeta
from ..format.tree import LayoutSpec, flatten, suggest
from .display import human_bytes

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .lazy import LazyTensor


class SubTree(Mapping[str, "LazyTensor"]):
    """The tensors and leaves of a checkpoint under one dotted prefix.

    Parameters
    ----------
    ckpt : Checkpoint
        The open checkpoint.
    prefix : str
        A group of the state (``"model"``, ``"optimizer.exp_avg"``), without
        the trailing dot.

    Iteration, ``len`` and ``in`` cover the tensors (relative names); indexing
    also reaches leaves (``ck["optimizer"]["step"]``) and deeper sub-trees.
    """

    def __init__(self, ckpt: Checkpoint, prefix: str) -> None:
        self.ckpt = ckpt
        self.prefix = prefix
        head = prefix + "."
        #: ``{relative name: record}`` of the tensors under the prefix.
        self.arrays: dict[str, ArrayMeta] = {n[len(head):]: m for n, m in ckpt.arrays.items() if n.startswith(head)}
        #: ``{relative name: value}`` of the leaves under the prefix.
        self.leaves: dict[str, Any] = {n[len(head):]: v for n, v in ckpt.leaves.items() if n.startswith(head)}

    @property
    def names(self) -> list[str]:
        """The tensors' relative names."""
        return list(self.arrays)

    @property
    def leaf_names(self) -> list[str]:
        return list(self.leaves)

    @property
    def url(self) -> str:
        return self.ckpt.url

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.arrays.values())

    def _full(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def __getitem__(self, name: str) -> Any:
        if name in self.arrays or name in self.leaves:
            return self.ckpt[self._full(name)]
        tree = SubTree(self.ckpt, self._full(name))
        if tree.arrays or tree.leaves:
            return tree
        raise TensorNotFoundError(f"{self.url}: no tensor named {name!r} under {self.prefix!r}"
                                  f"{suggest(name, [*self.arrays, *self.leaves])}")

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __repr__(self) -> str:
        return f"<reshard.SubTree {self.prefix!r} of {self.url!r}: {len(self)} tensors, {human_bytes(self.nbytes)}>"

    def tree(self) -> dict[str, Any]:
        """Nested dict of lazy tensors and leaves under the prefix."""
        return _below(self.ckpt.tree(), self.prefix)

    def load(self, layouts: LayoutSpec, rank: int, *, names: Any = None,
             out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One rank's pieces of the sub-tree: :meth:`Checkpoint.load` with names relative to the prefix.

        ``layouts`` (a mapping or a ``(name, shape) -> Layout`` rule), ``names``
        and ``out`` use relative names; the result is nested from the prefix
        down, leaves under the prefix included.
        """
        if isinstance(layouts, Mapping):
            full: LayoutSpec = {self._full(n): lay for n, lay in layouts.items()}
        else:
            rule = layouts
            head = len(self.prefix) + 1

            def full(name: str, shape: tuple[int, ...]) -> Any:
                return rule(name[head:], shape)
        if names is None and not isinstance(layouts, Mapping):
            names = list(self.arrays)
        wanted = None if names is None else [self._full(n) for n in names]
        given = None
        if out is not None:
            given = {self._full(n): v for n, v in flatten(out, self.arrays)[0].items()}
        return _below(self.ckpt.load(full, rank, names=wanted, out=given), self.prefix)

    def read_all(self) -> dict[str, Any]:
        """Every tensor of the sub-tree whole (nested), plus its leaves."""
        from reshard.layouts import Layout

        return self.load(lambda n, s: Layout.single(s), rank=0)


def _below(nested: dict[str, Any], prefix: str) -> dict[str, Any]:
    node: Any = nested
    for part in prefix.split("."):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node if isinstance(node, dict) else {}

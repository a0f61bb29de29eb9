"""Placement + SBP: OneFlow's global-view layouts, ``to_global``/``to_local``, and the sharded save and load
(:func:`save_oneflow`, :func:`load_oneflow`; the package docstring tells the whole story)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import BadNameError, LayoutError

from ...format.tree import flatten, is_tensor, unflatten
from ...read.checkpoint import Checkpoint
from ...read.open import open
from ...write.writer import CheckpointWriter, create, single_process
from .flow_save import is_flow_save, load_flow_save
from .npz import KeyPath, key_str, load_npz, save_npz, walk

SbpLike = Any  # an SBP, a tuple of them, or a callback (state_dict, tensor) -> SBP


class sbp:  # spelled like flow.sbp on purpose
    """SBP spellings without OneFlow: ``sbp.split(0)``, ``sbp.broadcast``."""

    broadcast = "broadcast"
    partial_sum = "partial_sum"

    @staticmethod
    def split(dim: int) -> str:
        """Split tensor dim ``dim`` across a placement axis."""
        return f"split({int(dim)})"


def load_local(src: Any, *, headers_only: bool = False) -> dict[str, Any]:
    """One rank's local state dict from a ``flow.save`` folder or a :func:`save_npz` folder / ``.npz`` file.

    Parameters
    ----------
    src : str or Path
        The folder (or ``.npz`` file).
    headers_only : bool
        Tensors become zero-memory stand-ins of the right shape and dtype.
    """
    if is_flow_save(src):
        return load_flow_save(src, headers_only=headers_only)
    return load_npz(src, headers_only=headers_only)


def placement_ranks(ranks: Any) -> list[int]:
    """The flat rank list of a placement's (nested) rank array."""
    return [int(r) for r in np.asarray(ranks, dtype=np.int64).reshape(-1)]


def _sbp_of(spec: SbpLike, state: Any, tensor: Any) -> Any:
    return spec(state, tensor) if callable(spec) and not isinstance(spec, str) else spec


def tensor_paths(state: Mapping[Any, Any]) -> dict[str, tuple[KeyPath, Any]]:
    """``{dotted name: (key path, tensor)}`` of a nested state dict's tensors.

    Raises
    ------
    BadNameError
        For two key paths with the same dotted name (``{"a": {"b": x}}`` next
        to ``{"a.b": y}``): one checkpoint name each.
    """
    out: dict[str, tuple[KeyPath, Any]] = {}
    for path, value in walk(state):
        if not is_tensor(value):
            continue
        name = ".".join(path)
        if name in out:
            raise BadNameError(f"name {name!r} is given twice (as {list(out[name][0])} and {list(path)})")
        out[name] = (path, value)
    return out


def _with_path(layout: Layout, path: KeyPath) -> Layout:
    return dataclasses.replace(layout, origin={**(layout.origin or {}), "path": list(path)})


def placement_layouts(state: Mapping[Any, Any], ranks: Any, spec: SbpLike, *,
                      shapes: Mapping[str, Sequence[int]] | None = None, local: bool = True) -> dict[str, Layout]:
    """``to_global`` as layouts: ``{dotted name: Layout}`` of a state dict's tensors on a placement.

    Parameters
    ----------
    state : mapping
        Nested state dict (numpy arrays or anything with ``shape``); a callback
        `spec` is called with this very object.
    ranks : nested list of int
        ``placement.ranks``; its shape is the hierarchy.
    spec : SBP, tuple of SBP, or callable
        See the module docstring.
    shapes : mapping, optional
        Global shapes by dotted name.
    local : bool
        The arrays are local parts: without `shapes`, a global dim is the local
        one times the placement axes that split it (OneFlow's own rule, exact
        when the split divides). False: the arrays are global.

    Returns
    -------
    dict of str to Layout
        Each layout's ``origin`` holds OneFlow's placement and SBP and the key
        path of the tensor.
    """
    shapes = shapes or {}
    out = {}
    for name, (path, tensor) in tensor_paths(state).items():
        s = _sbp_of(spec, state, tensor)
        shape = tuple(int(n) for n in np.shape(tensor))
        if name in shapes:
            shape = tuple(int(n) for n in shapes[name])
        elif local:
            probe = Layout.from_oneflow(ranks, s, shape)
            shape = tuple(n * math.prod(probe.mesh[a] for a in axes)
                          for n, axes in zip(shape, probe.dims, strict=True))
        out[name] = _with_path(Layout.from_oneflow(ranks, s, shape), path)
    return out


def _map(state: Any, fn: Any, path: KeyPath = ()) -> Any:
    """``state`` with every tensor replaced by ``fn(dotted name, tensor)``; containers kept."""
    if isinstance(state, Mapping):
        return {k: _map(v, fn, (*path, key_str(k, path))) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and any(is_tensor(v) or isinstance(v, (Mapping, list, tuple)) for v in state):
        items = [_map(v, fn, (*path, str(i))) for i, v in enumerate(state)]
        return type(state)(items) if isinstance(state, list) else tuple(items)
    return fn(".".join(path), state) if is_tensor(state) else state


def _layouts_any(state: Any, ranks: Any, spec: SbpLike) -> dict[str, Layout]:
    """Layouts of the global arrays of a nested dict/list/tuple (to_global's inputs)."""
    out: dict[str, Layout] = {}

    def visit(name: str, tensor: Any) -> Any:
        out[name] = Layout.from_oneflow(ranks, _sbp_of(spec, state, tensor), np.shape(tensor))
        return tensor

    _map(state, visit)
    return out


def to_global(state: Any, ranks: Any, spec: SbpLike) -> Any:
    """The layout each global array of ``state`` gets on a placement (``flow.utils.global_view.to_global``).

    Parameters
    ----------
    state : dict, list, tuple, array or None
        Whole (global) arrays, nested in dicts, lists and tuples, as OneFlow accepts.
    ranks : nested list of int
        ``placement.ranks``.
    spec : SBP, tuple of SBP, or callable ``(state, tensor) -> sbp``
        See the module docstring.

    Returns
    -------
    Any
        ``state`` with every array replaced by its :class:`~reshard.layouts.Layout`
        (``.region(rank)``, ``.local_shape(rank)``); other values kept.
    """
    layouts = _layouts_any(state, ranks, spec)
    return _map(state, lambda name, _: layouts[name])


def to_local(state: Any, ranks: Any, spec: SbpLike, rank: int) -> Any:
    """One rank's local parts of whole arrays: OneFlow's ``to_local(to_global(state, placement, sbp))``.

    Parameters
    ----------
    state : dict, list, tuple or array
        Whole (global) arrays; the callback sees this object.
    ranks : nested list of int
        ``placement.ranks``.
    spec : SBP, tuple of SBP, or callable ``(state, tensor) -> sbp``
        See the module docstring.
    rank : int
        The rank whose parts to cut.

    Returns
    -------
    Any
        The same containers and keys (dotted keys stay dotted) holding the
        rank's pieces (views); None for a rank outside the placement.
    """
    if rank not in placement_ranks(ranks):
        return None
    layouts = _layouts_any(state, ranks, spec)
    return _map(state, lambda name, t: np.asarray(t)[(*layouts[name].region(rank), ...)])


def global_shapes(by_rank: Mapping[int, Mapping[Any, Any]], ranks: Any, spec: SbpLike) -> dict[str, tuple[int, ...]]:
    """Exact global shapes from every rank's local pieces, even when splits do not divide.

    Along a tensor dim, the pieces of the ranks that differ only on the
    placement axes splitting it tile the dim; the other axes repeat them. So
    the dim is the sum over all ranks divided by the repeat count.
    """
    flat = placement_ranks(ranks)
    first = by_rank[flat[0]]
    out = {}
    for name, (_, tensor) in tensor_paths(first).items():
        probe = Layout.from_oneflow(ranks, _sbp_of(spec, first, tensor), np.shape(tensor))
        total = [0] * len(probe.shape)
        for r in flat:
            held = tensor_paths(by_rank[r]).get(name)
            if held is None:
                raise LayoutError(f"rank {r}'s state dict lacks {name!r}, which rank {flat[0]}'s holds")
            local = np.shape(held[1])
            if len(local) != len(total):
                raise LayoutError(f"{name!r} is {len(local)}-d on rank {r} but {len(total)}-d on rank {flat[0]}")
            total = [t + n for t, n in zip(total, local, strict=True)]
        repeat = [math.prod(m for a, m in enumerate(probe.mesh) if a not in axes) for axes in probe.dims]
        out[name] = tuple(t // k for t, k in zip(total, repeat, strict=True))
    return out


def save_oneflow(state: Mapping[Any, Any] | None, url: str, ranks: Any, spec: SbpLike, *,
                 rank: int | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
                 commit: bool | None = None, **options: Any) -> CheckpointWriter | None:
    """Save local state dicts of the model-file placement (``flow.save(to_local(...))``).

    Two ways to call it:

    * per rank, in every process of the job:
      ``save_oneflow(local_sd, url, ranks, sbp, rank=r)``, with ``local_sd``
      what OneFlow's ``to_local(to_global(state_dict, placement, sbp))`` gives
      rank ``r``. Ranks outside the placement save nothing (their ``local_sd``
      may be None), as ``if rank in placement.ranks: flow.save(...)``. Commit
      once all have written: ``writer.commit()`` on one rank after a barrier,
      or ``commit=True`` on the rank you know finishes last.
    * all ranks at once: ``save_oneflow({rank: local_sd, ...}, url, ranks, sbp)``;
      global shapes come out exact from the pieces; commits unless ``commit=False``.

    Parameters
    ----------
    state : mapping or None
        The rank's local state dict (nested, numpy arrays and JSON leaves), or
        ``{rank: local state dict}`` when `rank` is None.
    url : str
        Destination (local path or fsspec URL).
    ranks : nested list of int
        The model-file placement's ranks.
    spec : SBP, tuple of SBP, or callable ``(state_dict, tensor) -> sbp``
        The callback gets the local state dict (the first placement rank's
        in the all-ranks call) and one of its tensors; it has the keys and
        nesting of the global one, so seed 001's ``get_sbp`` works as is.
    rank : int, optional
        This process's rank (per-rank call).
    shapes : mapping, optional
        Global shapes by dotted name; per rank, needed when a split does not divide.
    commit : bool, optional
        Commit after writing (default: True for the all-ranks call only).
    **options
        As for :func:`reshard.store.create` (``overwrite``, ``save_id``...).

    Returns
    -------
    CheckpointWriter or None
        The writer (``.commit()``), or None when this rank saves nothing.

    Raises
    ------
    LayoutError
        For ``partial_sum``, an unknown SBP, or ranks that do not match the placement.
    ShapeMismatchError
        When a piece does not have the shape the placement gives its rank.
    """
    flat = placement_ranks(ranks)
    if rank is not None:
        if state is None or rank not in flat:
            return None
        writer = create(url, placement_layouts(state, ranks, spec, shapes=shapes), **options)
        writer.write(rank, state)
        if commit:
            writer.commit()
        return writer
    if state is None or sorted(state) != sorted(flat):
        got = sorted(state) if state is not None else None
        raise LayoutError(f"save_oneflow without rank= wants {{rank: state dict}} for ranks {flat}, got {got}")
    exact = {**global_shapes(state, ranks, spec), **(shapes or {})}
    writer = create(url, placement_layouts(state[flat[0]], ranks, spec, shapes=exact), **single_process(options))
    for r in flat:
        writer.write(r, state[r])
    if commit is None or commit:
        writer.commit()
    return writer


def _paths_of(ckpt: Checkpoint) -> dict[str, list[str]]:
    out = {}
    for name, meta in ckpt.arrays.items():
        path = (meta.origin or {}).get("path") if isinstance(meta.origin, Mapping) else None
        if isinstance(path, list) and path and ".".join(map(str, path)) == name:
            out[name] = [str(p) for p in path]
    return out


def load_oneflow(src: str | Checkpoint, rank: int, ranks: Any, spec: SbpLike, *,
                 names: Sequence[str] | None = None,
                 storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One rank's local state dict on a placement and SBP (``to_local(to_global(load(...)))``).

    Parameters
    ----------
    src : str or Checkpoint
        The checkpoint (any saving layout: OneFlow, MindSpore, torch...).
    rank : int
        The rank to load for.
    ranks : nested list of int
        The target placement's ranks.
    spec : SBP, tuple of SBP, or callable ``(state_dict, tensor) -> sbp``
        The callback gets the checkpoint as a nested dict of lazy tensors
        (with the key paths they were saved under, see the module docstring)
        and one of them: test ``tensor is sd[...]``, or ``tensor.name`` /
        ``tensor.shape``.
    names : sequence of str, optional
        Load only these dotted names.
    storage_options : dict, optional
        fsspec options when `src` is a URL.

    Returns
    -------
    dict or None
        Nested ``{key: numpy array}`` plus the leaves, nested as saved; None for
        a rank outside the placement (as OneFlow's ``local_state_dict = None``).
    """
    if rank not in placement_ranks(ranks):
        return None
    ckpt = src if isinstance(src, Checkpoint) else open(src, storage_options=storage_options)
    paths = _paths_of(ckpt)
    lazy = {n: ckpt[n] for n in ckpt.arrays}
    tree = unflatten({**ckpt.leaves, **lazy}, paths)
    wanted = list(names) if names is not None else list(ckpt.arrays)
    missing = [n for n in wanted if n not in ckpt.arrays]
    if missing:
        raise KeyError(f"{ckpt.url} holds no tensors {missing}")
    layouts = {n: Layout.from_oneflow(ranks, _sbp_of(spec, tree, lazy[n]), ckpt.arrays[n].shape) for n in wanted}
    pieces, _ = flatten(ckpt.load(layouts, rank), ckpt.arrays)
    return unflatten({**ckpt.leaves, **pieces}, paths)


__all__ = ["global_shapes", "load_flow_save", "load_local", "load_npz", "load_oneflow", "placement_layouts",
           "placement_ranks", "save_npz", "save_oneflow", "sbp", "tensor_paths", "to_global", "to_local", "walk"]

"""OneFlow front end: the global-view sharded save and load of seed 001, without OneFlow.

OneFlow saves a big model by moving its state dict onto a "model file"
placement (``flow.utils.global_view.to_global(state_dict, placement, sbp)``),
then each rank of that placement saves its local part (``to_local``) with
``flow.save`` into its own folder. Here the local parts go into one reshard
checkpoint instead, every tensor one zarr array whose shards are the
placement's blocks, and can be loaded back onto any other placement and SBP.

* :func:`save_oneflow` is ``flow.save(to_local(to_global(sd, placement, sbp)))``:
  each rank of the placement writes its local pieces (no communication).
* :func:`load_oneflow` is ``to_global(flow.load(...), placement, sbp)`` followed
  by ``to_local`` on a new placement: each rank reads only its own region.
* :func:`to_local` cuts whole arrays into one rank's pieces (what OneFlow's
  ``to_global`` + ``to_local`` give a rank), e.g. for tests or single-process use.

``sbp`` is one SBP for every tensor, a tuple for an N-d placement, or a
callback ``(state_dict, tensor) -> sbp`` as in OneFlow (compare tensors with
``is``). SBPs are OneFlow objects, their ``str``, or the strings of :class:`sbp`
(``split(d)``, ``broadcast``). Splits are OneFlow's balanced ones (the first
``S % k`` pieces one longer); ``partial_sum`` cannot be saved.

OneFlow's own ``flow.save`` files are pickles: reshard does not read them
(unpickling runs code). Load them in OneFlow and pass numpy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import LayoutError

from ..reader import Checkpoint, open
from ..tree import flatten, unflatten
from ..writer import CheckpointWriter, create

SbpLike = Any  # an SBP, a tuple of them, or a callback (state_dict, tensor) -> SBP


class sbp:  # spelled like flow.sbp on purpose
    """SBP spellings without OneFlow: ``sbp.split(0)``, ``sbp.broadcast``."""

    broadcast = "broadcast"
    partial_sum = "partial_sum"

    @staticmethod
    def split(dim: int) -> str:
        """Split tensor dim ``dim`` across a placement axis."""
        return f"split({int(dim)})"


def placement_ranks(ranks: Any) -> list[int]:
    """The flat rank list of a placement's (nested) rank array."""
    return [int(r) for r in np.asarray(ranks, dtype=np.int64).reshape(-1)]


def _sbp_of(spec: SbpLike, state: Any, tensor: Any) -> Any:
    return spec(state, tensor) if callable(spec) and not isinstance(spec, str) else spec


def placement_layouts(state: Mapping[str, Any], ranks: Any, spec: SbpLike, *,
                      shapes: Mapping[str, Sequence[int]] | None = None, local: bool = True) -> dict[str, Layout]:
    """``to_global`` as layouts: ``{dotted name: Layout}`` of a state dict's tensors on a placement.

    Parameters
    ----------
    state : mapping
        Nested state dict (numpy arrays or anything with ``shape``).
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
    """
    shapes = shapes or {}
    tensors, _ = flatten(state)
    out = {}
    for name, tensor in tensors.items():
        s = _sbp_of(spec, state, tensor)
        shape = tuple(int(n) for n in np.shape(tensor))
        if name in shapes:
            shape = tuple(int(n) for n in shapes[name])
        elif local:
            probe = Layout.from_oneflow(ranks, s, shape)
            shape = tuple(n * math.prod(probe.mesh[a] for a in axes)
                          for n, axes in zip(shape, probe.dims, strict=True))
        out[name] = Layout.from_oneflow(ranks, s, shape)
    return out


def to_local(state: Mapping[str, Any], ranks: Any, spec: SbpLike, rank: int) -> dict[str, Any] | None:
    """One rank's local parts of a state dict of whole arrays (``to_local(to_global(...))``).

    Returns None for a rank outside the placement; leaves pass through.
    """
    if rank not in placement_ranks(ranks):
        return None
    tensors, leaves = flatten(state)
    layouts = placement_layouts(state, ranks, spec, local=False)
    pieces = {n: np.asarray(t)[(*layouts[n].region(rank), ...)] for n, t in tensors.items()}
    return unflatten({**leaves, **pieces})


def save_oneflow(state: Mapping[Any, Any] | None, url: str, ranks: Any, spec: SbpLike, *,
                 rank: int | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
                 commit: bool | None = None, **options: Any) -> CheckpointWriter | None:
    """Save local state dicts of the model-file placement (``flow.save(to_local(...))``).

    Two ways to call it:

    * per rank, in every process: ``save_oneflow(local_sd, url, ranks, sbp, rank=r)``.
      Ranks outside the placement pass (or not) ``None`` and nothing happens.
      Commit once all have written: ``writer.commit()`` on one rank after a
      barrier, or ``commit=True`` on the rank you know finishes last.
    * all ranks at once: ``save_oneflow({rank: local_sd, ...}, url, ranks, sbp)``;
      commits unless ``commit=False``.

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
        The callback gets the rank's local state dict and the tensor object.
    rank : int, optional
        This process's rank (per-rank call).
    shapes : mapping, optional
        Global shapes by dotted name, needed when a split does not divide.
    commit : bool, optional
        Commit after writing (default: True for the all-ranks call only).
    **options
        As for :func:`reshard.store.create`.

    Returns
    -------
    CheckpointWriter or None
        The writer (``.commit()``), or None when this rank saves nothing.
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
    layouts = placement_layouts(state[flat[0]], ranks, spec, shapes=shapes)
    writer = create(url, layouts, **options)
    for r in flat:
        writer.write(r, state[r])
    if commit is None or commit:
        writer.commit()
    return writer


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
        The callback gets the checkpoint's nested dict of lazy tensors
        (:meth:`Checkpoint.tree`) and one of them: test ``tensor is sd[...]``
        or look at ``tensor.name`` / ``tensor.shape``.
    names : sequence of str, optional
        Load only these dotted names.
    storage_options : dict, optional
        fsspec options when `src` is a URL.

    Returns
    -------
    dict or None
        Nested ``{name: numpy array}`` plus the leaves; None for a rank outside
        the placement (as OneFlow's ``local_state_dict = None``).
    """
    if rank not in placement_ranks(ranks):
        return None
    ckpt = src if isinstance(src, Checkpoint) else open(src, storage_options=storage_options)
    tree = ckpt.tree()
    lazy, _ = flatten(tree, ckpt.arrays)
    wanted = list(names) if names is not None else list(ckpt.arrays)
    layouts = {n: Layout.from_oneflow(ranks, _sbp_of(spec, tree, lazy[n]), ckpt.arrays[n].shape) for n in wanted}
    return ckpt.load(layouts, rank)


__all__ = ["load_oneflow", "placement_layouts", "placement_ranks", "save_oneflow", "sbp", "to_local"]

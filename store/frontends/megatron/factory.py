"""Megatron-Core weights saved in several blocks per rank (a ``ShardedTensorFactory``), for :mod:`.buckets`.

Megatron-Core saves a gated MLP's ``linear_fc1`` (SwiGLU, ``gated_linear_unit``)
through ``apply_swiglu_sharded_factory`` (``megatron/core/transformer/mlp.py``):
tensor-parallel rank ``r`` of ``tp`` holds the local weight ``[gate_r; up_r]``
(``[2 * ffn / tp, h]``) and saves it as TWO ``ShardedTensor`` s of one key, its
halves at dim-0 fragments ``r`` and ``r + tp`` of ``2 * tp`` (dim 0 being the
first axis after the prepended ones: a layer, an expert). The global saved
tensor is ``[gate of every rank; up of every rank]``, and a ``dp_reshardable``
bucket's parameter is the concatenation of two blocks that are not adjacent.
(With the ``singleton_local_shards`` save option the halves are two keys,
``<key>_w`` and ``<key>_v``, each split like any weight; such saves are not
joined here, and untested.)

:func:`joined_index` lists every such pair of a save's blocks (:func:`factory_pairs`), with the digest
of their concatenation, so that a bucket parameter matches it as it matches a
single block; :func:`split_pieces` cuts a parameter's stored pieces at the
blocks' bound, so that each optimizer state lands in the global ``[gate; up]``
tensor where the weight does. :func:`no_match_reason` says why a parameter
matches nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from reshard.layouts.errors import FormatError
from reshard.layouts.megatron_buckets import BucketPiece

from ...io.storage import Storage
from ..torch.dcp import _dcp_item

Block = tuple[str, tuple[int, ...], tuple[int, ...]]  # (model key, chunk offsets, chunk sizes)
Part = tuple[Block, ...]  # the blocks a parameter's flattening is the concatenation of, in order
#: (chunk offset, chunk length, start, stop, block, at): elements [start, stop) of the stored chunk are the
#: block's elements [at, at + stop - start) (of its row-major flattening).
Cut = tuple[int, int, int, int, Block, int]


def digest(tensor: Any) -> bytes:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).digest()


#: The tensors Megatron-Core saves through ``apply_swiglu_sharded_factory``: a gated MLP's ``linear_fc1`` weight
#: and bias (``MLP.sharded_state_dict``; an MoE expert's too, under its own prefix and index).
FACTORY_KEYS = re.compile(r"(.+\.)?linear_fc1\.(weight|bias)\d*")
#: Optimizer state, not model weights: unprefixed or a ChainedOptimizer's (``chained_<i>.optimizer.``).
OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def factory_pairs(md: Any) -> Iterator[Part]:
    """The (gate, up) block pairs ``apply_swiglu_sharded_factory`` saves: of a :data:`FACTORY_KEYS` tensor, blocks
    ``i`` and ``i + m`` of ``2m`` equal fragments along the first axis whose blocks are longer than 1, every other
    offset equal."""
    for fqn, item in md.state_dict_metadata.items():
        if (OPTIMIZER_KEY.match(fqn) or not FACTORY_KEYS.fullmatch(fqn) or not hasattr(item, "chunks")
                or len(item.chunks) < 2):
            continue
        blocks = [(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in item.chunks]
        sizes = {s for _, s in blocks}
        if len(sizes) != 1:
            continue
        (size,) = sizes
        axis = next((a for a, n in enumerate(size) if n > 1), None)
        if axis is None or int(item.size[axis]) % (2 * size[axis]):
            continue
        half = int(item.size[axis]) // 2
        at = {off: (fqn, off, sz) for off, sz in blocks}
        for off, sz in blocks:
            if off[axis] < half:
                other = (*off[:axis], off[axis] + half, *off[axis + 1:])
                if other in at:
                    yield ((fqn, off, sz), at[other])


def joined_index(store: Storage, md: Any, where: dict[Any, Any]) -> dict[tuple[str, int], dict[bytes, set[Part]]]:
    """Every :func:`factory_pairs` pair by dtype, total length and the digest of its blocks concatenated."""
    import torch

    index: dict[tuple[str, int], dict[bytes, set[Part]]] = {}
    for part in factory_pairs(md):
        tensors = []
        for fqn, offsets, _ in part:
            info = where.get((fqn, offsets))
            if info is None:
                raise FormatError(f"{store.url}: chunk {list(offsets)} of {fqn!r} has no storage entry in .metadata")
            tensors.append(_dcp_item(store, info, f"chunk {list(offsets)} of {fqn!r}").reshape(-1))
        joined = torch.cat(tensors)
        dtype = str(joined.dtype).removeprefix("torch.")
        index.setdefault((dtype, joined.numel()), {}).setdefault(digest(joined), set()).add(part)
    return index


def split_pieces(part: Part, pieces: tuple[BucketPiece, ...]) -> list[Cut]:
    """A parameter's stored pieces (``(chunk offset, start, stop)`` of its flattening) cut at its blocks' bounds."""
    out: list[Cut] = []
    at = 0
    for block in part:
        n = int(np.prod(block[2]))
        for chunk, a, b in pieces:
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                out.append((chunk, b - a, lo - a, hi - a, block, lo - at))
        at += n
    return out


def no_match_reason(main: np.ndarray, start: int, index: dict[tuple[str, int], Any],
                    cast: Callable[[np.ndarray, str], Any]) -> str:
    """Why the fp32 main parameter at ``start`` equals no saved weight (``index``: (dtype, length) -> digest ->
    the blocks (joined) of that value, as :mod:`.buckets` builds it; ``cast(values, dtype)``: a torch tensor)."""
    if not index:
        return "the save holds no model weights (an optimizer-only save), which place the parameters"
    prefixes = sorted((n, part[0][0], part[0][1]) for (dtype, n), table in index.items() if start + n <= len(main)
                      for part in table.get(digest(cast(main[start:start + n], dtype)), ()) if len(part) == 1)
    if prefixes:
        n, key, offsets = prefixes[0]
        return (f"its first {n} elements equal the block at {list(offsets)} of {key!r}, what follows no other "
                "block: the weight is saved in several blocks per rank (a ShardedTensorFactory) in a way reshard "
                "does not join")
    return ("the saved weights are not the optimizer's main parameters cast to their dtype: FP8 parameters "
            "(saved dequantized), a save that skipped Megatron's parameter sync, or weights of another job")

"""Megatron-Core's ``dp_reshardable`` distributed-optimizer state: from flat buckets to each parameter's own shape.

In the ``dp_reshardable`` form (the default of Megatron-LM 0.16) the
distributed optimizer saves its buffers as they sit on the ranks: bucket ``b``
of buffer ``i`` of the data-parallel group ``g`` (one per tensor/pipeline
parallel rank) and state ``s`` (``param``: the fp32 main parameter;
``exp_avg``, ``exp_avg_sq``) is a 1-d tensor
``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<dtypes>.bucket_idx_<b>.<s>``
of the bucket's unpadded length, one DCP chunk per (parameter, data-parallel
rank) piece and per padding gap. Which parameter sits where is not saved: the
buffer order is the model's reverse ``named_parameters()`` order, which the
checkpoint does not record, and parameters of one shape (every layer's) leave
the same chunk bounds whatever their order.

:func:`place_buckets` finds it from the checkpoint alone, and proves it: the
saved model weights are Megatron's parameters, and the fp32 main parameter is
what they were cast from (the optimizer copies it into them after each step),
so a bucket's ``param`` state cast to a weight's dtype equals that weight's
saved block, byte for byte. Walking each bucket from its start, the next
parameter starts at the next multiple of 64 elements
(:mod:`reshard.layouts.megatron_buckets`) and must end on a stored chunk bound;
of the model's tensor-parallel blocks, exactly one may match there. None (model
weights not saved, or out of step with the optimizer: FP8 parameters, a save
that skipped the parameter sync) is an error naming the bucket and offset;
several blocks with identical values are accepted only when their optimizer
states are identical too (then any choice gives the same values), else
refused. The placement is then checked against Megatron's rules and the
stored chunks (:func:`~reshard.layouts.megatron_buckets.bucket_pieces`).

Each state of each parameter becomes ``optimizer.state.<s>.<model key>`` in the
model tensor's shape, under a :class:`~reshard.layouts.FlatLayout` whose range
``k`` is the ``k``-th stored piece (a data-parallel rank's range of a
tensor-parallel block). A block held by several data-parallel groups (a norm
weight replicated over tensor parallelism) is taken from the lowest group.

A ``ChainedOptimizer`` (an MoE model under expert parallelism: 0 dense, 1 the
experts, over the expert-data-parallel group) saves each optimizer's buckets
under ``chained_<i>.``: :func:`place_chained_buckets` places each optimizer's
on their own against the same saved weights, its tensors named
``chained_<i>.optimizer.state.<s>.<model key>`` (the names Megatron gives the
``fully_reshardable`` form).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import FormatError
from reshard.layouts.megatron_buckets import BucketPiece, bucket_pieces, chunk_bounds, param_start

from ...io.storage import Storage
from ..torch.dcp import _dcp_item
from .factory import Block, Part, digest, joined_index, no_match_reason, split_pieces
from .grouped import grouped_index, is_grouped

BUCKET_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                        r"\.([A-Za-z_][A-Za-z0-9_]*)")
#: ShardedObjects of the form that :func:`place_buckets` reads (checked, not kept as leaves).
BUCKET_OBJECTS = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.per_bucket_numel(_unpadded)?(/shard_.*)?")
#: A ``ChainedOptimizer``'s prefix (one optimizer per parameter group, e.g. an MoE model's expert parameters):
#: its buckets are decoded like the unprefixed ones, into ``chained_<i>.optimizer.state.<s>.<model key>``.
CHAINED = re.compile(r"(chained_\d+\.)(optimizer\..+)")
#: Flat buckets under any other prefix: not decoded, an import refuses them unless skipped.
PREFIXED_BUCKETS = re.compile(r"(.+)\.optimizer\.distributed\..+")
MAIN_PARAM = "param"

Placed = tuple[tuple[BucketPiece, ...], dict[str, str]]  # a parameter's pieces in a bucket; state -> bucket fqn
Index = dict[tuple[str, int], dict[bytes, set[Part]]]  # (dtype, length) -> digest -> the blocks joined


Source = tuple[str, int, int, int, int]  # (bucket fqn, chunk offset, chunk length, start, stop)


@dataclass
class BucketTensor:
    """One imported state tensor: its layout, dtype, and per range the stored chunk it comes from."""

    layout: Layout
    dtype: str
    #: (bucket fqn, chunk offset, chunk length, start, stop): elements [start, stop) of that stored chunk
    sources: list[Source] = field(default_factory=list)
    #: A GroupedMLP state (:mod:`.grouped`; ``layout`` then the saved weight's blocks): per parameter, its blocks
    #: (a :data:`~.grouped.GROUPED` part) and the sources of its flat memory, in order.
    grouped: list[tuple[Part, list[Source]]] = field(default_factory=list)


def chained_prefix(fqn: str) -> str:
    """``"chained_<i>."`` for a ``ChainedOptimizer``'s key ``chained_<i>.optimizer.*``, else ``""``."""
    m = CHAINED.fullmatch(fqn)
    return m.group(1) if m else ""


def is_bucket_key(fqn: str) -> bool:
    return BUCKET_KEY.fullmatch(fqn.removeprefix(chained_prefix(fqn))) is not None


def is_bucket_object(fqn: str) -> bool:
    """A ``per_bucket_numel*`` ShardedObject (read by :func:`place_buckets`), unprefixed or a chained optimizer's."""
    return BUCKET_OBJECTS.fullmatch(fqn.removeprefix(chained_prefix(fqn))) is not None


def place_chained_buckets(store: Storage, md: Any, where: dict[Any, Any]) -> dict[str, BucketTensor]:
    """:func:`place_buckets` for the unprefixed buckets and for each ``ChainedOptimizer``'s (``chained_<i>.``).

    Each optimizer's buckets are placed on their own (an optimizer's buckets hold only its parameters,
    e.g. the expert-parallel ones under the expert-data-parallel group) against the same model weights;
    their tensors keep the optimizer's prefix. A model tensor placed by two optimizers is refused.
    """
    prefixes = sorted({chained_prefix(fqn) for fqn in md.state_dict_metadata if is_bucket_key(fqn)},
                      key=lambda p: (len(p), p))
    out: dict[str, BucketTensor] = {}
    owner: dict[str, str] = {}
    index = model_index(store, md, where) if prefixes else {}  # read once, for every optimizer
    for prefix in prefixes:
        for name, tensor in place_buckets(store, md, where, prefix, index).items():
            key = name.removeprefix(prefix).split(".", 3)[3]
            if owner.setdefault(key, prefix) != prefix:
                raise FormatError(f"{store.url}: the optimizer state of {key!r} is found in the buckets of two "
                                  f"optimizers ({owner[key] or 'unprefixed'!r} and {prefix!r})")
            out[name] = tensor
    return out


def place_buckets(store: Storage, md: Any, where: dict[Any, Any], prefix: str = "",
                  index: Index | None = None) -> dict[str, BucketTensor]:
    """Every ``dp_reshardable`` bucket state of a ``torch_dist`` save, as per-parameter tensors (see the module).

    ``prefix``: only the buckets under it (a ``ChainedOptimizer``'s ``"chained_<i>."``), whose tensors keep it;
    ``index``: the saved model blocks by digest, when the caller has read them already.
    """
    buckets: dict[tuple[int, int, str, int], dict[str, Any]] = {}
    for fqn, item in md.state_dict_metadata.items():
        m = BUCKET_KEY.fullmatch(fqn[len(prefix):]) if fqn.startswith(prefix) else None
        if m and hasattr(item, "chunks"):
            g, i, dt, b, state = m.groups()
            buckets.setdefault((int(g), int(i), dt, int(b)), {})[state] = (fqn, item)
    if not buckets:
        return {}
    if index is None:
        index = model_index(store, md, where)
    unpadded = _unpadded_sizes(store, md, where, prefix)
    found: dict[Part, Placed] = {}
    ambiguous: list[tuple[frozenset[Part], Placed]] = []
    states: list[str] | None = None
    for key in sorted(buckets):
        entry = buckets[key]
        what = (f"bucket {key[3]} of buffer {key[1]} of data-parallel group {key[0]}"
                + (f" of {prefix}optimizer.distributed" if prefix else ""))
        if MAIN_PARAM not in entry:
            raise FormatError(f"{what}: no {MAIN_PARAM!r} state (the fp32 main parameters), which places the others")
        if states is None:
            states = sorted(entry)
        elif sorted(entry) != states:
            raise FormatError(f"{what}: states {sorted(entry)}, other buckets hold {states}")
        fqn, item = entry[MAIN_PARAM]
        size = _size(item, fqn)
        chunks = [(int(c.offsets[0]), int(c.sizes[0])) for c in item.chunks]
        for s in states:
            other = entry[s][1]
            if _size(other, entry[s][0]) != size or sorted((int(c.offsets[0]), int(c.sizes[0]))
                                                           for c in other.chunks) != sorted(chunks):
                raise FormatError(f"{what}: state {s!r} is stored in other chunks than {MAIN_PARAM!r}")
        want = unpadded.get((key[0], key[1], key[3]))
        if want is not None and want != size:
            raise FormatError(f"{what}: stored with {size} elements, its per_bucket_numel_unpadded says {want}")
        bounds = set(chunk_bounds(size, chunks, what))
        for off, n in chunks:  # sizes checked against the bytes stored before allocating the bucket
            info = where.get((fqn, (off,)))
            if info is not None and int(getattr(info, "length", 0)) < n * item.properties.dtype.itemsize:
                raise FormatError(f"{what}: chunk [{off}] claims {n} elements but its stored item holds "
                                  f"{info.length} bytes")
        main = np.empty(size, dtype=np.float32)
        for off, n in chunks:
            main[off:off + n] = _read(store, where, fqn, off, n).astype(np.float32, copy=False)
        spans, picks = _walk(what, main, bounds, index)
        pieces = bucket_pieces(size, chunks, spans, what)
        fqns = {s: entry[s][0] for s in states}
        for blocks, piece in zip(picks, pieces, strict=True):
            if len(blocks) == 1:
                found.setdefault(next(iter(blocks)), (piece, fqns))
            else:
                ambiguous.append((blocks, (piece, fqns)))
    _settle(store, where, found, ambiguous)
    return {prefix + name: t for name, t in _tensors(md, found, states or [], store).items()}


def _walk(what: str, main: np.ndarray, bounds: set[int], index: Index
          ) -> tuple[list[tuple[int, int]], list[frozenset[Part]]]:
    import torch

    def cast(values: np.ndarray, dtype: str) -> Any:
        return torch.from_numpy(values).to(getattr(torch, dtype))

    size = len(main)
    at, spans, picks = 0, [], []
    while at < size:
        start = param_start(at)
        if start >= size or start not in bounds:
            raise FormatError(f"{what}: no parameter can start at element {start} (the bucket holds {size}; "
                              "parameters start 64-aligned on a stored chunk bound)")
        hits: dict[int, set[Part]] = {}
        for (dtype, n), table in index.items():
            if start + n in bounds:
                got = table.get(_digest(cast(main[start:start + n], dtype)))
                if got:
                    hits.setdefault(n, set()).update(got)
        if not hits:
            raise FormatError(f"{what}: the fp32 main parameter at element {start} equals no saved model weight "
                              "(cast to its dtype), so its place cannot be proven: "
                              f"{no_match_reason(main, start, index, cast)}")
        if len(hits) > 1:
            hits = _joined_over_halves(hits)
        if len(hits) > 1:
            raise FormatError(f"{what}: the values at element {start} match saved weights of {sorted(hits)} elements: "
                              "the parameter's length is ambiguous")
        (n, blocks), = hits.items()
        spans.append((start, start + n))
        picks.append(frozenset(blocks))
        at = start + n
    return spans, picks


def _joined_over_halves(hits: dict[int, set[Part]]) -> dict[int, set[Part]]:
    """A factory-saved weight whose first block also ends on a chunk bound matches both as itself and as that
    block alone: the joined blocks are the parameter (Megatron saves a key in halves only through a factory)."""
    longest = max(hits)
    heads = {(part[0],) for part in hits[longest] if len(part) > 1}
    if all(part in heads for n, parts in hits.items() if n != longest for part in parts):
        return {longest: hits[longest]}
    return hits


def _settle(store: Storage, where: dict[Any, Any], found: dict[Part, Placed],
            ambiguous: list[tuple[frozenset[Part], Placed]]) -> None:
    """Blocks of identical values: accepted when every state of the spans they match is identical too."""
    groups: dict[frozenset[Part], list[Placed]] = {}
    for blocks, placed in ambiguous:
        groups.setdefault(blocks, []).append(placed)
    for blocks, spans in groups.items():
        digests = set()
        for piece, fqns in spans:
            digests.add(tuple(hashlib.sha256(b"".join(_read(store, where, fqns[s], off, b - a).tobytes()
                                                      for off, a, b in piece)).digest() for s in sorted(fqns)))
        if len(digests) > 1:
            names = sorted(" + ".join(f"{k} at {list(o)}" for k, o, _ in part) for part in blocks)
            raise FormatError(f"parameters {names} hold identical values but different optimizer states: which "
                              "state belongs to which cannot be told from the checkpoint")
        for block in sorted(blocks):
            found.setdefault(block, spans[0])


def _tensors(md: Any, found: dict[Part, Placed], states: list[str], store: Storage) -> dict[str, BucketTensor]:
    out = _grouped_tensors(md, {p: v for p, v in found.items() if is_grouped(p)}, states, store)
    # each block's cuts (chunk offset, chunk length, start, stop) in its flattening's order, and the bucket fqns
    cuts: dict[Block, tuple[list[tuple[int, int, int, int, int]], dict[str, str]]] = {}
    for part, (pieces, fqns) in found.items():
        if is_grouped(part):
            continue
        for chunk, n, lo, hi, block, at in split_pieces(part, pieces):
            cuts.setdefault(block, ([], fqns))[0].append((chunk, n, lo, hi, at))
    by_key: dict[str, list[Block]] = {}
    for block in cuts:
        by_key.setdefault(block[0], []).append(block)
    for name, blocks in sorted(by_key.items()):
        if f"optimizer.state.{MAIN_PARAM}.{name}" in out:
            raise FormatError(f"{store.url}: the buckets hold some blocks of {name!r} as GroupedMLP parameters "
                              f"(transposed) and others as plain parameters")
        item = md.state_dict_metadata[name]
        every = {(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in item.chunks}
        held = {(off, sizes) for _, off, sizes in blocks}
        if held != every:
            missing = sorted(every - held)[:3]
            raise FormatError(f"{store.url}: the buckets hold optimizer state for only part of {name!r} (none for "
                              f"its blocks at {[list(o) for o, _ in missing]})")
        shape = tuple(int(n) for n in item.size)
        for s in states:
            ranges: list[tuple[int, tuple[int, ...], tuple[int, ...], int, int, int]] = []
            sources = []
            for block in sorted(blocks):
                _, off, sizes = block
                held_cuts, fqns = cuts[block]
                for chunk, n, lo, hi, at in held_cuts:
                    ranges.append((len(ranges), off, sizes, at, at + hi - lo, 0))
                    sources.append((fqns[s], chunk, n, lo, hi))
            lay = FlatLayout.from_ranges(shape, ranges, {"framework": "megatron", "form": "dp_reshardable"})
            dtype = str(md.state_dict_metadata[sources[0][0]].properties.dtype).removeprefix("torch.")
            out[f"optimizer.state.{s}.{name}"] = BucketTensor(lay, dtype, sources)
    return out


def _grouped_tensors(md: Any, found: dict[Part, Placed], states: list[str], store: Storage
                     ) -> dict[str, BucketTensor]:
    """The states of GroupedMLP parameters (:mod:`.grouped`), in the saved weight's name, shape and blocks."""
    by_key: dict[str, list[tuple[Part, Placed]]] = {}
    for part, placed in sorted(found.items()):
        by_key.setdefault(part[1][0], []).append((part, placed))
    out: dict[str, BucketTensor] = {}
    for name, parts in by_key.items():
        item = md.state_dict_metadata[name]
        every = [(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in item.chunks]
        held = sorted((off, sizes) for part, _ in parts for _, off, sizes in part[1:])
        if held != sorted(every):
            missing = sorted(set(every) - set(held))[:3]
            raise FormatError(f"{store.url}: the buckets hold the GroupedMLP optimizer state of {name!r} for only "
                              f"part of it (its blocks at {[list(o) for o, _ in missing]} are "
                              f"{'missing' if missing else 'held twice'})")
        shape = tuple(int(n) for n in item.size)
        lay = Layout.from_blocks(shape, [(i, off, sizes, 0) for i, (off, sizes) in enumerate(every)])
        for s in states:
            grouped = [(part, [(fqns[s], chunk, b - a, 0, b - a) for chunk, a, b in pieces])
                       for part, (pieces, fqns) in parts]
            dtype = str(md.state_dict_metadata[grouped[0][1][0][0]].properties.dtype).removeprefix("torch.")
            out[f"optimizer.state.{s}.{name}"] = BucketTensor(lay, dtype, grouped=grouped)
    return out


def model_index(store: Storage, md: Any, where: dict[Any, Any]) -> Index:
    """What a bucket parameter may equal: every saved model block, every pair a SwiGLU factory saved (joined), and
    every GroupedMLP parameter (the transposed view of its blocks, :mod:`.grouped`)."""
    index: Index = {k: {d: {(b,) for b in blocks} for d, blocks in table.items()}
                    for k, table in _model_index(store, md, where).items()}
    for extra in (joined_index(store, md, where), grouped_index(store, md, where)):
        for k, table in extra.items():
            for d, parts in table.items():
                index.setdefault(k, {}).setdefault(d, set()).update(parts)
    return index


def _model_index(store: Storage, md: Any, where: dict[Any, Any]) -> dict[tuple[str, int], dict[bytes, set[Block]]]:
    """Every saved model block (a DCP chunk of a tensor outside ``optimizer.``) by dtype, length and digest."""
    index: dict[tuple[str, int], dict[bytes, set[Block]]] = {}
    for fqn, item in md.state_dict_metadata.items():
        if fqn.startswith("optimizer.") or chained_prefix(fqn) or not hasattr(item, "chunks"):
            continue
        dtype = str(item.properties.dtype).removeprefix("torch.")
        for chunk in item.chunks:
            offsets, sizes = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
            n = int(np.prod(sizes))
            if n == 0:
                continue
            info = where.get((fqn, offsets))
            if info is None:
                raise FormatError(f"{store.url}: chunk {list(offsets)} of {fqn!r} has no storage entry in .metadata")
            tensor = _dcp_item(store, info, f"chunk {list(offsets)} of {fqn!r}")
            if tuple(tensor.shape) != sizes or str(tensor.dtype).removeprefix("torch.") != dtype:
                raise FormatError(f"{store.url}: chunk {list(offsets)} of {fqn!r} is not the {dtype} {list(sizes)} "
                                  "the metadata says")
            index.setdefault((dtype, n), {}).setdefault(_digest(tensor), set()).add((fqn, offsets, sizes))
    return index


def _unpadded_sizes(store: Storage, md: Any, where: dict[Any, Any], prefix: str = ""
                    ) -> dict[tuple[int, int, int], int]:
    """``per_bucket_numel_unpadded`` as saved: (group, buffer, bucket) -> elements (checked against the tensors)."""
    out: dict[tuple[int, int, int], int] = {}
    for idx, info in where.items():
        m = re.fullmatch(re.escape(prefix) + r"optimizer\.distributed\.dp_group_idx_(\d+)\.per_bucket_numel_unpadded"
                         r"(/shard_.*)?", idx[0])
        if not m:
            continue
        value = _dcp_item(store, info, f"item {idx[0]!r}")
        while isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
            value = value[0]  # ShardedObjects are saved wrapped
        if not isinstance(value, list):
            raise FormatError(f"{store.url}: {idx[0]!r} is not a list of buffers")
        for i, buf in enumerate(value):
            sizes = list(buf.values()) if isinstance(buf, dict) and len(buf) == 1 else None
            if not sizes or not isinstance(sizes[0], list) or not all(type(n) is int for n in sizes[0]):
                raise FormatError(f"{store.url}: {idx[0]!r} buffer {i} is not {{dtypes: [bucket sizes]}}")
            for b, n in enumerate(sizes[0]):
                out[(int(m.group(1)), i, b)] = n
    return out


def _size(item: Any, fqn: str) -> int:
    size = tuple(int(n) for n in item.size)
    if len(size) != 1:
        raise FormatError(f"bucket tensor {fqn!r} has shape {list(size)}, not 1-d")
    return size[0]


def _read(store: Storage, where: dict[Any, Any], fqn: str, off: int, n: int) -> np.ndarray:
    from ...format.torch_arrays import to_numpy

    info = where.get((fqn, (off,)))
    if info is None:
        raise FormatError(f"{store.url}: chunk [{off}] of {fqn!r} has no storage entry in .metadata")
    tensor = _dcp_item(store, info, f"chunk [{off}] of {fqn!r}")
    if tuple(tensor.shape) != (n,):
        raise FormatError(f"{store.url}: chunk [{off}] of {fqn!r} has shape {list(tensor.shape)}, the metadata "
                          f"says [{n}]")
    return np.asarray(to_numpy(tensor))


_digest = digest

"""Layouts on a Megatron mesh for every tensor a preset's name rules recognise.

The mesh is Megatron-LM's default rank order ``tp-cp-ep-dp-pp`` (tensor-parallel
fastest; context parallelism 1): axes ``(pp, dp, ep, tp)`` row-major, so

    rank = ((p * dp + d) * ep + e) * tp + t.

Dense tensors are replicated over ``dp`` and ``ep`` (Megatron folds the expert
axis into data parallelism for them); expert tensors are split over ``ep`` (global
expert ``i`` on expert rank ``i // (experts / ep)``) with the expert
tensor-parallel size equal to ``tp`` (Megatron's default), and replicated over
``dp``. Layers go to pipeline stages in order, ``layers / pp`` each; the word
embedding on the first stage, the output layer and final norm on the last.

Pure math: names and shapes in, :class:`~reshard.layouts.Layout` out.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..core import Layout
from ..errors import LayoutError
from . import rules
from .rules import Rule

#: Mesh axes, outermost first (rank order ``tp-cp-ep-dp-pp`` read from the slowest axis).
AXES = ("pp", "dp", "ep", "tp")
#: Trailing name components of per-parameter optimizer states (``...q_proj.weight.exp_avg``): matched without them.
STATE_WORDS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "square_avg", "sum", "step")


class PresetError(LayoutError):
    """A preset cannot lay out a checkpoint as asked (the message says which tensor and count)."""


@dataclass(frozen=True)
class Mesh:
    """The parallel sizes: tensor, pipeline, expert and data parallelism (each at least 1)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PresetError(f"--{axis} must be a positive integer, got {value!r}")

    @property
    def world(self) -> int:
        """The number of ranks, ``tp * pp * ep * dp``."""
        return self.tp * self.pp * self.ep * self.dp

    def rank(self, pp: int = 0, dp: int = 0, ep: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (tensor-parallel fastest)."""
        return ((pp * self.dp + dp) * self.ep + ep) * self.tp + tp


@dataclass(frozen=True)
class Counts:
    """Model sizes the preset checks the mesh against; None: unknown (read from shapes where they tell)."""

    heads: int | None = None
    kv_heads: int | None = None
    experts: int | None = None


@dataclass(frozen=True)
class PresetResult:
    """What a preset gives: a layout per tensor, the rule each matched, the names it did not know, notes."""

    layouts: dict[str, Layout]
    rules: dict[str, Rule]
    unmatched: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())


@dataclass
class _Item:
    name: str
    shape: tuple[int, ...]
    rule: Rule
    base: int = 0  # stacked leading axes (layers, experts)
    layer_axis: int | None = None
    layer: int | None = None
    expert_axis: int | None = None
    expert: int | None = None
    tp_dim: int | None = None


def _key(name: str) -> str:
    """`name` without a trailing optimizer-state word (``x.weight.exp_avg`` -> ``x.weight``)."""
    head, _, last = name.rpartition(".")
    return head if head and last in STATE_WORDS else name


def _item(name: str, shape: tuple[int, ...], rule: Rule) -> _Item:
    key = _key(name)
    it = _Item(name, shape, rule)
    if rule.family == rules.MC:
        m = rules.MC_LAYER.search(key)
        if m and m.group(2) is None and shape:
            it.layer_axis, it.base = 0, 1
        elif m and m.group(2) is not None:
            it.layer = int(m.group(2))
        if rules.MC_STACKED_EXPERTS.search(key) and len(shape) > it.base:
            it.expert_axis, it.base = it.base, it.base + 1
    else:
        h = rules.HF_LAYER.search(key)
        it.layer = int(h.group(3)) if h else None
    e = rules.EXPERT.search(key)
    if e and it.expert_axis is None:
        it.expert = int(e.group(2))
    if rule.dim is not None:
        dim = it.base + rule.dim if rule.dim >= 0 else len(shape) + rule.dim
        it.tp_dim = dim if it.base <= dim < len(shape) else None
    return it


def _few(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def megatron_layouts(shapes: Mapping[str, Sequence[int]], mesh: Mesh, counts: Counts = Counts()) -> PresetResult:
    """Megatron-LM's layouts of every tensor on ``mesh``, by name (:mod:`.rules`).

    Parameters
    ----------
    shapes : mapping
        ``{name: global shape}``.
    mesh : Mesh
        The parallel sizes.
    counts : Counts
        Attention heads, key-value heads (query groups), experts, where known.

    Returns
    -------
    PresetResult
        Tensors no rule knows are whole on every rank (listed in ``unmatched``).

    Raises
    ------
    PresetError
        No tensor matches the preset; tp does not divide the heads, the
        key-value heads (query groups) or a split dim; ep does not divide the
        experts; pp does not divide the layers; the counts are needed and
        unknown.
    """
    items: dict[str, _Item] = {}
    unmatched = []
    for name, shape in shapes.items():
        rule = rules.match(_key(name))
        if rule is None:
            unmatched.append(name)
        else:
            items[name] = _item(name, tuple(int(s) for s in shape), rule)
    if not items:
        raise PresetError(f"preset megatron matches none of the {len(shapes)} tensors (e.g. {_few(sorted(shapes))}): "
                          "it knows Megatron-Core names (embedding.word_embeddings.weight, "
                          "decoder.layers.self_attention.linear_qkv.weight, ...) and Hugging Face names "
                          "(model.layers.<i>.self_attn.q_proj.weight, transformer.h.<i>.mlp.c_fc.weight, ...)")
    notes: list[str] = []
    _check_heads(items, shapes, mesh, counts)
    _glu(items, shapes, mesh, notes)
    layers = _layers(items, mesh)
    experts = _experts(items, mesh, counts)
    out = {}
    for name, it in items.items():
        out[name] = _layout(it, mesh, layers, experts)
    full = {}
    for name in unmatched:
        full[name] = Layout(tuple(shapes[name]), (mesh.world,))
    fused = sorted(n for n, it in items.items() if it.rule.kind == "fused" and it.tp_dim is None and mesh.tp > 1)
    if fused:
        notes.append(f"kept whole over the {mesh.tp} tensor-parallel ranks: {_few(fused)} (fused tensors whose "
                     "parts the preset cannot tell apart by shape)")
    if unmatched and mesh.world > 1:
        notes.append(f"{len(unmatched)} tensors match no rule of preset megatron and are whole on every rank: "
                     f"{_few(sorted(unmatched))}")
    return PresetResult({**out, **full}, {n: it.rule for n, it in items.items()}, tuple(unmatched), tuple(notes))


def _sibling(name: str, old: str, new: str, shapes: Mapping[str, Sequence[int]]) -> tuple[int, ...] | None:
    """The shape of the tensor named like `name` with `old` replaced by `new` (and ``.bias`` by ``.weight``)."""
    for cand in (re.sub(old, new, name), re.sub(old, new, name.replace(".bias", ".weight"))):
        if cand != name and cand in shapes:
            return tuple(shapes[cand])
    return None


def _check_heads(items: dict[str, _Item], shapes: Mapping[str, Sequence[int]], mesh: Mesh, counts: Counts) -> None:
    attention = sorted(n for n, it in items.items() if it.rule.heads in ("q", "kv", "qkv") and it.tp_dim is not None)
    if mesh.tp == 1 or not attention:
        return
    h = counts.heads
    if h is None:
        raise PresetError(f"--tp {mesh.tp} splits attention tensors ({_few(attention, 2)}) by heads, but the number "
                          "of attention heads is not known: the checkpoint carries no config naming it; pass --heads H "
                          "(and --kv-heads G for grouped-query attention)")
    if h % mesh.tp:
        first = next((n for n in attention if items[n].rule.heads in ("q", "qkv")), attention[0])
        raise PresetError(f"--tp {mesh.tp} does not divide the {h} attention heads ({first}): Megatron gives "
                          "each tensor-parallel rank whole heads")
    for name in attention:
        it = items[name]
        rows = it.shape[it.tp_dim]  # type: ignore[index]
        if it.rule.heads == "q":
            if rows % h:
                raise PresetError(f"{name}: {rows} rows are not {h} heads of equal size (--heads {h})")
            continue
        if it.rule.heads == "kv":
            q = _sibling(name, r"(k_proj|v_proj)", "q_proj", shapes)
            if q is None:
                raise PresetError(f"{name}: no q_proj beside it to tell the head size from")
            if q[0] % h:
                raise PresetError(f"{name}: the {q[0]} rows of its q_proj are not {h} heads of equal size "
                                  f"(--heads {h})")
            g, rem = divmod(rows, q[0] // h)
        else:
            proj = _sibling(name, r"linear_qkv\.(weight|bias)$", "linear_proj.weight", shapes)
            if proj is None:
                raise PresetError(f"{name}: no linear_proj.weight beside it to tell the head size from")
            if proj[-1] % h:
                raise PresetError(f"{name}: the {proj[-1]} inputs of its linear_proj.weight are not {h} heads of "
                                  f"equal size (--heads {h})")
            size = proj[-1] // h
            groups, rem = divmod(rows - proj[-1], 2 * size)
            g = groups
        if rem or g < 1:
            raise PresetError(f"{name}: {rows} rows do not hold whole key-value heads beside {h} query heads")
        if counts.kv_heads is not None and counts.kv_heads != g:
            raise PresetError(f"{name} holds {g} key-value heads (query groups), not --kv-heads {counts.kv_heads}")
        if g % mesh.tp:
            raise PresetError(f"--tp {mesh.tp} does not divide the {g} key-value heads (query groups) of {name}: "
                              "Megatron gives each tensor-parallel rank whole query groups")


def _glu(items: dict[str, _Item], shapes: Mapping[str, Sequence[int]], mesh: Mesh, notes: list[str]) -> None:
    """Megatron-Core ``linear_fc1`` of a GLU (``[gate; up]`` rows) becomes ``fused`` in two parts: tensor-parallel
    rank ``t`` holds ``gate[t]`` and ``up[t]`` (``apply_swiglu_sharded_factory``), two blocks."""
    tails: dict[str, tuple[int, ...]] | None = None  # the linear_fc2 weights by their name from "decoder."
    for name, it in items.items():
        if it.rule.heads != "glu" or it.tp_dim is None:
            continue
        fc2 = _sibling(name, r"linear_fc1\.(weight|bias)$", "linear_fc2.weight", shapes)
        if fc2 is None and ".decoder." in name:  # an optimizer state (optimizer.state.exp_avg.decoder...): its
            if tails is None:                       # parameter's linear_fc2, so that both split alike
                tails = {n[n.index("decoder."):]: tuple(v) for n, v in shapes.items()
                         if n.endswith("linear_fc2.weight") and "decoder." in n}
            tail = name[name.index(".decoder.") + 1:]
            fc2 = tails.get(re.sub(r"linear_fc1\.(weight|bias)$", "linear_fc2.weight", tail))
        rows = it.shape[it.tp_dim]
        if fc2 is not None and rows == fc2[-1]:
            continue  # plain MLP: column-parallel
        if fc2 is not None:
            it.rule = Rule("fused", it.rule.dim, it.rule.stage, family=it.rule.family,
                           what="GLU linear_fc1 (gate and up halves)", parts=2)
            continue
        it.rule = Rule("fused", None, it.rule.stage, family=it.rule.family, what="GLU linear_fc1")
        it.tp_dim = None
        if mesh.tp > 1:
            notes.append(f"{name}: no linear_fc2.weight beside it tells whether it is a GLU; kept whole over tp")


def _layers(items: dict[str, _Item], mesh: Mesh) -> int:
    """The number of layers (stacked axis or indices), checked to divide over pp."""
    stacked = {it.shape[0] for it in items.values() if it.layer_axis is not None}
    indexed = {it.layer for it in items.values() if it.layer is not None}
    if len(stacked) > 1:
        raise PresetError(f"stacked decoder.layers tensors disagree on the number of layers: {sorted(stacked)}")
    n = stacked.pop() if stacked else (max(indexed) + 1 if indexed else 0)
    if indexed and stacked and max(indexed) + 1 != n:
        raise PresetError(f"stacked tensors hold {n} layers but layer indices reach {max(indexed)}")
    if mesh.pp > 1:
        if n == 0:
            raise PresetError(f"--pp {mesh.pp}: no tensor names a layer (decoder.layers..., model.layers.<i>..., "
                              "transformer.h.<i>...) to put on pipeline stages")
        if n % mesh.pp:
            raise PresetError(f"--pp {mesh.pp} does not divide the {n} layers: Megatron gives each pipeline stage "
                              "the same number of layers")
        loose = sorted(n for n, it in items.items() if it.rule.stage == "layer" and it.layer is None
                       and it.layer_axis is None)
        if loose:
            raise PresetError(f"--pp {mesh.pp}: no layer index tells which pipeline stage holds {_few(loose)}")
    return n


def _experts(items: dict[str, _Item], mesh: Mesh, counts: Counts) -> int:
    stacked = {it.shape[it.expert_axis] for it in items.values() if it.expert_axis is not None}
    indexed = {it.expert for it in items.values() if it.expert is not None}
    found = stacked | ({max(indexed) + 1} if indexed else set())
    if counts.experts is not None:
        found.add(counts.experts)
    if len(found) > 1:
        raise PresetError(f"the expert tensors and config disagree on the number of experts: {sorted(found)}")
    n = found.pop() if found else 0
    if mesh.ep > 1 and n == 0:
        raise PresetError(f"--ep {mesh.ep}: the checkpoint holds no expert tensors (mlp.experts..., "
                          "block_sparse_moe.experts.<i>...)")
    if n and n % mesh.ep:
        raise PresetError(f"--ep {mesh.ep} does not divide the {n} experts: Megatron gives each expert-parallel rank "
                          "the same number of experts")
    return n


def _layout(it: _Item, mesh: Mesh, layers: int, experts: int) -> Layout:
    fixed: dict[str, int] = {}
    stage = it.rule.stage
    if stage == "first":
        fixed["pp"] = 0
    elif stage == "last":
        fixed["pp"] = mesh.pp - 1
    elif it.layer is not None and mesh.pp > 1:
        fixed["pp"] = it.layer // (layers // mesh.pp)
    if it.expert is not None:
        fixed["ep"] = it.expert // (experts // mesh.ep)
    split: dict[int, str] = {}
    if it.layer_axis is not None:
        split[it.layer_axis] = "pp"
    if it.expert_axis is not None:
        split[it.expert_axis] = "ep"
    parts = it.rule.parts if it.rule.kind == "fused" else 1
    if it.tp_dim is not None and it.rule.kind in ("column", "row", "vocab", "fused"):
        size = it.shape[it.tp_dim]
        if it.rule.kind != "vocab" and size % (mesh.tp * parts):
            per = f" into {parts} parts, each" if parts > 1 else ""
            raise PresetError(f"--tp {mesh.tp} does not divide dim {it.tp_dim} ({size}) of {it.name}, which Megatron "
                              f"splits{per} {it.rule.what}")
        split[it.tp_dim] = "tp"
    free = [a for a in AXES if a not in fixed]
    sizes = tuple(getattr(mesh, a) for a in free)
    ranks = tuple(mesh.rank(**fixed, **dict(zip(free, c, strict=True)))
                  for c in itertools.product(*(range(s) for s in sizes)))
    dims = tuple((free.index(split[d]),) if d in split and getattr(mesh, split[d]) > 1 else ()
                 for d in range(len(it.shape)))
    layout = Layout(it.shape, sizes, ranks, dims, "balanced" if it.rule.kind == "vocab" else "even")
    if parts > 1 and it.tp_dim is not None and mesh.tp > 1:
        return _fused(layout, it.tp_dim, parts)
    return layout


def _fused(column: Layout, dim: int, parts: int) -> Layout:
    """`parts` tensors side by side along `dim`, each column-parallel: the rank holding piece ``t`` of `column`
    (the whole tensor cut in tp) holds piece ``t`` of each part instead, one after the other along `dim`."""
    size = column.shape[dim]
    blocks = []
    for rank in column.ranks:
        region = column.region(rank)
        width = region[dim].stop - region[dim].start  # size / tp
        t, step = region[dim].start // width, width // parts  # its tp index; its rows (columns) of one part
        for j in range(parts):
            off = tuple(j * (size // parts) + t * step if d == dim else s.start for d, s in enumerate(region))
            shape = tuple(step if d == dim else s.stop - s.start for d, s in enumerate(region))
            local = tuple(j * step if d == dim else 0 for d in range(len(region)))
            blocks.append((rank, off, shape, column.replica_id(rank), local))
    return Layout.from_blocks(column.shape, blocks)


__all__ = ["AXES", "Counts", "Mesh", "PresetError", "PresetResult", "megatron_layouts"]

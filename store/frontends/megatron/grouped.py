"""Megatron-Core's legacy ``GroupedMLP`` experts in ``dp_reshardable`` buckets, for :mod:`.buckets`.

``GroupedMLP`` (``megatron/core/transformer/moe/experts.py``, ``moe_grouped_gemm``
with ``moe_use_legacy_grouped_gemm``) keeps an expert-parallel rank's ``E``
local experts in one parameter each: ``weight1`` ``[H, E * F]`` (``E * 2F``
with a gated linear unit, each expert's ``[gate | up]`` columns side by side)
and ``weight2`` ``[E * F, H]`` (``F`` the tensor-parallel rank's share of the
expert FFN width). Its ``sharded_state_dict`` saves them through a
``ShardedTensorFactory`` whose ``sh_ten_build_fn`` reads the parameter's
memory as ``[E, H, F]`` (``weight1``) or ``[E, F, H]`` (``weight2``),
transposes the last two axes and saves the result as ONE block of
SequentialMLP's ``experts.linear_fc1.weight`` ``[..., experts, F, H]`` /
``experts.linear_fc2.weight`` ``[..., experts, H, F]`` (the expert axis after
the layer's; offsets: the expert-parallel rank's experts, and the
tensor-parallel rank's share of the F axis). With a gated linear unit the
transposed ``[E, 2F, H]`` is cut in two along its F axis, saved as tensor-parallel
fragments ``r`` and ``tp + r`` of ``2 * tp``: the gate half and the up half,
as the dense SwiGLU factory does (:mod:`.factory`).

A ``dp_reshardable`` bucket holds the parameter flat (the untransposed memory),
so the parameter equals no saved block: :func:`grouped_index` lists, for every
block of those keys (and every such gate/up pair), the digest of the saved
values transposed back into the parameter's order, marked by :data:`GROUPED`
as the first member of its :data:`~.factory.Part`; a bucket's stretch matches
it as it matches a plain block (byte for byte, cast to the weight's dtype: never
guessed). :func:`blocks_of` applies the factory's transform to a state read
from the buckets in the parameter's order, giving each saved block's values:
the optimizer state is then named, shaped and blocked as the saved weight (as
Megatron's own ``fully_reshardable`` save of a GroupedMLP holds it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from reshard.layouts.errors import FormatError

from ...io.storage import Storage
from ..torch.dcp import _dcp_item
from .factory import Block, Part, digest

#: The first member of a :data:`~.factory.Part` whose blocks a GroupedMLP parameter is the transposed view of.
GROUPED: Block = ("<GroupedMLP transposed>", (), ())
#: SequentialMLP's names, under which GroupedMLP saves ``weight1`` (``linear_fc1``) and ``weight2`` (``linear_fc2``).
EXPERT_KEYS = re.compile(r"(.+\.)?experts\.linear_fc([12])\.weight")


def is_grouped(part: Part) -> bool:
    return bool(part) and part[0] == GROUPED


def grouped_parts(md: Any) -> Iterator[Part]:
    """Every block of a :data:`EXPERT_KEYS` tensor (3-d or more: ``[..., experts, a, b]``), and every gate/up pair
    of a ``linear_fc1`` one: two blocks of the same sizes whose offsets differ only on the ``a`` axis, by half the
    tensor's ``a``."""
    for fqn, item in md.state_dict_metadata.items():
        m = EXPERT_KEYS.fullmatch(fqn)
        if not m or fqn.startswith("optimizer.") or not hasattr(item, "chunks") or len(item.size) < 3:
            continue
        blocks = [(fqn, tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in item.chunks]
        for block in blocks:
            yield (GROUPED, block)
        size = int(item.size[-2])
        if m.group(2) != "1" or size % 2:
            continue
        at = {(b[1], b[2]): b for b in blocks}
        for block in blocks:
            off = block[1]
            if off[-2] < size // 2:
                other = at.get(((*off[:-2], off[-2] + size // 2, off[-1]), block[2]))
                if other is not None:
                    yield (GROUPED, block, other)


def _to_param(values: list[Any]) -> Any:
    """The parameter's memory of saved blocks ``[..., E, a, b]`` (joined along ``a``): ``[E, b, a]`` flat."""
    import torch

    joined = torch.cat([v.reshape(-1, *v.shape[-2:]) for v in values], dim=-2)
    return joined.transpose(-1, -2).contiguous().reshape(-1)


def grouped_index(store: Storage, md: Any, where: dict[Any, Any]) -> dict[tuple[str, int], dict[bytes, set[Part]]]:
    """Every :func:`grouped_parts` part by dtype, length and the digest of the parameter it is the view of."""
    read: dict[Block, Any] = {}
    index: dict[tuple[str, int], dict[bytes, set[Part]]] = {}
    for part in grouped_parts(md):
        values = []
        for block in part[1:]:
            if block not in read:
                fqn, offsets, _ = block
                info = where.get((fqn, offsets))
                if info is None:
                    raise FormatError(f"{store.url}: chunk {list(offsets)} of {fqn!r} has no storage entry in "
                                      ".metadata")
                read[block] = _dcp_item(store, info, f"chunk {list(offsets)} of {fqn!r}")
            values.append(read[block])
        flat = _to_param(values)
        dtype = str(flat.dtype).removeprefix("torch.")
        index.setdefault((dtype, flat.numel()), {}).setdefault(digest(flat), set()).add(part)
    return index


def blocks_of(part: Part, flat: np.ndarray) -> list[tuple[Block, np.ndarray]]:
    """A state of the parameter (its flat memory, as the buckets hold it) as the values of each saved block."""
    blocks = part[1:]
    _, _, sizes = blocks[0]
    experts, a, b = int(np.prod(sizes[:-2])), sizes[-2], sizes[-1]
    if flat.size != experts * a * b * len(blocks):
        raise FormatError(f"the GroupedMLP parameter of {blocks[0][0]!r} holds {flat.size} elements, its saved "
                          f"blocks {[list(s) for _, _, s in blocks]} hold {experts * a * b * len(blocks)}")
    whole = flat.reshape(experts, b, a * len(blocks)).transpose(0, 2, 1)
    return [(block, np.ascontiguousarray(whole[:, i * a:(i + 1) * a, :]).reshape(block[2]))
            for i, block in enumerate(blocks)]

"""Tensor-parallel layouts for Hugging Face checkpoints, by parameter name: the older Python entry point.

The rules live in :mod:`reshard.layouts.presets` (pure math, Megatron-Core and
Hugging Face names, tensor, pipeline, expert and data parallelism);
``reshard redivide --preset megatron`` uses them. :func:`preset_layouts` keeps
its ``[dp, tp]`` signature (rank = d x tp + t, the same rank order) and passes
the head counts on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reshard.layouts import Layout
from reshard.layouts.presets import Counts, Mesh, match, megatron_layouts

PRESETS = ("megatron",)


def _known(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")


def split_dim(name: str, ndim: int, preset: str = "megatron") -> int | None:
    """The dim of (unstacked) tensor ``name`` the preset splits over the tp ranks, or None (whole on every rank).

    A fused tensor (GPT-2's ``c_attn``: q, k, v side by side) gives the dim each of its parts is split along
    (a rank then holds one block of each part: :meth:`reshard.layouts.Layout.pieces`).
    """
    _known(preset)
    rule = match(name)
    if rule is None or rule.dim is None or rule.kind not in ("column", "row", "vocab", "fused"):
        return None
    dim = rule.dim if rule.dim >= 0 else ndim + rule.dim
    return dim if 0 <= dim < ndim else None


def preset_layouts(shapes: Mapping[str, Sequence[int]], tp: int, dp: int = 1, preset: str = "megatron", *,
                   heads: int | None = None, kv_heads: int | None = None, experts: int | None = None
                   ) -> dict[str, Layout]:
    """Layouts on a ``[dp, tp]`` mesh (rank = d x tp + t) that split each tensor as ``preset`` says.

    ``heads`` (and ``kv_heads``, else read from the shapes) are needed when tp > 1
    splits attention: tp must divide both. See
    :func:`reshard.layouts.presets.megatron_layouts` for pipeline and expert
    parallelism.
    """
    _known(preset)
    return megatron_layouts(shapes, Mesh(tp=tp, dp=dp), Counts(heads, kv_heads, experts)).layouts


__all__ = ["PRESETS", "preset_layouts", "split_dim"]

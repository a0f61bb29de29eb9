"""Tensor-parallel layouts for Hugging Face checkpoints, by parameter name (``reshard redivide --preset``).

``megatron`` is Megatron-LM's split of a transformer block, in Hugging Face names:

* **column-parallel** (each rank holds some output features): Llama-style
  ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` (``nn.Linear``
  weights are ``[out, in]``: dim 0, and their biases); GPT-2 ``mlp.c_fc``
  (``Conv1D`` weights are ``[in, out]``: dim 1, bias dim 0);
* **row-parallel** (each rank holds some input features, biases whole):
  ``o_proj``, ``down_proj`` (dim 1); GPT-2 ``attn.c_proj``, ``mlp.c_proj`` (dim 0);
* **vocab-parallel**: ``embed_tokens``, ``lm_head``, GPT-2 ``wte`` (dim 0, the vocabulary);
* everything else (norms, position embeddings, scalars) whole on every rank.

GPT-2's ``attn.c_attn`` holds q, k and v side by side in one ``[in, 3 x out]``
weight. Megatron gives each rank its heads of all three, three column ranges per
rank, and a layout gives a rank one block: the preset keeps ``c_attn`` whole on
every rank, which any tensor-parallel loader can slice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from reshard.layouts import Layout

#: (name pattern, tensor dim split over the tp ranks); the first match wins, no match: whole on every rank.
MEGATRON: tuple[tuple[re.Pattern[str], int], ...] = tuple((re.compile(p), d) for p, d in (
    (r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    (r"(^|\.)(o_proj|down_proj)\.weight$", 1),
    (r"(^|\.)mlp\.c_fc\.weight$", 1),
    (r"(^|\.)mlp\.c_fc\.bias$", 0),
    (r"(^|\.)(attn|mlp)\.c_proj\.weight$", 0),
    (r"(^|\.)(embed_tokens|lm_head|wte)\.weight$", 0),
))
PRESETS = {"megatron": MEGATRON}


def split_dim(name: str, ndim: int, preset: str = "megatron") -> int | None:
    """The dim of tensor ``name`` the preset splits over the tp ranks, or None (whole on every rank)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    for pattern, dim in PRESETS[preset]:
        if pattern.search(name):
            return dim if dim < ndim else None
    return None


def preset_layouts(shapes: Mapping[str, Sequence[int]], tp: int, dp: int = 1,
                   preset: str = "megatron") -> dict[str, Layout]:
    """Layouts on a ``[dp, tp]`` mesh (rank = d x tp + t) that split each tensor as ``preset`` says.

    Splits that do not divide give the first ranks one more row (``balanced``).
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be at least 1, got tp={tp} dp={dp}")
    out = {}
    for name, shape in shapes.items():
        dim = split_dim(name, len(shape), preset)
        dims = tuple((1,) if d == dim else () for d in range(len(shape)))
        out[name] = Layout(tuple(shape), (dp, tp), dims=dims, split="balanced")
    return out


__all__ = ["MEGATRON", "PRESETS", "preset_layouts", "split_dim"]

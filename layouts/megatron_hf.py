"""Megatron-Core GPT names and shapes -> a Hugging Face ``LlamaForCausalLM``'s: pure name and shape math.

A Llama-style Megatron-Core model (SwiGLU, grouped-query attention, RMSNorm,
RoPE, no biases) holds, per layer (stacked ``decoder.layers.X``, dim 0 the
layer, as ``dist_checkpointing`` saves it; or ``decoder.layers.<i>.X``):

* ``self_attention.linear_qkv.weight`` ``[groups * (heads / groups + 2) * head_dim, hidden]``: per query
  group ``g`` the rows of its ``heads / groups`` query heads, then its key head, then its value head
  (megatron/core/transformer/attention.py, ``get_query_key_value_tensors``: ``[..., ng, (np/ng + 2) * hn]``
  split ``[np/ng * hn, hn, hn]``). Query head ``g * heads / groups + j`` uses key/value head ``g``, as
  Hugging Face's ``repeat_kv`` pairs them, so ``q_proj`` is the query rows of every group in order,
  ``k_proj`` / ``v_proj`` the key / value rows;
* ``mlp.linear_fc1.weight`` ``[gate; up]`` (``2 * ffn`` rows) -> ``gate_proj``, ``up_proj``;
  ``linear_proj`` -> ``o_proj``, ``linear_fc2`` -> ``down_proj``;
* the norms: ``linear_qkv.layer_norm_weight`` (or ``input_layernorm.weight``) -> ``input_layernorm``,
  ``linear_fc1.layer_norm_weight`` (or ``pre_mlp_layernorm.weight``) -> ``post_attention_layernorm``.

Model-wide: ``embedding.word_embeddings`` -> ``model.embed_tokens``,
``decoder.final_layernorm`` -> ``model.norm``, ``output_layer`` -> ``lm_head`` (absent: tied embeddings).

:func:`llama_views` gives each Hugging Face tensor as a :class:`~reshard.layouts.views.View`:
pieces of stored tensors, each a region contiguous in C order, whose bytes one
after the other are the new tensor's, so an exporter streams them without a copy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import LayoutError
from .views import Piece, View

#: Names that are optimizer state, not model tensors (skipped).
OPTIMIZER_PREFIXES = ("optimizer.", "chained_")

_LAYER = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")
#: Per-layer Megatron suffix -> its role.
_SUFFIXES = {
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm",
    "input_layernorm.weight": "input_layernorm",
    "self_attention.linear_proj.weight": "o_proj",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm",
    "pre_mlp_layernorm.weight": "post_attention_layernorm",
    "mlp.linear_fc2.weight": "down_proj",
}
_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
_PLAIN = {"input_layernorm": "input_layernorm.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
          "o_proj": "self_attn.o_proj.weight", "down_proj": "mlp.down_proj.weight"}


class ConversionError(LayoutError):
    """A checkpoint's tensors are not those of the model asked for (the message names the tensor or count)."""


@dataclass(frozen=True)
class LlamaSizes:
    """The sizes a Llama config needs, as the shapes (and the head count) give them."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool


def _rows(name: str, shape: tuple[int, ...], layer: int | None, lo: int, hi: int) -> Piece:
    """Rows ``[lo, hi)`` of one layer of a 2-d weight (stacked: ``shape`` is ``[layers, rows, cols]``)."""
    if layer is None:
        return Piece(name, ((lo, hi), (0, shape[-1])))
    return Piece(name, ((layer, layer + 1), (lo, hi), (0, shape[-1])))


def _whole(name: str, shape: tuple[int, ...], layer: int | None) -> Piece:
    if layer is None:
        return Piece(name, tuple((0, n) for n in shape))
    return Piece(name, ((layer, layer + 1), *((0, n) for n in shape[1:])))


def _classify(shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, str], dict[tuple[int | None, str], str]]:
    """Model-wide names by Megatron name, and per-layer names by (layer or None for stacked, role)."""
    model: dict[str, str] = {}
    layered: dict[tuple[int | None, str], str] = {}
    unknown = []
    for name in shapes:
        if name.startswith(OPTIMIZER_PREFIXES):
            continue
        m = _LAYER.fullmatch(name)
        if name in _GLOBAL:
            model[name] = _GLOBAL[name]
        elif m and m.group(2) in _SUFFIXES:
            layer = None if m.group(1) is None else int(m.group(1))
            layered[(layer, _SUFFIXES[m.group(2)])] = name
        else:
            unknown.append(name)
    if unknown:
        raise ConversionError(f"{len(unknown)} tensor(s) have no place in a Llama model (biases, experts, "
                              f"LayerNorm biases, position embeddings... are not Llama's): {sorted(unknown)[:8]}")
    return model, layered


def llama_sizes(shapes: Mapping[str, Sequence[int]], heads: int, kv_heads: int | None = None) -> LlamaSizes:
    """A Megatron-Core Llama's sizes from its tensors' shapes and its attention head count.

    ``linear_proj``'s input is ``heads * head_dim`` and ``linear_qkv``'s rows ``(heads + 2 * groups) *
    head_dim``: with ``heads`` these give the head size and the query groups (``kv_heads`` is checked).

    Raises
    ------
    ConversionError
        A Llama tensor is missing, a shape does not fit the others, or ``heads`` / ``kv_heads`` do not divide
        the shapes (the message names the tensor and the counts).
    """
    model, layered = _classify(shapes)
    if "embedding.word_embeddings.weight" not in model:
        raise ConversionError("no embedding.word_embeddings.weight: not a Megatron-Core GPT model's tensors "
                              "(or only a later pipeline stage's)")
    vocab, hidden = (int(n) for n in shapes["embedding.word_embeddings.weight"])
    stacked = {k for k in layered if k[0] is None}
    per_layer = {k[0] for k in layered if k[0] is not None}
    if stacked and per_layer:
        raise ConversionError("the checkpoint holds both stacked decoder.layers.X and per-layer "
                              "decoder.layers.<i>.X tensors")
    qkv_name = layered.get((None, "qkv")) or layered.get((min(per_layer, default=0), "qkv"))
    if qkv_name is None:
        raise ConversionError("no decoder.layers...self_attention.linear_qkv.weight in the checkpoint")
    layers = int(shapes[qkv_name][0]) if stacked else len(per_layer)
    if per_layer and per_layer != set(range(layers)):
        raise ConversionError(f"per-layer tensors for layers {sorted(per_layer)}, not 0..{layers - 1}")
    for layer in (None,) if stacked else sorted(per_layer):
        missing = sorted(set(_SUFFIXES.values()) - {role for (at, role) in layered if at == layer})
        if missing:
            raise ConversionError(f"layer {'(stacked)' if layer is None else layer} has no {missing} tensor")
    one = (lambda s: tuple(int(n) for n in s[1:])) if stacked else (lambda s: tuple(int(n) for n in s))
    qkv, proj = one(shapes[qkv_name]), one(shapes[layered[(min(per_layer, default=None), "o_proj")]])
    fc1, fc2 = (one(shapes[layered[(min(per_layer, default=None), r)]]) for r in ("fc1", "down_proj"))
    if heads <= 0 or proj[1] % heads:
        raise ConversionError(f"--heads {heads} does not divide linear_proj's input size {proj[1]}")
    head_dim = proj[1] // heads
    extra = qkv[0] - proj[1]
    if extra <= 0 or extra % (2 * head_dim) or qkv[1] != hidden:
        raise ConversionError(f"linear_qkv.weight {list(qkv)} is not [(heads + 2 * groups) * head_dim, hidden] "
                              f"with {heads} heads of {head_dim} (linear_proj {list(proj)}, hidden {hidden})")
    groups = extra // (2 * head_dim)
    if heads % groups:
        raise ConversionError(f"{groups} query groups (from linear_qkv's rows) do not divide {heads} heads")
    if kv_heads is not None and kv_heads != groups:
        raise ConversionError(f"--kv-heads {kv_heads}, but linear_qkv.weight {list(qkv)} holds {groups} query "
                              f"groups of {head_dim} with {heads} heads")
    if fc1 != (2 * fc2[1], hidden) or fc2[0] != hidden:
        raise ConversionError(f"linear_fc1.weight {list(fc1)} is not [gate; up] of linear_fc2.weight {list(fc2)}'s "
                              f"input: Llama's MLP is gated (SwiGLU, gated_linear_unit=True)")
    for name, want in (("decoder.final_layernorm.weight", (hidden,)), ("output_layer.weight", (vocab, hidden))):
        if name in shapes and tuple(int(n) for n in shapes[name]) != want:
            raise ConversionError(f"{name} is {list(shapes[name])}, not {list(want)}")
    if "decoder.final_layernorm.weight" not in model:
        raise ConversionError("no decoder.final_layernorm.weight (a save of the last pipeline stage is needed)")
    return LlamaSizes(layers=layers, hidden=hidden, heads=heads, kv_heads=groups, head_dim=head_dim,
                      ffn=fc2[1], vocab=vocab, tied="output_layer.weight" not in shapes)


def llama_views(shapes: Mapping[str, Sequence[int]], heads: int,
                kv_heads: int | None = None) -> tuple[LlamaSizes, dict[str, View]]:
    """The sizes and every Hugging Face ``LlamaForCausalLM`` tensor as a :class:`View` of Megatron's tensors.

    Optimizer states (``optimizer.*``, ``chained_*``) are left out; any other tensor without a Llama place
    is refused (:class:`ConversionError`, naming it), as are the cases of :func:`llama_sizes`.
    """
    sizes = llama_sizes(shapes, heads, kv_heads)
    model, layered = _classify(shapes)
    views: dict[str, View] = {hf: View(tuple(int(n) for n in shapes[mc]), (_whole(mc, tuple(shapes[mc]), None),))
                              for mc, hf in model.items()}
    hd, per_group = sizes.head_dim, sizes.heads // sizes.kv_heads
    stride = (per_group + 2) * hd
    for i in range(sizes.layers):
        def name(role: str, i: int = i) -> tuple[str, int | None]:
            stacked = layered.get((None, role))
            return (stacked, i) if stacked is not None else (layered[(i, role)], None)

        pre = f"model.layers.{i}."
        qkv, at = name("qkv")
        shape = tuple(shapes[qkv])
        for proj, lo, n in (("q_proj", 0, per_group * hd), ("k_proj", per_group * hd, hd),
                            ("v_proj", (per_group + 1) * hd, hd)):
            pieces = tuple(_rows(qkv, shape, at, g * stride + lo, g * stride + lo + n) for g in range(sizes.kv_heads))
            views[f"{pre}self_attn.{proj}.weight"] = View((n * sizes.kv_heads, sizes.hidden), pieces)
        fc1, at = name("fc1")
        for k, proj in enumerate(("gate_proj", "up_proj")):
            views[f"{pre}mlp.{proj}.weight"] = View(
                (sizes.ffn, sizes.hidden), (_rows(fc1, tuple(shapes[fc1]), at, k * sizes.ffn, (k + 1) * sizes.ffn),))
        for role, hf in _PLAIN.items():
            mc, at = name(role)
            shape = tuple(int(n) for n in shapes[mc])
            views[pre + hf] = View(shape[1:] if at is not None else shape, (_whole(mc, shape, at),))
    return sizes, views


__all__ = ["OPTIMIZER_PREFIXES", "ConversionError", "LlamaSizes", "llama_sizes", "llama_views"]

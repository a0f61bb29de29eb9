"""The ``megatron`` preset's name rules: which Megatron-LM split each tensor gets, by its name.

Two families of names are recognised, both by their last components (so an
optimizer state ``optimizer.state.exp_avg.<key>`` matches the rule of
``<key>``):

* **Megatron-Core** names (``dist_checkpointing``): ``decoder.layers.X``
  tensors stacked on dim 0 (``[num_layers, ...]``), or per layer
  (``decoder.layers.<i>.X``); experts either ``local_experts.<i>.`` or stacked
  on the dim after the layer axis (``mlp.experts.experts.linear_fc1.weight``
  ``[layers, experts, ...]``).
* **Hugging Face** names: Llama / Mistral / Qwen2 (``model.layers.<i>.``),
  Mixtral (``block_sparse_moe.experts.<i>.w1/w2/w3``), GPT-2 (``transformer.h.<i>.``,
  ``Conv1D`` weights ``[in, out]``).

A :class:`Rule` gives the kind of split and the dim of the *per-item* tensor (one
layer's, one expert's) it applies to; :mod:`.core` adds the stacked axes. Pure
data and regular expressions: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Kinds of split: over tp (``column``, ``row``, ``vocab``), none (``whole``), and ``fused``: the tensor is
#: ``parts`` tensors side by side along ``dim`` (a GLU ``linear_fc1``'s ``[gate; up]``, GPT-2 ``c_attn``'s
#: ``[q; k; v]``), each column-parallel, so Megatron gives a rank one block of each (:meth:`Layout.pieces`);
#: a ``fused`` rule without a dim (``qkv_proj``: q, k and v of unequal sizes) keeps the tensor whole over tp.
KINDS = ("column", "row", "vocab", "whole", "fused")


@dataclass(frozen=True)
class Rule:
    """How one family of tensors splits.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    dim : int or None
        The dim of one layer's (one expert's) tensor split over tp; negative
        counts from the end; None for ``whole`` (and a ``fused`` tensor kept whole).
    stage : str
        ``"layer"`` (the stage of the tensor's layer), ``"first"``, ``"last"``
        (pipeline stage), or ``"all"`` (every stage).
    heads : str
        ``"q"`` (rows of query heads), ``"kv"`` (rows of key-value heads),
        ``"qkv"`` (Megatron-Core's grouped ``linear_qkv``), ``"glu"`` (a
        ``linear_fc1`` that may be GLU-gated), or ``""``.
    family : str
        ``"megatron-core"`` or ``"huggingface"``.
    what : str
        A few words for messages.
    parts : int
        ``fused``: how many tensors lie side by side along `dim`, each split
        over tp (a rank holds one block of each, concatenated along `dim`).
    """

    kind: str
    dim: int | None
    stage: str = "layer"
    heads: str = ""
    family: str = "huggingface"
    what: str = ""
    parts: int = 1


def _r(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


MC = "megatron-core"
HF = "huggingface"
_DEC = r"(^|\.)decoder\.(.*\.)?"
#: Megatron-Core rules, first match wins.
MEGATRON_CORE: tuple[tuple[re.Pattern[str], Rule], ...] = (
    (_r(r"(^|\.)embedding\.word_embeddings\.weight$"), Rule("vocab", 0, "first", family=MC, what="vocab-parallel")),
    (_r(r"(^|\.)embedding\.position_embeddings\.weight$"), Rule("whole", None, "first", family=MC)),
    (_r(r"(^|\.)output_layer\.weight$"), Rule("vocab", 0, "last", family=MC, what="vocab-parallel")),
    (_r(r"(^|\.)decoder\.final_(layer)?norm\.(weight|bias)$"), Rule("whole", None, "last", family=MC)),
    (_r(_DEC + r"linear_qkv\.(weight|bias)$"),
     Rule("column", 0, heads="qkv", family=MC, what="column-parallel (query groups)")),
    (_r(_DEC + r"linear_fc1\.(weight|bias)_[wv]$"),  # a GLU's halves apart (singleton_local_shards)
     Rule("column", 0, family=MC, what="column-parallel (GLU half)")),
    (_r(_DEC + r"linear_fc1\.(weight|bias)$"),
     Rule("column", 0, heads="glu", family=MC, what="column-parallel")),
    (_r(_DEC + r"linear_(proj|fc2)\.weight$"), Rule("row", -1, family=MC, what="row-parallel")),
    (_r(_DEC + r"linear_(proj|fc2)\.bias$"), Rule("whole", None, family=MC)),
    (_r(_DEC + r"(layer_norm_weight|layer_norm_bias|\w*norm\.(weight|bias))$"), Rule("whole", None, family=MC)),
    (_r(_DEC + r"router\.(weight|bias|expert_bias)$"), Rule("whole", None, family=MC)),
    (_r(_DEC + r"shared_experts\.gate_weight$"), Rule("whole", None, family=MC)),
)

_LAYERS_HF = r"(^|\.)(layers|h)\.\d+\."
#: Hugging Face rules, first match wins.
HUGGINGFACE: tuple[tuple[re.Pattern[str], Rule], ...] = (
    (_r(r"(^|\.)q_proj\.(weight|bias)$"), Rule("column", 0, heads="q", what="column-parallel (query heads)")),
    (_r(r"(^|\.)(k_proj|v_proj)\.(weight|bias)$"),
     Rule("column", 0, heads="kv", what="column-parallel (key-value heads)")),
    (_r(r"(^|\.)(gate_proj|up_proj)\.(weight|bias)$"), Rule("column", 0, what="column-parallel")),
    (_r(r"(^|\.)experts\.\d+\.(w1|w3)\.weight$"), Rule("column", 0, what="column-parallel")),
    (_r(r"(^|\.)(o_proj|down_proj)\.weight$"), Rule("row", 1, what="row-parallel")),
    (_r(r"(^|\.)experts\.\d+\.w2\.weight$"), Rule("row", 1, what="row-parallel")),
    (_r(r"(^|\.)(o_proj|down_proj)\.bias$"), Rule("whole", None)),
    (_r(r"(^|\.)mlp\.c_fc\.weight$"), Rule("column", 1, what="column-parallel (Conv1D [in, out])")),
    (_r(r"(^|\.)mlp\.c_fc\.bias$"), Rule("column", 0, what="column-parallel")),
    (_r(r"(^|\.)(attn|mlp)\.c_proj\.weight$"), Rule("row", 0, what="row-parallel (Conv1D [in, out])")),
    (_r(r"(^|\.)(attn|mlp)\.c_proj\.bias$"), Rule("whole", None)),
    (_r(r"(^|\.)attn\.c_attn\.weight$"), Rule("fused", 1, what="fused q/k/v (Conv1D [in, out])", parts=3)),
    (_r(r"(^|\.)attn\.c_attn\.bias$"), Rule("fused", 0, what="fused q/k/v", parts=3)),
    (_r(r"(^|\.)gate_up_proj\.(weight|bias)$"), Rule("fused", 0, what="fused gate/up", parts=2)),
    (_r(r"(^|\.)qkv_proj\.(weight|bias)$"), Rule("fused", None, what="fused q/k/v of unequal sizes")),
    (_r(r"(^|\.)(embed_tokens|wte)\.weight$"), Rule("vocab", 0, "first", what="vocab-parallel")),
    (_r(r"(^|\.)wpe\.weight$"), Rule("whole", None, "first")),
    (_r(r"(^|\.)lm_head\.weight$"), Rule("vocab", 0, "last", what="vocab-parallel")),
    (_r(_LAYERS_HF + r"(.*norm|ln_\d|attn\.bias|attn\.masked_bias|.*rotary_emb\.inv_freq|block_sparse_moe\.gate"
        r"|mlp\.gate|mlp\.shared_expert_gate)(\.(weight|bias))?$"), Rule("whole", None)),
    (_r(r"(^|\.)(model\.norm|transformer\.ln_f|model\.final_layernorm)\.(weight|bias)$"), Rule("whole", None, "last")),
)

#: A Megatron-Core per-layer index, a Hugging Face layer index, an expert index.
MC_LAYER = re.compile(r"(^|\.)decoder\.layers\.(?:(\d+)\.)?")
HF_LAYER = re.compile(_LAYERS_HF.replace(r"\d+", r"(\d+)"))
EXPERT = re.compile(r"(^|\.)(?:local_experts|experts)\.(\d+)\.")
#: Megatron-Core expert tensors stacked on an expert axis (not ``local_experts.<i>``, not shared experts).
MC_STACKED_EXPERTS = re.compile(r"(^|\.)mlp\.experts\.(experts\.)?linear_fc[12]\.(weight|bias)$")


def match(name: str) -> Rule | None:
    """The first rule whose pattern `name` matches (Megatron-Core names first), or None."""
    for pattern, rule in MEGATRON_CORE + HUGGINGFACE:
        if pattern.search(name):
            return rule
    return None


__all__ = ["EXPERT", "HF_LAYER", "HUGGINGFACE", "KINDS", "MC_LAYER", "MC_STACKED_EXPERTS", "MEGATRON_CORE", "Rule",
           "match"]

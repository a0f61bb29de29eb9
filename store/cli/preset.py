"""``reshard redivide --preset megatron``: the preset's layouts for an open checkpoint, counts from its config.

The name rules and the mesh are pure math in :mod:`reshard.layouts.presets`;
this module reads what they need from the checkpoint: the model's head and
expert counts from the ``config.json`` a Hugging Face import keeps (leaf
``__files__``) or from a Megatron ``args`` leaf, unless ``--heads`` /
``--kv-heads`` give them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from reshard.layouts import Layout
from reshard.layouts.presets import Counts, Mesh, megatron_layouts

#: Config keys of each count: Hugging Face (Llama, Mixtral, Qwen2-MoE, GPT-2) and Megatron-LM ``args``.
HEADS = ("num_attention_heads", "n_head")
KV_HEADS = ("num_key_value_heads", "num_query_groups")
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def carried_config(leaves: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The model config a checkpoint carries: a Hugging Face import's ``config.json``, else a leaf holding
    ``num_attention_heads`` (Megatron-LM's ``args``, when it imported as JSON); ``{}`` if none."""
    from ..frontends.huggingface.folder import kept_files

    for name, data in kept_files(leaves, where):
        if name == "config.json":
            try:
                cfg = json.loads(data)
            except ValueError:
                continue
            if isinstance(cfg, dict):
                return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    for value in leaves.values():
        if isinstance(value, Mapping) and any(k in value for k in HEADS):
            return dict(value)
    return {}


def counts_for(leaves: Mapping[str, Any], where: str, heads: int | None, kv_heads: int | None) -> Counts:
    """The counts the preset checks: ``--heads`` / ``--kv-heads`` where given, else the carried config's."""
    cfg = carried_config(leaves, where)
    if heads is None:
        heads = _first(cfg, HEADS)
    if kv_heads is None and (cfg.get("group_query_attention", True) or "num_key_value_heads" in cfg):
        kv_heads = _first(cfg, KV_HEADS)
    return Counts(heads=heads, kv_heads=kv_heads, experts=_first(cfg, EXPERTS))


def preset_layouts_for(ckpt: Any, args: Any) -> dict[str, Layout]:
    """The layouts of ``--preset megatron`` for `ckpt` on the mesh of ``--tp/--pp/--ep/--dp``; notes on stderr."""
    counts = counts_for(ckpt.leaves, ckpt.url, args.heads, args.kv_heads)
    mesh = Mesh(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp)
    result = megatron_layouts({n: m.shape for n, m in ckpt.arrays.items()}, mesh, counts)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return result.layouts

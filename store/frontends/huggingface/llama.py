"""A Megatron-Core Llama-style import -> a Hugging Face ``LlamaForCausalLM`` folder (``reshard export llama``).

The names and regions are :func:`reshard.layouts.megatron_hf.llama_views`
(``linear_qkv`` cut per query group into ``q_proj`` / ``k_proj`` / ``v_proj``,
``linear_fc1`` into ``gate_proj`` / ``up_proj``, the stacked layer axis into
``model.layers.<i>``); the tensors stream into safetensors shards through
:func:`~.write.export_safetensors` without a copy in memory, and ``config.json``
is written beside them. Only model tensors are written (optimizer state is left out).

A Megatron-Core save records no model config: the shapes give the sizes, the rest
(attention heads, RoPE base, RMSNorm epsilon, the position limit) comes from the
caller, or from a Hugging Face ``config.json`` passed as ``config`` (e.g. the one
the model was converted from); what neither gives is refused, by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from reshard.layouts.megatron_hf import OPTIMIZER_PREFIXES, ConversionError, LlamaSizes, llama_views

from ...format.tree import FILES_LEAF, METADATA_LEAF, json_leaves
from ...read.checkpoint import Checkpoint
from ...read.open import open as open_checkpoint
from .write import DEFAULT_SHARD_SIZE, export_safetensors

#: What a Megatron-Core save does not record: config key, the option that gives it, Megatron's name for it.
NEEDED = (("num_attention_heads", "--heads", "num_attention_heads"),
          ("rope_theta", "--rope-theta", "rotary_base, default 10000"),
          ("rms_norm_eps", "--norm-eps", "layernorm_epsilon / --norm-epsilon, default 1e-5"),
          ("max_position_embeddings", "--max-positions", "max_position_embeddings / --max-position-embeddings"))


def _rope_theta(cfg: Mapping[str, Any]) -> Any:
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        return params["rope_theta"]
    return cfg.get("rope_theta")


def llama_config(sizes: LlamaSizes, dtype: str, *, rope_theta: float, norm_eps: float, max_positions: int,
                 base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` with these sizes: ``base``'s other keys kept, its sizes
    checked against the tensors' (a :class:`ConversionError` names a key that differs)."""
    cfg = dict(base or {})
    sized = {"vocab_size": sizes.vocab, "hidden_size": sizes.hidden, "intermediate_size": sizes.ffn,
             "num_hidden_layers": sizes.layers, "num_attention_heads": sizes.heads,
             "num_key_value_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
             "tie_word_embeddings": sizes.tied}
    for key, value in sized.items():
        if key in cfg and cfg[key] is not None and cfg[key] != value:
            raise ConversionError(f"the config gives {key} = {cfg[key]!r}, the checkpoint's tensors {value!r}")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConversionError(f"the config sets {key}, but the checkpoint has no such biases")
    rope = dict(cfg["rope_parameters"]) if isinstance(cfg.get("rope_parameters"), Mapping) else \
        {"rope_type": "default"}
    rope["rope_theta"] = rope_theta
    cfg.update(sized, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               rms_norm_eps=norm_eps, max_position_embeddings=max_positions, rope_theta=rope_theta,
               rope_parameters=rope, attention_bias=False, mlp_bias=False, dtype=dtype)
    cfg.pop("torch_dtype", None)
    return cfg


def export_llama(src: str | Checkpoint, folder: str | os.PathLike[str], *, heads: int | None = None,
                 kv_heads: int | None = None, rope_theta: float | None = None, norm_eps: float | None = None,
                 max_positions: int | None = None, config: Mapping[str, Any] | None = None,
                 max_shard_size: int | str = DEFAULT_SHARD_SIZE, storage_options: Mapping[str, Any] | None = None,
                 overwrite: bool = False, **options: Any) -> dict[str, Any]:
    """Write a Megatron-Core Llama-style import as a Hugging Face ``LlamaForCausalLM`` folder.

    Parameters
    ----------
    src : str or Checkpoint
        A ``reshard import megatron`` checkpoint of a GPT model with SwiGLU, grouped-query (or multi-head)
        attention, RMSNorm, RoPE and no biases (stacked ``decoder.layers.X`` or ``decoder.layers.<i>.X``).
    folder : path
        The model folder: safetensors (one file or shards and their index) and ``config.json``.
    heads, kv_heads : int, optional
        Attention heads (Megatron's ``num_attention_heads``) and query groups (checked against the shapes).
    rope_theta, norm_eps, max_positions : optional
        Megatron's ``rotary_base``, ``layernorm_epsilon`` and ``max_position_embeddings``.
    config : mapping, optional
        A Hugging Face Llama config to start from: what the arguments above leave out is taken from it, its
        other keys (token ids, ``rope_parameters``' scaling...) are kept, its sizes must match the tensors'.
    max_shard_size, storage_options, overwrite, **options
        As for :func:`~.write.export_safetensors`.

    Returns
    -------
    dict
        :func:`~.write.export_safetensors`'s, with ``"config"`` (what ``config.json`` holds).

    Raises
    ------
    ConversionError
        A value above neither given nor in ``config`` (all such are named, with their options), a tensor
        without a place in a Llama model, shapes that do not fit together or the counts, a config that
        differs from the tensors.
    """
    base = dict(config or {})
    given: dict[str, Any] = {"num_attention_heads": heads if heads is not None else base.get("num_attention_heads"),
             "rope_theta": rope_theta if rope_theta is not None else _rope_theta(base),
             "rms_norm_eps": norm_eps if norm_eps is not None else base.get("rms_norm_eps"),
             "max_position_embeddings": max_positions if max_positions is not None
             else base.get("max_position_embeddings")}
    missing = [f"{key} ({option}; Megatron's {name})" for key, option, name in NEEDED if given[key] is None]
    if missing:
        raise ConversionError("a Megatron-Core save does not record " + ", ".join(missing)
                              + ": pass them, or a Hugging Face config.json that has them")
    if kv_heads is None and isinstance(base.get("num_key_value_heads"), int):
        kv_heads = base["num_key_value_heads"]
    opts = dict(storage_options) if storage_options is not None else None
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(str(src), storage_options=opts)
    sizes, views = llama_views({n: m.shape for n, m in ckpt.arrays.items()}, int(given["num_attention_heads"]),
                               kv_heads)
    dtypes = {ckpt.tensor(p.name).dtype for v in views.values() for p in v.pieces}
    if len(dtypes) != 1:
        raise ConversionError(f"the model tensors are of several dtypes {sorted(dtypes)}: a Hugging Face config "
                              "gives one")
    cfg = llama_config(sizes, dtypes.pop(), rope_theta=float(given["rope_theta"]),
                       norm_eps=float(given["rms_norm_eps"]), max_positions=int(given["max_position_embeddings"]),
                       base=base)
    files = {"config.json": (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()}
    # The files' "reshard.leaves" (the checkpoint's non-tensor leaves) without the optimizer's.
    model_leaves = {k: v for k, v in ckpt.leaves.items() if not k.startswith((*OPTIMIZER_PREFIXES, "common.optimizer"))
                    and k not in (METADATA_LEAF, FILES_LEAF)}
    metadata = {**(options.pop("metadata", None) or {}), "reshard.leaves": json.dumps(json_leaves(model_leaves))}
    done = export_safetensors(ckpt, folder, max_shard_size=max_shard_size, views=views, files=files,
                              overwrite=overwrite, metadata=metadata, **options)
    done["config"] = cfg
    return done


__all__ = ["NEEDED", "export_llama", "llama_config"]

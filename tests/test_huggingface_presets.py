"""``--preset megatron``: Hugging Face checkpoints split as Megatron tensor parallelism computes.

Each rank's pieces, loaded under the preset's layouts, must compute the model's
own MLP and attention output when used as Megatron does: column-parallel
pieces give each rank some features, row-parallel pieces give partial sums that
add up (one all-reduce) to the whole model's result.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.frontends.huggingface.presets import preset_layouts, split_dim

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch
TP = 2


def _import(model: object, tmp_path: Path) -> rs.Checkpoint:
    from reshard.store.frontends.huggingface import import_safetensors

    model.save_pretrained(tmp_path / "hf")  # type: ignore[attr-defined]
    return import_safetensors(tmp_path / "hf", str(tmp_path / "ck"))


def _ranks(ckpt: rs.Checkpoint, tmp_path: Path, dp: int = 1) -> list[dict[str, np.ndarray]]:
    layouts = preset_layouts({n: m.shape for n, m in ckpt.arrays.items()}, TP, dp, heads=4)
    rs.redivide(ckpt, str(tmp_path / "tp"), layouts)
    tp = rs.open(str(tmp_path / "tp"))
    return [tp.load(layouts, rank) for rank in range(TP)]


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flat(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def test_llama_mlp_and_attention_output_match_the_whole_model(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ckpt = _import(model, tmp_path)
    ranks = [_flat(r) for r in _ranks(ckpt, tmp_path)]
    p = "model.layers.0."
    assert ranks[0][p + "self_attn.q_proj.weight"].shape == (16, 32)  # column: half the heads
    assert ranks[0][p + "self_attn.o_proj.weight"].shape == (32, 16)  # row: half the inputs
    assert ranks[0]["model.embed_tokens.weight"].shape == (32, 32)    # vocab-parallel
    assert ranks[0][p + "input_layernorm.weight"].shape == (32,)      # whole

    x = torch.randn(3, 32)
    layer = model.model.layers[0]
    with torch.no_grad():
        want = layer.mlp(x).numpy()
        attn_in = torch.randn(3, 32)  # the heads' outputs, concatenated
        want_o = layer.self_attn.o_proj(attn_in).numpy()
    xs = x.numpy()
    partial, partial_o = [], []
    for r, w in enumerate(ranks):
        gate, up, down = (w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        h = xs @ gate.T
        partial.append(((h / (1 + np.exp(-h))) * (xs @ up.T)) @ down.T)  # SiLU(x W_g) * (x W_u), then row-parallel
        cols = slice(r * 16, (r + 1) * 16)  # this rank's heads
        partial_o.append(attn_in.numpy()[:, cols] @ w[p + "self_attn.o_proj.weight"].T)
    np.testing.assert_allclose(sum(partial), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum(partial_o), want_o, rtol=1e-5, atol=1e-6)


def test_gpt2_conv1d_weights_split_transposed(tmp_path: Path) -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ckpt = _import(model, tmp_path)
    ranks = [_flat(r) for r in _ranks(ckpt, tmp_path)]
    p = "transformer.h.0."
    assert ranks[0][p + "mlp.c_fc.weight"].shape == (32, 64)     # Conv1D [in, out]: column = dim 1
    assert ranks[0][p + "mlp.c_proj.weight"].shape == (64, 32)   # row = dim 0
    assert ranks[0][p + "attn.c_attn.weight"].shape == (32, 48)  # fused q/k/v: a third of each, side by side
    x = torch.randn(3, 32)
    _gpt2_attention_sums_to_the_whole(model, ranks, x.numpy(), p, heads=4)
    with torch.no_grad():
        want = model.transformer.h[0].mlp(x).numpy()
    gelu = transformers.activations.ACT2FN[cfg.activation_function]
    partial = []
    for w in ranks:
        h = x.numpy() @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        partial.append(gelu(torch.from_numpy(h)).numpy() @ w[p + "mlp.c_proj.weight"])
    got = sum(partial) + ranks[0][p + "mlp.c_proj.bias"]  # the row-parallel bias is added once
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _gpt2_attention_sums_to_the_whole(model: object, ranks: list[dict[str, np.ndarray]], x: np.ndarray, p: str,
                                      heads: int) -> None:
    """Each rank's c_attn ([q_t | k_t | v_t]: its heads' q, k, v) and c_proj rows give a partial attention output;
    their sum plus the bias is the whole layer's (causal self-attention, as GPT-2 computes it)."""
    def attend(qkv: np.ndarray, n: int) -> np.ndarray:
        q, k, v = (a.reshape(len(x), n, -1).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=1))
        score = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]) + np.triu(np.full((len(x),) * 2, -np.inf), 1)
        weight = np.exp(score - score.max(-1, keepdims=True))
        return ((weight / weight.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(len(x), -1)

    attn = model.transformer.h[0].attn  # type: ignore[attr-defined]
    whole = {n: t.detach().numpy() for n, t in attn.named_parameters()}
    want = attend(x @ whole["c_attn.weight"] + whole["c_attn.bias"], heads) @ whole["c_proj.weight"]
    partial = [attend(x @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"], heads // TP)
               @ w[p + "attn.c_proj.weight"] for w in ranks]
    np.testing.assert_allclose(sum(partial), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(partial[0], want, atol=1e-3)  # each rank's part alone is not the whole


def test_preset_rules() -> None:
    assert split_dim("model.layers.3.self_attn.k_proj.bias", 1) == 0
    assert split_dim("model.norm.weight", 1) is None
    assert split_dim("transformer.h.0.attn.c_attn.weight", 2) == 1  # q, k, v each split along dim 1
    assert split_dim("model.layers.0.self_attn.qkv_proj.weight", 2) is None  # q, k, v of unequal sizes: whole
    with pytest.raises(ValueError, match="unknown preset 'deepspeed'"):
        split_dim("x", 2, "deepspeed")


def test_cli_redivide_with_the_preset(tmp_path: Path) -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    ckpt = _import(transformers.GPT2LMHeadModel(cfg), tmp_path)
    run = subprocess.run([sys.executable, "-m", "reshard.store.cli", "redivide", ckpt.url, str(tmp_path / "tp"),
                          "--tp", "2", "--preset", "megatron"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    tp = rs.open(str(tmp_path / "tp"))
    assert tp["transformer.h.0.mlp.c_fc.weight"].layout.local_shape(1) == (32, 64)
    assert tp["transformer.wte.weight"].layout.local_shape(0) == (32, 32)
    np.testing.assert_array_equal(tp["transformer.wte.weight"].read(), ckpt["transformer.wte.weight"].read())

"""``reshard redivide --preset megatron``: Megatron-LM's layouts by name, checked against Megatron's own rules.

Hugging Face models (Llama, Qwen2, Mixtral, GPT-2) are built tiny by
transformers, written with ``save_pretrained``, imported and redivided by the CLI;
every rank's loaded block is compared with the slice Megatron's rules give,
computed here from the whole tensor by head, expert and layer index.
Megatron-Core names are checked against saves Megatron-Core itself wrote at TP=2
x DP=2 and EP=2 (tests/data/megatron): every chunk a rank wrote must lie inside
that rank's region of the preset, and the preset must cut where Megatron cut.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts.presets import Counts, Mesh, PresetError, megatron_layouts
from reshard.store.cli import main
from test_docs import blocks

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

pytestmark = pytest.mark.torch
DATA = Path(__file__).parent / "data" / "megatron"


def cli(*argv: str) -> int:
    return main([str(a) for a in argv])


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flat(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def _saved(model: Any, tmp_path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """save_pretrained, import by the CLI; the checkpoint's URL and the file's tensors read by safetensors."""
    model.save_pretrained(tmp_path / "hf")
    assert cli("import", "safetensors", tmp_path / "hf", tmp_path / "ck") == 0
    whole = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        with safetensors.safe_open(str(f), "np") as st:
            whole.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return str(tmp_path / "ck"), whole


def _redivided(src: str, dst: Path, *flags: str) -> dict[int, dict[str, np.ndarray]]:
    """Redivide by the CLI; every rank's arrays, loaded under the layouts the new checkpoint was written with."""
    assert cli("redivide", src, dst, "--preset", "megatron", *flags) == 0
    ckpt = rs.open(str(dst))
    layouts = {n: a.layout for n, a in ckpt.arrays.items()}
    world = max(r for lay in layouts.values() for r in lay.ranks) + 1
    return {r: {n: v for n, v in _flat(ckpt.load(layouts, r)).items() if isinstance(v, np.ndarray)}
            for r in range(world)}


def _rank(t: int = 0, e: int = 0, d: int = 0, p: int = 0, *, tp: int, ep: int = 1, dp: int = 1) -> int:
    """Megatron's default order tp-cp-ep-dp-pp: tensor-parallel fastest."""
    return ((p * dp + d) * ep + e) * tp + t


def _heads(w: np.ndarray, heads: int, t: int, tp: int, axis: int = 0) -> np.ndarray:
    """Tensor-parallel rank t's heads of w (head by head along axis): heads t * n / tp ... (t + 1) * n / tp - 1."""
    size = w.shape[axis] // heads
    mine = range(t * heads // tp, (t + 1) * heads // tp)
    return np.concatenate([np.take(w, range(h * size, (h + 1) * size), axis=axis) for h in mine], axis=axis)


def _part(w: np.ndarray, t: int, tp: int, axis: int) -> np.ndarray:
    n = w.shape[axis] // tp
    return np.take(w, range(t * n, (t + 1) * n), axis=axis)


def _compare(got: dict[int, dict[str, np.ndarray]], want: dict[int, dict[str, np.ndarray]]) -> None:
    assert sorted(got) == sorted(want)
    for rank in want:
        assert sorted(got[rank]) == sorted(want[rank]), rank
        for name, value in want[rank].items():
            np.testing.assert_array_equal(got[rank][name], value, err_msg=f"rank {rank} {name}")


# ------------------------------------------------------------------ Llama-style (Llama, Qwen2, Mixtral)
def _llama_want(whole: dict[str, np.ndarray], cfg: Any, tp: int, pp: int = 1, ep: int = 1, dp: int = 1
                ) -> dict[int, dict[str, np.ndarray]]:
    """Megatron's rules by head, expert and layer index, from the whole tensors."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers, experts = cfg.num_hidden_layers, getattr(cfg, "num_local_experts", 0)
    want: dict[int, dict[str, np.ndarray]] = {r: {} for r in range(tp * pp * ep * dp)}
    for name, w in whole.items():
        m = re.search(r"layers\.(\d+)\.", name)
        stage = int(m.group(1)) // (layers // pp) if m else (0 if "embed_tokens" in name else pp - 1)
        x = re.search(r"experts\.(\d+)\.", name)
        for t, e, d in np.ndindex(tp, ep, dp):
            if x and int(x.group(1)) // (experts // ep) != e:
                continue
            if re.search(r"q_proj\.(weight|bias)$", name):
                part = _heads(w, heads, t, tp)
            elif re.search(r"[kv]_proj\.(weight|bias)$", name):
                part = _heads(w, kv, t, tp)
            elif re.search(r"(gate_proj|up_proj|w1|w3)\.weight$|embed_tokens|lm_head", name):
                part = _part(w, t, tp, 0)
            elif re.search(r"(o_proj|down_proj|w2)\.weight$", name):
                part = _part(w, t, tp, 1)
            else:
                part = w  # norms, the router: whole
            want[_rank(t, e, d, stage, tp=tp, ep=ep, dp=dp)][name] = part
    return want


def _llama(tmp_path: Path) -> tuple[str, dict[str, np.ndarray], Any]:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return (*_saved(transformers.LlamaForCausalLM(cfg), tmp_path), cfg)


def test_llama_tp2_pp2_dp2_blocks_are_megatrons(tmp_path: Path) -> None:
    src, whole, cfg = _llama(tmp_path)
    got = _redivided(src, tmp_path / "out", "--tp", "2", "--pp", "2", "--dp", "2")
    _compare(got, _llama_want(whole, cfg, tp=2, pp=2, dp=2))
    assert "model.layers.1.self_attn.q_proj.weight" in got[_rank(1, p=1, d=1, tp=2, dp=2)]
    assert "model.layers.1.self_attn.q_proj.weight" not in got[_rank(1, p=0, tp=2, dp=2)]


def test_qwen2_biases_split_by_heads(tmp_path: Path) -> None:
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(1)
    src, whole = _saved(transformers.Qwen2ForCausalLM(cfg), tmp_path)
    assert "model.layers.0.self_attn.k_proj.bias" in whole
    got = _redivided(src, tmp_path / "out", "--tp", "2")
    _compare(got, _llama_want(whole, cfg, tp=2))
    assert got[1]["model.layers.0.self_attn.k_proj.bias"].shape == (8,)  # one of 2 kv heads of size 8


def test_mixtral_experts_over_ep_and_tp(tmp_path: Path) -> None:
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=16)
    torch.manual_seed(2)
    src, whole = _saved(transformers.MixtralForCausalLM(cfg), tmp_path)
    got = _redivided(src, tmp_path / "out", "--tp", "2", "--ep", "2", "--pp", "2")
    _compare(got, _llama_want(whole, cfg, tp=2, pp=2, ep=2))
    # expert 3 on expert rank 1 only (3 // (4 / 2)), layer 0 on stage 0
    holders = [r for r, arrays in got.items() if "model.layers.0.block_sparse_moe.experts.3.w1.weight" in arrays]
    assert holders == [_rank(0, 1, tp=2, ep=2), _rank(1, 1, tp=2, ep=2)]


# ------------------------------------------------------------------ GPT-2 (Conv1D, fused c_attn)
def _thirds(w: np.ndarray, t: int, tp: int, axis: int) -> np.ndarray:
    """Tensor-parallel rank t's part of a fused [q; k; v] along axis: the t-th slice of each, side by side."""
    return np.concatenate([_part(x, t, tp, axis) for x in np.split(w, 3, axis=axis)], axis=axis)


def test_gpt2_conv1d_transposed_and_fused_qkv_in_thirds(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """GPT-2's c_attn (Conv1D [in, out], columns [q; k; v]): tp rank t holds the t-th slice of q, of k and of v,
    its local [H, 3H / tp] (three blocks of the stored tensor), as Megatron's rank t holds its heads' q, k, v."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    torch.manual_seed(3)
    src, whole = _saved(transformers.GPT2LMHeadModel(cfg), tmp_path)
    capfd.readouterr()
    got = _redivided(src, tmp_path / "out", "--tp", "2", "--pp", "2")
    assert "kept whole" not in capfd.readouterr().err
    out = rs.open(str(tmp_path / "out"))
    lay = out["transformer.h.1.attn.c_attn.weight"].layout
    assert lay.multi_piece and len(lay.pieces(_rank(1, p=1, tp=2))) == 3 and lay.is_regular()
    assert out["transformer.h.1.attn.c_attn.weight"].meta.shard == (32, 16)  # a shard a block: 3 x tp of them
    want: dict[int, dict[str, np.ndarray]] = {r: {} for r in range(4)}
    for name, w in whole.items():
        m = re.search(r"\.h\.(\d+)\.", name)
        stage = int(m.group(1)) if m else (0 if re.search(r"wte|wpe", name) else 1)
        for t in range(2):
            if name.endswith("attn.c_attn.weight"):
                part = _thirds(w, t, 2, 1)
            elif name.endswith("attn.c_attn.bias"):
                part = _thirds(w, t, 2, 0)
            elif name.endswith("mlp.c_fc.weight"):
                part = _part(w, t, 2, 1)  # Conv1D [in, out]: column-parallel = dim 1
            elif name.endswith(("mlp.c_fc.bias", "wte.weight")) or re.search(r"c_proj\.weight$", name):
                part = _part(w, t, 2, 0)
            else:
                part = w
            want[_rank(t, p=stage, tp=2)][name] = part
    _compare(got, want)


# ------------------------------------------------------------------ Megatron-Core names: Megatron's own saves
def _written(folder: Path) -> dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """Per model tensor, the chunks Megatron-Core saved: (writing rank, offsets, sizes), from torch DCP's metadata."""
    class Stub:  # Megatron's own classes in the pickle (its save plan): not needed here, and not installed
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __setstate__(self, state: Any) -> None:
            pass

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return Stub if module.startswith("megatron") else super().find_class(module, name)

    with open(folder / ".metadata", "rb") as f:
        md = Unpickler(f).load()  # torch DCP's Metadata, as FileSystemReader.read_metadata reads it
    out: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    for index, info in md.storage_data.items():
        if "optimizer." in index.fqn or index.offset is None:
            continue
        chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
        rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))  # type: ignore[union-attr]
        out.setdefault(index.fqn, []).append((rank, tuple(chunk.offsets), tuple(chunk.sizes)))
    return out


def _cuts(regions: list[tuple[tuple[int, ...], tuple[int, ...]]], dim: int) -> set[int]:
    return {o[dim] for o, _ in regions} | {o[dim] + s[dim] for o, s in regions}


@pytest.mark.parametrize(("sample", "flags"), [
    ("tp2dp2", ["--tp", "2", "--dp", "2"]),                                     # megatron-core 0.12.1
    ("forms/dp_reshardable", ["--tp", "2", "--dp", "2", "--heads", "2"]),       # megatron-core 0.16.1 GPT
    ("forms/moe_dp_reshardable", ["--ep", "2", "--dp", "2"]),                   # 0.16.1 MoE, 4 experts, EP=2
    ("forms/glu", ["--tp", "2", "--heads", "2"]),                               # 0.16.1 SwiGLU, layers stacked
    ("forms/glu_singleton", ["--tp", "2", "--heads", "2"]),                     # layers apart, GLU halves apart
])
def test_megatron_core_names_give_the_blocks_megatron_saved(tmp_path: Path, sample: str, flags: list[str]) -> None:
    assert cli("import", "megatron", DATA / sample, tmp_path / "ck") == 0
    assert cli("redivide", tmp_path / "ck", tmp_path / "out", "--preset", "megatron", *flags) == 0
    out = rs.open(str(tmp_path / "out"))
    written = _written(DATA / sample)
    assert written and set(written) <= set(out.arrays)
    for name, chunks in written.items():
        layout = out[name].layout
        stacked = name.startswith("decoder.layers.")
        for rank, off, size in chunks:  # what each rank saved lies in one of that rank's blocks
            regions = [glob for glob, _ in layout.pieces(rank)]
            assert any(all(r.start <= o and o + s <= r.stop for r, o, s in zip(region, off, size, strict=True))
                       for region in regions), (name, rank, off, size, regions)
        saved = [(o, s) for _, o, s in chunks]
        preset = [(tuple(s.start for s in b.region), b.shape) for b in layout.blocks()]
        for dim in range(len(layout.shape)):
            if stacked and dim == 0:  # Megatron saves each layer apart; the preset keeps a stage's together
                continue
            if ".experts." in name and dim == int(stacked):  # SequentialMLP saves each expert apart; the preset
                assert _cuts(preset, dim) <= _cuts(saved, dim), (name, dim)  # keeps an EP rank's experts together
            else:
                assert _cuts(saved, dim) == _cuts(preset, dim), (name, dim)


def test_megatron_core_pp2_stages_and_optimizer_states_against_megatrons_values(tmp_path: Path) -> None:
    """--pp 2 on the 2-layer GPT Megatron-Core 0.16.1 saved at TP=2: stage p holds layer p, the embedding the
    first stage, the output layer the last; values equal what Megatron held (reference npz), optimizer states
    laid out as their parameters."""
    assert cli("import", "megatron", DATA / "forms" / "dp_reshardable", tmp_path / "ck") == 0
    got = _redivided(str(tmp_path / "ck"), tmp_path / "out", "--tp", "2", "--pp", "2", "--heads", "2")
    ref = np.load(DATA / "forms" / "reference_dp_reshardable.npz")
    qkv, proj = "decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_proj.weight"
    for p, t in np.ndindex(2, 2):
        rank = _rank(t, p=p, tp=2)
        mine = got[rank]
        np.testing.assert_array_equal(mine[qkv].astype(np.float32), _part(ref[f"model/{qkv}"][p:p + 1], t, 2, 1))
        np.testing.assert_array_equal(mine[proj].astype(np.float32), _part(ref[f"model/{proj}"][p:p + 1], t, 2, 2))
        np.testing.assert_array_equal(mine[f"optimizer.state.exp_avg.{qkv}"],
                                      _part(ref[f"exp_avg/{qkv}"][p:p + 1], t, 2, 1))
        assert ("embedding.word_embeddings.weight" in mine) == (p == 0)
        assert ("output_layer.weight" in mine) == ("decoder.final_layernorm.weight" in mine) == (p == 1)
    out = rs.open(str(tmp_path / "out"))
    for name in out.arrays:
        if name.startswith("optimizer.state."):
            assert out[name].layout == out[name.split(".", 3)[3]].layout, name


# ------------------------------------------------------------------ refusals and notes
def test_refusals_name_what_is_wrong(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    src, _, _ = _llama(tmp_path)
    capfd.readouterr()
    cases = [
        (["--tp", "3"], "--tp 3 does not divide the 4 attention heads (model.layers.0.self_attn.q_proj.weight)"),
        (["--tp", "4"], "--tp 4 does not divide the 2 key-value heads (query groups) of model.layers.0.self_attn"),
        (["--tp", "2", "--pp", "3"], "--pp 3 does not divide the 2 layers"),
        (["--ep", "2"], "--ep 2: the checkpoint holds no expert tensors"),
        (["--tp", "2", "--kv-heads", "4"], "holds 2 key-value heads (query groups), not --kv-heads 4"),
    ]
    for flags, message in cases:
        assert cli("redivide", src, tmp_path / "no", "--preset", "megatron", *flags) == 1
        assert message in capfd.readouterr().err, flags
    assert cli("redivide", src, tmp_path / "no", "--tp", "2", "--pp", "2") == 2
    assert "--pp, --ep, --heads and --kv-heads belong to --preset megatron" in capfd.readouterr().err
    rs.save({"encoder.w": np.zeros((4, 4), np.float32), "encoder.b": np.zeros(4, np.float32)}, str(tmp_path / "x"))
    assert cli("redivide", tmp_path / "x", tmp_path / "no", "--tp", "2", "--preset", "megatron") == 1
    assert "preset megatron matches none of the 2 tensors (e.g. encoder.b, encoder.w)" in capfd.readouterr().err
    assert not (tmp_path / "no").exists()


def test_megatron_core_heads_unknown_then_given(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert cli("import", "megatron", DATA / "forms" / "dp_reshardable", tmp_path / "ck") == 0
    capfd.readouterr()
    assert cli("redivide", tmp_path / "ck", tmp_path / "out", "--tp", "2", "--preset", "megatron") == 1
    err = capfd.readouterr().err
    assert "number of attention heads is not known" in err and "pass --heads H" in err
    assert cli("redivide", tmp_path / "ck", tmp_path / "out", "--tp", "2", "--preset", "megatron", "--heads", "6") == 1
    assert "the 8 inputs of its linear_proj.weight are not 6 heads of equal size (--heads 6)" in capfd.readouterr().err
    assert cli("redivide", tmp_path / "ck", tmp_path / "out", "--tp", "4", "--preset", "megatron", "--heads", "2") == 1
    assert "--tp 4 does not divide the 2 attention heads (decoder.layers.self_attention.linear_qkv.weight)" in \
        capfd.readouterr().err


def test_glu_linear_fc1_is_told_by_shapes_and_given_as_two_blocks_per_rank() -> None:
    """Megatron-Core's SwiGLU linear_fc1 is [gate_all; up_all]: TP rank r holds gate rows r and up rows r, two
    blocks (apply_swiglu_sharded_factory), its local [gate_r; up_r]; its optimizer states alike."""
    shapes = {"decoder.layers.mlp.linear_fc1.weight": (2, 2 * 12, 8),
              "decoder.layers.mlp.linear_fc2.weight": (2, 8, 12),
              "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight": (2, 2 * 12, 8)}
    res = megatron_layouts(shapes, Mesh(tp=2, pp=2))
    fc1 = res.layouts["decoder.layers.mlp.linear_fc1.weight"]
    assert fc1.pieces(_rank(1, p=1, tp=2)) == (  # its stage's layer: gate rows 6..12, then up rows 18..24
        ((slice(1, 2), slice(6, 12), slice(0, 8)), (slice(0, 1), slice(0, 6), slice(0, 8))),
        ((slice(1, 2), slice(18, 24), slice(0, 8)), (slice(0, 1), slice(6, 12), slice(0, 8))))
    assert fc1.local_shape(1) == (1, 12, 8) and fc1.is_regular() and fc1.block_shape() == (1, 6, 8)
    assert res.layouts["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"] == fc1
    assert res.rules["decoder.layers.mlp.linear_fc1.weight"].kind == "fused" and not res.notes
    with pytest.raises(PresetError, match=r"--tp 8 does not divide dim 1 \(24\) of decoder.layers.mlp.linear_fc1"
                                          r".weight, which Megatron splits into 2 parts, each GLU"):
        megatron_layouts(shapes, Mesh(tp=8))  # 24 rows divide by 8, but not their halves
    alone = megatron_layouts({"decoder.layers.mlp.linear_fc1.weight": (2, 24, 8)}, Mesh(tp=2))
    assert alone.layouts["decoder.layers.mlp.linear_fc1.weight"].region(1) == (slice(0, 2), slice(0, 24), slice(0, 8))
    assert any("no linear_fc2.weight beside it" in note for note in alone.notes)
    plain = megatron_layouts({**shapes, "decoder.layers.mlp.linear_fc1.weight": (2, 12, 8)}, Mesh(tp=2))
    assert plain.layouts["decoder.layers.mlp.linear_fc1.weight"].region(1) == (slice(0, 2), slice(6, 12),
                                                                                 slice(0, 8))


def test_python_api_counts_and_errors() -> None:
    shapes = {"model.layers.0.self_attn.q_proj.weight": (32, 32), "model.layers.0.self_attn.k_proj.weight": (16, 32)}
    with pytest.raises(PresetError, match="pass --heads H"):
        megatron_layouts(shapes, Mesh(tp=2))
    lay = megatron_layouts(shapes, Mesh(tp=2, dp=2), Counts(heads=4)).layouts
    assert lay["model.layers.0.self_attn.k_proj.weight"].region(3) == (slice(8, 16), slice(0, 32))  # d=1, t=1
    with pytest.raises(PresetError, match="--tp must be a positive integer"):
        Mesh(tp=0)
    res = megatron_layouts({**shapes, "vision.patch.weight": (4, 4)}, Mesh(tp=2), Counts(heads=4))
    assert res.unmatched == ("vision.patch.weight",)
    assert res.layouts["vision.patch.weight"].region(1) == (slice(0, 4), slice(0, 4))
    assert "1 tensors match no rule of preset megatron and are whole on every rank: vision.patch.weight" in res.notes


# ------------------------------------------------------------------ the docs' recipes, as written
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _recipe(page_blocks: list[Any], first: str) -> list[str]:
    """The command lines of the ``bash`` block of a page (``test_docs.blocks``) whose first line starts ``first``
    (its marker ``<!-- docs-test: covered-by ... -->`` names the test that runs it)."""
    block = next(b for b in page_blocks if b.lang == "bash" and b.code.startswith(first))
    return [line for line in block.code.splitlines() if line.strip()]


def _run_recipe(lines: list[str], capfd: pytest.CaptureFixture[str], data: Path | None = None) -> None:
    """Run each ``reshard ...`` line by the CLI; ``# exit 1: MESSAGE`` lines must fail with MESSAGE on stderr."""
    for line in lines:
        command, _, comment = line.partition("#")
        argv = shlex.split(command)
        assert argv[0] == "reshard", line
        if data is not None:
            argv = [str(data / a.removeprefix("tests/data/")) if a.startswith("tests/data/") else a for a in argv]
        capfd.readouterr()
        code = cli(*argv[1:])
        err = capfd.readouterr().err
        if comment.strip().startswith("exit 1:"):
            assert code == 1 and comment.split(":", 1)[1].strip() in err, (line, err)
        else:
            assert code == 0, (line, err)


def test_huggingface_docs_recipe(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _recipe(blocks((DOCS / "huggingface.md").read_text()), "reshard import safetensors ./llama ")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(4)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with safetensors.safe_open(str(tmp_path / "llama" / "model.safetensors"), "np") as st:
        whole = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    monkeypatch.chdir(tmp_path)
    _run_recipe(lines, capfd)
    ckpt = rs.open("ck-tp2pp2")
    layouts = {n: a.layout for n, a in ckpt.arrays.items()}
    got = {r: {n: v for n, v in _flat(ckpt.load(layouts, r)).items() if isinstance(v, np.ndarray)} for r in range(8)}
    _compare(got, _llama_want(whole, cfg, tp=2, pp=2, dp=2))


def test_megatron_docs_recipe(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _recipe(blocks((DOCS / "megatron.md").read_text()), "reshard import megatron tests/data/megatron/forms/dp_")
    monkeypatch.chdir(tmp_path)
    _run_recipe(lines, capfd, data=DATA.parent)
    ckpt = rs.open("rs-gpt-tp2pp2")
    ref = np.load(DATA / "forms" / "reference_dp_reshardable.npz")
    fc2 = "decoder.layers.mlp.linear_fc2.weight"
    layouts = {n: a.layout for n, a in ckpt.arrays.items()}
    for p, t in np.ndindex(2, 2):
        got = _flat(ckpt.load(layouts, _rank(t, p=p, tp=2)))
        np.testing.assert_array_equal(got[fc2].astype(np.float32), _part(ref[f"model/{fc2}"][p:p + 1], t, 2, 2))
        vocab = got.get("embedding.word_embeddings.weight")
        assert (vocab is not None) == (p == 0)
        if vocab is not None:
            np.testing.assert_array_equal(vocab.astype(np.float32),
                                          _part(ref["model/embedding.word_embeddings.weight"], t, 2, 0))


def test_glu_linear_fc1_against_what_megatron_held(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Megatron-Core 0.16.1's SwiGLU at TP=2: the stacked linear_fc1 is [gate_all; up_all], rank r holding gate
    rows r and up rows r; each rank loads its local [gate_r; up_r] exactly as Megatron held it. Saved with
    singleton_local_shards, the halves weight_w / weight_v are column-parallel tensors of their own."""
    held = np.load(DATA / "forms" / "reference_glu.npz")
    assert cli("import", "megatron", DATA / "forms" / "glu", tmp_path / "ck") == 0
    capfd.readouterr()
    got = _redivided(str(tmp_path / "ck"), tmp_path / "out", "--tp", "2", "--heads", "2")
    assert "kept whole" not in capfd.readouterr().err
    for r, layer in np.ndindex(2, 2):
        np.testing.assert_array_equal(got[r]["decoder.layers.mlp.linear_fc1.weight"][layer], held[f"rank{r}/{layer}"])
    assert cli("import", "megatron", DATA / "forms" / "glu_singleton", tmp_path / "ck1") == 0
    got = _redivided(str(tmp_path / "ck1"), tmp_path / "out1", "--tp", "2", "--heads", "2")
    for r, layer in np.ndindex(2, 2):
        fc1 = f"decoder.layers.{layer}.mlp.linear_fc1."
        mine = np.concatenate([got[r][fc1 + "weight_w"], got[r][fc1 + "weight_v"]])
        np.testing.assert_array_equal(mine, held[f"rank{r}/{layer}"])


def _has_megatron() -> bool:
    python = os.environ.get("RESHARD_MEGATRON16_PYTHON")
    if not python:
        return False
    try:
        return subprocess.run([python, "-c", "import megatron.core"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _has_megatron(), reason="megatron-core >= 0.13 is not importable by "
                                                "$RESHARD_MEGATRON16_PYTHON")
def test_glu_samples_are_what_megatron_writes(tmp_path: Path) -> None:
    """make_glu.py, run again by megatron-core, writes the same per-rank weights as the checked-in sample."""
    run = subprocess.run([os.environ["RESHARD_MEGATRON16_PYTHON"], str(DATA / "forms" / "make_glu.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    fresh, held = np.load(tmp_path / "reference_glu.npz"), np.load(DATA / "forms" / "reference_glu.npz")
    assert sorted(fresh.files) == sorted(held.files)
    for key in held.files:
        np.testing.assert_array_equal(fresh[key], held[key])
    assert sorted(p.name for p in (tmp_path / "glu").iterdir()) == sorted(
        p.name for p in (DATA / "forms" / "glu").iterdir())


# ------------------------------------------------------------------ the round trip a user makes (issue 36 item 4)
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_redivided_then_exported_the_model_gives_the_same_logits(tmp_path: Path, family: str) -> None:
    """save_pretrained -> reshard import -> redivide by Megatron's rules (tp 2 x pp 2, experts over ep 2) ->
    export safetensors -> from_pretrained: the logits equal, bit for bit, those of the original folder's model."""
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16)
    if family == "llama":
        cfg, cls, ep = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM, []
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        cls, ep = transformers.MixtralForCausalLM, ["--ep", "2"]
    torch.manual_seed(4)
    src, _ = _saved(cls(cfg), tmp_path)
    assert cli("redivide", src, tmp_path / "tp2", "--preset", "megatron", "--tp", "2", "--pp", "2", *ep) == 0
    assert cli("export", "safetensors", tmp_path / "tp2", tmp_path / "out", "--max-shard-size", "40KB") == 0
    if not (tmp_path / "out" / "config.json").exists():
        cfg.save_pretrained(tmp_path / "out")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = cls.from_pretrained(tmp_path / "hf").eval()(tokens).logits
        got = cls.from_pretrained(tmp_path / "out").eval()(tokens).logits
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1  # sharded as asked
    assert torch.equal(got, want)


def test_phi3_gate_up_proj_in_halves_and_qkv_proj_whole() -> None:
    """Phi-3's gate_up_proj ([2F, H], rows [gate; up]) gives tp rank t [gate_t; up_t]; its qkv_proj (q, k, v of
    unequal sizes under grouped-query attention) stays whole over tp, with a note."""
    shapes = {"model.layers.0.mlp.gate_up_proj.weight": (16, 8), "model.layers.0.self_attn.qkv_proj.weight": (24, 8)}
    res = megatron_layouts(shapes, Mesh(tp=2))
    full = np.arange(16 * 8).reshape(16, 8)
    lay = res.layouts["model.layers.0.mlp.gate_up_proj.weight"]
    for t in range(2):
        local = np.zeros(lay.local_shape(t), dtype=full.dtype)
        for glob, loc in lay.pieces(t):
            local[loc] = full[glob]
        np.testing.assert_array_equal(local, np.concatenate([_part(full[:8], t, 2, 0), _part(full[8:], t, 2, 0)]))
    assert res.layouts["model.layers.0.self_attn.qkv_proj.weight"].region(1) == (slice(0, 24), slice(0, 8))
    assert any("kept whole" in n and "qkv_proj" in n for n in res.notes)


def test_swiglu_expert_fc1_stacked_gives_each_tp_rank_its_experts_gate_and_up() -> None:
    """Stacked SwiGLU experts ([layers, experts, 2F, H]) at --tp 2 --ep 2: rank (t, e) holds its expert rank's
    experts, and of each its gate rows t and up rows t (expert tensor parallelism = tp)."""
    shapes = {"decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 24, 8),
              "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 8, 12)}
    lay = megatron_layouts(shapes, Mesh(tp=2, ep=2)).layouts["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    full = np.arange(2 * 4 * 24 * 8).reshape(2, 4, 24, 8)
    for t, e in np.ndindex(2, 2):
        rank = _rank(t, e, tp=2, ep=2)
        local = np.zeros(lay.local_shape(rank), dtype=full.dtype)
        for glob, loc in lay.pieces(rank):
            local[loc] = full[glob]
        mine = full[:, 2 * e:2 * e + 2]
        want = np.concatenate([_part(mine[:, :, :12], t, 2, 2), _part(mine[:, :, 12:], t, 2, 2)], axis=2)
        np.testing.assert_array_equal(local, want)

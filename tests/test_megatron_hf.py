"""A Megatron-Core Llama-style import exported as a Hugging Face ``LlamaForCausalLM`` folder (``reshard export llama``).

The samples are tests/data/megatron/forms/llama_<form> (megatron-core 0.16.1, make_llama.py: 2 layers, hidden
16, 4 heads in 2 query groups of head size 4, SwiGLU ffn 24, RMSNorm, RoPE, vocab 32, untied), with what the
saving job held in reference_llama_<form>.npz. Without Megatron: every exported tensor equals the slice of the
reference that the test cuts itself (q/k/v rows by query group, gate/up halves), and transformers loads the
folder with nothing missing. With megatron-core (``RESHARD_MEGATRON16_PYTHON``): Megatron-Core's own fp32
forward pass at TP1 x PP1, its weights loaded from reshard's ``export megatron`` of the same import
(make_llama.py ``logits``), gives the logits transformers computes from the exported folder.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts.errors import ShapeMismatchError
from reshard.layouts.megatron_hf import ConversionError, llama_views
from reshard.layouts.views import Piece, View, check_piece
from reshard.store.cli import main
from reshard.store.frontends.huggingface.llama import export_llama
from reshard.store.frontends.megatron import export_megatron, import_megatron
from test_docs import DOCS, blocks
from test_megatron_forms import MC_PYTHON, _has_megatron

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "megatron" / "forms"
FORMS = ("dp_reshardable", "fully_reshardable")
LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 2, 16, 4, 2, 4, 24, 32
OPTIONS = {"heads": HEADS, "rope_theta": 10000.0, "norm_eps": 1e-5, "max_positions": 8}  # make_llama.py's job
#: |logit| <= 1 here. Both sides compute in fp32 from the same bf16-exact weights, so they differ only by
#: rounding in kernels that sum in another order (matmuls over <= 24 terms, softmax, RMSNorm): a few fp32 ulps
#: (measured 1.2e-7). 1e-5 is ~80 ulps of 1.0, and 100 times below what a wrong RoPE base gives (below).
ATOL = 1e-5


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for form in FORMS:
        out[form] = tmp_path_factory.mktemp(form) / "rs"
        import_megatron(str(DATA / f"llama_{form}"), str(out[form]))
    return out


def expected(form: str) -> dict[str, np.ndarray]:
    """The Hugging Face tensors, cut here from what the saving job held (reference_llama_<form>.npz)."""
    ref = np.load(DATA / f"reference_llama_{form}.npz")
    m = {k[len("model/"):]: ref[k] for k in ref.files if k.startswith("model/")}
    per = HEADS // GROUPS
    qkv = m["decoder.layers.self_attention.linear_qkv.weight"].reshape(LAYERS, GROUPS, (per + 2) * HEAD_DIM, HIDDEN)
    gate, up = np.split(m["decoder.layers.mlp.linear_fc1.weight"], 2, axis=1)
    out = {"model.embed_tokens.weight": m["embedding.word_embeddings.weight"],
           "model.norm.weight": m["decoder.final_layernorm.weight"], "lm_head.weight": m["output_layer.weight"]}
    for i in range(LAYERS):
        heads = np.split(qkv[i], per + 2, axis=1)  # per group: [q_0 .. q_{per-1}, k, v], each [GROUPS, hd, H]
        layer = {"self_attn.q_proj.weight": np.stack(heads[:per], 1).reshape(HEADS * HEAD_DIM, HIDDEN),
                 "self_attn.k_proj.weight": heads[per].reshape(GROUPS * HEAD_DIM, HIDDEN),
                 "self_attn.v_proj.weight": heads[per + 1].reshape(GROUPS * HEAD_DIM, HIDDEN),
                 "self_attn.o_proj.weight": m["decoder.layers.self_attention.linear_proj.weight"][i],
                 "mlp.gate_proj.weight": gate[i], "mlp.up_proj.weight": up[i],
                 "mlp.down_proj.weight": m["decoder.layers.mlp.linear_fc2.weight"][i],
                 "input_layernorm.weight": m["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
                 "post_attention_layernorm.weight": m["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i]}
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return out


def exported_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out


@pytest.mark.parametrize("form", FORMS)
def test_exported_tensors_are_megatrons_slices(tmp_path, imported, form):
    """Every tensor of the folder equals the slice of what Megatron held that the rules give; bf16 kept."""
    done = export_llama(str(imported[form]), tmp_path / "hf", **OPTIONS)
    got, want = exported_tensors(tmp_path / "hf"), expected(form)
    assert sorted(got) == sorted(want) and len(got) == 3 + 9 * LAYERS
    for name, arr in want.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)
    assert done["config"]["dtype"] == "bfloat16" and done["total_size"] == 2 * sum(a.size for a in want.values())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        leaves = json.loads(f.metadata()["reshard.leaves"])
    assert leaves["reshard.source"]["format"] == "Megatron-Core torch_dist"
    assert not any("optimizer" in k for k in leaves)  # the optimizer's param groups are not the model's


def test_small_slabs_write_the_same_bytes(tmp_path, imported):
    """Pieces cut into many slabs (16-byte tasks: rows of a layer's q rows) land where whole pieces do."""
    export_llama(str(imported["dp_reshardable"]), tmp_path / "a", **OPTIONS)
    export_llama(str(imported["dp_reshardable"]), tmp_path / "b", fuse_bytes=16, max_shard_size="3KB", **OPTIONS)
    a, b = exported_tensors(tmp_path / "a"), exported_tensors(tmp_path / "b")
    assert len(list((tmp_path / "b").glob("*.safetensors"))) > 1 and (tmp_path / "b" / "model.safetensors.index.json"
                                                                        ).exists()
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_transformers_loads_the_folder_whole(tmp_path, imported):
    """from_pretrained finds every weight it expects and nothing else; the config has the job's values."""
    export_llama(str(imported["dp_reshardable"]), tmp_path / "hf", **OPTIONS)
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (LAYERS, HIDDEN, HEADS, GROUPS,
                                                                                HEAD_DIM, FFN, VOCAB, False)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_parameters["rope_theta"] == 10000.0
    want = expected("dp_reshardable")
    for name, param in model.state_dict().items():
        np.testing.assert_array_equal(param.numpy(), want[name], err_msg=name)


def test_a_config_gives_what_the_options_leave_out(tmp_path, imported):
    """--config: the values the save lacks come from a Hugging Face config, its other keys kept; a size that
    differs from the tensors' is refused by name."""
    base = {"num_attention_heads": 4, "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "bos_token_id": 7, "hidden_size": HIDDEN}
    done = export_llama(str(imported["dp_reshardable"]), tmp_path / "hf", config=base, norm_eps=1e-5)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg == done["config"] and cfg["bos_token_id"] == 7 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0 and cfg["max_position_embeddings"] == 64
    with pytest.raises(ConversionError, match="hidden_size = 32, the checkpoint's tensors 16"):
        export_llama(str(imported["dp_reshardable"]), tmp_path / "x", config={**base, "hidden_size": 32})


def test_what_the_save_does_not_say_is_asked_for(tmp_path, imported):
    src = str(imported["dp_reshardable"])
    with pytest.raises(ConversionError) as e:
        export_llama(src, tmp_path / "x")
    for needed in ("num_attention_heads (--heads", "rope_theta (--rope-theta", "rms_norm_eps (--norm-eps",
                   "max_position_embeddings (--max-positions"):
        assert needed in str(e.value)
    with pytest.raises(ConversionError, match=r"--kv-heads 4, but linear_qkv\.weight"):
        export_llama(src, tmp_path / "x", kv_heads=4, **OPTIONS)
    with pytest.raises(ConversionError, match="--heads 3 does not divide linear_proj's input size 16"):
        export_llama(src, tmp_path / "x", **{**OPTIONS, "heads": 3})
    with pytest.raises(ConversionError, match="--heads 5 does not divide"):
        export_llama(src, tmp_path / "x", **{**OPTIONS, "heads": 5})
    assert not (tmp_path / "x").exists()
    # The shapes alone fit other head counts too (2 heads of 8 in 1 group; 8 of 2 in 4): --heads decides.
    assert export_llama(src, tmp_path / "x", **{**OPTIONS, "heads": 2})["config"]["num_key_value_heads"] == 1


@pytest.mark.parametrize(("sample", "named"), [("dp_reshardable", "embedding.position_embeddings.weight"),
                                                ("moe_dp_reshardable", "decoder.layers.mlp.router.weight")])
def test_a_model_that_is_not_llama_is_refused(tmp_path, sample, named):
    """The GPT sample (LayerNorm, learned positions, GELU) and the MoE one (experts, router): no
    transformers Llama holds them, and the export names the tensors instead of dropping them."""
    import_megatron(str(DATA / sample), str(tmp_path / "rs"))
    with pytest.raises(ConversionError, match="no place in a Llama model") as e:
        export_llama(str(tmp_path / "rs"), tmp_path / "hf", **{**OPTIONS, "heads": 2})
    assert named in str(e.value)


def test_without_output_layer_the_embeddings_are_tied(tmp_path):
    """share_embeddings_and_output_weights=True saves no output_layer: tie_word_embeddings, and transformers'
    lm_head is the embedding."""
    import ml_dtypes

    ref = np.load(DATA / "reference_llama_dp_reshardable.npz")
    state = {k[len("model/"):]: ref[k].astype(ml_dtypes.bfloat16) for k in ref.files
             if k.startswith("model/") and k != "model/output_layer.weight"}
    rs.save(state, str(tmp_path / "rs"))
    done = export_llama(str(tmp_path / "rs"), tmp_path / "hf", **OPTIONS)
    assert done["config"]["tie_word_embeddings"] and "lm_head.weight" not in exported_tensors(tmp_path / "hf")
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), ref["model/embedding.word_embeddings.weight"])


def test_per_layer_names_give_the_same_views():
    """decoder.layers.<i>.X (as singleton_local_shards saves) maps like the stacked decoder.layers.X."""
    stacked = {"embedding.word_embeddings.weight": (VOCAB, HIDDEN), "decoder.final_layernorm.weight": (HIDDEN,),
               "output_layer.weight": (VOCAB, HIDDEN),
               "decoder.layers.self_attention.linear_qkv.weight": (LAYERS, 32, HIDDEN),
               "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (LAYERS, HIDDEN),
               "decoder.layers.self_attention.linear_proj.weight": (LAYERS, HIDDEN, 16),
               "decoder.layers.mlp.linear_fc1.weight": (LAYERS, 2 * FFN, HIDDEN),
               "decoder.layers.mlp.linear_fc1.layer_norm_weight": (LAYERS, HIDDEN),
               "decoder.layers.mlp.linear_fc2.weight": (LAYERS, HIDDEN, FFN)}
    per_layer = {k: v for k, v in stacked.items() if not k.startswith("decoder.layers.")}
    per_layer.update({k.replace("decoder.layers.", f"decoder.layers.{i}."): v[1:]
                      for k, v in stacked.items() if k.startswith("decoder.layers.") for i in range(LAYERS)})
    sizes_a, views_a = llama_views(stacked, HEADS)
    sizes_b, views_b = llama_views(per_layer, HEADS, kv_heads=GROUPS)
    assert sizes_a == sizes_b and views_a.keys() == views_b.keys()
    for name, view in views_a.items():
        other = views_b[name]
        assert view.shape == other.shape and len(view.pieces) == len(other.pieces)
        for p, q in zip(view.pieces, other.pieces, strict=True):
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            want = p.region[1:] if layer is not None else p.region
            assert q.region == want and q.name == p.name.replace("decoder.layers.", f"decoder.layers.{layer}.")
    q = views_a["model.layers.1.self_attn.q_proj.weight"].pieces
    assert [pc.region[:2] for pc in q] == [((1, 2), (0, 8)), ((1, 2), (16, 24))]  # group g: rows [16g, 16g + 8)


def test_a_piece_must_be_contiguous():
    check_piece(Piece("w", ((1, 2), (3, 5), (0, 16))), (2, 8, 16))
    with pytest.raises(ShapeMismatchError, match="not contiguous"):
        check_piece(Piece("w", ((0, 2), (3, 5), (0, 16))), (2, 8, 16))
    with pytest.raises(ShapeMismatchError, match="not inside"):
        check_piece(Piece("w", ((1, 2), (3, 9), (0, 16))), (2, 8, 16))
    assert View((2, 16), (Piece("w", ((1, 2), (3, 5), (0, 16))),)).pieces[0].size == 32


def test_the_command_line_and_the_docs_recipe(tmp_path, monkeypatch, capsys):
    """docs/megatron.md's recipe ("Export to Hugging Face"), command by command, as a user runs it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests/data/megatron/forms").mkdir(parents=True)
    (tmp_path / "tests/data/megatron/forms/llama_dp_reshardable").symlink_to(DATA / "llama_dp_reshardable")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "rope_theta": 10000.0,
                                                      "rms_norm_eps": 1e-5, "max_position_embeddings": 8}))
    recipe = next(b for b in blocks((DOCS / "megatron.md").read_text()) if "export llama rs-llama" in b.code)
    lines = recipe.code.splitlines()
    assert len(lines) == 4 and all(line.startswith("reshard ") for line in lines)
    for line in lines:  # "# exit 1: names A, B": exits 1 naming each
        command, _, comment = line.partition("#")
        capsys.readouterr()
        code = main(shlex.split(command)[1:])
        if "exit 1: names " in comment:
            err = capsys.readouterr().err
            assert code == 1 and all(n in err for n in comment.split("names ", 1)[1].split(", ")), (line, err)
        else:
            assert code == 0, line
    got, want = exported_tensors(tmp_path / "hf-llama"), expected("dp_reshardable")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert (tmp_path / "hf-llama2/config.json").read_text() == (tmp_path / "hf-llama/config.json").read_text()
    model = transformers.LlamaForCausalLM.from_pretrained("hf-llama", dtype=torch.float32)
    assert model.config.num_key_value_heads == GROUPS
    assert main(["export", "rs-llama", "x.npz", "--heads", "4"]) == 2  # --heads is the llama export's


# ------------------------------------------------------------------------------------------------ with Megatron
needs_megatron = pytest.mark.skipif(not _has_megatron(), reason="needs megatron-core >= 0.13 with torch "
                                                                "(set RESHARD_MEGATRON16_PYTHON)")


def _logits(tmp_path: Path, imported: Path) -> dict[str, np.ndarray]:
    """Megatron-Core's own fp32 forward pass at TP1 x PP1 from reshard's export megatron of the import."""
    export_megatron(str(imported), str(tmp_path / "mc"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([MC_PYTHON, str(DATA / "make_llama.py"), "logits", str(tmp_path / "mc"),
                    str(tmp_path / "logits.npz")], check=True, timeout=600, env=env, cwd=DATA)
    return dict(np.load(tmp_path / "logits.npz"))


def _hf_logits(folder: Path, tokens: np.ndarray) -> tuple[np.ndarray, object]:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy(), model


@needs_megatron
@pytest.mark.parametrize("form", FORMS)
def test_transformers_logits_equal_megatrons(tmp_path, imported, form):
    """The exported folder's logits on a fixed token batch equal Megatron-Core's from the same weights (fp32
    both, ATOL above); RoPE agrees (Megatron not interleaved, as transformers' rotate_half; the same inverse
    frequencies), and a wrong RoPE base is caught by the same comparison."""
    mc = _logits(tmp_path, imported[form])
    done = export_llama(str(imported[form]), tmp_path / "hf", **OPTIONS)
    got, model = _hf_logits(tmp_path / "hf", mc["tokens"])
    assert not mc["rotary_interleaved"] and float(mc["layernorm_epsilon"]) == done["config"]["rms_norm_eps"]
    np.testing.assert_array_equal(model.model.rotary_emb.inv_freq.numpy(), mc["inv_freq"])  # type: ignore[attr-defined]
    assert got.shape == mc["logits"].shape == (2, 8, VOCAB) and np.abs(mc["logits"]).max() > 0.1
    np.testing.assert_allclose(got, mc["logits"], rtol=0, atol=ATOL)
    # What the comparison catches: q/k rows in the interleaved RoPE order (pairs (0, 1), (2, 3)... of each head
    # instead of (0, hd/2)...), key heads paired with the wrong query groups, a wrong RoPE base.
    state = {k: v.clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    half = [j for i in range(HEAD_DIM // 2) for j in (i, i + HEAD_DIM // 2)]
    probes = {}
    for probe in ("interleaved", "groups"):
        changed = dict(state)
        for i in range(LAYERS):
            pre = f"model.layers.{i}.self_attn."
            if probe == "interleaved":
                for proj in ("q_proj", "k_proj"):
                    w = state[f"{pre}{proj}.weight"]
                    changed[f"{pre}{proj}.weight"] = w.view(-1, HEAD_DIM, HIDDEN)[:, half].reshape(w.shape)
            else:
                w = state[f"{pre}k_proj.weight"]
                changed[f"{pre}k_proj.weight"] = w.view(GROUPS, HEAD_DIM, HIDDEN).flip(0).reshape(w.shape)
        model.load_state_dict(changed)  # type: ignore[attr-defined]
        with torch.no_grad():
            probes[probe] = np.abs(model(torch.from_numpy(mc["tokens"])).logits.numpy() - mc["logits"]).max()  # type: ignore[operator]
    export_llama(str(imported[form]), tmp_path / "theta", **{**OPTIONS, "rope_theta": 500000.0})
    probes["theta"] = np.abs(_hf_logits(tmp_path / "theta", mc["tokens"])[0] - mc["logits"]).max()
    assert probes["interleaved"] > 100 * ATOL and probes["groups"] > 100 * ATOL and probes["theta"] > 10 * ATOL, probes

"""Issue 14 item 4: Hugging Face safetensors in and out, checked with the ``safetensors`` package itself.

Files are written by ``safetensors.torch.save_file`` (the library transformers'
``save_pretrained`` uses) and the sharded folder follows transformers' layout
(``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` with
``metadata.total_size`` and ``weight_map``); what reshard exports is read back
with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.cli import main
from reshard.store.frontends import huggingface as sf
from reshard.store.frontends.huggingface.write import plan_shards

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
safe_open = pytest.importorskip("safetensors").safe_open

#: torch dtype -> the numpy twin reshard stores.
NP = {torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16,
      torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2,
      torch.int64: np.int64, torch.bool: np.bool_}


def gpt2_state(n_layer: int = 2, d: int = 32, vocab: int = 96, positions: int = 16) -> dict[str, Any]:
    """A GPT-2-shaped state dict (transformers' GPT2LMHeadModel names, Conv1D [in, out] weights).

    bf16 weights, f32 layer norms, an fp8 copy of one projection with its scale
    (as fp8 checkpoints carry them), and the causal-mask buffer as bool.
    """
    g = torch.Generator().manual_seed(4)

    def rand(*shape: int, dtype: Any = torch.bfloat16) -> Any:
        return torch.randn(*shape, generator=g).to(dtype)

    state = {"transformer.wte.weight": rand(vocab, d), "transformer.wpe.weight": rand(positions, d)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        state |= {p + "ln_1.weight": rand(d, dtype=torch.float32), p + "ln_1.bias": rand(d, dtype=torch.float32),
                  p + "attn.c_attn.weight": rand(d, 3 * d), p + "attn.c_attn.bias": rand(3 * d),
                  p + "attn.c_proj.weight": rand(d, d), p + "attn.c_proj.bias": rand(d),
                  p + "ln_2.weight": rand(d, dtype=torch.float32), p + "ln_2.bias": rand(d, dtype=torch.float32),
                  p + "mlp.c_fc.weight": rand(d, 4 * d), p + "mlp.c_fc.bias": rand(4 * d),
                  p + "mlp.c_proj.weight": rand(4 * d, d), p + "mlp.c_proj.bias": rand(d),
                  p + "attn.bias": torch.tril(torch.ones(positions, positions, dtype=torch.bool))}
    state |= {"transformer.ln_f.weight": rand(d, dtype=torch.float32), "transformer.ln_f.bias": rand(d),
              "transformer.h.0.mlp.c_fc.weight_fp8": rand(d, 4 * d, dtype=torch.float8_e4m3fn),
              "transformer.h.0.mlp.c_fc.weight_e5m2": rand(d, 4 * d, dtype=torch.float8_e5m2),
              "transformer.h.0.mlp.c_fc.weight_scale": torch.tensor([0.5], dtype=torch.float32),
              "lm_head.position_ids": torch.arange(positions, dtype=torch.int64)}
    return state


def as_numpy(t: Any) -> np.ndarray:
    """A torch tensor's values as numpy, by bit pattern (numpy has no bf16/fp8 of its own)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    if t.dtype == torch.bool:
        return t.numpy()
    return t.contiguous().view(width).numpy().view(NP[t.dtype])


def same(got: np.ndarray, t: Any) -> None:
    want = as_numpy(t)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def save_sharded(state: dict[str, Any], folder: Path, max_bytes: int) -> dict[str, Any]:
    """What transformers' save_pretrained(max_shard_size=...) writes: shards and their index."""
    shards = plan_shards(((n, t.numel() * t.element_size()) for n, t in state.items()), max_bytes)
    weight_map = {}
    folder.mkdir(parents=True, exist_ok=True)
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        st_torch.save_file({n: state[n] for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index


# ------------------------------------------------------------------ import
def test_import_a_single_file_keeps_every_dtype(tmp_path: Path) -> None:
    state = gpt2_state()
    st_torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "source": "test"})
    header = sf.read_header(tmp_path / "model.safetensors")
    assert {e.name for e in header.entries} == set(state) and header.metadata["source"] == "test"
    ckpt = sf.import_safetensors(tmp_path / "model.safetensors", str(tmp_path / "ck"))
    assert set(ckpt) == set(state)
    assert ckpt.arrays["transformer.wte.weight"].dtype == "bfloat16"
    assert ckpt.arrays["transformer.h.0.mlp.c_fc.weight_fp8"].dtype == "float8_e4m3fn"
    assert ckpt.arrays["transformer.h.0.mlp.c_fc.weight_e5m2"].dtype == "float8_e5m2"
    assert ckpt.arrays["transformer.h.1.attn.bias"].dtype == "bool"
    for name, t in state.items():
        same(ckpt[name].read(), t)
    assert ckpt["__metadata__"] == {"source": "test"}  # the file's other metadata, kept as a leaf
    assert ckpt["transformer"]["h.1.attn.c_attn.weight"].layout == Layout.single((32, 96))


def test_import_a_sharded_folder_with_layouts(tmp_path: Path) -> None:
    state = gpt2_state()
    index = save_sharded(state, tmp_path / "hf", 12_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tp = {"transformer.h.0.mlp.c_fc.weight": Layout.from_dtensor((2,), ["S(1)"], (32, 128))}
    for src in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors.index.json"):
        dst = str(tmp_path / f"ck-{src.name}")
        ckpt = sf.import_safetensors(src, dst, layouts=lambda n, s: tp.get(n, Layout.single(s)))
        assert set(ckpt) == set(index["weight_map"])
        assert ckpt["transformer.h.0.mlp.c_fc.weight"].layout == tp["transformer.h.0.mlp.c_fc.weight"]
        for name, t in state.items():
            same(ckpt[name].read(), t)
    assert main(["import", "safetensors", str(tmp_path / "hf"), str(tmp_path / "cli")]) == 0
    assert set(rs.open(str(tmp_path / "cli"))) == set(state)


def test_export_sharded_reads_back_with_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = gpt2_state()
    st_torch.save_file(state, str(tmp_path / "model.safetensors"))
    url = str(tmp_path / "ck")
    sf.import_safetensors(tmp_path / "model.safetensors", url)
    out = tmp_path / "hf"
    assert main(["export", url, str(out), "--format", "safetensors", "--max-shard-size", "10KB"]) == 0
    assert "model.safetensors.index.json" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    nbytes = {n: t.numel() * t.element_size() for n, t in state.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values())
    assert set(index["weight_map"]) == set(state)
    files = sorted({*index["weight_map"].values()})
    assert files == sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    for file in files:
        held = [n for n, f in index["weight_map"].items() if f == file]
        assert sum(nbytes[n] for n in held) <= 10_000 or len(held) == 1  # 10KB = 10**4 bytes, as transformers
        with safe_open(str(out / file), framework="pt") as f:
            assert f.metadata()["format"] == "pt"  # transformers refuses files without it
            assert sorted(f.keys()) == sorted(held)
            for name in held:
                got = f.get_tensor(name)
                assert got.dtype == state[name].dtype
                same(as_numpy(got), state[name])
    # and the exported folder imports again, bit for bit
    again = sf.import_safetensors(out, str(tmp_path / "again"))
    for name, t in state.items():
        same(again[name].read(), t)


def test_export_that_fits_is_one_file_and_leaves_round_trip(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    w = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    rs.save({"w": w, "step": 5, "optimizer": {"param_groups": [{"lr": 0.1}]}}, url)
    done = sf.export_safetensors(url, tmp_path / "out", metadata={"source": "reshard"})
    assert done["files"] == [str(tmp_path / "out" / "model.safetensors")] and done["index"] is None
    with safe_open(done["files"][0], framework="pt") as f:
        assert f.metadata()["source"] == "reshard"
        np.testing.assert_array_equal(as_numpy(f.get_tensor("w")), w)
    back = sf.import_safetensors(tmp_path / "out" / "model.safetensors", str(tmp_path / "back"))
    assert back["step"] == 5 and back["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert back["__metadata__"] == {"source": "reshard"}
    assert sf.parse_size("5GB") == 5 * 10**9 and sf.parse_size("500MiB") == 500 * 2**20 and sf.parse_size(7) == 7
    with pytest.raises(ValueError):
        sf.parse_size("lots")


# ------------------------------------------------------------------ bad input
def _raw(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_bad_files_name_file_and_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases = {
        "short": (_raw(tmp_path / "short.safetensors", {"a": ok}, b"\0" * 4), "a"),
        "overlap": (_raw(tmp_path / "overlap.safetensors", {"a": ok, "b": {**ok, "data_offsets": [4, 12]}},
                         b"\0" * 12), "overlap"),
        "size": (_raw(tmp_path / "size.safetensors", {"a": {**ok, "shape": [3]}}, b"\0" * 8), "a"),
    }
    for path, word in cases.values():
        with pytest.raises(rs.FormatError, match=word) as e:
            sf.import_safetensors(path, str(tmp_path / "x"))
        assert str(path) in str(e.value)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(rs.FormatError, match="not a safetensors file"):
        sf.read_header(tmp_path / "junk.safetensors")
    e8 = _raw(tmp_path / "e8m0.safetensors", {"s": {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(rs.DTypeMismatchError, match="'s' has dtype F8_E8M0"):
        sf.import_safetensors(e8, str(tmp_path / "x"))
    hf = tmp_path / "hf"
    save_sharded({"a": torch.zeros(2), "b": torch.ones(3)}, hf, 8)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["import", "safetensors", str(hf), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tensor 'c'" in err and "model-00001-of-00002" in err
    assert not (tmp_path / "x").exists()  # every header is checked before anything is written
    _raw(tmp_path / "empty.safetensors", {}, b"")
    with pytest.raises(rs.CheckpointNotFoundError, match="holds no tensors"):
        sf.import_safetensors(tmp_path / "empty.safetensors", str(tmp_path / "x"))
    with pytest.raises(rs.CheckpointNotFoundError, match="does not exist"):
        sf.import_safetensors(tmp_path / "nothing", str(tmp_path / "x"))


# ------------------------------------------------------------------ memory
PEAK = textwrap.dedent("""
    import sys
    from reshard.store.frontends.huggingface import import_safetensors

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    import_safetensors(sys.argv[1], sys.argv[2] + "-warm")  # modules, pools, first-use allocations
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    before = status("VmRSS")
    import_safetensors(sys.argv[3], sys.argv[2], buffer_bytes=4 << 20)  # packed form: 4 MiB held at most
    print(status("VmHWM") - before)
""")


def test_import_streams_one_tensor_at_a_time(tmp_path: Path) -> None:
    """48 MiB of 2 MiB tensors: the importing process grows by a few tensors and its buffer, not by the file."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    tensors = {f"layer.{i}.w": np.full((512, 1024), i, np.float32) for i in range(24)}
    st_np = pytest.importorskip("safetensors.numpy")
    st_np.save_file(tensors, str(tmp_path / "big.safetensors"))
    st_np.save_file({"w": np.zeros((512, 1024), np.float32)}, str(tmp_path / "warm.safetensors"))
    proc = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "warm.safetensors"), str(tmp_path / "ck"),
                           str(tmp_path / "big.safetensors")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.split()[-1])
    print(f"peak RSS growth importing 48 MiB of 2 MiB tensors: {growth / 2**20:.1f} MiB")
    assert growth < 16 * 2**20, growth / 2**20  # the file is 48 MiB; one tensor 2 MiB
    ckpt = rs.open(str(tmp_path / "ck"))
    np.testing.assert_array_equal(ckpt["layer.23.w"][-1, :4].read(), np.full(4, 23, np.float32))


# ------------------------------------------------------------------ issue 35: nothing dropped silently
def test_a_name_given_twice_in_a_header_is_refused(tmp_path: Path) -> None:
    """The last entry used to win; safetensors 0.8 keeps the last too when the data is covered. Refused, named."""
    ok = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    second = '{"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}'
    raw = f'{{"a": {ok}, "b": {second}, "a": {ok}}}'.encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "twice.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(rs.FormatError, match=r"twice\.safetensors: the safetensors header names 'a' twice"):
        sf.import_safetensors(path, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    nested = _raw(tmp_path / "meta.safetensors", {}, b"")
    head = b'{"__metadata__": {"k": "1", "k": "2"}, "a": ' + ok.encode() + b"}"
    head += b" " * (-len(head) % 8)
    nested.write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * 8)
    with pytest.raises(rs.FormatError, match=r"meta\.safetensors: the safetensors header names 'k' twice"):
        sf.read_header(nested)


def test_metadata_that_shards_disagree_on_is_refused_unless_skipped(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Each file's __metadata__ entry went into one leaf, the first file's value kept and the others' dropped."""
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    hf = tmp_path / "hf"
    hf.mkdir()
    for i, run in enumerate(("a", "b")):
        _raw(hf / f"model-0000{i + 1}-of-00002.safetensors", {"__metadata__": {"run": run}, f"w{i}": ok}, b"\0" * 8)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w0": "model-00001-of-00002.safetensors", "w1": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(rs.FormatError, match=r"model-00002-of-00002\.safetensors: __metadata__ entry 'run': its value "
                       r"differs from the one in .*model-00001-of-00002\.safetensors"):
        sf.import_safetensors(hf, str(tmp_path / "x"))
    assert main(["import", "safetensors", str(hf), str(tmp_path / "x")]) == 1
    assert not (tmp_path / "x").exists()
    ckpt = sf.import_safetensors(hf, str(tmp_path / "x"), skip=["__metadata__.run"])
    assert ckpt.leaves["__metadata__"] == {"run": "a"}
    assert [r["name"] for r in ckpt.leaves["reshard.skipped"]] == ["__metadata__.run"]
    capsys.readouterr()
    assert main(["import", "safetensors", str(hf), str(tmp_path / "y"), "--skip", "__metadata__"]) == 0
    assert '"skipped": ["__metadata__.run"]' in capsys.readouterr().out
    assert rs.open(str(tmp_path / "y")).leaves["reshard.skipped"][0]["name"] == "__metadata__.run"

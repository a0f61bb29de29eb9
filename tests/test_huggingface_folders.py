"""Hugging Face folders as transformers and torch write them, in and out.

* a re-export replaces the folder whole (never old shards beside new ones);
* the files beside the weights (``config.json``...) travel with the checkpoint,
  so ``from_pretrained`` loads the export and gives the original model's logits;
* torch's per-rank ``HuggingFaceStorageWriter`` files import as whole tensors,
  and a lone rank file is refused;
* every export path writes the same ``__metadata__``, ``format: pt`` first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.frontends.huggingface import export_safetensors, import_safetensors, read_header


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"h.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(4)}


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_reexport_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    rs.save(_state(), str(tmp_path / "ck"))
    export_safetensors(str(tmp_path / "ck"), tmp_path / "hf", max_shard_size="10KB")
    before = {n: (tmp_path / "hf" / n).read_bytes() for n in _files(tmp_path / "hf")}
    with pytest.raises(rs.CheckpointExistsError, match=r"hf already exists.*overwrite"):
        export_safetensors(str(tmp_path / "ck"), tmp_path / "hf")
    assert {n: (tmp_path / "hf" / n).read_bytes() for n in _files(tmp_path / "hf")} == before


def test_reexport_with_overwrite_replaces_the_whole_set(tmp_path: Path) -> None:
    state = _state()
    rs.save(state, str(tmp_path / "ck"))
    export_safetensors(str(tmp_path / "ck"), tmp_path / "hf", max_shard_size="10KB")
    assert len(_files(tmp_path / "hf")) == 5  # 4 shards + index
    rs.save({"h.0.w": state["h.0.w"] * 2}, str(tmp_path / "ck2"))
    done = export_safetensors(str(tmp_path / "ck2"), tmp_path / "hf", overwrite=True)
    assert _files(tmp_path / "hf") == ["model.safetensors"]  # no old shard, no old index
    assert done["files"] == [str(tmp_path / "hf" / "model.safetensors")]
    back = import_safetensors(tmp_path / "hf", str(tmp_path / "back"))
    np.testing.assert_array_equal(back["h.0.w"].read(), state["h.0.w"] * 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # nothing left beside


def test_cli_reexport_needs_overwrite(tmp_path: Path) -> None:
    rs.save(_state(), str(tmp_path / "ck"))
    (tmp_path / "hf").mkdir()
    run = [sys.executable, "-m", "reshard.store.cli", "export", str(tmp_path / "ck"), str(tmp_path / "hf")]
    assert subprocess.run(run, capture_output=True, timeout=120).returncode == 0
    second = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert second.returncode == 1 and "--overwrite" in second.stderr
    assert subprocess.run([*run, "--overwrite"], capture_output=True, timeout=120).returncode == 0


def test_metadata_is_the_same_on_every_export_path(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": np.ones((2, 2), np.float32)}, str(src / "model.safetensors"),
              metadata={"format": "ms", "origin": "mindspore"})
    ckpt = import_safetensors(src, str(tmp_path / "ck"))
    ckpt.export(str(tmp_path / "one.safetensors"))
    export_safetensors(ckpt, tmp_path / "folder")
    one = read_header(tmp_path / "one.safetensors").metadata
    folder = read_header(tmp_path / "folder" / "model.safetensors").metadata
    assert one == folder
    assert one["format"] == "pt" and one["origin"] == "mindspore"


# ------------------------------------------------------------------ torch's per-rank HF files
def _hf_writer(rank: int, world: int, port: int, root: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    import torchproc
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torchproc.init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = dict(np.load(f"{root}/full.npz"))
        sd = {"w": distribute_tensor(torch.from_numpy(full["w"]), mesh, [Shard(0)]),
              "b": distribute_tensor(torch.from_numpy(full["b"]), mesh, [Shard(0)]),
              "r": distribute_tensor(torch.from_numpy(full["r"]), mesh, [Replicate()])}
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(f"{root}/hf", save_distributed=True))
    finally:
        torchproc.done()


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    import torchproc

    root = tmp_path_factory.mktemp("hf_ranks")
    rng = np.random.default_rng(1)
    np.savez(root / "full.npz", w=rng.standard_normal((6, 4)).astype(np.float32),
             b=rng.standard_normal(5).astype(np.float32), r=rng.standard_normal((3, 3)).astype(np.float32))
    torchproc.run(_hf_writer, 2, str(root))
    return root


@pytest.mark.torch
def test_per_rank_files_import_as_whole_tensors(rank_files: Path, tmp_path: Path) -> None:
    full = dict(np.load(rank_files / "full.npz"))
    files = sorted((rank_files / "hf").glob("*.safetensors"))
    assert len(files) == 2 and all("DCP_SHARDING_INFO" in read_header(f).metadata for f in files)
    ckpt = import_safetensors(rank_files / "hf", str(tmp_path / "ck"))
    for name, want in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), want, err_msg=name)
    assert len(ckpt["w"].layout.blocks()) == 2  # the pieces as saved: one block per rank's file
    assert "DCP_SHARDING_INFO" not in (ckpt.leaves.get("__metadata__") or {})


@pytest.mark.torch
def test_a_lone_rank_file_is_refused(rank_files: Path, tmp_path: Path) -> None:
    lone = sorted((rank_files / "hf").glob("*.safetensors"))[0]
    with pytest.raises(rs.FormatError, match=r"one rank's file of a per-rank save.*import the folder"):
        import_safetensors(lone, str(tmp_path / "ck"))
    with pytest.raises(rs.CheckpointNotFoundError):
        rs.open(str(tmp_path / "ck"))
    # a folder missing the first rank's file: its pieces leave the start of each tensor out
    partial = tmp_path / "partial"
    partial.mkdir()
    second = sorted((rank_files / "hf").glob("*.safetensors"))[1]
    (partial / second.name).write_bytes(second.read_bytes())
    with pytest.raises(rs.FormatError, match=r"tensor 'b'.*hold 2 of its 5 elements"):
        import_safetensors(partial, str(tmp_path / "ck"))


# ------------------------------------------------------------------ transformers
@pytest.mark.torch
def test_from_pretrained_loads_an_export_with_the_original_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 16}))
    kept = {n: (tmp_path / "hf" / n).read_bytes() for n in _files(tmp_path / "hf") if n != "model.safetensors"}
    assert "config.json" in kept

    ckpt = import_safetensors(tmp_path / "hf", str(tmp_path / "ck"))
    # redivided for 2 tensor-parallel ranks and back out: the files ride along
    tp2 = {n: Layout.from_dtensor((2,), ["S(0)"] if len(m.shape) >= 2 else ["R"], m.shape)
           for n, m in ckpt.arrays.items()}
    rs.redivide(ckpt, str(tmp_path / "tp2"), tp2)
    done = export_safetensors(str(tmp_path / "tp2"), tmp_path / "out")
    assert sorted(os.path.basename(p) for p in done["attached"]) == sorted(kept)
    for name, data in kept.items():
        assert (tmp_path / "out" / name).read_bytes() == data, name

    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.arange(12).reshape(2, 6) % cfg.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_kept_files_are_checked_before_export(tmp_path: Path) -> None:
    import hashlib

    data = b'{"a": 1}'
    files = [{"name": "config.json", "sha256": hashlib.sha256(b"other").hexdigest(), "data": data}]
    rs.save({"w": np.ones(2, np.float32), "__files__": files}, str(tmp_path / "ck"))
    with pytest.raises(rs.FormatError, match=r"'config.json' does not match its sha256"):
        export_safetensors(str(tmp_path / "ck"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    hostile = [{"name": "../evil.json", "sha256": hashlib.sha256(data).hexdigest(), "data": data}]
    rs.save({"w": np.ones(2, np.float32), "__files__": hostile}, str(tmp_path / "ck2"))
    with pytest.raises(rs.FormatError, match=r"not a plain non-weight file name"):
        export_safetensors(str(tmp_path / "ck2"), tmp_path / "out")
    assert not (tmp_path / "evil.json").exists()


def test_inspect_and_show_a_folder_import_name_the_carried_files(tmp_path: Path, capsys) -> None:
    from reshard.store.cli import main

    folder = tmp_path / "model"
    rs.save(_state(), str(tmp_path / "src"))
    export_safetensors(str(tmp_path / "src"), folder)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.model").write_bytes(bytes(range(256)) * 3)
    import_safetensors(folder, str(tmp_path / "ck"))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    footer = capsys.readouterr().out.splitlines()[-1]
    assert "__files__" in footer
    assert main(["show", str(tmp_path / "ck"), "__files__"]) == 0
    text = capsys.readouterr().out
    assert '"tokenizer.model"' in text and '"<768 bytes>"' in text and '"<23 bytes>"' in text
    assert "\\u0000" not in text and "b'" not in text


def test_export_with_a_prefix_names_the_tensors_without_it(tmp_path: Path) -> None:
    """A training save's model, ``{"model": ..., "optim": ...}``, as a folder of transformers' own names."""
    rng = np.random.default_rng(3)
    state = {"model": {"lm_head.weight": rng.standard_normal((6, 4)).astype(np.float32),
                       "model.norm.weight": np.ones(4, np.float32)},
             "optim": {"state": {"lm_head.weight": {"exp_avg": np.zeros((6, 4), np.float32)}}}}
    rs.save(state, tmp_path / "ck")
    done = export_safetensors(str(tmp_path / "ck"), tmp_path / "hf", prefix="model.", max_shard_size="64B")
    index = json.loads(Path(done["index"]).read_text())
    assert sorted(index["weight_map"]) == ["lm_head.weight", "model.norm.weight"]
    back = import_safetensors(str(tmp_path / "hf"), str(tmp_path / "back"))
    np.testing.assert_array_equal(back.read("lm_head.weight"), state["model"]["lm_head.weight"])
    with pytest.raises(rs.TensorNotFoundError, match=r"no tensor under 'decoder\.'"):
        export_safetensors(str(tmp_path / "ck"), tmp_path / "none", prefix="decoder.")
    cli = [sys.executable, "-m", "reshard.store.cli", "export", "safetensors", str(tmp_path / "ck")]
    bad = subprocess.run([*cli, str(tmp_path / "one.safetensors"), "--prefix", "model."], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "give --max-shard-size" in bad.stderr
    good = subprocess.run([*cli, str(tmp_path / "hf2"), "--prefix", "model.", "--max-shard-size", "5GB"],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert sorted(e.name for e in read_header(str(tmp_path / "hf2" / "model.safetensors")).entries) == sorted(
        index["weight_map"])

"""The notebooks run top to bottom (nbclient, kernel ``python3``) and say what they should."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.cli import demo
from reshard.store.format.tree import flatten

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a notebook; return the text of every stream and plain-text output."""
    # the kernel spec runs "python": make it this interpreter, whatever PATH says
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


@pytest.mark.parametrize("name", ["explore.ipynb", "redivide.ipynb", "cloud.ipynb"])
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: strip outputs before committing"


def printed(text: str, pattern: str) -> str:
    """The first group of ``pattern`` in a notebook's output (a clear failure when it printed no such line)."""
    found = re.search(pattern, text)
    assert found, f"no output matches {pattern!r}"
    return found.group(1)


def test_explore(tmp_path, monkeypatch):
    text = execute("explore.ipynb", tmp_path, monkeypatch)
    assert "VERIFIED: every byte of 39 tensors matches the original" in text
    assert "~ model.embed.weight" in text and "leaf step: 100 -> 101" in text and "exit code 1" in text
    assert "<Figure" in text and "LazyTensor 'model.layers.0.mlp.up.weight'" in text
    # values: what the notebook printed, against reshard's own read of its checkpoint here
    out = printed(text, r"checkpoints under (\S+)")
    ckpt = rs.open(f"{out}/step-100")
    assert ckpt.form == "packed"  # the default form, whose folder plain zarr used to read as zeros (issue 23)
    embed = ckpt["model.embed.weight"].read().astype(np.float64)
    mean = float(printed(text, r"xarray: \('model.embed.weight.0', 'model.embed.weight.1'\) bfloat16 mean (\S+)"))
    assert embed.std() > 0 and mean == pytest.approx(float(embed.mean()), rel=1e-9, abs=1e-12)
    assert "the same bytes as reshard reads: True" in text
    layers = sorted({int(n.split(".")[2]) for n in ckpt if n.startswith("model.layers.")})
    for kind in ["attn.qkv", "attn.out", "mlp.up", "mlp.down"]:
        norms = [round(float(np.linalg.norm(ckpt[f"model.layers.{i}.{kind}.weight"].read().astype(np.float32))), 2)
                 for i in layers]
        assert f"{kind} {norms}" in text


def test_redivide(tmp_path, monkeypatch):
    text = execute("redivide.ipynb", tmp_path, monkeypatch)
    for device, values in enumerate(["[1. 2.]", "[3. 4.]", "[5. 6.]", "[7. 8.]"]):  # the seed's table
        assert f"Device{device} {values}" in text
    assert "[[1. 2. 3. 4.]\n [5. 6. 7. 8.]]" in text
    assert "Device0 [1. 2. 3. 4.]" in text and "Device1 [5. 6. 7. 8.]" in text
    assert "VERIFIED: 7 ranks loaded their rows exactly" in text


def test_cloud(tmp_path, monkeypatch):
    text = execute("cloud.ipynb", tmp_path, monkeypatch)
    assert "open: 2 requests" in text
    ratio = float(re.search(r"\nbytes fetched ratio: ([0-9.]+) of the checkpoint", text).group(1))
    lean = float(re.search(r"gap=0 bytes fetched ratio: ([0-9.]+) of the checkpoint", text).group(1))
    requests = [int(n) for n in re.findall(r"in (\d+) requests", text)]
    # one rank of 7 needs a fraction; merging gaps (up to 128 KiB on object stores) fetches no less
    assert 0 < lean < 0.6 and lean <= ratio <= 1
    assert requests[0] <= requests[1]  # ... in no more requests
    assert "s3://checkpoints/step-100  (committed, saved by 8 ranks)" in text
    # zarr-python through zarr_store() on S3: the saved values (the same state, made again here)
    embed = flatten(demo.model_state(100))[0]["model.embed.weight"].astype(np.float64)
    total = float(printed(text, r"zarr-python: \(\d+, \d+\) bfloat16 sum (\S+)"))
    assert embed.std() > 0 and total == pytest.approx(float(embed.sum()), rel=1e-12)
    assert "the same bytes as reshard reads: True" in text

"""Megatron-Core torch_dist saves with the distributed optimizer's flattened ranges: import, load, redivide.

tests/data/megatron/tp2dp2 was written by megatron-core 0.12.1 itself (4 gloo ranks, TP=2 x DP=2;
make_samples.py there says how), so CI checks the real byte layout without Megatron. Where
``RESHARD_MEGATRON_PYTHON`` names an interpreter with megatron-core 0.12, one test writes a
fresh save with it (skipped otherwise).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import CheckpointNotFoundError, FormatError, UnsupportedError
from reshard.store.frontends.megatron import flat_layout, import_megatron
from reshard.store.ops.redivide import local_part

DATA = Path(__file__).parent / "data" / "megatron"
SAMPLE = DATA / "tp2dp2"


def sample_facts() -> SimpleNamespace:
    """What make_samples.py wrote (its expected.json): shapes, TP axes, states, value codes, TP, DP, cuts."""
    doc = json.loads((DATA / "expected.json").read_text())
    shapes = {n: (tuple(s), doc["tp_axis"][n]) for n, s in doc["shapes"].items()}
    codes = {tuple(k.split("/")): c for k, c in doc["codes"].items()}
    return SimpleNamespace(SHAPES=shapes, STATES=tuple(doc["states"]), CODES=codes, TP=doc["tp"], DP=doc["dp"],
                           CUTS=doc["cuts"])


F = sample_facts()


def values(name: str, state: str) -> np.ndarray:
    shape = F.SHAPES[name][0]
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape) + 1000 * F.CODES[name, state]


def expected() -> dict[str, np.ndarray]:
    out = {name: values(name, "param") for name in F.SHAPES}
    out.update({f"optimizer.state.{s}.{name}": values(name, s) for name in F.SHAPES for s in F.STATES[1:]})
    return out


def tp_blocks(name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    shape, axis = F.SHAPES[name]
    if axis is None:
        return [((0,) * len(shape), shape)]
    step = shape[axis] // F.TP
    return [(tuple(k * step if d == axis else 0 for d in range(len(shape))),
             tuple(step if d == axis else n for d, n in enumerate(shape))) for k in range(F.TP)]


def dp_ranges(name: str, dp: int) -> FlatLayout:
    """Each TP block's flattening cut evenly among ``dp`` ranks (another DP size than the save's)."""
    entries, rank = [], 0
    for off, block in tp_blocks(name):
        n = math.prod(block)
        for i in range(dp):
            entries.append((rank, off, block, n * i // dp, n * (i + 1) // dp, 0))
            rank += 1
    return FlatLayout.from_megatron(F.SHAPES[name][0], entries)


def test_import_the_saved_ranges(tmp_path):
    done = import_megatron(str(SAMPLE), str(tmp_path / "rs"))
    want = expected()
    assert done["tensors"] == len(want) and done["flat"] == len(F.SHAPES) * (len(F.STATES) - 1)
    ckpt = rs.open(str(tmp_path / "rs"))
    assert set(ckpt) == set(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr, err_msg=name)  # integration: each tensor whole
    for name, (shape, axis) in F.SHAPES.items():
        lay = ckpt.tensor(f"optimizer.state.exp_avg.{name}").layout
        assert isinstance(lay, FlatLayout) and lay.shape == shape
        blocks = tp_blocks(name)
        cut = F.CUTS[name]  # the ranges Megatron's ranks held: every DP cut of every TP block (replicas deduplicated)
        got = sorted((off, block, start, stop) for _, off, block, start, stop, _ in lay.ranges)
        want_ranges = sorted((off, block, cut[i], cut[i + 1]) for off, block in (blocks if axis is not None
                                                                               else blocks[:1])
                             for i in range(F.DP))
        assert got == want_ranges, name
        assert lay.origin["framework"] == "megatron"


@pytest.mark.parametrize("dp", [1, 3])
def test_load_other_dp_and_tp_sizes(tmp_path, dp):
    import_megatron(str(SAMPLE), str(tmp_path / "rs"))
    ckpt = rs.open(str(tmp_path / "rs"))
    want = expected()
    targets = {f"optimizer.state.{s}.{n}": dp_ranges(n, dp) for n in F.SHAPES for s in F.STATES[1:]}
    ranks = sorted(set().union(*(lay.ranks for lay in targets.values())))
    for rank in ranks:
        got = ckpt.load(targets, rank)
        for name, lay in targets.items():
            if rank in lay.ranks:
                node = got
                for part in name.split("."):
                    node = node[part]
                np.testing.assert_array_equal(node, local_part(lay, rank, want[name]), err_msg=f"{name} {rank}")
    # tensor parallelism 2 -> 4 (rows, a ceil split), as one redivide
    rows = {n: Layout.from_dtensor((4,), ["S(0)"], arr.shape) for n, arr in want.items()}
    rs.redivide(ckpt, str(tmp_path / "tp4"), rows)
    out = rs.open(str(tmp_path / "tp4"))
    for rank in range(4):
        got = out.load(rows, rank)
        for name, arr in want.items():
            np.testing.assert_array_equal(_leaf(got, name), arr[rows[name].region(rank)], err_msg=f"{name} {rank}")


def _leaf(tree, name):
    for part in name.split("."):
        tree = tree[part]
    return tree


def test_cli_import(tmp_path):
    from reshard.store.cli import main

    assert main(["import", "megatron", str(SAMPLE), str(tmp_path / "rs")]) == 0
    assert "optimizer.state.fp32_param.decoder.linear_fc1.weight" in rs.open(str(tmp_path / "rs"))


def test_refusals(tmp_path):
    chunk = SimpleNamespace
    with pytest.raises(FormatError, match="not \\[fragments"):
        flat_layout("w", (8, 10), (3, 1, 40), [])
    with pytest.raises(FormatError, match="blocks \\[4, 10\\] hold 40"):
        flat_layout("w", (8, 10), (2, 1, 41), [])
    with pytest.raises(FormatError, match="not a flat range"):
        flat_layout("w", (8, 10), (2, 1, 40), [chunk(offsets=(0, 0, 0), sizes=(2, 1, 40))])
    with pytest.raises(FormatError, match="do not describe"):  # a gap in block 0's ranges
        flat_layout("w", (4,), (1, 4), [chunk(offsets=(0, 0), sizes=(1, 2)), chunk(offsets=(0, 3), sizes=(1, 1))])
    with pytest.raises(CheckpointNotFoundError, match=r"metadata\.json"):
        import_megatron(str(tmp_path), str(tmp_path / "x"))
    shutil.copytree(SAMPLE, tmp_path / "zarr")
    (tmp_path / "zarr" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(UnsupportedError, match="zarr"):
        import_megatron(str(tmp_path / "zarr"), str(tmp_path / "x"))
    shutil.copytree(SAMPLE, tmp_path / "evil")
    (tmp_path / "evil" / ".metadata").write_bytes(b"cos\nsystem\n(S'echo owned'\ntR.")
    with pytest.raises(FormatError, match=r"os\.system"):
        import_megatron(str(tmp_path / "evil"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


MC_PYTHON = os.environ.get("RESHARD_MEGATRON_PYTHON", sys.executable)


def _has_megatron() -> bool:
    code = "import megatron.core as m; assert m.__version__.startswith('0.12'), m.__version__"
    try:
        return subprocess.run([MC_PYTHON, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _has_megatron(), reason="megatron-core 0.12 is not importable (set RESHARD_MEGATRON_PYTHON)")
def test_real_megatron_writes_what_the_sample_holds(tmp_path):
    shutil.copy(DATA / "make_samples.py", tmp_path / "make_samples.py")
    done = subprocess.run([MC_PYTHON, str(tmp_path / "make_samples.py")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    import_megatron(str(tmp_path / "tp2dp2"), str(tmp_path / "rs"))
    ckpt = rs.open(str(tmp_path / "rs"))
    for name, arr in expected().items():
        np.testing.assert_array_equal(ckpt[name].read(), arr, err_msg=name)

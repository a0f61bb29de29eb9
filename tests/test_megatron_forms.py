"""Megatron-Core's newer distributed-optimizer checkpoint forms: dp_reshardable (flat buckets) and fully_reshardable.

tests/data/megatron/forms was written by megatron-core 0.16.1 itself: a tiny bf16 GPT, TP=2 x DP=2
on 4 gloo ranks, two Adam steps, saved in each form (make_forms.py there says how), with what
Megatron's optimizer held per parameter in reference_<form>.npz (MoE saves: tests/test_megatron_moe.py).
CI checks the import against it without Megatron; where ``RESHARD_MEGATRON16_PYTHON`` names an
interpreter with megatron-core >= 0.13, one test writes fresh saves with it (skipped otherwise).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import FlatLayout
from reshard.layouts.errors import FormatError, StorageError
from reshard.layouts.megatron_buckets import PARAM_ALIGN, bucket_pieces, chunk_bounds, param_start
from reshard.store.frontends.megatron import import_megatron
from reshard.store.ops.redivide import local_part
from reshard.store.read.display import saved_by

DATA = Path(__file__).parent / "data" / "megatron" / "forms"
STATES = ("param", "exp_avg", "exp_avg_sq")


def reference(form: str, folder: Path = DATA) -> dict[str, np.ndarray]:
    """What Megatron held, by the imported name: model weights (float32) and optimizer.state.<state>.<key>."""
    with np.load(folder / f"reference_{form}.npz", allow_pickle=False) as ref:
        return {(key if state == "model" else f"optimizer.state.{state}.{key}"): ref[name]
                for name in ref.files for state, key in [name.split("/", 1)]}


def _leaf(tree, name):
    for part in name.split("."):
        tree = tree[part]
    return tree


def _same(ckpt, want):
    for name, arr in want.items():
        got = np.asarray(ckpt[name].read(), dtype=np.float32)  # model weights are bf16: exact in float32
        np.testing.assert_array_equal(got, arr, err_msg=name)


@pytest.mark.parametrize("form", ["dp_reshardable", "fully_reshardable"])
def test_import_gives_each_parameters_state(tmp_path, form):
    done = import_megatron(str(DATA / form), str(tmp_path / "rs"))
    want = reference(form)
    ckpt = rs.open(str(tmp_path / "rs"))
    assert set(ckpt) == set(want) and done["tensors"] == len(want) and not done["skipped"]
    _same(ckpt, want)
    states = [n for n in want if n.startswith("optimizer.state.")]
    assert len(states) == 3 * (len(want) - len(states))  # every parameter has its three states
    for name in states:
        lay = ckpt.tensor(name).layout
        assert lay.shape == want[name].shape and ckpt.tensor(name).dtype == "float32"
        assert isinstance(lay, FlatLayout) == (form == "dp_reshardable"), name
    # the ranks that wrote data (__<rank>_<n>.distcp), not the flat pieces the layouts number: in the TP=2 x DP=2
    # job all 4 wrote dp_reshardable buckets; fully_reshardable state is gathered, and the second DP group's ranks
    # (their weights replicas of the first's) wrote nothing
    writers = 4 if form == "dp_reshardable" else 2
    assert ckpt.leaves["reshard.source"] == {"format": "Megatron-Core torch_dist", "ranks": writers}
    assert saved_by(ckpt).startswith(f"imported from the files of {writers} ranks of a Megatron-Core torch_dist save")


def test_dp_reshardable_ranges_are_megatrons_pieces(tmp_path):
    """Each range is one stored piece: a data-parallel rank's part of one tensor-parallel block (per layer)."""
    import_megatron(str(DATA / "dp_reshardable"), str(tmp_path / "rs"))
    ckpt = rs.open(str(tmp_path / "rs"))
    cut = 0
    for name in (n for n in ckpt if n.startswith("optimizer.state.exp_avg.")):
        lay = ckpt.tensor(name).layout
        model = ckpt.tensor(name.removeprefix("optimizer.state.exp_avg.")).layout
        blocks = {(tuple(s.start for s in b.region), b.shape) for b in model.blocks()}
        assert {(off, block) for _, off, block, _, _, _ in lay.ranges} == blocks, name
        assert lay.origin == {"framework": "megatron", "form": "dp_reshardable"}
        cut += sum(1 for _, _, block, start, stop, _ in lay.ranges if stop - start < math.prod(block))
    assert cut >= 4  # the sample's buckets cut parameters at data-parallel shard bounds


def dp_targets(ckpt, dp: int) -> dict[str, FlatLayout]:
    """Every optimizer state under another data-parallel size: each tensor-parallel block cut evenly among dp ranks."""
    out = {}
    for name in (n for n in ckpt if n.startswith("optimizer.state.")):
        model = ckpt.tensor(name.split(".", 3)[3]).layout
        entries, rank = [], 0
        for block in sorted(model.blocks(), key=lambda b: tuple(s.start for s in b.region)):
            n = math.prod(block.shape)
            for i in range(dp):
                entries.append((rank, tuple(s.start for s in block.region), block.shape, n * i // dp,
                                n * (i + 1) // dp, 0))
                rank += 1
        out[name] = FlatLayout.from_megatron(model.shape, entries)
    return out


@pytest.mark.parametrize("dp", [1, 3])
def test_load_and_redivide_to_another_dp_size(tmp_path, dp):
    import_megatron(str(DATA / "dp_reshardable"), str(tmp_path / "rs"))
    ckpt = rs.open(str(tmp_path / "rs"))
    want = reference("dp_reshardable")
    targets = dp_targets(ckpt, dp)
    ranks = sorted(set().union(*(lay.ranks for lay in targets.values())))
    for rank in ranks:
        got = ckpt.load(targets, rank)
        for name, lay in targets.items():
            if lay.has_rank(rank):
                np.testing.assert_array_equal(_leaf(got, name), local_part(lay, rank, want[name]),
                                              err_msg=f"{name} {rank}")
    rs.redivide(ckpt, str(tmp_path / f"dp{dp}"), targets)
    out = rs.open(str(tmp_path / f"dp{dp}"))
    for name, lay in targets.items():
        assert out.tensor(name).layout == lay
        np.testing.assert_array_equal(out[name].read(), want[name], err_msg=name)


def test_cli_imports_dp_reshardable(tmp_path):
    from reshard.store.cli import main

    assert main(["import", "megatron", str(DATA / "dp_reshardable"), str(tmp_path / "rs")]) == 0
    assert "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight" in rs.open(str(tmp_path / "rs"))


# ------------------------------------------------------------------ what is not decoded: refused, or skipped on request
# (MoE saves, whose ChainedOptimizer buckets are decoded: tests/test_megatron_moe.py)


def test_a_common_entry_that_is_not_json_is_refused_unless_skipped(tmp_path):
    import torch

    folder = tmp_path / "src"
    shutil.copytree(DATA / "dp_reshardable", folder)
    common = torch.load(folder / "common.pt", weights_only=True)
    common["table"] = torch.arange(4)  # a tensor: not JSON, and not a ShardedTensor either
    torch.save(common, folder / "common.pt")
    with pytest.raises(FormatError, match=r"src/common\.pt: entry 'table': it holds a tensor of shape \[4\]"):
        import_megatron(str(folder), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    done = import_megatron(str(folder), str(tmp_path / "x"), skip=["common.table"])
    assert done["skipped"] == ["common.table"]
    assert rs.open(str(tmp_path / "x")).leaves["reshard.skipped"][0]["name"] == "common.table"


# ------------------------------------------------------------------ the bucket rules, pure


def test_bucket_pieces_follow_megatrons_rules():
    assert PARAM_ALIGN == 64 and param_start(0) == 0 and param_start(1) == 64 and param_start(128) == 128
    # a bucket of 200 on 2 ranks of 128 (padded 256): params of 80 and 72 at 0 and 128; padding [80, 128)
    chunks = [(0, 80), (80, 48), (128, 72)]
    assert chunk_bounds(200, chunks) == (0, 80, 128, 200)
    assert bucket_pieces(200, chunks, [(0, 80), (128, 200)]) == (((0, 0, 80),), ((128, 0, 72),))
    # a param across the data-parallel bound at 64: two pieces
    assert bucket_pieces(100, [(0, 64), (64, 36)], [(0, 100)]) == (((0, 0, 64), (64, 64, 100)),)


@pytest.mark.parametrize("chunks, spans, match", [
    ([(0, 80), (90, 110)], [(0, 80)], "leave a gap"),
    ([(0, 80), (70, 130)], [(0, 80)], "overlap"),
    ([(0, 80), (80, 48), (128, 80)], [(0, 80)], "end at element 208"),
    ([(0, 80), (80, 48), (128, 72)], [(0, 80), (100, 200)], "next multiple of 64"),
    ([(0, 80), (80, 48), (128, 62), (190, 10)], [(0, 80), (128, 190)], "end at element 190, the bucket holds"),
    ([(0, 200)], [(0, 80), (128, 200)], "no stored chunk starts or ends at element 80"),
])
def test_bucket_pieces_refuse_what_megatron_does_not_write(chunks, spans, match):
    with pytest.raises(FormatError, match=match):
        bucket_pieces(200, chunks, spans)


# ------------------------------------------------------------------ hostile or damaged saves


def _doctor(tmp_path: Path, change) -> Path:
    """A copy of the dp_reshardable sample whose DCP .metadata ``change(md)`` altered (test-side pickle)."""
    folder = tmp_path / "doctored"
    shutil.copytree(DATA / "dp_reshardable", folder)
    md = pickle.loads((folder / ".metadata").read_bytes())  # the test's own sample
    change(md)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return folder


def _buckets(md, state="param"):
    return [k for k in md.state_dict_metadata if k.startswith("optimizer.distributed.") and k.endswith(f".{state}")
            and hasattr(md.state_dict_metadata[k], "chunks")]


def test_without_model_weights_the_buckets_cannot_be_placed(tmp_path):
    def drop_model(md):
        for key in [k for k in md.state_dict_metadata if not k.startswith("optimizer.")]:
            del md.state_dict_metadata[key]

    with pytest.raises(FormatError, match="equals no saved model weight"):
        import_megatron(str(_doctor(tmp_path, drop_model)), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_weights_out_of_step_with_the_optimizer_are_refused(tmp_path):
    """Layer 0's block of a weight made to read layer 1's bytes: layer 0's main parameter then equals no saved
    weight, and layer 1's equals two blocks whose states differ; either way, refused, not guessed."""
    def point_elsewhere(md):
        fc1 = {tuple(i.offset): i for i in md.storage_data if i.fqn == "decoder.layers.mlp.linear_fc1.weight"}
        md.storage_data[fc1[(0, 0, 0)]] = md.storage_data[fc1[(1, 0, 0)]]

    with pytest.raises(FormatError, match=r"equals no saved model weight|identical values but different optimizer"):
        import_megatron(str(_doctor(tmp_path, point_elsewhere)), str(tmp_path / "x"))


def test_damaged_bucket_metadata_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def gap(md):
        item = md.state_dict_metadata[_buckets(md)[0]]
        c = item.chunks[1]
        item.chunks[1] = ChunkStorageMetadata(offsets=c.offsets, sizes=type(c.sizes)([c.sizes[0] - 1]))

    with pytest.raises(FormatError, match=r"stored chunks leave a gap|other chunks"):
        import_megatron(str(_doctor(tmp_path / "a", gap)), str(tmp_path / "x"))

    def no_main(md):
        for key in _buckets(md):
            del md.state_dict_metadata[key]

    with pytest.raises(FormatError, match="no 'param' state"):
        import_megatron(str(_doctor(tmp_path / "b", no_main)), str(tmp_path / "x"))

    def other_chunks(md):
        item = md.state_dict_metadata[_buckets(md, "exp_avg")[0]]
        item.chunks.pop()

    with pytest.raises(FormatError, match="other chunks"):
        import_megatron(str(_doctor(tmp_path / "c", other_chunks)), str(tmp_path / "x"))


def test_a_bucket_claiming_more_than_is_stored_is_refused_before_allocating(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def huge(md):
        for key in [k for state in STATES for k in _buckets(md, state)]:
            item = md.state_dict_metadata[key]
            last = item.chunks[-1]
            grown = int(last.sizes[0]) + 10**12
            item.chunks[-1] = ChunkStorageMetadata(offsets=last.offsets, sizes=type(last.sizes)([grown]))
            item.size = type(item.size)([int(last.offsets[0]) + grown])

    with pytest.raises(FormatError, match="1000000000304 elements, its per_bucket_numel_unpadded says 304"):
        import_megatron(str(_doctor(tmp_path / "a", huge)), str(tmp_path / "x"))

    def huge_alone(md):  # and without the per_bucket_numel objects that gave it away
        huge(md)
        for index in [i for i in md.storage_data if "per_bucket_numel" in i.fqn]:
            del md.storage_data[index]

    with pytest.raises(FormatError, match="claims 1000000000"):
        import_megatron(str(_doctor(tmp_path / "b", huge_alone)), str(tmp_path / "x"))


def test_truncated_bucket_file_is_a_clear_error(tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(DATA / "dp_reshardable", folder)
    biggest = max(folder.glob("__*.distcp"), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.raises((FormatError, StorageError), match=r"past its end|short read|cannot decode"):
        import_megatron(str(folder), str(tmp_path / "x"))


# ------------------------------------------------------------------ export back to Megatron (fully_reshardable)


@pytest.mark.parametrize("form", ["dp_reshardable", "fully_reshardable"])
def test_export_reads_back_as_the_same_values(tmp_path, form):
    """Exported, the save imports again (through the same reader as Megatron's own saves) with every value."""
    import torch
    from reshard.store.frontends.megatron import export_megatron

    import_megatron(str(DATA / form), str(tmp_path / "rs"))
    done = export_megatron(str(tmp_path / "rs"), str(tmp_path / "mc"))
    want = reference(form)
    assert done["tensors"] == len(want) and done["states"] == len([n for n in want if n.startswith("optimizer.")])
    assert json.loads((tmp_path / "mc" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch.load(tmp_path / "mc" / "common.pt", weights_only=True)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and all(g["step"] == 2.0 for g in groups)
    import_megatron(str(tmp_path / "mc"), str(tmp_path / "back"))
    back = rs.open(str(tmp_path / "back"))
    assert set(back) == set(want)
    _same(back, want)
    assert back.leaves["common.optimizer"]["param_state_sharding_type"] == "fully_reshardable"


def test_export_after_a_redivision(tmp_path):
    from reshard.store.frontends.megatron import export_megatron

    import_megatron(str(DATA / "dp_reshardable"), str(tmp_path / "rs"))
    ckpt = rs.open(str(tmp_path / "rs"))
    rs.redivide(ckpt, str(tmp_path / "dp3"), dp_targets(ckpt, 3))
    export_megatron(str(tmp_path / "dp3"), str(tmp_path / "mc"))
    import_megatron(str(tmp_path / "mc"), str(tmp_path / "back"))
    _same(rs.open(str(tmp_path / "back")), reference("dp_reshardable"))


def test_export_refusals(tmp_path):
    from reshard.store.frontends.megatron import export_megatron

    import_megatron(str(DATA / "dp_reshardable"), str(tmp_path / "rs"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(rs.CheckpointExistsError, match=r"full already exists.*--overwrite"):
        export_megatron(str(tmp_path / "rs"), str(tmp_path / "full"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "rs"] and (tmp_path / "full" / "x").read_text() == "x"
    export_megatron(str(tmp_path / "rs"), str(tmp_path / "full"), overwrite=True)
    assert not (tmp_path / "full" / "x").exists() and (tmp_path / "full" / "common.pt").is_file()
    rs.save({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "plain"))
    with pytest.raises(FormatError, match="no optimizer param groups"):
        export_megatron(str(tmp_path / "plain"), str(tmp_path / "x"))


def test_cli_exports_megatron(tmp_path):
    from reshard.store.cli import main

    assert main(["import", "megatron", str(DATA / "dp_reshardable"), str(tmp_path / "rs")]) == 0
    assert main(["export", "megatron", str(tmp_path / "rs"), str(tmp_path / "mc")]) == 0
    assert (tmp_path / "mc" / ".metadata").is_file() and (tmp_path / "mc" / "common.pt").is_file()


# ------------------------------------------------------------------ the real framework

MC_PYTHON = os.environ.get("RESHARD_MEGATRON16_PYTHON", sys.executable)


def _has_megatron() -> bool:
    code = ("import megatron.core as m; v = tuple(int(x) for x in m.__version__.split('.')[:2]); "
            "assert v >= (0, 13), m.__version__")
    try:
        return subprocess.run([MC_PYTHON, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _has_megatron(), reason="megatron-core >= 0.13 is not importable "
                                                "(set RESHARD_MEGATRON16_PYTHON)")
@pytest.mark.skipif(not os.environ.get("RESHARD_SOAK"), reason="trains and saves with Megatron-Core anew: 5-10 "
                    "minutes on 2 cores; with RESHARD_SOAK=1 (the committed samples it writes are tested always)")
def test_real_megatron_saves_import(tmp_path):
    out = tmp_path / "mc"
    done = subprocess.run([MC_PYTHON, str(DATA / "make_forms.py"), str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for form in ("dp_reshardable", "fully_reshardable"):
        import_megatron(str(out / form), str(tmp_path / form))
        _same(rs.open(str(tmp_path / form)), reference(form, out))


@pytest.mark.skipif(not _has_megatron(), reason="megatron-core >= 0.13 is not importable "
                                                "(set RESHARD_MEGATRON16_PYTHON)")
@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 1)])
def test_real_megatron_loads_the_export_at_another_parallelism(tmp_path, tp, dp):
    """dp_reshardable (TP=2 x DP=2) -> import -> export (fully_reshardable) -> Megatron-Core loads it on TP x DP
    ranks: its optimizer then holds, per parameter, exactly what the saving job held."""
    from reshard.store.frontends.megatron import export_megatron

    import_megatron(str(DATA / "dp_reshardable"), str(tmp_path / "rs"))
    export_megatron(str(tmp_path / "rs"), str(tmp_path / "mc"))
    done = subprocess.run([MC_PYTHON, str(DATA / "load_export.py"), str(tmp_path / "mc"), str(tmp_path / "held.npz"),
                           str(tp), str(dp)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "held.npz", allow_pickle=False) as held, \
            np.load(DATA / "reference_dp_reshardable.npz", allow_pickle=False) as ref:
        assert sorted(held.files) == sorted(ref.files)
        for name in ref.files:
            np.testing.assert_array_equal(held[name], ref[name], err_msg=name)

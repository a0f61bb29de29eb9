"""DeepSpeed ZeRO checkpoints: import, redivide to another DP size, export, load back.

Two kinds of tests:

* **Files built to DeepSpeed's documented layout** (always run): tests/dssaves.py
  writes ZeRO-1/2 and ZeRO-3 saves with ``torch.save``, following DeepSpeed's
  rules (stated in reshard.layouts.flatbuf and there, computed with numpy
  independently of reshard's layouts), DeepSpeed's classes named in the pickles
  as DeepSpeed writes them.
* **The real framework** (skipped when absent): DeepSpeed trains on gloo ranks
  and saves, reshard imports, redivides and exports for another DP size,
  DeepSpeed loads that on its ranks and saves again, and every tensor equals the
  first save's. DeepSpeed runs in the interpreter named by
  ``RESHARD_DEEPSPEED_PYTHON`` (default: this one), through tests/dsjob.py; the
  test is skipped when that interpreter cannot import deepspeed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
import torch
from dssaves import GROUPS, STATES, build_save, stub
from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import CheckpointNotFoundError, FormatError
from reshard.store.frontends.deepspeed import group_buffer, import_deepspeed
from reshard.store.frontends.deepspeed.write import PICKLE, export_deepspeed
from reshard.store.ops.redivide import local_part


def check_flat_loads(url: str, full: dict[str, np.ndarray], stage: int, dp: int) -> None:
    """Every rank of DeepSpeed's partition over ``dp`` ranks loads exactly its ranges."""
    ckpt = rs.open(url)
    for named in GROUPS:
        lays = group_buffer(stage, [s for _, s in named], dp).layouts()
        targets = {f"optimizer.{w}.{n}": lay for (n, _), lay in zip(named, lays, strict=True)
                   for w in ("fp32", *STATES)}
        for r in range(dp):
            got = ckpt.load(targets, r)
            for name, lay in targets.items():
                if r in lay.ranks:
                    node = got
                    for part in name.split("."):
                        node = node[part]
                    np.testing.assert_array_equal(node, local_part(lay, r, full[name]), err_msg=f"{name} rank {r}")


@pytest.mark.parametrize(("stage", "dp", "new"), [(2, 4, 3), (1, 3, 2), (3, 2, 3)])
def test_import_redivide_export_built_saves(tmp_path, stage, dp, new):
    full = build_save(tmp_path / "ds" / "global_step2", stage, dp)
    done = import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"))
    assert (done["stage"], done["dp"], done["tensors"]) == (stage, dp, len(full))
    ckpt = rs.open(str(tmp_path / "rs"))
    assert set(ckpt) == set(full)
    for name, arr in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr, err_msg=name)
    lay = ckpt.tensor("optimizer.fp32.embed.weight").layout
    assert isinstance(lay, FlatLayout) and lay.origin == {"framework": "deepspeed", "zero_stage": stage}
    assert isinstance(ckpt.tensor("module.norm.running").layout, Layout)
    check_flat_loads(str(tmp_path / "rs"), full, stage, new)
    # redivide to the new DP size (reshard's own flat layouts), export from there, import the export
    targets = {}
    for named in GROUPS:
        for (n, _), lay in zip(named, group_buffer(stage, [s for _, s in named], new).layouts(), strict=True):
            targets.update({f"optimizer.{w}.{n}": lay for w in ("fp32", *STATES)})
    rs.redivide(str(tmp_path / "rs"), str(tmp_path / "rs3"), targets)
    out = export_deepspeed(str(tmp_path / "rs3"), str(tmp_path / "ds3"), new)
    assert out["dp"] == new and (tmp_path / "ds3" / "latest").read_text() == "reshard"
    again = import_deepspeed(str(tmp_path / "ds3"), str(tmp_path / "again"))
    assert again["dp"] == new
    back = rs.open(str(tmp_path / "again"))
    assert set(back) == set(full)
    for name, arr in full.items():
        np.testing.assert_array_equal(back[name].read(), arr, err_msg=name)
    assert back.leaves["deepspeed"]["groups"][0]["hyper"]["betas"] == [0.9, 0.999]


def test_bf16_optimizer_files(tmp_path):
    full = build_save(tmp_path / "ds" / "s", 1, 3, prefix="bf16_")
    assert import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"))["stage"] == 1
    export_deepspeed(str(tmp_path / "rs"), str(tmp_path / "out"), 2)
    assert sorted(p.name for p in (tmp_path / "out" / "reshard").iterdir() if "optim" in p.name) == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    import_deepspeed(str(tmp_path / "out"), str(tmp_path / "again"))
    back = rs.open(str(tmp_path / "again"))
    for name, arr in full.items():
        np.testing.assert_array_equal(back[name].read(), arr, err_msg=name)


def test_import_refuses_what_it_cannot_read(tmp_path):
    build_save(tmp_path / "ok" / "s", 2, 2)
    shutil.copytree(tmp_path / "ok", tmp_path / "gap")
    os.remove(tmp_path / "gap" / "s" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(FormatError, match="optimizer files are of data-parallel ranks"):
        import_deepspeed(str(tmp_path / "gap"), str(tmp_path / "x"))
    shutil.copytree(tmp_path / "ok", tmp_path / "mp")
    shutil.copy(tmp_path / "mp" / "s" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                tmp_path / "mp" / "s" / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(FormatError, match=r"model-parallel rank 1's optimizer files .* some are missing"):
        import_deepspeed(str(tmp_path / "mp"), str(tmp_path / "x"))
    shutil.copytree(tmp_path / "ok", tmp_path / "evil")
    torch.save({"optimizer_state_dict": {"x": stub("os.system", ("echo owned",))}},
               tmp_path / "evil" / "s" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", pickle_module=PICKLE)
    with pytest.raises(FormatError, match=r"os\.system"):  # refused before anything is unpickled
        import_deepspeed(str(tmp_path / "evil"), str(tmp_path / "x"))
    shutil.copytree(tmp_path / "ok", tmp_path / "lie")
    model = torch.load(tmp_path / "lie" / "s" / "mp_rank_00_model_states.pt", weights_only=True)
    model["param_shapes"][0]["embed.weight"] = torch.Size([36, 12])  # the partitions no longer fit
    torch.save(model, tmp_path / "lie" / "s" / "mp_rank_00_model_states.pt")
    with pytest.raises(FormatError, match=r"param_slice_mappings|fp32 elements"):
        import_deepspeed(str(tmp_path / "lie"), str(tmp_path / "x"))
    with pytest.raises(CheckpointNotFoundError):
        import_deepspeed(str(tmp_path / "nowhere"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_export_writes_only_allowed_classes(tmp_path):
    build_save(tmp_path / "ds" / "s", 2, 2)
    import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"))
    ckpt = rs.open(str(tmp_path / "rs"))
    info = ckpt.leaves["deepspeed"]
    info["optimizer"]["loss_scaler"] = {"stub": "os.system", "args": ["echo owned"], "state": None}
    tensors = {n: ckpt[n].read() for n in ckpt}
    rs.save({**tensors, "deepspeed": info}, str(tmp_path / "edited"))
    with pytest.raises(FormatError, match=r"os\.system"):
        export_deepspeed(str(tmp_path / "edited"), str(tmp_path / "out"), 2)
    rs.save({"w": np.zeros(3, np.float32)}, str(tmp_path / "plain"))
    with pytest.raises(FormatError, match="not a checkpoint imported from DeepSpeed"):
        export_deepspeed(str(tmp_path / "plain"), str(tmp_path / "out"), 2)


def test_reexport_for_fewer_ranks_replaces_the_folder_whole(tmp_path):
    """``--dp 4`` then ``--dp 2 --overwrite`` into one DIR: only the new save (no rank 2 or 3 file, no old
    tag), and ``reshard import deepspeed`` reads it exactly."""
    from reshard.store.cli import main

    full = build_save(tmp_path / "ds" / "global_step2", 2, 4)
    import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"))
    out = tmp_path / "out"
    assert main(["export", "deepspeed", str(tmp_path / "rs"), str(out), "--dp", "4", "--tag", "four"]) == 0
    before = sorted(p.name for p in (out / "four").iterdir())
    assert main(["export", "deepspeed", str(tmp_path / "rs"), str(out), "--dp", "2"]) == 1  # refused: nothing changes
    assert sorted(os.listdir(out)) == ["four", "latest"] and sorted(p.name for p in (out / "four").iterdir()) == before
    assert main(["export", "deepspeed", str(tmp_path / "rs"), str(out), "--dp", "2", "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["latest", "reshard"] and (out / "latest").read_text() == "reshard"
    assert sorted(os.listdir(tmp_path)) == ["ds", "out", "rs"]  # nothing left beside
    assert sorted(os.listdir(out / "reshard")) == ["mp_rank_00_model_states.pt",
                                                   *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))]
    assert main(["import", "deepspeed", str(out), str(tmp_path / "back")]) == 0
    back = rs.open(str(tmp_path / "back"))
    assert back.leaves["deepspeed"]["dp"] == 2 and set(back) == set(full)
    for name, arr in full.items():
        np.testing.assert_array_equal(back[name].read(), arr, err_msg=name)


def test_cli_import_and_export(tmp_path):
    from reshard.store.cli import main

    build_save(tmp_path / "ds" / "s", 2, 4)
    assert main(["import", "deepspeed", str(tmp_path / "ds"), str(tmp_path / "rs"), "--tag", "s"]) == 0
    assert main(["export", "deepspeed", str(tmp_path / "rs"), str(tmp_path / "out"), "--dp", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "out" / "reshard").iterdir()) == [
        "mp_rank_00_model_states.pt", *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3))]


# ------------------------------------------------------------------------- the real framework

DS_PYTHON = os.environ.get("RESHARD_DEEPSPEED_PYTHON", sys.executable)
JOB = Path(__file__).with_name("dsjob.py")


def _has_deepspeed() -> bool:
    try:
        return subprocess.run([DS_PYTHON, "-c", "import deepspeed"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ds_job(*args: object) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([DS_PYTHON, str(JOB), *map(str, args)], capture_output=True, text=True, timeout=540,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.skipif(not _has_deepspeed(), reason="DeepSpeed is not importable (set RESHARD_DEEPSPEED_PYTHON)")
@pytest.mark.parametrize(("stage", "dp", "new"), [(2, 4, 3), (3, 2, 3), (-1, 2, 3)],
                         ids=["zero2", "zero3", "bf16-zero1"])
def test_real_deepspeed_save_redivide_load(tmp_path, stage, dp, new):
    ds_job("save", tmp_path / "ds", dp, stage)  # two training steps, then save_checkpoint
    import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"))
    first = rs.open(str(tmp_path / "rs"))
    names = first.leaves["deepspeed"]["groups"]
    targets = {}
    assert first.leaves["deepspeed"]["file_prefix"] == ("bf16_" if stage < 0 else "")
    for g in names:
        for n, lay in zip(g["names"], group_buffer(abs(stage), [tuple(s) for s in g["shapes"]], new).layouts(),
                          strict=True):
            targets.update({f"optimizer.{w}.{n}": lay for w in ("fp32", *g["states"])})
    rs.redivide(str(tmp_path / "rs"), str(tmp_path / "rs-new"), targets)
    export_deepspeed(str(tmp_path / "rs-new"), str(tmp_path / "ds-new"), new)
    ds_job("resave", tmp_path / "ds-new", tmp_path / "ds-again", new, stage)  # load_checkpoint, save again
    import_deepspeed(str(tmp_path / "ds-again"), str(tmp_path / "again"))
    again = rs.open(str(tmp_path / "again"))
    assert again.leaves["deepspeed"]["dp"] == new and set(again) == set(first)
    for name in first:
        np.testing.assert_array_equal(again[name].read(), first[name].read(), err_msg=name)
    if stage in (1, 2):  # the module weights are the fp32 master weights (fp32 training)
        for g in names:
            for n in g["names"]:
                np.testing.assert_array_equal(first[f"module.{n}"].read(), first[f"optimizer.fp32.{n}"].read())


@pytest.mark.skipif(not _has_deepspeed(), reason="DeepSpeed is not importable (set RESHARD_DEEPSPEED_PYTHON)")
def test_real_deepspeed_tensor_parallel(tmp_path):
    """DeepSpeed trains tests/dsjob.py's tensor-parallel model on 2 TP x 2 DP ranks (ZeRO-2, an ``mpu`` as
    Megatron gives it) and saves with Megatron-DeepSpeed's universal_checkpoint_info; reshard joins the TP
    slices, and DeepSpeed loads exports for 2 TP x 1 DP and 1 TP x 3 DP ranks, saves again, and every tensor
    equals the first save's."""
    from reshard.store.frontends.deepspeed import deepspeed_layouts
    from reshard.store.frontends.torch.pt_files import load_pt

    ds_job("save", tmp_path / "ds", 4, 2, 2)
    assert import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"))["tp"] == 2
    first = rs.open(str(tmp_path / "rs"))
    rules = first.leaves["deepspeed"]["tp_rules"]
    assert rules == {"fc1_weight": 0, "fc1_bias": 0, "fc2_weight": 1, "fc2_bias": "replicated",
                     "embed.weight": "replicated", "norm.weight": "replicated", "norm.bias": "replicated"}
    # the module weights DeepSpeed saved per TP rank, joined here with numpy, are what reshard stored
    local = [load_pt(str(tmp_path / "ds" / "step" / f"mp_rank_{m:02d}_model_states.pt"))["module"] for m in (0, 1)]
    for name, rule in rules.items():
        parts = [local[m][name].numpy() for m in (0, 1)]
        want = np.concatenate(parts, axis=rule) if isinstance(rule, int) else parts[0]
        np.testing.assert_array_equal(first[f"module.{name}"].read(), want, err_msg=name)
        np.testing.assert_array_equal(first[f"optimizer.fp32.{name}"].read(), want, err_msg=name)  # fp32 training
    assert first.tensor("optimizer.fp32.fc1_weight").layout.block_of(1) == (slice(4, 8), slice(0, 12))  # dp 0, mp 1
    for tp, dp in ((2, 1), (1, 3)):
        out = tmp_path / f"tp{tp}dp{dp}"
        rs.redivide(str(tmp_path / "rs"), str(out / "rs"), deepspeed_layouts(first, dp, tp=tp))
        export_deepspeed(str(out / "rs"), str(out / "ds"), dp, tp=tp)
        ds_job("resave", out / "ds", out / "again", tp * dp, 2, tp)  # load_checkpoint, save again
        assert import_deepspeed(str(out / "again"), str(out / "back"))["tp"] == tp
        again = rs.open(str(out / "back"))
        assert set(again) == set(first)
        for name in first:
            np.testing.assert_array_equal(again[name].read(), first[name].read(), err_msg=f"tp {tp} dp {dp}: {name}")


def test_model_state_entries_that_are_not_data_are_refused_unless_skipped(tmp_path):
    """Issue 35: a model-states entry that is not plain data (here a tensor) was left out of the leaf silently."""
    build_save(tmp_path / "ck" / "s", 2, 2, extra={"lr_scheduler": {"table": torch.arange(3)}})
    with pytest.raises(FormatError, match=r"model states entry 'lr_scheduler' \(in .*s/mp_rank_00_model_states\.pt\): "
                       r"it holds a tensor of shape \[3\], not plain data.*--skip lr_scheduler"):
        import_deepspeed(str(tmp_path / "ck"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    done = import_deepspeed(str(tmp_path / "ck"), str(tmp_path / "x"), skip=["lr_scheduler"])
    assert done["skipped"] == ["lr_scheduler"]
    leaves = rs.open(str(tmp_path / "x")).leaves
    assert "lr_scheduler" not in leaves["deepspeed"]["model_states"]
    assert leaves["reshard.skipped"][0]["name"] == "lr_scheduler"


def test_a_pickle_the_restricted_unpickler_refuses_names_the_file(tmp_path):
    """A pickle opcode torch's scan does not know surfaced as a bare 'UnpicklingError: Unsupported operand 149'."""
    import pickle
    import zipfile

    build_save(tmp_path / "ck" / "s", 2, 2)
    path = tmp_path / "ck" / "s" / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path) as z:
        entries = {i.filename: z.read(i) for i in z.infolist()}
    pkl = next(n for n in entries if n.endswith("/data.pkl"))
    entries[pkl] = pickle.dumps({"module": {}}, protocol=4)  # FRAME, SHORT_BINUNICODE: outside torch's scan
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    with pytest.raises(FormatError, match=r"mp_rank_00_model_states\.pt is not a torch\.save archive reshard reads "
                       r"\(UnpicklingError: Unsupported operand"):
        import_deepspeed(str(tmp_path / "ck"), str(tmp_path / "x"))

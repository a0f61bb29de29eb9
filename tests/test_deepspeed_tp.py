"""DeepSpeed saves with model-parallel (tensor-parallel) ranks: import, redivide, export for other TP/DP sizes.

The saves are built here to DeepSpeed's layout (tests/test_deepspeed.py's builder, one model-parallel rank at a
time: ``mp_rank_<m>_model_states.pt`` + ``zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt``, each rank's ZeRO
partition of its own TP slices); the slices are cut here with numpy (``np.array_split``: uneven where the dims
do not divide) and the expected whole tensors joined here with numpy, independently of reshard. The run with
DeepSpeed itself is in tests/test_deepspeed.py (``test_real_deepspeed_tensor_parallel``).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import reshard.store as rs
import torch
from dssaves import STATES, build_save, reference_parts
from reshard.layouts import FlatLayout
from reshard.layouts.errors import FormatError, UnsupportedError
from reshard.store.frontends.deepspeed import deepspeed_layouts, export_deepspeed, import_deepspeed

RNG = np.random.default_rng(2727)
#: The whole model, in DeepSpeed's group order, and how each parameter is split over the TP ranks.
MODEL = [[("fc1.weight", (8, 12), 0), ("fc2.weight", (5, 8), 1), ("embed.weight", (37, 12), 0)],
         [("fc1.bias", (8,), 0), ("fc2.bias", (5,), "replicated"), ("norm.weight", (12,), "average"),
          ("norm.bias", (12,), "replicated")]]
UC_INFO = {"universal_checkpoint_version": 0.2,
           "tp_replicated_parameter_patterns": [r"fc2\.bias", r"norm\.bias"],
           "parameter_to_average_patterns": [r"norm\.weight"],
           "parameter_with_row_parallelism_patterns": [r"fc2\.weight"],
           "vocabulary_parameter_patterns": [r"embed\."],
           "original_vocab_size": 37, "padded_vocab_size": 37}
TP_SPLIT = {r"fc2\.weight": 1, r"fc2\.bias|norm\.bias|norm\.running": "replicated", r"norm\.weight": "average",
            r".*": 0}  # the catch-all covers buffers too: norm.running is named before it
WHATS = ("fp32", *STATES)


def cut(arr: np.ndarray, rule: int | str, tp: int) -> list[np.ndarray]:
    return np.array_split(arr, tp, axis=rule) if isinstance(rule, int) else [arr] * tp


def build_tp_save(folder, stage: int, dp: int, tp: int, extra: dict | None = None, differ: str | None = None):
    """Every model-parallel rank's files; returns (whole tensors by reshard's names, per rank its local tensors
    and local groups). ``differ``: a replicated parameter whose TP copies differ (a broken save)."""
    whole, local = {}, [dict() for _ in range(tp)]
    for named in MODEL:
        for name, shape, rule in named:
            for what in WHATS:
                key = f"optimizer.{what}.{name}"
                if rule == "average" or name == differ:  # each TP rank its own values; the import keeps the mean
                    parts = [RNG.standard_normal(shape).astype(np.float32) for _ in range(tp)]
                    total = parts[0]
                    for p in parts[1:]:
                        total = total + p
                    whole[key] = (total / tp).astype(np.float32)
                else:
                    whole[key] = RNG.standard_normal(shape).astype(np.float32)
                    parts = cut(whole[key], rule, tp)
                for m in range(tp):
                    local[m][key] = np.ascontiguousarray(parts[m])
            for m in range(tp):
                local[m][f"module.{name}"] = local[m][f"optimizer.fp32.{name}"]
            if stage != 3:
                whole[f"module.{name}"] = whole[f"optimizer.fp32.{name}"]
    whole["module.norm.running"] = np.arange(3.0, dtype=np.float32)  # a buffer, the same on every rank
    groups = [[[(n, local[m][f"optimizer.fp32.{n}"].shape) for n, _, _ in named] for named in MODEL]
              for m in range(tp)]
    for m in range(tp):
        build_save(folder, stage, dp, groups=groups[m], mp=m, tp=tp, values=local[m], extra=extra)
    return whole, local, groups


def check_ranks(ckpt, local, groups, stage: int, dp: int, tp: int) -> None:
    """Global rank d * tp + m loads, under the saved layout, exactly its ZeRO range of rank m's slice; the
    module weights' rank m its slice."""
    for g, named in enumerate(MODEL):
        for m in range(tp):
            parts = reference_parts(stage, [s for _, s in groups[m][g]], dp)
            for d in range(dp):
                for _, t, a, b in parts[d][:-1]:
                    name = named[t][0]
                    for what in WHATS:
                        key = f"optimizer.{what}.{name}"
                        lay = ckpt.tensor(key).layout
                        assert isinstance(lay, FlatLayout)
                        if not lay.has_rank(d * tp + m):
                            assert m > 0 and named[t][2] in ("replicated", "average"), (key, d, m)
                            continue  # a replica whose range is not model-parallel rank 0's
                        got = ckpt.load({key: lay}, d * tp + m)
                        for part in key.split("."):
                            got = got[part]
                        want = local[m][key].reshape(-1)[a:b]
                        if named[t][2] == "average":
                            want = ckpt[key].read().reshape(-1)[a:b]
                        np.testing.assert_array_equal(got, want, err_msg=f"{key} dp {d} mp {m}")
            if stage != 3:
                for name, _, rule in named:
                    lay = ckpt.tensor(f"module.{name}").layout
                    got = ckpt.load({f"module.{name}": lay}, m)
                    for part in f"module.{name}".split("."):
                        got = got[part]
                    if rule != "average":
                        np.testing.assert_array_equal(got, local[m][f"module.{name}"], err_msg=f"module.{name}")


def check_values(url: str, whole: dict[str, np.ndarray], exact: bool = True) -> None:
    back = rs.open(url)
    assert set(back) == set(whole)
    for name, arr in whole.items():
        got = back[name].read()
        if exact or "norm.weight" not in name:
            np.testing.assert_array_equal(got, arr, err_msg=name)
        else:  # an averaged tensor written to every TP rank and averaged again
            np.testing.assert_allclose(got, arr, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize(("stage", "dp", "tp", "how"), [(2, 2, 2, "info"), (3, 2, 2, "user"), (1, 3, 3, "info")])
def test_import_redivide_export_tp_saves(tmp_path, stage, dp, tp, how):
    whole, local, groups = build_tp_save(tmp_path / "ds" / "s", stage, dp, tp,
                                         extra={"universal_checkpoint_info": UC_INFO} if how == "info" else None)
    split = TP_SPLIT if how == "user" else None
    done = import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rs"), tp_split=split)
    assert (done["stage"], done["dp"], done["tp"], done["tensors"]) == (stage, dp, tp, len(whole))
    check_values(str(tmp_path / "rs"), whole)
    ckpt = rs.open(str(tmp_path / "rs"))
    info = ckpt.leaves["deepspeed"]
    assert info["tp"] == tp and info["tp_rules"] == {n: r for named in MODEL for n, _, r in named} | (
        {"norm.running": "replicated"})
    lay = ckpt.tensor("optimizer.fp32.fc2.weight").layout
    assert lay.origin == {"framework": "deepspeed", "zero_stage": stage, "tp": tp, "tp_rule": 1}
    assert sorted(ckpt.tensor("optimizer.exp_avg.embed.weight").layout.ranks) == list(range(dp * tp))
    check_ranks(ckpt, local, groups, stage, dp, tp)
    if tp == 3:  # 8 rows of fc1.bias cut 3, 3, 2: rank 2's buffer puts norm.bias elsewhere, not a replica of rank 0
        assert not any(r % 3 == 2 for r in ckpt.tensor("optimizer.fp32.norm.bias").layout.ranks)
    # the same TP size, another DP size: redivide, export, import the export
    rs.redivide(str(tmp_path / "rs"), str(tmp_path / "rs2"), deepspeed_layouts(ckpt, dp + 1))
    out = export_deepspeed(str(tmp_path / "rs2"), str(tmp_path / "ds2"), dp + 1)
    assert (out["tp"], out["dp"]) == (tp, dp + 1)
    names = sorted(p.name for p in (tmp_path / "ds2" / "reshard").iterdir() if "optim" in p.name)
    assert names == sorted(f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(dp + 1)
                           for m in range(tp))
    import_deepspeed(str(tmp_path / "ds2"), str(tmp_path / "again"), tp_split=split)
    check_values(str(tmp_path / "again"), whole, exact=False)
    # one TP rank (a data-parallel save): every rank holds whole tensors' ranges
    rs.redivide(str(tmp_path / "rs"), str(tmp_path / "rs1"), deepspeed_layouts(ckpt, 2, tp=1))
    export_deepspeed(str(tmp_path / "rs1"), str(tmp_path / "ds1"), 2, tp=1)
    assert import_deepspeed(str(tmp_path / "ds1"), str(tmp_path / "one"))["tp"] == 1
    check_values(str(tmp_path / "one"), whole)
    if tp == 2:  # and back to two TP ranks from the data-parallel save, the rules given by the user (37 rows of
        # embed.weight do not split evenly: replicated this time)
        rules = {r"embed\.": "replicated", **TP_SPLIT}
        export_deepspeed(str(tmp_path / "one"), str(tmp_path / "ds-tp2"), 1, tp=2, tp_split=rules)
        assert import_deepspeed(str(tmp_path / "ds-tp2"), str(tmp_path / "two"), tp_split=rules)["tp"] == 2
        check_values(str(tmp_path / "two"), whole, exact=False)
        lay = rs.open(str(tmp_path / "two")).tensor("optimizer.fp32.fc1.weight").layout
        assert [lay.block_of(r) for r in (0, 1)] == [(slice(0, 4), slice(0, 12)), (slice(4, 8), slice(0, 12))]


def test_tp_import_refuses_what_it_cannot_join(tmp_path):
    build_tp_save(tmp_path / "bare" / "s", 2, 2, 2)  # no universal_checkpoint_info
    with pytest.raises(UnsupportedError, match=r"fc1\.weight: the save is split over tensor-parallel ranks"):
        import_deepspeed(str(tmp_path / "bare"), str(tmp_path / "x"))
    with pytest.raises(UnsupportedError, match=r"embed\.weight"):  # a tp_split that leaves one out
        import_deepspeed(str(tmp_path / "bare"), str(tmp_path / "x"), tp_split={k: v for k, v in TP_SPLIT.items()
                                                                                  if k != ".*"} | {"fc1": 0})
    with pytest.raises(FormatError, match=r"do not join along dim 2"):
        import_deepspeed(str(tmp_path / "bare"), str(tmp_path / "x"), tp_split={".*": 2})
    with pytest.raises(ValueError, match="rule 'sideways'"):
        import_deepspeed(str(tmp_path / "bare"), str(tmp_path / "x"), tp_split={".*": "sideways"})
    build_tp_save(tmp_path / "differ" / "s", 2, 2, 2, extra={"universal_checkpoint_info": UC_INFO},
                  differ="fc2.bias")
    with pytest.raises(FormatError, match=r"fc2\.bias: model-parallel ranks 0 and 1 hold different values"):
        import_deepspeed(str(tmp_path / "differ"), str(tmp_path / "x"))
    for info, error, match in [
            ({**UC_INFO, "tp_replicated_parameter_patterns": ["(a+)+$"]}, FormatError, "repeats a repeated group"),
            ({**UC_INFO, "tp_replicated_parameter_patterns": ["(unclosed"]}, FormatError, "not a regular expression"),
            ({**UC_INFO, "tp_replicated_parameter_patterns": "norm"}, FormatError, "not a list of patterns"),
            ({**UC_INFO, "parameter_with_sub_params": [{"patterns": [r"fc1\.weight"], "shape": [2, -1, 12],
                                                        "partition_dim": 1}]},
             UnsupportedError, r"fc1\.weight: universal_checkpoint_info's parameter_with_sub_params"),
            ("not a dict", FormatError, "universal_checkpoint_info is a str")]:
        folder = tmp_path / f"bad{abs(hash(str(info)))}"
        build_tp_save(folder / "s", 2, 2, 2, extra={"universal_checkpoint_info": info})
        with pytest.raises(error, match=match):
            import_deepspeed(str(folder), str(tmp_path / "x"))
    ok = tmp_path / "ok"
    build_tp_save(ok / "s", 1, 2, 2, extra={"universal_checkpoint_info": UC_INFO})
    shutil.copytree(ok, tmp_path / "gap")
    (tmp_path / "gap" / "s" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(FormatError, match="model-parallel rank 1's optimizer files are of data-parallel ranks"):
        import_deepspeed(str(tmp_path / "gap"), str(tmp_path / "x"))
    shutil.copytree(ok, tmp_path / "lie")
    model = torch.load(tmp_path / "lie" / "s" / "mp_rank_01_model_states.pt", weights_only=True)
    model["mp_world_size"] = 4
    torch.save(model, tmp_path / "lie" / "s" / "mp_rank_01_model_states.pt")
    with pytest.raises(FormatError, match="say 4 model-parallel ranks, the folder holds optimizer files of 2"):
        import_deepspeed(str(tmp_path / "lie"), str(tmp_path / "x"))
    model["mp_world_size"] = 2
    model["module"]["norm.running"] = torch.ones(3)  # a buffer no rule names, different on rank 1
    torch.save(model, tmp_path / "lie" / "s" / "mp_rank_01_model_states.pt")
    with pytest.raises(FormatError, match=r"module\.norm\.running: model-parallel ranks 0 and 1"):
        import_deepspeed(str(tmp_path / "lie"), str(tmp_path / "x"))
    shutil.copytree(ok, tmp_path / "pipe")
    shutil.copy(ok / "s" / "mp_rank_00_model_states.pt", tmp_path / "pipe" / "s" / "layer_01-model_00-model_states.pt")
    with pytest.raises(UnsupportedError, match="pipeline-parallel"):
        import_deepspeed(str(tmp_path / "pipe"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    # an export to more TP ranks needs rules, and dims that divide
    import_deepspeed(str(ok), str(tmp_path / "rs"))
    with pytest.raises(ValueError, match=r"embed\.weight: dim 0 of shape \[37, 12\] does not split evenly"):
        export_deepspeed(str(tmp_path / "rs"), str(tmp_path / "out"), 1, tp=4)
    export_deepspeed(str(tmp_path / "rs"), str(tmp_path / "one"), 2, tp=1)
    import_deepspeed(str(tmp_path / "one"), str(tmp_path / "rs1"))
    with pytest.raises(UnsupportedError, match=r"fc1\.weight: writing 2 tensor-parallel ranks"):
        export_deepspeed(str(tmp_path / "rs1"), str(tmp_path / "out"), 1, tp=2)


def test_tp_cli(tmp_path):
    from reshard.store.cli import main

    whole, _, _ = build_tp_save(tmp_path / "ds" / "s", 2, 2, 2)
    rules = [arg for p, r in TP_SPLIT.items() for arg in ("--tp-split", f"{p}={r}")]
    assert main(["import", "deepspeed", str(tmp_path / "ds"), str(tmp_path / "rs"), *rules]) == 0
    check_values(str(tmp_path / "rs"), whole)
    assert main(["export", "deepspeed", str(tmp_path / "rs"), str(tmp_path / "out"), "--dp", "3", "--tp", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "out" / "reshard").iterdir()) == [
        "mp_rank_00_model_states.pt", *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3))]
    assert main(["import", "deepspeed", str(tmp_path / "ds"), str(tmp_path / "rs2"), "--tp-split", "no-rule"]) == 2
    assert not (tmp_path / "rs2").exists()


def test_docs_page_runs_on_built_saves(tmp_path, monkeypatch):
    """docs/deepspeed.md's python blocks, run as pasted (tests/test_docs.py's reader) in a folder holding the saves
    they name, built here: ``ckpts/`` (ZeRO-2, 4 DP ranks) and ``ckpts-tp/`` (2 TP x 2 DP). What they read and
    write holds the built values: the tensor read, both redivisions, and both exports imported again."""
    from test_docs import DOCS, blocks

    monkeypatch.chdir(tmp_path)
    full = build_save(tmp_path / "ckpts" / "global_step2", 2, 4)
    whole, _, _ = build_tp_save(tmp_path / "ckpts-tp" / "global_step2", 2, 2, 2)
    scope: dict[str, object] = {"__name__": "__docs__"}
    ran = 0
    for block in blocks((DOCS / "deepspeed.md").read_text()):
        if block.lang == "python":
            assert block.skip is None, f"docs/deepspeed.md:{block.line} is skipped"
            exec(compile("\n" * (block.line - 1) + block.code, str(DOCS / "deepspeed.md"), "exec"), scope)
            ran += 1
    assert ran == 2
    np.testing.assert_array_equal(scope["exp_avg"], full["optimizer.exp_avg.embed.weight"])
    np.testing.assert_array_equal(scope["fc1"], whole["optimizer.fp32.fc1.weight"])
    three = rs.open("rs-ckpt-3")
    assert three.tensor("optimizer.fp32.embed.weight").layout.ranks == (0, 1, 2)
    for url, want in (("rs-ckpt", full), ("rs-ckpt-3", full), ("rs-tp", whole), ("rs-tp1", whole)):
        check_values(url, want)
    import_deepspeed("ckpts-3/", "again")
    import_deepspeed("ckpts-tp1/", "again-tp1")
    assert rs.open("again").leaves["deepspeed"]["dp"] == 3 and rs.open("again-tp1").leaves["deepspeed"]["dp"] == 2
    check_values("again", full)
    check_values("again-tp1", whole)

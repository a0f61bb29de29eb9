"""OneFlow front end: seed 001's sharded save/load, with real processes writing concurrently."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.frontends.oneflow import load_oneflow, placement_layouts, save_oneflow, sbp, to_local

MODEL_FILE_RANKS = [0, 1]  # seed 001: model_file_placement = flow.placement("cpu", ranks=[0, 1])
STAGES = [(16, 8), (8, 4), (4, 2), (2, 1)]  # Linear(in, out) of m_stage0..3, one per pipeline rank


def pipeline_state() -> dict[str, Any]:
    """The graph's state dict of seed 001 (weights [out, in], as OneFlow's Linear), deterministic."""
    rng = np.random.default_rng(1)
    module = {}
    for s, (n_in, n_out) in enumerate(STAGES):
        module[f"m_stage{s}.linear.weight"] = rng.standard_normal((n_out, n_in)).astype(np.float32)
        module[f"m_stage{s}.linear.bias"] = rng.standard_normal(n_out).astype(np.float32)
    return {"System-Train-TrainStep": np.array([2], np.int64), "module_pipeline": module, "lr": 0.001}


def get_sbp(state_dict: Any, tensor: Any) -> str:
    """Seed 001's get_sbp, word for word but for the ``flow.`` prefix."""
    if tensor is state_dict["System-Train-TrainStep"]:
        return sbp.broadcast
    if tensor is state_dict["module_pipeline"]["m_stage3.linear.weight"]:
        return sbp.split(1)
    if tensor is state_dict["module_pipeline"]["m_stage3.linear.bias"]:
        return sbp.broadcast
    return sbp.split(0)


def _rank_main(rank: int, url: str, barrier: Any) -> None:
    """One rank of the 4-rank pipeline job: save the model-file pieces it holds, rank 0 commits."""
    # OneFlow's to_global(state_dict, model_file_placement, get_sbp) moves the stages'
    # tensors onto ranks 0 and 1; to_local then gives each of them its piece (None on 2, 3).
    local = to_local(pipeline_state(), MODEL_FILE_RANKS, get_sbp, rank)
    writer = save_oneflow(local, url, MODEL_FILE_RANKS, get_sbp, rank=rank)
    assert (writer is None) == (rank not in MODEL_FILE_RANKS)
    barrier.wait()
    if rank == 0 and writer is not None:
        writer.commit()


def test_seed001_pipeline_saved_by_four_processes(tmp_path: Path) -> None:
    url = str(tmp_path / "graph_save_load_global")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_rank_main, args=(r, url, barrier)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]

    ckpt = rs.open(url)
    full = pipeline_state()
    module = full["module_pipeline"]
    assert ckpt.leaves == {"lr": 0.001}
    w3 = ckpt["module_pipeline.m_stage3.linear.weight"]
    assert w3.layout == placement_layouts({"w": module["m_stage3.linear.weight"]}, [0, 1], "S(1)", local=False)["w"]
    assert ckpt["module_pipeline.m_stage0.linear.weight"].meta.shard == (4, 16)  # rank 0's and rank 1's halves
    np.testing.assert_array_equal(ckpt["System-Train-TrainStep"].read(), [2])

    # back onto the pipeline: stage s whole (broadcast) on rank s
    for s in range(4):
        names = [f"module_pipeline.m_stage{s}.linear.{p}" for p in ("weight", "bias")]
        got = load_oneflow(ckpt, s, [s], sbp.broadcast, names=names)
        assert got is not None
        for p in ("weight", "bias"):
            np.testing.assert_array_equal(got["module_pipeline"][f"m_stage{s}.linear.{p}"],
                                          module[f"m_stage{s}.linear.{p}"])

    # onto 3 ranks (balanced, uneven: 8 rows -> 3, 3, 2; the 1-element bias -> 1, 0, 0)
    pieces = {r: load_oneflow(ckpt, r, [0, 1, 2], get_sbp) for r in range(4)}
    assert pieces[3] is None
    w0 = module["m_stage0.linear.weight"]
    for r, rows in enumerate([slice(0, 3), slice(3, 6), slice(6, 8)]):
        local = pieces[r]
        assert local is not None
        np.testing.assert_array_equal(local["module_pipeline"]["m_stage0.linear.weight"], w0[rows])
        np.testing.assert_array_equal(local["System-Train-TrainStep"], [2])
        assert local["module_pipeline"]["m_stage2.linear.bias"].shape == ((1,), (1,), (0,))[r]
        assert local["lr"] == 0.001
    cols = [pieces[r]["module_pipeline"]["m_stage3.linear.weight"] for r in range(3)]  # type: ignore[index]
    np.testing.assert_array_equal(np.concatenate(cols, axis=1), module["m_stage3.linear.weight"])

    # onto a 2-d placement [[0, 1], [2, 3]] with (split(0), split(1))
    for r in range(4):
        got = load_oneflow(ckpt, r, [[0, 1], [2, 3]], (sbp.split(0), sbp.split(1)),
                           names=["module_pipeline.m_stage0.linear.weight"])
        assert got is not None
        want = w0[4 * (r // 2):4 * (r // 2) + 4, 8 * (r % 2):8 * (r % 2) + 8]
        np.testing.assert_array_equal(got["module_pipeline"]["m_stage0.linear.weight"], want)


def test_all_ranks_at_once_uneven_and_errors(tmp_path: Path) -> None:
    """seed 001's Linear(2, 6) example: weight [6, 2] split(0) on ranks [0, 1], loaded broadcast on [0]."""
    state = {"weight": np.arange(12, dtype=np.float32).reshape(6, 2), "bias": np.zeros(6, np.float32)}
    by_rank = {r: to_local(state, [0, 1], sbp.split(0), r) for r in (0, 1)}
    assert by_rank[0]["weight"].shape == (3, 2)  # type: ignore[index]
    save_oneflow(by_rank, str(tmp_path / "a"), [0, 1], "oneflow.sbp.split(dim=0)")
    got = load_oneflow(str(tmp_path / "a"), 0, [0], sbp.broadcast)
    assert got is not None
    np.testing.assert_array_equal(got["weight"], state["weight"])

    # 5 rows on 2 ranks: 3 + 2, so the global shape must be given
    odd = {"x": np.arange(10, dtype=np.int32).reshape(5, 2)}
    parts = {r: to_local(odd, [0, 1], "S(0)", r) for r in (0, 1)}
    with pytest.raises(rs.ShapeMismatchError):
        save_oneflow(parts, str(tmp_path / "b"), [0, 1], "S(0)")
    save_oneflow(parts, str(tmp_path / "c"), [0, 1], "S(0)", shapes={"x": (5, 2)})
    np.testing.assert_array_equal(rs.open(str(tmp_path / "c"))["x"].read(), odd["x"])

    with pytest.raises(rs.LayoutError, match="partial_sum"):
        save_oneflow(parts[0], str(tmp_path / "d"), [0, 1], sbp.partial_sum, rank=0)
    assert save_oneflow(parts[0], str(tmp_path / "d"), [0, 1], "S(0)", rank=5) is None
    with pytest.raises(rs.LayoutError, match="wants"):
        save_oneflow({0: parts[0]}, str(tmp_path / "e"), [0, 1], "S(0)")

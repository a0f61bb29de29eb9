"""OneFlow front end: seed 001's sharded save/load, with real processes writing concurrently."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.frontends.oneflow import (
    load_npz,
    load_oneflow,
    placement_layouts,
    save_npz,
    save_oneflow,
    sbp,
    to_global,
    to_local,
)

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


def stage_state(stage: int) -> dict[str, Any]:
    """What pipeline rank ``stage`` holds: its own stage's Linear (P{stage}) and the step counter."""
    module = pipeline_state()["module_pipeline"]
    mine = {k: v for k, v in module.items() if k.startswith(f"m_stage{stage}.")}
    return {"System-Train-TrainStep": np.array([2], np.int64), "module_pipeline": mine, "lr": 0.001}


TIMEOUT = 60  # seconds any process waits on another before the test fails (it never hangs)


def _rank_main(rank: int, url: str, shared: Any, barrier: Any) -> None:
    """One rank of the 4-rank pipeline job of seed 001 (``train_with_graph(0, ...)``).

    Rank s holds only stage s. OneFlow's ``to_global(state_dict, model_file_placement,
    get_sbp)`` is a collective over the graph's *global* state dict; here the
    collective's data movement is emulated by exchanging the stages through a
    manager dict, so every rank then sees the whole dict (as get_sbp requires) and
    cuts its own piece; only the ranks of the model-file placement save.
    """
    shared[rank] = stage_state(rank)
    barrier.wait()
    gathered = [shared[r] for r in range(4)]
    state = {**gathered[0], "module_pipeline": {k: v for g in gathered for k, v in g["module_pipeline"].items()}}
    local = to_local(state, MODEL_FILE_RANKS, get_sbp, rank)  # to_local(to_global(...)): None on 2, 3
    assert (local is None) == (rank not in MODEL_FILE_RANKS)
    if local is not None:
        assert set(local["module_pipeline"]) == set(state["module_pipeline"])  # dotted keys kept
    # `if flow.env.get_rank() in model_file_placement.ranks: flow.save(to_local(...), dir)`
    writer = save_oneflow(local, url, MODEL_FILE_RANKS, get_sbp, rank=rank)
    assert (writer is None) == (rank not in MODEL_FILE_RANKS)
    barrier.wait()
    if rank == 0:
        assert writer is not None
        writer.commit()


def run_ranks(target: Any, n: int, *args: Any) -> None:
    """Run ``target(rank, *args, shared, barrier)`` in n spawned processes; fail, never hang."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        shared = manager.dict()
        barrier = ctx.Barrier(n, timeout=TIMEOUT)
        procs = [ctx.Process(target=target, args=(r, *args, shared, barrier)) for r in range(n)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(3 * TIMEOUT)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(10)
        assert [p.exitcode for p in procs] == [0] * n


def test_seed001_pipeline_saved_by_four_processes(tmp_path: Path) -> None:
    url = str(tmp_path / "graph_save_load_global")
    run_ranks(_rank_main, 4, url)

    ckpt = rs.open(url)
    full = pipeline_state()
    module = full["module_pipeline"]
    assert ckpt.leaves == {"lr": 0.001}
    w3 = ckpt["module_pipeline.m_stage3.linear.weight"]
    assert w3.layout == placement_layouts({"w": module["m_stage3.linear.weight"]}, [0, 1], "S(1)", local=False)["w"]
    assert ckpt["module_pipeline.m_stage0.linear.weight"].meta.shard == (4, 16)  # rank 0's and rank 1's halves
    np.testing.assert_array_equal(ckpt["System-Train-TrainStep"].read(), [2])

    # seed 001's train_with_graph(1, ...): the same placement and get_sbp give each rank what it saved
    for r in range(4):
        got = load_oneflow(ckpt, r, MODEL_FILE_RANKS, get_sbp)
        want = to_local(full, MODEL_FILE_RANKS, get_sbp, r)
        assert (got is None) == (want is None)
        if got is not None:
            assert got["module_pipeline"].keys() == module.keys()  # nested as saved, dotted keys kept
            for name, value in want["module_pipeline"].items():
                np.testing.assert_array_equal(got["module_pipeline"][name], value)
            np.testing.assert_array_equal(got["System-Train-TrainStep"], [2])

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

    # 5 rows on 2 ranks: 3 + 2. All ranks at once: the global shape comes from the pieces;
    # per rank, a piece alone cannot tell 5 from 6 (or 4) rows, so the shape must be given.
    odd = {"x": np.arange(10, dtype=np.int32).reshape(5, 2)}
    parts = {r: to_local(odd, [0, 1], "S(0)", r) for r in (0, 1)}
    save_oneflow(parts, str(tmp_path / "b"), [0, 1], "S(0)")
    np.testing.assert_array_equal(rs.open(str(tmp_path / "b"))["x"].read(), odd["x"])
    writers = [save_oneflow(parts[r], str(tmp_path / "c"), [0, 1], "S(0)", rank=r) for r in (0, 1)]
    with pytest.raises(rs.FormatError, match="disagree on the layout of 'x'"):  # 6 rows by rank 0, 4 by rank 1
        writers[1].commit()  # type: ignore[union-attr]
    for r in (0, 1):
        save_oneflow(parts[r], str(tmp_path / "c"), [0, 1], "S(0)", rank=r, shapes={"x": (5, 2)}, commit=r == 1,
                     save_id="retry")  # a new save: the failed attempt's manifests are not mixed in
    np.testing.assert_array_equal(rs.open(str(tmp_path / "c"))["x"].read(), odd["x"])

    with pytest.raises(rs.LayoutError, match="partial_sum"):
        save_oneflow(parts[0], str(tmp_path / "d"), [0, 1], sbp.partial_sum, rank=0)
    assert save_oneflow(parts[0], str(tmp_path / "d"), [0, 1], "S(0)", rank=5) is None
    with pytest.raises(rs.LayoutError, match="wants"):
        save_oneflow({0: parts[0]}, str(tmp_path / "e"), [0, 1], "S(0)")
    with pytest.raises(KeyError, match="nope"):
        load_oneflow(str(tmp_path / "b"), 0, [0], "B", names=["nope"])


def test_nested_uneven_2d_placement_and_global_view_helpers(tmp_path: Path) -> None:
    """REFERENCE 2: nested splits narrow the already narrowed extent; dicts, lists and tuples."""
    x = np.arange(7 * 5, dtype=np.float64).reshape(7, 5)
    ranks = [[0, 1, 2], [3, 4, 5]]
    spec = (sbp.split(0), sbp.split(0))  # 7 -> 4, 3; then 4 -> 2,1,1 and 3 -> 1,1,1
    layouts = to_global({"opt": [x, 0.5], "t": (x,)}, ranks, spec)
    assert layouts["opt"][1] == 0.5 and isinstance(layouts["t"], tuple)
    assert [layouts["opt"][0].local_shape(r)[0] for r in range(6)] == [2, 1, 1, 1, 1, 1]  # not flat 7/6: 2,1,1,1,1,1
    assert Layout.from_oneflow([0, 1, 2, 3, 4, 5], "S(0)", (20, 1)).local_shape(5) == (3, 1)  # 20 into 6: 4,4,3,3,3,3
    local = to_local({"opt": [x, 0.5], "t": (x,)}, ranks, spec, 1)
    np.testing.assert_array_equal(local["opt"][0], x[2:3])
    assert local["opt"][1] == 0.5 and isinstance(local["t"], tuple)

    by_rank = {r: to_local({"m": {"a.w": x}, "step": 3}, ranks, spec, r) for r in range(6)}
    save_oneflow(by_rank, str(tmp_path / "n"), ranks, spec)
    ckpt = rs.open(str(tmp_path / "n"))
    assert ckpt["m.a.w"].shape == (7, 5) and ckpt.leaves == {"step": 3}
    got = load_oneflow(ckpt, 4, ranks, (sbp.broadcast, sbp.split(1)))  # columns 5 -> 2, 2, 1
    assert got is not None and list(got["m"]) == ["a.w"]
    np.testing.assert_array_equal(got["m"]["a.w"], x[:, 2:4])


def test_npz_folders_hold_no_pickles(tmp_path: Path) -> None:
    state = {"System-Train-TrainStep": np.array([2], np.int64),
             "module_pipeline": {"m_stage0.linear.weight": np.ones((2, 3), np.float32)}, "lr": 0.001}
    folder = save_npz(state, tmp_path / "graph_save_load_global_0")
    with np.load(folder / "tensors.npz", allow_pickle=False) as f:
        assert sorted(f.files) == ["System-Train-TrainStep", "module_pipeline/m_stage0.linear.weight"]
    back = load_npz(folder)
    assert back["lr"] == 0.001 and list(back["module_pipeline"]) == ["m_stage0.linear.weight"]
    np.testing.assert_array_equal(back["module_pipeline"]["m_stage0.linear.weight"], 1)
    with pytest.raises(rs.BadNameError, match="'/'"):
        save_npz({"a/b": np.ones(1)}, tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match=r"no \.npz"):
        load_npz(tmp_path)


# ----------------------------------------------------------- flow.save folders (issue 24 item 15)
FLOW = Path(__file__).parent / "data" / "oneflow"  # written by make_samples.py with OneFlow 0.9.0


def _flow_expected() -> dict[str, Any]:
    import json

    return json.loads((FLOW / "expected.json").read_text())


def test_flow_save_folders_written_by_oneflow(tmp_path: Path) -> None:
    """OneFlow's own flow.save output, per rank of a [0, 1] placement (split(0) 5 -> 3 + 2, split(1),
    broadcast) and whole (global_dst_rank=0), read without OneFlow and without unpickling."""
    from reshard.store.cli import main
    from reshard.store.frontends.oneflow import load_flow_save

    want = _flow_expected()
    local = load_flow_save(FLOW / "local")
    assert list(local) == ["model", "head", "step", "half", "lr"] and local["lr"] == 0.25
    assert local["half"].dtype == np.float16 and local["step"].dtype == np.int64
    np.testing.assert_array_equal(local["model"]["weight"], np.float32(want["model.weight"]))
    rank1 = load_flow_save(FLOW / "rank_1")
    assert rank1["model"]["weight"].shape == (2, 4) and rank1["head"]["proj.weight"].shape == (2, 1)

    out = str(tmp_path / "ck")
    assert main(["import", "oneflow", str(FLOW / "rank_0"), str(FLOW / "rank_1"), out, "--placement", "[0, 1]",
                 "--sbp", "S(0)", "--sbp-for", "head.proj.weight=S(1)", "--sbp-for", "step=B"]) == 0
    ckpt = rs.open(out)
    assert ckpt["model.weight"].layout == Layout.from_oneflow([0, 1], "S(0)", (5, 4))
    assert ckpt["model.weight"].layout.local_shape(0) == (3, 4)  # OneFlow's balanced split, as saved
    assert ckpt.leaves == {"lr": 0.25}
    for name in ("model.weight", "model.bias", "head.proj.weight", "step", "half"):
        np.testing.assert_allclose(ckpt[name].read().astype(np.float32), np.float32(want[name]), err_msg=name)
    # onto 3 ranks with OneFlow's own load rules
    back = load_oneflow(ckpt, 2, [0, 1, 2], sbp.split(0), names=["model.weight"])
    np.testing.assert_array_equal(back["model"]["weight"], np.float32(want["model.weight"])[4:])

    whole = str(tmp_path / "whole")  # one folder of whole tensors: placement [0], broadcast by default
    assert main(["import", "oneflow", str(FLOW / "global_dst0"), whole]) == 0
    np.testing.assert_array_equal(rs.open(whole)["head.proj.weight"].read(), np.float32(want["head.proj.weight"]))

    with pytest.raises(rs.FormatError, match=r"pickled oneflow\.nn\.modules\.linear\.Linear object"):
        load_flow_save(FLOW / "module")  # a whole module needs unpickling: refused, named


def test_flow_save_legacy_folders_and_what_needs_unpickling(tmp_path: Path) -> None:
    """The pickle-free layout (one <name>/meta + <name>/out folder per tensor, snapshot_done), built to
    OneFlow's documented layout; pickles holding anything but a state dict are refused, never loaded."""
    import pickle

    from reshard.store.frontends.oneflow import load_flow_save
    from reshard.store.frontends.oneflow.flow_save import decode_structure

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    (tmp_path / "legacy" / "fc.weight").mkdir(parents=True)
    (tmp_path / "legacy" / "snapshot_done").write_text("")
    (tmp_path / "legacy" / "fc.weight" / "meta").write_text("shape {\n  dim: 2\n  dim: 3\n}\ndata_type: kFloat\n")
    (tmp_path / "legacy" / "fc.weight" / "out").write_bytes(w.tobytes())
    got = load_flow_save(tmp_path / "legacy")
    np.testing.assert_array_equal(got["fc.weight"], w)
    (tmp_path / "legacy" / "fc.weight" / "out").write_bytes(w.tobytes()[:-4])
    with pytest.raises(rs.ShapeMismatchError, match="20 bytes"):
        load_flow_save(tmp_path / "legacy")

    in_memory = pickle.dumps({"protocol_version": 1, "data": {"w": w}})  # written here, never loaded
    with pytest.raises(rs.FormatError, match=r"numpy\S*_reconstruct"):
        decode_structure(in_memory)
    with pytest.raises(rs.FormatError, match=r"os\.system"):
        decode_structure(b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94"
                         b"\x8c\x02id\x94\x85\x94R\x94.")

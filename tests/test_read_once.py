"""Read-once loads (issue 25 item 2): ``reshard.torch.load(..., process_group=pg)`` reads every stored byte once.

Real jobs of 8 spawned ranks (tests/torchproc.py: gloo on 127.0.0.1, every wait
bounded) load DDP (8 replicas), HSDP (2 shard x 4 replicate) and TP 4 x DP 2
state dicts from checkpoints on local files (packed and directory form, saved
by one process or by the ranks themselves) and on the moto S3 server, with and
without the group. Every value is compared with the independent read and with
the saved values; the bytes read from storage by the whole job are the ranks'
``IOStats.bytes_fetched`` and, on S3, the GET bytes counted on the wire by one
counting proxy per load. A rank whose read fails, or that dies, mid-exchange
makes every rank raise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import reshard.store as rs
import torchproc
from reshard.layouts import Layout
from reshard.store.testing import S3Proxy

pytestmark = pytest.mark.torch

WORLD = 8
#: The state: model-shaped tensors, 1.3 MiB, one bfloat16 and one 0-d among them.
SHAPES = {"layer0.w": (256, 512), "layer1.w": (512, 256), "emb": (1000, 64), "norm": (512,), "bias": (512,),
          "step": ()}
KINDS = ("ddp", "hsdp", "tpdp")
#: How many ranks hold each byte under each target: what independent reads fetch, at least.
REPLICAS = {"ddp": 8, "hsdp": 4, "tpdp": 2}


def state() -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(25)
    out = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items() if len(s) > 0}
    out["norm"] = out["norm"].astype(ml_dtypes.bfloat16)
    out["step"] = np.array(1234, dtype=np.int64)
    return out


def saving_layouts() -> dict[str, Layout]:
    """A mix: FSDP over 8, 2-D over (2, 4), whole tensors."""
    return {"layer0.w": Layout.from_dtensor((8,), ["S(0)"], SHAPES["layer0.w"]),
            "layer1.w": Layout.from_dtensor((2, 4), ["S(0)", "S(1)"], SHAPES["layer1.w"]),
            **{n: Layout.single(SHAPES[n]) for n in ("emb", "norm", "bias", "step")}}


def stored_bytes(fs: Any, root: str) -> int:
    """Bytes of every object of a checkpoint (what one full read could fetch at most)."""
    return sum(int(info["size"]) for info in fs.find(root, detail=True).values())


# ------------------------------------------------------------ in the ranks
def _target(kind: str, meshes: dict[str, Any]) -> dict[str, Any]:
    """A zero state dict as each training layout holds it: plain tensors (DDP) or DTensors."""
    import torch
    from reshard.store.frontends import torch as rt
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, Any] = {}
    for name, value in state().items():
        zero = rt.from_numpy(np.zeros_like(value))
        if kind == "ddp" or value.ndim == 0:
            out[name] = zero
            continue
        mesh = meshes[kind]
        if kind == "hsdp":  # mesh (replicate 4, shard 2)
            placements = [Replicate(), Shard(0)]
        else:  # mesh (dp 2, tp 4): columns of 2-D tensors, rows of 1-D ones
            placements = [Replicate(), Shard(value.ndim - 1)]
        out[name] = distribute_tensor(zero, mesh, placements)
        assert isinstance(out[name], torch.Tensor)
    return out


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _check(target: dict[str, Any], rank: int) -> None:
    from reshard.store.frontends import torch as rt

    want = state()
    for name, value in target.items():
        region = rt.layout_of(value, [rank]).region(rank)
        got = rt.to_numpy(_local(value))
        assert got.dtype == want[name].dtype, name
        np.testing.assert_array_equal(got, want[name][region], err_msg=name)


def _load_worker(rank: int, world: int, port: int, root: str, sources: list[Any], results: str) -> None:
    import torch
    import torch.distributed as dist
    from reshard.store.frontends import torch as rt
    from torch.distributed.device_mesh import init_device_mesh

    torchproc.init(rank, world, port)
    try:
        meshes = {"hsdp": init_device_mesh("cpu", (4, 2)), "tpdp": init_device_mesh("cpu", (2, 4))}
        # the ranks save a DDP state themselves: every replicated block cut among its 8 holders
        rt.save({n: rt.from_numpy(v.copy()) for n, v in state().items()}, f"{root}/by-ranks")
        out: dict[str, Any] = {}
        for label, url, options in sources:
            for kind in KINDS:
                pieces = {}
                for mode in ("none", "group"):
                    target = _target(kind, meshes)
                    group = dist.group.WORLD if mode == "group" else None
                    dist.barrier()
                    began = time.perf_counter()
                    stats = rt.load(target, url, process_group=group, read_once=group is not None,
                                    storage_options=options[f"{kind}/{mode}"] if options else None)
                    took = time.perf_counter() - began
                    _check(target, rank)
                    pieces[mode] = {n: _local(v).clone() for n, v in target.items()}
                    fetched: list[Any] = [None] * world
                    dist.all_gather_object(fetched, (stats.bytes_fetched, took))
                    out[f"{label}/{kind}/{mode}"] = fetched
                for name, value in pieces["group"].items():  # equal to the independent read
                    assert torch.equal(value, pieces["none"][name]), name
        if rank == 0:
            Path(results).write_text(json.dumps(out))
    finally:
        torchproc.done()


# ---------------------------------------------------------------- the tests
def test_read_once_loads_read_each_byte_once(tmp_path: Path, s3_server: Any, s3_bucket: str) -> None:
    import fsspec

    values, layouts = state(), saving_layouts()
    rs.save(values, str(tmp_path / "packed"), layouts)
    rs.save(values, str(tmp_path / "directory"), layouts, form="directory")
    s3_url = f"s3://{s3_bucket}/ck"
    s3_options = s3_server.storage_options()
    rs.save(values, s3_url, layouts, storage_options=s3_options)
    with S3Proxy(s3_server.endpoint_url) as proxy:  # what one rank's open and marker check cost
        rs.open(s3_url, storage_options=proxy.storage_options()).check_current()
        opened = sum(r.bytes_sent for r in proxy.records(method="GET"))
    proxies = {f"{k}/{m}": S3Proxy(s3_server.endpoint_url).start() for k in KINDS for m in ("none", "group")}
    try:
        sources = [("packed", str(tmp_path / "packed"), None), ("directory", str(tmp_path / "directory"), None),
                   ("by-ranks", str(tmp_path / "by-ranks"), None),
                   ("s3", s3_url, {k: p.storage_options() for k, p in proxies.items()})]
        torchproc.run(_load_worker, WORLD, str(tmp_path), sources, str(tmp_path / "results.json"), timeout=600)
        gets = {k: sum(r.bytes_sent for r in p.records(method="GET")) for k, p in proxies.items()}
    finally:
        for p in proxies.values():
            p.stop()
    results = json.loads((tmp_path / "results.json").read_text())
    local = fsspec.filesystem("file")
    sizes = {label: stored_bytes(local, str(tmp_path / label)) for label in ("packed", "directory", "by-ranks")}
    sizes["s3"] = stored_bytes(fsspec.filesystem("s3", **s3_options), f"{s3_bucket}/ck")
    data = sum(v.nbytes for v in values.values())
    report, failed = [], []
    for key, per_rank in results.items():
        label, kind, mode = key.split("/")
        fetched = sum(b for b, _ in per_rank)
        report.append(f"{key}: {fetched / sizes[label]:.2f}x the checkpoint, {max(t for _, t in per_rank):.2f} s")
        if mode == "group":  # each stored byte once, whichever layouts saved and load
            ok = data <= fetched <= 1.1 * sizes[label]
        else:  # every holder reads its own copy
            ok = fetched >= REPLICAS[kind] * data
        if not ok:
            failed.append(report[-1])
    # on the wire: what S3 sent for each load (the ranks' opens and marker checks included)
    extra = WORLD * 2 * opened
    for key, sent in gets.items():
        kind, mode = key.split("/")
        report.append(f"s3 GET {key}: {sent / sizes['s3']:.2f}x the checkpoint")
        ok = sent <= 1.1 * sizes["s3"] + extra if mode == "group" else sent >= REPLICAS[kind] * data
        if not ok:
            failed.append(report[-1])
    print("\n".join(report))
    assert not failed, failed


# ------------------------------------------------------------------ failures
def _failure_worker(rank: int, world: int, port: int, root: str, results: str) -> None:
    import torch.distributed as dist
    from reshard.layouts.errors import ChecksumError, TensorNotFoundError
    from reshard.store.frontends import torch as rt

    torchproc.init(rank, world, port)
    try:
        outcomes = []
        for case, url in (("corrupt", f"{root}/corrupt"), ("missing", f"{root}/intact")):
            target = {"w": rt.from_numpy(np.zeros((256, 512), np.float32))}
            if case == "missing" and rank == 2:
                target["not.saved"] = rt.from_numpy(np.zeros(3, np.float32))
            try:
                rt.load(target, url, process_group=dist.group.WORLD, read_once=True)
                outcomes.append((case, "returned", ""))
            except (ChecksumError, TensorNotFoundError, RuntimeError) as e:
                outcomes.append((case, type(e).__name__, str(e)))
        # the group is not left out of step: a load after the failures works on every rank
        target = {"w": rt.from_numpy(np.zeros((256, 512), np.float32))}
        rt.load(target, f"{root}/intact", process_group=dist.group.WORLD, read_once=True)
        want = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
        np.testing.assert_array_equal(rt.to_numpy(target["w"]), want)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, outcomes)
        if rank == 0:
            Path(results).write_text(json.dumps(everyone))
    finally:
        torchproc.done()


def test_a_failed_read_on_one_rank_makes_every_rank_raise(tmp_path: Path) -> None:
    w = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
    layout = {"w": Layout.from_dtensor((4,), ["S(0)"], w.shape)}
    rs.save({"w": w}, str(tmp_path / "intact"), layout, form="directory")
    rs.save({"w": w}, str(tmp_path / "corrupt"), layout, form="directory")
    shard = next((tmp_path / "corrupt").glob("gen-*/w/c/2/0"))
    blob = bytearray(shard.read_bytes())
    blob[100] ^= 0xFF  # inside the first chunk's values: its crc32c no longer matches
    shard.write_bytes(bytes(blob))
    torchproc.run(_failure_worker, 4, str(tmp_path), str(tmp_path / "results.json"), timeout=300)
    everyone = json.loads((tmp_path / "results.json").read_text())
    for case, own in (("corrupt", "ChecksumError"), ("missing", "TensorNotFoundError")):
        kinds = [next(o for o in outcomes if o[0] == case)[1:] for outcomes in everyone]
        assert [k for k, _ in kinds].count(own) == 1, kinds  # the rank that met it raises its own error
        for kind, message in kinds:
            if kind != own:  # the others are told which rank failed, and why
                assert kind == "RuntimeError" and own in message and "rank " in message, kinds


def _dying_worker(rank: int, world: int, port: int, url: str, results: str) -> None:
    import signal

    import torch.distributed as dist
    from reshard.store.frontends import torch as rt

    torchproc.init(rank, world, port)
    if rank == 1:  # killed (SIGKILL) as it enters the exchange, after reading its part
        dist.all_to_all_single = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    began = time.monotonic()
    try:
        rt.load({"w": rt.from_numpy(np.zeros((256, 512), np.float32))}, url, process_group=dist.group.WORLD,
                read_once=True)
        outcome = "returned"
    except Exception as e:  # what the survivors must see: an error, not a hang
        outcome = f"raised {type(e).__name__} after {time.monotonic() - began:.1f} s"
    Path(f"{results}.{rank}").write_text(outcome)
    os._exit(0)  # no teardown with a dead peer


def test_a_rank_dying_mid_exchange_makes_the_others_raise(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    w = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
    rs.save({"w": w}, str(tmp_path / "ck"), {"w": Layout.from_dtensor((4,), ["S(0)"], w.shape)})
    results = str(tmp_path / "outcome")
    ctx = mp.start_processes(_dying_worker, args=(4, torchproc.free_port(), str(tmp_path / "ck"), results),
                             nprocs=4, join=False, start_method="spawn")
    deadline = time.monotonic() + torchproc.COLLECTIVE_TIMEOUT + 120
    try:
        for p in ctx.processes:
            p.join(max(0.1, deadline - time.monotonic()))
        codes = [p.exitcode for p in ctx.processes]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert codes[1] == -9, codes  # the killed rank
    assert [codes[r] for r in (0, 2, 3)] == [0, 0, 0], codes
    outcomes = [Path(f"{results}.{r}").read_text() for r in (0, 2, 3)]
    assert all(o.startswith("raised") for o in outcomes), outcomes


# ------------------------------------------------------------- GPU targets
def _cuda_worker(rank: int, world: int, port: int, url: str, backend: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from reshard.store.frontends import torch as rt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=torchproc.COLLECTIVE_TIMEOUT))
    try:
        want = state()
        target = {n: torch.zeros(v.shape, dtype=torch.float32 if n == "norm" else rt.from_numpy(v).dtype,
                                 device=device) for n, v in want.items()}  # "norm" cast bfloat16 -> float32
        stats = rt.load(target, url, process_group=dist.group.WORLD, read_once=True)
        for name, value in target.items():
            assert value.device == device, name
            expect = rt.from_numpy(want[name].copy()).to(value.dtype)
            assert torch.equal(value.cpu(), expect), name
        assert stats.bytes_fetched < sum(v.nbytes for v in want.values())  # a share, not the whole
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize(("backend", "gpus"), [("gloo", 1), ("nccl", 2)])
def test_read_once_into_gpu_tensors(tmp_path: Path, backend: str, gpus: int) -> None:
    """Targets in GPU memory: gloo exchanges through host buffers; NCCL receives into device memory (one GPU
    per rank). Runs on a machine with CUDA (the lent GPU machine), skipped elsewhere."""
    import torch

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s) (runs on the lent GPU machine)")
    url = str(tmp_path / "ck")
    rs.save(state(), url, saving_layouts())
    torchproc.run(_cuda_worker, 2, url, backend, timeout=300)

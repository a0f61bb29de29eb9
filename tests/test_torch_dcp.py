"""The DCP storage plugin: ``dcp.save``/``dcp.async_save``/``dcp.load`` on reshard checkpoints.

4 gloo ranks train FSDP2 + TP (the model of test_torch_fsdp) and save with
``dcp.save(storage_writer=StorageWriter(url))``, ``dcp.async_save`` and
``rt.save``; 3 ranks (FSDP2 alone) and one process load each back with
``dcp.load(storage_reader=StorageReader(url))``. Every value is compared with
torch's own ``full_tensor()`` taken before the save.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import reshard.store as rs
import reshard.torch as rt
import torch
import torchproc
from reshard.store.frontends.torch import dtensor
from test_torch_fsdp import Net, _build, _check_local, _full, _train

pytestmark = pytest.mark.torch

KINDS = ("dcp", "async", "rt")


def _save_worker(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torchproc.init(rank, world, port)
    try:
        model, optim = _build(2, 2)
        _train(model, optim)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "run": {"step": 2, "name": "fsdp-tp"}}
        ref = _full(state)
        if rank == 0:
            np.savez(f"{root}/ref.npz", **ref)
        dcp.save(state, storage_writer=rt.StorageWriter(f"{root}/dcp"))
        future = dcp.async_save(state, checkpoint_id=f"{root}/async", storage_writer=rt.StorageWriter())
        future.result(timeout=torchproc.COLLECTIVE_TIMEOUT)
        rt.save(state, f"{root}/rt")
    finally:
        torchproc.done()


def _load_worker(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torchproc.init(rank, world, port)
    try:
        ref = dict(np.load(f"{root}/ref.npz"))
        for kind in KINDS:
            model, optim = _build(world, 1)
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "run": {"step": 0, "name": ""}}
            reader = rt.StorageReader(f"{root}/{kind}")
            dcp.load(state, storage_reader=reader)
            assert state["run"] == {"step": 2, "name": "fsdp-tp"}, kind
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            msd, osd = get_state_dict(model, optim)
            assert _check_local({"model": msd, "optim": osd}, ref, rank) == len(ref), kind
            assert optim.param_groups[0]["lr"] == 0.05 and optim.param_groups[0]["betas"] == (0.9, 0.999), kind
            # only this rank's rows were read: its local pieces in float32 (+ scalar steps)
            local = sum(dtensor._local(v).numel() * 4 for n, _, _, v in dtensor._walk({"m": msd, "o": osd})
                        if isinstance(v, torch.Tensor))
            assert reader.last_stats.bytes_delivered == local, kind
    finally:
        torchproc.done()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_plugin")
    torchproc.run(_save_worker, 4, str(root))
    return root


def test_plugin_writes_a_reshard_checkpoint(saved: Path) -> None:
    ref = dict(np.load(saved / "ref.npz"))
    plain = rs.open(str(saved / "rt"))
    for kind in ("dcp", "async"):
        ckpt = rs.open(str(saved / kind))
        assert set(ckpt.arrays) == set(ref), kind
        for name, want in ref.items():
            np.testing.assert_array_equal(ckpt.read(name), want, err_msg=f"{kind} {name}")
        # the leaves are those rt.save writes: param_groups joined back, a JSON dict kept whole
        assert ckpt.leaves == plain.leaves, kind
        # one block per chunk DCP saved (replicas deduplicated): 4 for a TP x FSDP weight
        assert len(ckpt["model.up.weight"].layout.blocks()) == 4
        files = [p for p in (saved / kind).rglob("*") if p.is_file()]
        assert not any(p.name == ".metadata" or p.suffix == ".distcp" for p in files)
        for p in files:
            if p.suffix == ".json":
                json.loads(p.read_bytes())  # every document is JSON; the rest are zarr shards


def test_load_onto_three_ranks(saved: Path) -> None:
    torchproc.run(_load_worker, 3, str(saved))


def test_load_in_one_process(saved: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ref = dict(np.load(saved / "ref.npz"))
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    _train(model, optim)
    state = {"model": model.state_dict(), "optim": {"state": {n: optim.state[p] for n, p in model.named_parameters()}}}
    with warnings.catch_warnings():  # torch: "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=rt.StorageReader(str(saved / "dcp")))
    got = _full(state)
    for name, want in ref.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_plugin_refuses_what_json_cannot_hold(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings(), pytest.raises(CheckpointException) as info:  # DCP wraps every rank's error
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "obj": object()}, storage_writer=rt.StorageWriter(str(tmp_path / "x")))
    assert "leaf 'obj' of type object is not JSON" in repr(info.value.failures)
    with pytest.raises(rs.CheckpointNotFoundError):
        rs.open(str(tmp_path / "x"))

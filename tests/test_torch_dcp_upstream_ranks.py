"""PyTorch's own multi-rank DCP test cases, ported to reshard's plugin (see test_torch_dcp_upstream.py).

4 gloo ranks on CPU run every case in one spawned job, each case on DCP's
``FileSystemWriter``/``FileSystemReader`` and on ``reshard.torch``'s plugin;
each rank records every case's outcome, and ``test_on_4_ranks[<upstream name>]``
reads its own.
"""

from __future__ import annotations

import io
import json
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.distributed.checkpoint as dcp
import torchproc
from test_torch_dcp_upstream import Dummy, Holder, System, TrainState, _both, _plain, _seeded, _train
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

pytestmark = pytest.mark.torch

WORLD = 4


def _dist_model(kind: str) -> tuple[Any, Any]:
    """Dummy under FSDP, HSDP (FSDP2's ``fully_shard``: FSDP1 needs an accelerator) or DDP, its Adam, and
    DCP's patched state dicts, as upstream."""
    from torch.distributed.checkpoint.state_dict import _patch_model_state_dict, _patch_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model: Any = Dummy()
    if kind in ("FSDP", "HSDP"):
        mesh = (init_device_mesh("cpu", (WORLD,)) if kind == "FSDP"
                else init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")))
        for layer in (model.net1, model.net2, model.net3, model.net4):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "DDP":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    if kind != "NONE":
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=optim)
    return model, optim


def _full_state(model: Any, optim: Any) -> dict[str, Any]:
    """Model and optimizer state, every tensor whole (DCP's FQN-keyed state dicts)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizers=optim)
    return _plain({"model": msd, "optim": osd})


# ============================================================ 4-rank cases (one spawned job runs them all)
def _dtensor_1d_to_1d(system: System, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    mesh = init_device_mesh("cpu", (WORLD,))
    whole = torch.arange(16, dtype=torch.float).view(4, 4)
    out = []
    for i, (before, after) in enumerate((([Replicate()], [Shard(0)]), ([Shard(0)], [Replicate()]))):
        saved = distribute_tensor(whole, mesh, before)
        dcp.save({"dtensor": saved}, storage_writer=system.writer(f"{path}/{i}"))
        sd = {"dtensor": zeros([4, 4], device_mesh=mesh, placements=after)}
        dcp.load(sd, storage_reader=system.reader(f"{path}/{i}"))
        assert torch.equal(sd["dtensor"].redistribute(mesh, [Replicate()]).to_local(), whole)
        assert torch.equal(sd["dtensor"].redistribute(mesh, before).to_local(), saved.to_local())
        out.append(_plain(sd))
    return out


TWO_D = ("RR", "RS", "SR", "SS")


def _placements(code: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0) if c == "S" else Replicate() for c in code]


def _dtensor_2d_to_2d(system: System, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, zeros

    mesh = init_device_mesh("cpu", (2, WORLD // 2))
    whole = torch.arange(16, dtype=torch.float).view(4, 4)
    out = {}
    for before in TWO_D:
        dcp.save({"dtensor": distribute_tensor(whole, mesh, _placements(before))},
                 storage_writer=system.writer(f"{path}/{before}"))
        for after in TWO_D:
            if after == before:
                continue
            sd = {"dtensor": zeros([4, 4], device_mesh=mesh, placements=_placements(after))}
            dcp.load(sd, storage_reader=system.reader(f"{path}/{before}"))
            assert torch.equal(sd["dtensor"].full_tensor(), whole), (before, after)
            back = sd["dtensor"].redistribute(mesh, _placements(before)).to_local()
            assert torch.equal(back, distribute_tensor(whole, mesh, _placements(before)).to_local())
            out[before + after] = _plain(sd)
    return out


def _dtensor_mesh_change(saved_on: str) -> Callable[[System, str], Any]:
    def scenario(system: System, path: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor, zeros

        meshes = {"1d": (init_device_mesh("cpu", (WORLD,)), ("R", "S")),
                  "2d": (init_device_mesh("cpu", (2, WORLD // 2)), TWO_D)}
        (src, src_codes), (dst, dst_codes) = meshes[saved_on], meshes["2d" if saved_on == "1d" else "1d"]
        whole = torch.arange(16, dtype=torch.float).view(4, 4)
        out = {}
        for before in src_codes:
            dcp.save({"dtensor": distribute_tensor(whole, src, _placements(before))},
                     storage_writer=system.writer(f"{path}/{before}"))
            for after in dst_codes:
                sd = {"dtensor": zeros([4, 4], device_mesh=dst, placements=_placements(after))}
                dcp.load(sd, storage_reader=system.reader(f"{path}/{before}"))
                assert torch.equal(sd["dtensor"].full_tensor(), whole), (before, after)
                out[f"{before}->{after}"] = _plain(sd)
        return out
    return scenario


def _dtensor_empty_shard(system: System, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    whole = _seeded(1, seed=1)  # one element over 4 ranks: three empty shards
    saved = distribute_tensor(whole, init_device_mesh("cpu", (WORLD,)), [Shard(0)])
    dcp.save({"dtensor": saved}, storage_writer=system.writer(path))
    mesh = init_device_mesh("cpu", (2, WORLD // 2))
    sd = {"dtensor": distribute_tensor(_seeded(1, seed=2), mesh, [Shard(0), Shard(0)])}
    dcp.load(sd, storage_reader=system.reader(path))
    assert torch.equal(sd["dtensor"].full_tensor(), whole)
    return _plain(sd)


def _dtensor_uneven_shards(system: System, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank = torch.distributed.get_rank()
    rows = 2 if rank == WORLD - 1 else 4  # 4, 4, 4, 2 rows of a 14 x 1 tensor
    local = torch.arange(rank * 4, rank * 4 + rows, dtype=torch.float).view(rows, 1)
    saved = DTensor.from_local(local, init_device_mesh("cpu", (WORLD,)), [Shard(0)], run_check=True,
                               shape=torch.Size([14, 1]), stride=(1, 1))
    dcp.save({"uneven_sharded_dtensor": saved}, storage_writer=system.writer(path))
    sd = {"uneven_sharded_dtensor": _seeded(14, 1)}  # loaded whole, as a plain tensor
    dcp.load(sd, storage_reader=system.reader(path))
    assert torch.equal(sd["uneven_sharded_dtensor"], torch.arange(14, dtype=torch.float).view(14, 1))
    return _plain(sd)


class Piece(torch.Tensor):
    """A tensor that is one rank's rows [offset, offset + n) of a global (16, 1) tensor, saved and loaded
    through DCP's extension hooks (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``)."""

    @staticmethod
    def __new__(cls, fqn: str, local: torch.Tensor, offset: int, size: tuple[int, ...]) -> Piece:
        r = torch.Tensor._make_wrapper_subclass(cls, size, dtype=local.dtype, device=local.device)
        r.fqn, r.local, r.offsets = fqn, local, torch.Size([offset] + [0] * (len(size) - 1))
        r.whole = torch.Size(size)
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"Piece does not compute ({func})")

    def _chunk(self) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk()]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        data = TensorWriteData(chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self.local),
                               size=self.whole)
        return [WriteItem(index=MetadataIndex(fqn=self.fqn, offset=self.offsets), type=WriteItemType.SHARD,
                          tensor_data=data)]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        assert index.fqn == self.fqn and torch.Size(index.offset) == self.offsets, index
        return self.local


def _uneven_checkpointable(system: System, path: str) -> Any:
    rank = torch.distributed.get_rank()
    save_plan, load_plan = [(0, 4), (4, 3), (7, 4), (11, 5)], [(0, 2), (2, 4), (6, 6), (12, 4)]
    off, n = save_plan[rank]
    saved = Piece("checkpointable_tensor", torch.arange(off, off + n, dtype=torch.float).view(n, 1), off, (16, 1))
    dcp.save({"checkpointable_tensor": saved}, storage_writer=system.writer(path))
    off, n = load_plan[rank]
    target = _seeded(n, 1, seed=rank)
    dcp.load({"checkpointable_tensor": Piece("checkpointable_tensor", target, off, (16, 1))},
             storage_reader=system.reader(path))
    assert torch.equal(target, torch.arange(off, off + n, dtype=torch.float).view(n, 1))
    return _plain(target)


def _uneven_shards_wrapper(system: System, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    rank, mesh = torch.distributed.get_rank(), init_device_mesh("cpu", (WORLD,))
    save_plan, load_plan = [(0, 4), (4, 3), (7, 4), (11, 5)], [(0, 6), (6, 2), (8, 1), (9, 7)]

    def wrapped(local: torch.Tensor, off: int) -> Any:
        shards = LocalShardsWrapper(local_shards=[local], local_offsets=[(off, 0)])
        return DTensor.from_local(shards, mesh, [Shard(0)], shape=torch.Size([16, 1]), stride=(1, 1))

    off, n = save_plan[rank]
    dcp.save({"checkpointable_tensor": wrapped(torch.arange(off, off + n, dtype=torch.float).view(n, 1), off)},
             storage_writer=system.writer(path))
    off, n = load_plan[rank]
    target = _seeded(n, 1, seed=rank)
    dcp.load({"checkpointable_tensor": wrapped(target, off)}, storage_reader=system.reader(path))
    assert torch.equal(target, torch.arange(off, off + n, dtype=torch.float).view(n, 1))
    return _plain(target)


class ExtraState(torch.nn.Module):
    """A sharded and a replicated DTensor parameter plus ``get_extra_state`` (an int and a tensor)."""

    def __init__(self, scale: float, extra: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        mesh = init_device_mesh("cpu", (WORLD,))
        self.rdt = torch.nn.Parameter(distribute_tensor(torch.arange(4, 8.0) * scale, mesh, [Replicate()]))
        self.sdt = torch.nn.Parameter(distribute_tensor(torch.arange(0, 4.0) * scale, mesh, [Shard(0)]))
        self.extra = {"extra_state": extra, "extra_state_tensor": torch.full((1,), float(extra - 1))}

    def get_extra_state(self) -> dict[str, Any]:
        return dict(self.extra)

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.extra = dict(state)


def _distributed_tensor_planner(system: System, path: str) -> Any:
    saved = ExtraState(1.0, 1)
    dcp.save(saved.state_dict(), storage_writer=system.writer(path))
    sd = ExtraState(10.0, 11).state_dict()
    dcp.load(sd, storage_reader=system.reader(path))
    assert torch.equal(sd["rdt"].to_local(), saved.rdt.to_local())
    assert torch.equal(sd["sdt"].to_local(), saved.sdt.to_local())
    assert sd["_extra_state"]["extra_state"] == 1
    assert torch.equal(sd["_extra_state"]["extra_state_tensor"], torch.zeros(1))
    return _plain(sd)


def _list_stored_sd_metadata(system: System, path: str) -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, WORLD // 2))
    sd = {"distributed_weight": distribute_tensor(torch.arange(16, dtype=torch.float).view(4, 4), mesh,
                                                  [Shard(0), Replicate()]),
          "bytes_data": io.BytesIO(b"TrainingEpoch:4")}
    dcp.save(sd, storage_writer=system.writer(path))
    md = system.reader(path).read_metadata().state_dict_metadata  # what list_stored_state_dict returns
    weight = md["distributed_weight"]
    assert isinstance(weight, TensorStorageMetadata)
    assert weight.size == torch.Size([4, 4]) and weight.properties.dtype == torch.float32
    assert isinstance(md["bytes_data"], BytesStorageMetadata)
    return sorted(md), type(weight).__name__, tuple(weight.size), str(weight.properties.dtype)


def _save_load_bytes(system: System, path: str) -> Any:
    dcp.save({"bytes0": [1], "bytes1": "string"}, storage_writer=system.writer(path))
    sd = {"bytes0": [2], "bytes1": "other"}
    dcp.load(sd, storage_reader=system.reader(path))
    assert sd == {"bytes0": [1], "bytes1": "string"}
    return sd


def _switch_sharded_and_plain(system: System, path: str) -> Any:
    """Upstream uses ShardedTensor; here DTensors of three shardings, uneven (30 = 8 + 8 + 8 + 6)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    size = 30
    one, two = init_device_mesh("cpu", (WORLD,)), init_device_mesh("cpu", (2, WORLD // 2))
    specs = {"S": (one, [Shard(0)]), "SS": (two, [Shard(0), Shard(0)]), "RS": (two, [Replicate(), Shard(0)])}
    out = {}
    for save_spec, (save_mesh, save_placements) in specs.items():
        sharded, replicated = _seeded(size, seed=3), _seeded(size, seed=4)
        dcp.save({"sharded": distribute_tensor(sharded, save_mesh, save_placements), "replicated": replicated},
                 storage_writer=system.writer(f"{path}/{save_spec}"))
        for load_spec, (mesh, placements) in specs.items():
            sd = {"sharded": torch.zeros(size), "replicated": distribute_tensor(torch.zeros(size), mesh, placements)}
            dcp.load(sd, storage_reader=system.reader(f"{path}/{save_spec}"))
            assert torch.equal(sd["sharded"], sharded), (save_spec, load_spec)
            assert torch.equal(sd["replicated"].full_tensor(), replicated), (save_spec, load_spec)
            out[f"{save_spec}->{load_spec}"] = _plain(sd)
    return out


class Gatherer:
    """A Stateful whose ``load_state_dict`` runs a collective (``all_gather`` or ``all_reduce``)."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.seen: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = torch.arange(2, dtype=torch.int64) + 1 + 2 * torch.distributed.get_rank()
        if self.op == "gather":
            parts = [torch.ones(2, dtype=torch.int64) for _ in range(WORLD)]
            torch.distributed.all_gather(parts, mine)
            self.seen = torch.cat(parts).tolist()
        else:
            torch.distributed.all_reduce(mine)
            self.seen = mine.tolist()


def _different_ordered_keys(system: System, path: str) -> Any:
    a, b = Gatherer("gather"), Gatherer("reduce")
    sd = {"A": a, "B": b} if torch.distributed.get_rank() == 0 else {"B": b, "A": a}
    dcp.save(sd, storage_writer=system.writer(path))
    dcp.load(sd, storage_reader=system.reader(path))  # a rank loading in its own key order would deadlock
    assert a.seen == list(range(1, 2 * WORLD + 1)) and b.seen == [16, 20]
    return a.seen, b.seen


def _overwrite(system: System, path: str) -> Any:
    import re

    t1, t2 = _seeded(10, seed=5), _seeded(10, seed=6)
    dcp.save({"random": t1}, storage_writer=system.writer(path))
    dcp.save({"random": t2}, storage_writer=system.writer(path, overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=system.reader(path))
    assert torch.allclose(sd["random"], t2)
    try:
        dcp.save({"random": t2}, storage_writer=system.writer(path, overwrite=False))
    except CheckpointException as e:
        assert re.search(".*Checkpoint already exists.*", str(e)), str(e)  # upstream's assertRaisesRegex
    else:
        raise AssertionError("overwrite=False saved over a checkpoint")
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=system.reader(path))
    assert torch.equal(sd["random"], t2)  # the refused save changed nothing
    return _plain(sd)


def _e2e(kind: str, async_type: str | None = None) -> Callable[[System, str], Any]:
    """test_e2e / test_e2e_async_cached: train, save model + optimizer + Statefuls, load into a fresh job, go on."""

    def scenario(system: System, path: str) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

        model, optim = _dist_model("NONE")
        _train(model, optim, 2)
        dist_model, dist_optim = _dist_model(kind)
        _, train_state = _train(dist_model, dist_optim, 2)
        holder = Holder(torch.rand(10, 10))  # the same on every rank (the RNG was seeded alike)
        sd = {"model": dist_model, "optimizer": dist_optim, "s": holder, "train_state": train_state}
        if async_type is None:
            dcp.save(sd, storage_writer=system.writer(path))
        else:
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=async_type == "PROCESS",
                                                  use_async_staging=False, use_non_blocking_copy=False))
            response = dcp.async_save(sd, storage_writer=system.writer(path), async_stager=stager,
                                      async_checkpointer_type=AsyncCheckpointerType[async_type])
            future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
            future.result(timeout=torchproc.COLLECTIVE_TIMEOUT)
        loaded_holder, loaded_state = Holder(torch.zeros(10, 10)), TrainState()
        dist_model, dist_optim = _dist_model(kind)
        dcp.load({"model": dist_model, "optimizer": dist_optim, "s": loaded_holder, "train_state": loaded_state},
                 storage_reader=system.reader(path))
        assert torch.equal(loaded_holder.data, holder.data)
        assert loaded_state.key() == train_state.key()
        loss, _ = _train(model, optim, 1)
        dist_loss, _ = _train(dist_model, dist_optim, 1)
        assert abs(loss - dist_loss) <= 1e-5 * max(1.0, abs(loss)), (loss, dist_loss)
        want, got = _full_state(model, optim), _full_state(dist_model, dist_optim)
        assert _close(got["model"], want["model"]), "model state after one more step"
        assert _close(got["optim"]["state"], want["optim"]["state"]), "optimizer state after one more step"
        return _plain(loaded_holder), loaded_state.key(), got
    return scenario


def _close(a: Any, b: Any) -> bool:
    """Plain forms equal, tensors' values to 1e-5 (the sharded and the plain model reduce in other orders)."""
    a, b = _whole(a), _whole(b)
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return a[:3] == b[:3] and bool(torch.allclose(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-5))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


def _whole(plain: Any) -> Any:
    """A DTensor's plain form as its whole tensor's; anything else as it is."""
    return plain[3] if isinstance(plain, tuple) and plain and plain[0] == "dtensor" else plain


def _partial_load(system: System, path: str) -> Any:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, optim = _dist_model("NONE")
    _train(model, optim, 2)
    dist_model, dist_optim = _dist_model("FSDP")
    _train(dist_model, dist_optim, 2)
    dcp.save({"model": dist_model, "optimizer": dist_optim}, storage_writer=system.writer(path))
    dist_model, _ = _dist_model("FSDP")
    dcp.load({"model": dist_model}, storage_reader=system.reader(path))
    want = _plain(get_model_state_dict(model))
    assert _close(_plain(get_model_state_dict(dist_model)), want)
    loaded_model = _load_state_dict_from_keys("model", storage_reader=system.reader(path))["model"]
    assert _close(_plain(loaded_model), want)
    optim_state = _load_state_dict_from_keys("optimizer.state", storage_reader=system.reader(path))
    state = optim_state["optimizer"]["state"]
    assert "param_groups" not in state and set(optim_state["optimizer"]) == {"state"}
    for name, values in dist_optim.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert _close(_plain(state[name][key]), _plain(values[key])), (name, key)
    return _plain({"loaded": loaded_model, "optim": optim_state})


#: The 4-rank cases, by upstream name: one spawned job runs them all, in this order.
ON_4_RANKS: dict[str, Callable[[System, str], Any]] = {
    "test_dtensor_resharding__test_1d_to_1d_reshard_placement_change": _dtensor_1d_to_1d,
    "test_dtensor_resharding__test_2d_to_2d_reshard_placement_change": _dtensor_2d_to_2d,
    "test_dtensor_resharding__test_1d_to_2d_reshard_mesh_change": _dtensor_mesh_change("1d"),
    "test_dtensor_resharding__test_2d_to_1d_reshard_mesh_change": _dtensor_mesh_change("2d"),
    "test_dtensor_resharding__test_dtensor_checkpoint_resharding_with_empty_shard": _dtensor_empty_shard,
    "test_dtensor_resharding__test_dtensor_checkpoint_with_uneven_shards": _dtensor_uneven_shards,
    "test_dtensor_resharding__test_uneven_reshard_with_checkpointable_api": _uneven_checkpointable,
    "test_dtensor_resharding__test_uneven_reshard_with_dtensor_shards_wrapper_api": _uneven_shards_wrapper,
    "test_dtensor_checkpoint__test_distributed_tensor_planner": _distributed_tensor_planner,
    "test_list_stored_state_dict__test_list_stored_sd_metadata": _list_stored_sd_metadata,
    "test_file_system_checkpoint_cpu__test_save_load_bytes": _save_load_bytes,
    "test_file_system_checkpoint_cpu__test_switch_between_sharded_tensor_to_tensor": _switch_sharded_and_plain,
    "test_e2e_save_and_load__test_different_ordered_state_dict_keys": _different_ordered_keys,
    "test_e2e_save_and_load__test_overwrite": _overwrite,
    "test_e2e_save_and_load__test_e2e[FSDP]": _e2e("FSDP"),
    "test_e2e_save_and_load__test_e2e[HSDP]": _e2e("HSDP"),
    "test_e2e_save_and_load__test_e2e[DDP]": _e2e("DDP"),
    "test_e2e_save_and_load__test_e2e_async_cached[THREAD]": _e2e("FSDP", "THREAD"),
    "test_e2e_save_and_load__test_e2e_async_cached[PROCESS]": _e2e("FSDP", "PROCESS"),
    "test_e2e_save_and_load__test_partial_load": _partial_load,
}


def _job(rank: int, world: int, port: int, root: str) -> None:
    """Every 4-rank case on this rank, each on both systems; the outcomes so far in ``{root}/{rank}.json``."""
    import torch.distributed as dist

    torchproc.init(rank, world, port)
    outcomes: dict[str, str] = {}
    try:
        warnings.simplefilter("ignore")  # DCP: "Detected an existing checkpoint ...", TypedStorage, ...
        for i, (name, scenario) in enumerate(ON_4_RANKS.items()):
            try:
                _both(scenario, f"{root}/{i}")
                outcomes[name] = "ok"
            except (Exception, CheckpointException):  # DCP's exception is a BaseException
                outcomes[name] = traceback.format_exc()
            dist.barrier()
            Path(f"{root}/{rank}.json").write_text(json.dumps(outcomes))
    finally:
        torchproc.done()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    """Each rank's outcome of every 4-rank case (the job runs once; a crash is every unfinished case's outcome)."""
    root = tmp_path_factory.mktemp("dcp_upstream")
    try:
        torchproc.run(_job, WORLD, str(root), timeout=2 * torchproc.JOB_TIMEOUT)  # 20 cases, 2 saves each
        crash = "did not run"
    except Exception:
        crash = traceback.format_exc()
    outcomes = {}
    for rank in range(WORLD):
        done = json.loads((root / f"{rank}.json").read_text()) if (root / f"{rank}.json").exists() else {}
        outcomes[rank] = {name: done.get(name, crash) for name in ON_4_RANKS}
    return outcomes


@pytest.mark.parametrize("name", list(ON_4_RANKS))
def test_on_4_ranks(four_ranks: dict[int, dict[str, str]], name: str) -> None:
    failed = {rank: done[name] for rank, done in four_ranks.items() if done[name] != "ok"}
    assert not failed, "\n".join(f"rank {rank}:\n{text}" for rank, text in failed.items())



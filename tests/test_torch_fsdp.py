"""FSDP2 on top of tensor parallelism: _StridedShard saved as a nested split, loaded onto 3 ranks and onto 1.

A (dp=2, tp=2) gloo mesh: ``parallelize_module`` on "tp", then ``fully_shard``
on "dp", so the column-parallel weights hold ``[_StridedShard(0, 2), Shard(0)]``.
Sizes are uneven (10 and 3 rows over 4 ranks, one piece empty). After AdamW
steps, every value of model and optimizer state is compared: with torch's own
``full_tensor()`` and with each rank's local tensor at its layout region.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import reshard.store as rs
import torch
import torchproc
from reshard.layouts import Layout, UnsupportedError
from reshard.store.frontends.torch import dtensor as rt

pytestmark = pytest.mark.torch

STEPS = 2


class Net(torch.nn.Module):
    """Embedding (row-parallel), up (column-), down (row-), side (column-parallel, 3 rows), head (FSDP only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 6)
        self.up = torch.nn.Linear(6, 4)
        self.down = torch.nn.Linear(4, 5)
        self.side = torch.nn.Linear(6, 3)
        self.head = torch.nn.Linear(5, 4, bias=False)

    def forward(self, x: Any) -> Any:
        h = self.emb(x)
        return self.head(torch.relu(self.down(torch.relu(self.up(h))))) + self.side(h).mean(-1, keepdim=True)


def _build(dp: int, tp: int) -> tuple[Any, Any]:
    """The model on a (dp, tp) mesh: TP where tp > 1, then FSDP2 over dp; and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = Net()
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {
            "emb": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(),
            "side": ColwiseParallel(output_layouts=Replicate()),  # 3 rows: uneven under TP too
        })
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    for part in (model.emb, model.up, model.down, model.side, model.head):
        fully_shard(part, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _train(model: Any, optim: Any) -> None:
    for step in range(STEPS):
        x = torch.arange(8).remainder(10).view(2, 4).roll(step)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _full(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor of a flat ``rt``-style walk, gathered whole (torch's own reassembly)."""
    out = {}
    for name, _, _, value in rt._walk(state):
        if isinstance(value, torch.Tensor):
            whole = value.full_tensor() if rt._is_dtensor(value) else value
            out[name] = rt.to_numpy(whole).copy()
    return out


def _check_local(state: dict[str, Any], ref: dict[str, np.ndarray], rank: int) -> int:
    """Each tensor's local piece equals the reference at its layout region; return how many compared."""
    count = 0
    for name, _, _, value in rt._walk(state):
        if not isinstance(value, torch.Tensor):
            continue
        region = rt.layout_of(value, [rank]).region(rank)
        np.testing.assert_array_equal(rt.to_numpy(rt._local(value)), ref[name][region], err_msg=name)
        np.testing.assert_array_equal(_full({name: value})[name], ref[name], err_msg=name)
        count += 1
    return count


def _save_worker(rank: int, world: int, port: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    torchproc.init(rank, world, port)
    try:
        model, optim = _build(2, 2)
        _train(model, optim)
        msd, osd = get_state_dict(model, optim)
        assert isinstance(model.up.weight.placements[0], _StridedShard)  # the case under test
        state = {"model": msd, "optim": osd, "step": STEPS}
        ref = _full(state)
        if rank == 0:
            np.savez(f"{root}/ref.npz", **ref)
        assert _check_local(state, ref, rank) == len(ref)
        rt.save(state, f"{root}/ckpt")
        # pipeline-like stages: each rank's own one-rank submesh holds a tensor no other rank has
        stages = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "x"))["x"]
        mine = DTensor.from_local(torch.full((2, rank + 1), float(rank)), stages, [Replicate()])
        rt.save({f"stage{rank}": {"w": mine}}, f"{root}/stages")
    finally:
        torchproc.done()


def _load_worker(rank: int, world: int, port: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torchproc.init(rank, world, port)
    try:
        ref = dict(np.load(f"{root}/ref.npz"))
        model, optim = _build(world, 1)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        rt.load(state, f"{root}/ckpt")
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        msd, osd = get_state_dict(model, optim)  # read back from the model and optimizer themselves
        assert _check_local({"model": msd, "optim": osd}, ref, rank) == len(ref)
        assert optim.param_groups[0]["lr"] == 0.05
        _train(model, optim)  # and training goes on from there
    finally:
        torchproc.done()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of FSDP2 + TP state saved by 4 ranks, and torch's full tensors (``ref.npz``)."""
    root = tmp_path_factory.mktemp("fsdp")
    torchproc.run(_save_worker, 4, str(root))
    return root


def test_strided_shards_saved_as_nested_split(saved: Path) -> None:
    ref = dict(np.load(saved / "ref.npz"))
    ckpt = rs.open(str(saved / "ckpt"))
    assert set(ckpt.arrays) == set(ref)
    for name, want in ref.items():
        np.testing.assert_array_equal(ckpt.read(name), want, err_msg=name)
    assert ckpt.leaves["step"] == STEPS
    for name in ("model.up.weight", "optim.state.side.weight.exp_avg", "model.side.bias", "model.emb.weight"):
        layout = ckpt[name].layout
        assert layout.dims[0] == (1, 0), name  # TP axis first, FSDP inside its block
        assert layout.origin is not None and layout.origin["placements"][0].startswith("_S(0"), name
    # 3 rows: TP gives 2 and 1, FSDP then 1, 1 and 1, 0 (an empty piece)
    assert [ckpt["model.side.bias"].layout.region(r)[0] for r in range(4)] == [
        slice(0, 1), slice(2, 3), slice(1, 2), slice(3, 3)]
    assert ckpt["model.down.weight"].layout.dims == ((0,), (1,))  # FSDP rows, TP columns: plain Shard


def test_submeshes_replicate_or_keep_their_own_tensors(saved: Path) -> None:
    ckpt = rs.open(str(saved / "ckpt"))
    head = ckpt["model.head.weight"].layout  # FSDP only, on mesh["dp"]: the two tp slices are replicas
    assert head.mesh == (2, 2) and head.ranks == (0, 2, 1, 3) and head.replica_id(1) == 1
    stages = rs.open(str(saved / "stages"))
    for rank in range(4):  # every stage's tensor was committed, though rank 0 never saw the others
        np.testing.assert_array_equal(stages.read(f"stage{rank}.w"), np.full((2, rank + 1), float(rank), "f4"))
    assert stages["stage3.w"].layout.ranks == (3,)


def test_load_onto_three_ranks(saved: Path) -> None:
    torchproc.run(_load_worker, 3, str(saved))


def test_load_onto_one_process(saved: Path) -> None:
    ref = dict(np.load(saved / "ref.npz"))
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    _train(model, optim)  # creates the optimizer state, then overwritten
    state = {"model": model.state_dict(),
             "optim": {"state": {n: optim.state[p] for n, p in model.named_parameters()}}}
    rt.load(state, str(saved / "ckpt"))
    got = _full(state)
    assert set(got) == set(ref)
    for name, want in ref.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_strided_placements_map_and_refuse() -> None:
    layout = Layout.from_dtensor((2, 2), ["_S(0, 2)", "S(0)"], (8, 8))
    assert [layout.region(r)[0] for r in range(4)] == [slice(0, 2), slice(4, 6), slice(2, 4), slice(6, 8)]
    assert Layout.from_dtensor((2, 2), ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"], (8, 8)) == layout
    # HSDP + TP: a replicate axis in front
    hsdp = Layout.from_dtensor((2, 2, 2), ["R", "_S(0, 2)", "S(0)"], (10, 3))
    assert hsdp.dims == ((2, 1), ()) and hsdp.replica_id(4) == 1
    # 9 rows over TP 2 x FSDP 4: torch's strided indices are not FSDP2's nested blocks
    with pytest.raises(UnsupportedError, match=r"size 9.*multiple of 8"):
        Layout.from_dtensor((4, 2), ["_S(0, 2)", "S(0)"], (9, 3))
    with pytest.raises(UnsupportedError, match="split_factor 3"):
        Layout.from_dtensor((2, 2), ["_S(0, 3)", "S(0)"], (12,))
    assert issubclass(UnsupportedError, rs.LayoutError)

"""FSDP1 FlatParameter state saved by its ranks as flat ranges (reshard.store.frontends.torch.fsdp_flat).

Real FSDP1 on 3 gloo ranks (tests/torchproc.py): each rank writes its own ranges of every
parameter (and, with ``use_orig_params=False``, of Adam's ``exp_avg``), no gather; the
checkpoint is then read whole, per rank of other layouts, and compared with FSDP's own full
state dicts. The partition reshard computes is also checked against FSDP's per-rank
``_shard_param_infos``.
"""

from __future__ import annotations

import numpy as np
import pytest
import reshard.store as rs
import torchproc
from reshard.layouts import Layout

WORLD = 3


def build():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Sequential(torch.nn.Linear(3, 7),
                                                                          torch.nn.LayerNorm(7)))


def worker(rank: int, world: int, port: int, url: str, ref: str, orig: bool) -> None:
    import torch
    from reshard.store.frontends.torch.fsdp_flat import flat_param_buffer, fsdp1_layouts, fsdp1_local, split_flat
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torchproc.init(rank, world, port)
    model = build()
    inner = model[1]
    fsdp = FSDP(model, use_orig_params=orig, device_id=torch.device("cpu"),
                auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or module is inner)
    opt = torch.optim.Adam(fsdp.parameters(), lr=0.1)
    fsdp(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
    opt.step()
    # the partition reshard computes is FSDP's own, rank by rank
    for module in fsdp.modules():
        handle = getattr(module, "_handle", None)
        if handle is None or handle.flat_param is None:
            continue
        flat = handle.flat_param
        segments = {t: (off, a, b) for off, t, a, b in flat_param_buffer(flat, range(world)).part(rank).segments}
        for t, info in enumerate(flat._shard_param_infos):
            if info.in_shard and info.numel_in_shard:
                assert segments[t] == (info.offset_in_shard, info.intra_param_start_idx,
                                       info.intra_param_end_idx + 1), (t, info, segments.get(t))
            else:
                assert t not in segments, (t, info)
    layouts = fsdp1_layouts(fsdp)
    state = fsdp1_local(fsdp)
    if not orig:  # Adam's state is per FlatParameter: the same ranges
        for _, flat, _ in _units(fsdp):
            exp_avg = opt.state[flat]["exp_avg"]
            buf = flat_param_buffer(flat, range(world))
            prefix = _prefix(fsdp, flat)
            for name, arr in split_flat(buf, rank, exp_avg, flat._fqns).items():
                state[f"exp_avg.{prefix}{name}"] = arr
            for t, fqn in enumerate(flat._fqns):
                layouts[f"exp_avg.{prefix}{fqn}"] = buf.layout(t)
    writer = rs.create(url, layouts, save_id=1)
    writer.write(rank, state)
    torch.distributed.barrier()
    if rank == 0:
        writer.commit()
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        full = fsdp.state_dict()
    optim_full = FSDP.full_optim_state_dict(fsdp, opt, rank0_only=True) if not orig else None
    if rank == 0:
        arrays = {k: v.detach().numpy() for k, v in full.items()}
        if optim_full is not None:
            arrays.update({f"exp_avg.{k}": v["exp_avg"].numpy() for k, v in optim_full["state"].items()})
        np.savez(ref, **arrays)
    torchproc.done()


def _units(fsdp):
    from reshard.store.frontends.torch.fsdp_flat import _handles

    return _handles(fsdp)


def _prefix(fsdp, flat):
    return next(prefix for prefix, f, _ in _units(fsdp) if f is flat)


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "use_orig_params"])
def test_fsdp1_ranks_save_their_ranges(tmp_path, orig):
    url, ref = str(tmp_path / "ck"), str(tmp_path / "ref.npz")
    torchproc.run(worker, WORLD, url, ref, orig)
    want = dict(np.load(ref))
    ckpt = rs.open(url)
    assert set(ckpt) == set(want) and (orig or any(n.startswith("exp_avg.") for n in want))
    for name, arr in want.items():
        assert ckpt.tensor(name).layout.describe().startswith("flat[")
        np.testing.assert_array_equal(ckpt[name].read(), arr, err_msg=name)
    rows = {n: Layout.from_dtensor((2,), ["S(0)"], a.shape) for n, a in want.items()}
    for rank in range(2):
        got = ckpt.load(rows, rank)
        for name, arr in want.items():
            node = got
            for part in name.split("."):
                node = node[part]
            np.testing.assert_array_equal(node, arr[rows[name].region(rank)], err_msg=f"{name} {rank}")

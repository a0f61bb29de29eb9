"""PyTorch DCP's side (``torch.distributed.checkpoint``, DTensor over gloo, one process per rank).

Same tensors and the same bytes per rank as reshard: W1 ``Shard(0)`` over a 1-d
mesh; W3 on a ``(tp, dp)`` mesh, column-parallel weights ``[Shard(0), Shard(0)]``
and row-parallel ones ``[Shard(1), Shard(0)]`` (tp slices cut again over dp:
optimizer sharding). ``FileSystemWriter(sync_files=False)`` because reshard
saves here with ``durable=False`` and ``np.save`` does not fsync either (Orbax
does: TensorStore's file driver fsyncs by default); everything else is DCP's default.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

from bench import data
from bench.harness import Ctx, Task


def _torch_tensor(a: np.ndarray) -> Any:
    import torch

    if a.dtype == data.np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(data.np_dtype("bfloat16"))
    return np.asarray(t.numpy())


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


class _Sharded(Task):
    """A process group, a device mesh, and each tensor's placements and local region."""

    def __init__(self, ctx: Ctx, mesh_key: str) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.ctx = ctx
        self.specs = data.tensors(ctx.args["workload"], ctx.args["cfg"])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ctx.args["port"]))
        dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world)
        shape = tuple(ctx.args[mesh_key])
        if ctx.args["workload"] == "w3":  # (dp, tp) as for reshard, laid out (tp, dp) here
            shape = (shape[1], shape[0])
        self.mesh = init_device_mesh("cpu", shape)
        self.placements = {}
        self.regions = {}
        for s in self.specs:
            pl = {"shard0": [Shard(0)], "col": [Shard(0), Shard(0)], "row": [Shard(1), Shard(0)]}[s.kind]
            local, offset = compute_local_shape_and_global_offset(s.shape, self.mesh, pl)
            self.placements[s.name] = pl
            self.regions[s.name] = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))

    def dtensor(self, spec: data.Spec, local: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor

        stride = tuple(int(np.prod(spec.shape[d + 1:])) for d in range(len(spec.shape)))
        return DTensor.from_local(local, self.mesh, self.placements[spec.name], run_check=False,
                                  shape=torch.Size(spec.shape), stride=stride)


class Save(_Sharded):
    """``dcp.save`` of each rank's DTensors."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx, "mesh")
        self.state = {s.name: self.dtensor(s, _torch_tensor(data.fill(s.index, self.regions[s.name], s.dtype)))
                      for s in self.specs}

    def prepare(self, rep: int) -> None:
        if self.ctx.rank == 0:
            shutil.rmtree(self.ctx.args["url"], ignore_errors=True)

    def run(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp

        sync = bool(self.ctx.args.get("durable", False))  # DCP's default is True; see the module docstring
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(self.ctx.args["url"], sync_files=sync))


class Load(_Sharded):
    """``dcp.load`` into freshly allocated DTensors of the target mesh (in place, DCP's way)."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx, "target")
        self.got: dict[str, Any] = {}

    def run(self, rep: int) -> dict[str, Any] | None:
        import torch
        import torch.distributed.checkpoint as dcp

        state = {s.name: self.dtensor(s, torch.empty(tuple(r.stop - r.start for r in self.regions[s.name]),
                                                     dtype=_torch_dtype(s.dtype))) for s in self.specs}
        url = self.ctx.args["url"]
        if url.startswith("s3://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            options = self.ctx.args["storage_options_per_rank"][self.ctx.rank]
            dcp.load(state, storage_reader=FsspecReader(url, **options))
        else:
            dcp.load(state, checkpoint_id=url)
        self.got = state
        return None

    def finish(self) -> dict[str, Any]:
        got = {n: _numpy(t.to_local()) for n, t in self.got.items()}
        return {"checked": data.check(self.specs, self.regions, got),
                "needed": sum(a.nbytes for a in got.values())}


class _Single(Task):
    """One process, no process group: whole tensors."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.specs = data.tensors(ctx.args["workload"], ctx.args["cfg"])
        self.got: dict[str, Any] = {}

    def load_whole(self) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp

        state = {s.name: torch.empty(s.shape, dtype=_torch_dtype(s.dtype)) for s in self.specs}
        dcp.load(state, checkpoint_id=self.ctx.args["url"], no_dist=True)
        return state

    def finish(self) -> dict[str, Any]:
        if not self.got:
            return {}
        got = {n: _numpy(t) for n, t in self.got.items()}
        return {"checked": data.check(self.specs, {s.name: data.whole(s.shape) for s in self.specs}, got)}


class SaveWhole(_Single):
    """``dcp.save(no_dist=True)`` of whole tensors in one process (W2)."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.state = {s.name: _torch_tensor(data.fill(s.index, data.whole(s.shape), s.dtype)) for s in self.specs}

    def prepare(self, rep: int) -> None:
        shutil.rmtree(self.ctx.args["url"], ignore_errors=True)

    def run(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(self.ctx.args["url"], sync_files=False),
                 no_dist=True)


class ReadAll(_Single):
    """Integration onto one host: ``dcp.load(no_dist=True)`` into whole tensors."""

    def run(self, rep: int) -> None:
        self.got = self.load_whole()


class OpenInspect(_Single):
    """Read the checkpoint's metadata and every tensor's shape and dtype."""

    def run(self, rep: int) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        md = dcp.FileSystemReader(self.ctx.args["url"]).read_metadata()
        seen = sum(len(m.size) >= 0 and m.properties.dtype is not None  # type: ignore[union-attr]
                   for m in md.state_dict_metadata.values())
        return {"tensors": seen}


class Export(_Single):
    """DCP to one safetensors file: load whole tensors, then ``safetensors.torch.save_file``."""

    def prepare(self, rep: int) -> None:
        if os.path.exists(self.ctx.args["out"]):
            os.remove(self.ctx.args["out"])

    def run(self, rep: int) -> None:
        from safetensors.torch import save_file

        save_file(self.load_whole(), self.ctx.args["out"])

"""Orbax's side: ``orbax-checkpoint`` ``StandardCheckpointer`` on CPU jax.

JAX on CPU is one process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
devices (set by the harness), so Orbax phases are one process holding every
rank's piece. W1: ``PartitionSpec('x')`` over the first n devices; W3: a
``('tp', 'dp')`` mesh, column-parallel weights ``P(('tp', 'dp'))`` and row-parallel
ones ``P('dp', 'tp')`` (the tp slice cut again over dp, as MindSpore's
optimizer sharding does). Orbax's defaults otherwise (OCDBT, async save waited for).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

from bench import data
from bench.harness import Ctx, Task

XLA_FLAGS = "--xla_force_host_platform_device_count=8"


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    out: dict[str, Any] = {}
    for name, v in flat.items():
        node = out
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def unnest(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`nest`."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(unnest(v, f"{prefix}.{k}" if prefix else k))
    return out


class _Orbax(Task):
    """jax devices, a checkpointer, and the shardings of a mesh."""

    def __init__(self, ctx: Ctx) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.jax, self.ocp, self.ctx = jax, ocp, ctx
        self.specs = data.tensors(ctx.args["workload"], ctx.args["cfg"])
        self.ckptr = ocp.StandardCheckpointer()
        self.path = os.path.abspath(ctx.args["url"])
        self.got: dict[str, Any] = {}

    def shardings(self, mesh_key: str | None) -> dict[str, Any]:
        from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
        from jax.sharding import PartitionSpec as P

        devices = self.jax.devices()
        if mesh_key is None:
            return {s.name: SingleDeviceSharding(devices[0]) for s in self.specs}
        dims = list(self.ctx.args[mesh_key])
        if self.ctx.args["workload"] == "w3":
            dp, tp = dims
            mesh = Mesh(np.array(devices[:tp * dp]).reshape(tp, dp), ("tp", "dp"))
            specs = {"col": P(("tp", "dp"), None), "row": P("dp", "tp")}
        else:
            mesh = Mesh(np.array(devices[:dims[0]]), ("x",))
            specs = {"shard0": P("x", None)}
        return {s.name: NamedSharding(mesh, specs[s.kind]) for s in self.specs}

    def restore(self, mesh_key: str | None) -> dict[str, Any]:
        shardings = self.shardings(mesh_key)
        target = {s.name: self.jax.ShapeDtypeStruct(s.shape, data.np_dtype(s.dtype), sharding=shardings[s.name])
                  for s in self.specs}
        got = unnest(self.ckptr.restore(self.path, nest(target)))
        self.jax.block_until_ready(got)
        return got

    def finish(self) -> dict[str, Any]:
        if not self.got:
            return {}
        got = {n: np.asarray(a) for n, a in self.got.items()}
        return {"checked": data.check(self.specs, {s.name: data.whole(s.shape) for s in self.specs}, got)}


class Save(_Orbax):
    """``StandardCheckpointer.save`` of sharded jax arrays, waited for."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        shardings = self.shardings("mesh") if ctx.args["workload"] != "w2" else self.shardings(None)
        state = {}
        for s in self.specs:
            def cb(index: tuple[slice, ...], s: data.Spec = s) -> np.ndarray:
                region = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, s.shape, strict=True))
                return data.fill(s.index, region, s.dtype)

            state[s.name] = self.jax.make_array_from_callback(s.shape, shardings[s.name], cb)
        self.state = nest(state)

    def prepare(self, rep: int) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def run(self, rep: int) -> None:
        self.ckptr.save(self.path, self.state)
        self.ckptr.wait_until_finished()


class Load(_Orbax):
    """``restore`` onto the target mesh."""

    def run(self, rep: int) -> None:
        self.got = self.restore("target")


class ReadAll(_Orbax):
    """Integration onto one host: restore every array onto one device."""

    def run(self, rep: int) -> None:
        self.got = self.restore(None)


class OpenInspect(_Orbax):
    """Read the checkpoint's metadata tree (every array's shape and dtype)."""

    def run(self, rep: int) -> dict[str, Any]:
        meta = self.ckptr.metadata(self.path)
        tree = getattr(meta, "item_metadata", meta)
        leaves = unnest(dict(tree))
        return {"tensors": sum(getattr(m, "shape", None) is not None for m in leaves.values())}


class Export(_Orbax):
    """Orbax to one safetensors file: restore onto one device, then ``safetensors.numpy.save_file``."""

    def prepare(self, rep: int) -> None:
        if os.path.exists(self.ctx.args["out"]):
            os.remove(self.ctx.args["out"])

    def run(self, rep: int) -> None:
        from safetensors.numpy import save_file

        save_file({n: np.asarray(a) for n, a in self.restore(None).items()}, self.ctx.args["out"])

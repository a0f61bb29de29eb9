"""Async save: how long ``save`` blocks the training loop, for one rank's W1 piece (128 MiB).

The rank holds W1's 16 tensors cut 8 ways (each 560 x 3744 float32, 8 MiB).
Every task times one call: ``np.copyto`` of the same bytes into buffers
allocated (and touched) before timing; reshard's ``CheckpointManager.save``
with ``async_save`` (returns once the staging copy is done) and without (returns
once the rank's data is written); DCP's ``async_save`` and ``save``; Orbax's
``AsyncCheckpointer.save`` and the same followed by ``wait_until_finished``.
Every system saves at its defaults, which are durable: reshard fsyncs
(``durable=True``), DCP too (``sync_files=True``), Orbax through TensorStore's
file driver (``file_io_sync``); one more reshard row saves with ``durable=False``.
The previous repetition's background work is finished (untimed) in ``prepare``.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

from bench import data
from bench.harness import Ctx, Task, reshard_store


class _State(Task):
    """The rank's tensors as numpy arrays."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.url = os.path.abspath(ctx.args.get("url", "."))
        self.specs = data.tensors("w1", ctx.args["cfg"])
        self.state = {s.name: data.fill(s.index, data.whole(s.shape), s.dtype) for s in self.specs}

    def finish(self) -> dict[str, Any]:
        return {"bytes": sum(a.nbytes for a in self.state.values())}


class CopyTo(_State):
    """``np.copyto`` of every tensor into buffers of the same shapes (the floor of any staging copy).

    ``prepare`` writes the buffers to a file (untimed), as the previous save's background write does
    before each of an async save's repetitions: both are timed after the same I/O.
    """

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.dst = {n: np.ones_like(a) for n, a in self.state.items()}
        os.makedirs(self.url, exist_ok=True)

    def prepare(self, rep: int) -> None:
        with open(os.path.join(self.url, "previous"), "wb") as f:
            for a in self.dst.values():
                f.write(a.tobytes())  # the bytes before each run, as a training loop overwrites

    def run(self, rep: int) -> None:
        for n, a in self.state.items():
            np.copyto(self.dst[n], a)


class ManagerSave(_State):
    """``CheckpointManager.save`` of the rank's state; ``mode`` ``async``, ``async+wait`` or ``sync``."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        rs = reshard_store()
        from reshard.layouts import Layout

        shutil.rmtree(self.url, ignore_errors=True)
        self.mode = ctx.args["mode"]
        layouts = {n: Layout.single(a.shape) for n, a in self.state.items()}
        self.mgr = rs.CheckpointManager(self.url, layouts, max_to_keep=1, async_save=self.mode != "sync", rank=0,
                                        durable=ctx.args.get("durable", True))
        self.step = 0

    def prepare(self, rep: int) -> None:
        self.mgr.wait(committed=True, timeout=300)  # the last repetition's write and commit, untimed

    def run(self, rep: int) -> dict[str, Any]:
        self.step += 1
        t0 = time.perf_counter()
        self.mgr.save(self.step, 0, self.state)
        blocked = time.perf_counter() - t0
        if self.mode == "async+wait":
            self.mgr.wait()
        return {"blocked_s": blocked}

    def finish(self) -> dict[str, Any]:
        self.mgr.close()
        got = self.mgr.open()[self.specs[3].name].read()
        return {**super().finish(), "ok": bool(np.array_equal(got, self.state[self.specs[3].name]))}


class DcpSave(_State):
    """``torch.distributed.checkpoint.async_save`` (``mode="async"``) or ``save``, one process."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        import torch

        self.sd = {n: torch.from_numpy(a) for n, a in self.state.items()}
        self.mode = ctx.args["mode"]
        self.future: Any = None
        self.n = 0

    def prepare(self, rep: int) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        shutil.rmtree(self.url, ignore_errors=True)

    def run(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.n += 1
        path = f"{self.url}/{self.n}"
        writer = dcp.FileSystemWriter(path)  # DCP's default: sync_files=True, as reshard's durable=True
        if self.mode == "async":
            self.future = dcp.async_save(self.sd, storage_writer=writer)
        else:
            dcp.save(self.sd, storage_writer=writer)

    def finish(self) -> dict[str, Any]:
        if self.future is not None:
            self.future.result()
        return super().finish()


class OrbaxSave(_State):
    """Orbax ``AsyncCheckpointer(StandardCheckpointHandler)``: ``save`` (``mode="async"``) or save + wait."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.tree = {n: jnp.asarray(a) for n, a in self.state.items()}
        self.ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
        self.mode = ctx.args["mode"]
        self.n = 0

    def prepare(self, rep: int) -> None:
        self.ckptr.wait_until_finished()
        shutil.rmtree(self.url, ignore_errors=True)

    def run(self, rep: int) -> None:
        self.n += 1
        self.ckptr.save(f"{self.url}/{self.n}", args=self.ocp.args.StandardSave(self.tree))
        if self.mode == "sync":
            self.ckptr.wait_until_finished()

    def finish(self) -> dict[str, Any]:
        self.ckptr.wait_until_finished()
        self.ckptr.close()
        return super().finish()

"""A torch training loop with FSDP2, async checkpoints every few steps, and resume after a crash.

Run ``python docs/examples/torch_train.py ROOT`` (2 processes on CPU, gloo). It
trains to step 12, saving every 3 steps with ``TorchCheckpointManager``
(async: ``save`` returns once the rank's tensors are staged). Run it again
with ``--crash-at 8``: the job dies at step 8; run it once more and it resumes
from the latest committed step, 6, whatever was being written when it died.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reshard.store.manager import TorchCheckpointManager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

WORLD, LAST, EVERY = 2, 12, 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(rank: int, root: str, port: int, crash_at: int | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model, optim = build()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    mgr = TorchCheckpointManager(root, state, max_to_keep=2, keep_every=6)  # on every rank, before training
    start = 0
    if mgr.latest_step() is not None:  # resume: any mesh could load it; here the same one
        start = mgr.load(state)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from step {start}")
    for step in range(start + 1, LAST + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step == crash_at:
            os._exit(1)  # a crash: no wait, no close
        if step % EVERY == 0:
            msd, osd = get_state_dict(model, optim)
            mgr.save(step, {"model": msd, "optim": osd, "step": step}, metrics={"loss": loss.item()})
    mgr.wait(committed=True)  # every rank: the last step is committed before the job ends
    mgr.close()
    if rank == 0:
        print(f"steps kept: {mgr.steps()}, final loss {loss.item():.4f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--crash-at", type=int, default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(args.root, port, args.crash_at), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()

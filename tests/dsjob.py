"""A DeepSpeed ZeRO job on gloo ranks for tests/test_deepspeed.py, run by an interpreter that has DeepSpeed.

``python dsjob.py save OUT WORLD STAGE``: train a small model two steps and ``save_checkpoint(OUT, tag="step")``.
``python dsjob.py resave IN OUT WORLD STAGE``: build the same engine, ``load_checkpoint(IN)``, save it again to OUT.
A negative STAGE trains in bf16 (ZeRO-|STAGE|).
Not a test module (no ``test_`` prefix): pytest does not collect it.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys


def model_and_optimizer():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(37, 12), torch.nn.Linear(12, 7), torch.nn.LayerNorm(7),
                                torch.nn.Linear(7, 5, bias=False))
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim > 1]},
              {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def run(rank: int, world: int, port: int, mode: str, src: str, out: str, stage: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    model, opt = model_and_optimizer()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": abs(stage)},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": stage < 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if mode == "save":
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            loss = engine(torch.randint(0, 37, (2, 3), generator=g)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    else:
        path, _ = engine.load_checkpoint(src)
        assert path is not None, f"DeepSpeed found no checkpoint in {src}"
    engine.save_checkpoint(out, tag="step")
    dist.barrier()


def main() -> None:
    import torch.multiprocessing as mp

    mode = sys.argv[1]
    src, out, world, stage = (None, *sys.argv[2:]) if mode == "save" else sys.argv[2:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(int(world), port, mode, src, out, int(stage)), nprocs=int(world))


if __name__ == "__main__":
    main()

"""The DeepSpeed side of bench W7, run by an interpreter with DeepSpeed (``--ds-python``).

``python w7_dsjob.py save OUT WORLD``: a module with GPT-2 small's parameter shapes (124 M), one AdamW step
under ZeRO-2 on WORLD gloo ranks, ``save_checkpoint(OUT, tag="step")``.
``python w7_dsjob.py load SRC WORLD [universal]``: the same engine on WORLD ranks, ``load_checkpoint(SRC)``
(with ``checkpoint.load_universal`` for ``ds_to_universal``'s output); prints the seconds the load took.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

GPT2 = [("wte", (50257, 768)), ("wpe", (1024, 768))]
for _i in range(12):
    GPT2 += [(f"h{_i}.ln_1.weight", (768,)), (f"h{_i}.ln_1.bias", (768,)),
             (f"h{_i}.attn.c_attn.weight", (768, 2304)), (f"h{_i}.attn.c_attn.bias", (2304,)),
             (f"h{_i}.attn.c_proj.weight", (768, 768)), (f"h{_i}.attn.c_proj.bias", (768,)),
             (f"h{_i}.ln_2.weight", (768,)), (f"h{_i}.ln_2.bias", (768,)),
             (f"h{_i}.mlp.c_fc.weight", (768, 3072)), (f"h{_i}.mlp.c_fc.bias", (3072,)),
             (f"h{_i}.mlp.c_proj.weight", (3072, 768)), (f"h{_i}.mlp.c_proj.bias", (768,))]
GPT2 += [("ln_f.weight", (768,)), ("ln_f.bias", (768,))]
if os.environ.get("W7_TINY"):  # a quick check of the job itself
    GPT2 = [(n, tuple(max(1, d // 64) for d in s)) for n, s in GPT2[:6]]


def model():
    import torch

    class Shapes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.p = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(torch.randn(s) * 0.02)
                                             for n, s in GPT2})

        def forward(self, x):
            return sum((p * x).sum() for p in self.p.values())

    return Shapes()


def run(rank: int, world: int, port: int, mode: str, path: str, universal: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=1800))
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "checkpoint": {"load_universal": universal}}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    if mode == "save":
        loss = engine(torch.tensor(0.5))
        engine.backward(loss)
        engine.step()
        # ds_to_universal needs this client state (Megatron-DeepSpeed writes TP patterns in it; none here)
        engine.save_checkpoint(path, tag="step", client_state={"universal_checkpoint_info": {}})
    else:
        dist.barrier()
        t0 = time.perf_counter()
        loaded, _ = engine.load_checkpoint(path)
        dist.barrier()
        assert loaded is not None, f"no checkpoint loaded from {path}"
        if rank == 0:
            print(f"LOAD_SECONDS {time.perf_counter() - t0:.3f}", flush=True)
    dist.barrier()


def main() -> None:
    import torch.multiprocessing as mp

    mode, path, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    universal = len(sys.argv) > 4 and sys.argv[4] == "universal"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(world, port, mode, path, universal), nprocs=world)


if __name__ == "__main__":
    main()

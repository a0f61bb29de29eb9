"""A DeepSpeed ZeRO job on gloo ranks for tests/test_deepspeed.py, run by an interpreter that has DeepSpeed.

``python dsjob.py save OUT WORLD STAGE [TP]``: train a small model two steps and ``save_checkpoint(OUT, tag="step")``.
``python dsjob.py resave IN OUT WORLD STAGE [TP]``: build the same engine, ``load_checkpoint(IN)``, save it again.
A negative STAGE trains in bf16 (ZeRO-|STAGE|). ``TP`` > 0 trains a tensor-parallel model instead
(:class:`TPModel`, TP ranks per data-parallel rank, given to DeepSpeed through an ``mpu`` object as
Megatron does; global rank ``dp * TP + tp``) and saves Megatron-DeepSpeed's ``universal_checkpoint_info``
with it; ``TP`` = 1 is the same model on one TP rank.
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


#: How TPModel's parameters are split over TP ranks, as Megatron-DeepSpeed's universal_checkpoint_info says it
#: (the parameters no pattern names are split on dim 0, DeepSpeed's default).
UC_INFO = {"universal_checkpoint_version": 0.2,
           "tp_replicated_parameter_patterns": [r"embed\.weight", r"norm\.", r"fc2_bias"],
           "parameter_with_row_parallelism_patterns": [r"fc2_weight"]}


class MPU:
    """The model-parallel facts DeepSpeed asks a Megatron ``mpu`` for: TP groups of consecutive ranks."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(self.dp)]
        self.dp_ranks = [list(range(t, world, tp)) for t in range(tp)]
        self.dp_groups = [dist.new_group(r) for r in self.dp_ranks]
        self.tp_rank, self.dp_rank = rank % tp, rank // tp

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_groups[self.dp_rank]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_groups[self.tp_rank]

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks[self.tp_rank]


def tp_model(mpu):
    """embed (replicated) -> norm (replicated) -> fc1 (column-parallel: dims 0) -> gelu -> fc2 (row-parallel:
    weight dim 1, bias replicated). Every TP size slices the same full weights."""
    import torch
    import torch.distributed as dist

    group, tp, r = mpu.get_model_parallel_group(), mpu.tp, mpu.tp_rank

    class Copy(torch.autograd.Function):  # Megatron's copy_to_tensor_model_parallel_region
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            if tp > 1:
                dist.all_reduce(g, group=group)
            return g

    class Reduce(torch.autograd.Function):  # reduce_from_tensor_model_parallel_region
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            if tp > 1:
                dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class TPModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(37, 12)
            self.norm = torch.nn.LayerNorm(12)
            w1, b1, w2 = torch.randn(8, 12) / 4, torch.randn(8) / 4, torch.randn(5, 8) / 3
            self.fc1_weight = torch.nn.Parameter(w1.chunk(tp, 0)[r].clone())
            self.fc1_bias = torch.nn.Parameter(b1.chunk(tp, 0)[r].clone())
            self.fc2_weight = torch.nn.Parameter(w2.chunk(tp, 1)[r].clone())
            self.fc2_bias = torch.nn.Parameter(torch.randn(5) / 5)

        def forward(self, ids):
            x = Copy.apply(self.norm(self.embed(ids)))
            h = torch.nn.functional.gelu(x @ self.fc1_weight.T + self.fc1_bias)
            return Reduce.apply(h @ self.fc2_weight.T) + self.fc2_bias

    model = TPModel()
    # the names Megatron's modules would give (fc1.weight...): DeepSpeed saves the module's own names
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim > 1]},
              {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def run(rank: int, world: int, port: int, mode: str, src: str, out: str, stage: int, tp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    mpu = MPU(tp) if tp else None
    model, opt = tp_model(mpu) if mpu else model_and_optimizer()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": abs(stage)},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": stage < 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=mpu)
    if mode == "save":
        g = torch.Generator().manual_seed(mpu.dp_rank if mpu else rank)  # TP ranks see their DP rank's batch
        for _ in range(2):
            loss = engine(torch.randint(0, 37, (2, 3), generator=g)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    else:
        path, _ = engine.load_checkpoint(src)
        assert path is not None, f"DeepSpeed found no checkpoint in {src}"
    engine.save_checkpoint(out, tag="step", client_state={"universal_checkpoint_info": UC_INFO} if tp else {})
    dist.barrier()  # every rank saved; then leave together (a rank tearing gloo down under another aborts it)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    mode = sys.argv[1]
    args = sys.argv[2:]
    src, out, world, stage, *tp = (None, *args) if mode == "save" else args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(int(world), port, mode, src, out, int(stage), int(tp[0]) if tp else 0), nprocs=int(world))


if __name__ == "__main__":
    main()

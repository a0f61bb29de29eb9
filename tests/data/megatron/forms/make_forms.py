"""Write dp_reshardable/ and fully_reshardable/: a tiny GPT's Megatron-Core torch_dist saves, by megatron-core itself.

4 gloo ranks on CPU, TP=2 x DP=2: a 2-layer GPTModel (local layer spec, no linear biases, untied
output layer) in bf16 (Float16Module, as Megatron-LM wraps it) under DistributedDataParallel with
the distributed optimizer (fp32 main parameters, Adam), two optimizer steps on gradients seeded
per parameter, then ``dist_checkpointing.save`` of ``{"model": model.sharded_state_dict(),
"optimizer": optimizer.sharded_state_dict(..., metadata={"distrib_optim_sharding_type": FORM})}``.
dp_reshardable (the default of Megatron-LM 0.16) is written with bucket_size=300, so each buffer
has 4 buckets and parameters are cut at data-parallel shard bounds; fully_reshardable with one
bucket per buffer (see FORMS). reference_<FORM>.npz holds what Megatron held, gathered on rank 0
from the optimizer's own per-parameter view (``_get_main_param_and_optimizer_states``):
``<state>/<checkpoint key>`` (``param`` = the fp32 main parameter, ``exp_avg``, ``exp_avg_sq``)
as the whole tensor, and ``model/<key>`` the model weights as float32 (np.savez: no pickle).

Run with megatron-core 0.16 and torch 2.13 on CPU: ``python make_forms.py [OUT]``. Megatron-Core
is written for CUDA; the shims in cpu_shims only keep its CUDA tensors on the CPU and let its
``param.type() == 'torch.cuda.FloatTensor'`` checks pass (nothing it writes changes).
"""

import datetime
import os
import shutil
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TP, DP = 2, 2
# form: DDP bucket_size (None: one bucket per buffer). Megatron-Core 0.16's fully_reshardable save reads every
# parameter past a buffer's first bucket from the wrong offset (NVIDIA/Megatron-LM PR 5077 fixes it), so that
# form is written with one bucket, where it is right; dp_reshardable with several.
FORMS = {"dp_reshardable": 300, "fully_reshardable": None}


def cpu_shims():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    plain_type = torch.Tensor.type

    def cuda_type(self, *a, **k):  # Megatron checks param.type() == 'torch.cuda.FloatTensor'
        r = plain_type(self, *a, **k)
        return r.replace("torch.", "torch.cuda.", 1) if not a and not k and ".cuda." not in r else r

    torch.Tensor.type = cuda_type

    def on_cpu(fn):
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))


def build(tp, world, bucket_size):
    """The tiny bf16 GPT under DDP with the distributed optimizer, on a gloo job of ``world`` ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=12,
                            add_bias_linear=False, use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                     max_sequence_length=8, share_embeddings_and_output_weights=False)
    model = Float16Module(cfg, model)  # as Megatron-LM does for bf16: every parameter bf16
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size,
        grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, use_distributed_optimizer=True,
                                                 clip_grad=0.0), [ddp])
    return model, opt


def held(model, opt, world, path):
    """Gather on rank 0 what Megatron holds per parameter and write it to ``path`` (np.savez)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    msd = model.sharded_state_dict()
    meta = {sh.data: sh for sh in msd.values() if isinstance(sh, ShardedTensor)}
    dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    pieces = []
    for gbuf in dopt.gbuf_ranges:
        for buckets in gbuf.values():
            for bucket in buckets:
                for param, ranges in bucket["param_map"].items():
                    sh, r = meta[param], ranges["param"]
                    states = dopt._get_main_param_and_optimizer_states(param)
                    pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.local_shape),
                                   r.start, r.end, {k: v.detach().float().numpy().copy() for k, v in states.items()
                                                    if k != "step"}))
    for sh in meta.values():
        pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.local_shape), 0,
                       sh.data.numel(), {"model": sh.data.detach().float().reshape(-1).numpy().copy()}))
    everything = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everything, dst=0)
    if dist.get_rank() == 0:
        ref = {}
        for key, gshape, goff, lshape, start, stop, states in (p for ps_ in everything for p in ps_):
            for state, vals in states.items():
                whole = ref.setdefault(f"{state}/{key}", np.full(gshape, np.nan, dtype=np.float32))
                lshape = (1,) * (len(goff) - len(lshape)) + lshape  # layer (prepended) axes hold one each
                block = whole[tuple(slice(o, o + n) for o, n in zip(goff, lshape, strict=True))]
                block[np.unravel_index(np.arange(start, stop), lshape)] = vals
        for name, arr in ref.items():
            assert not np.isnan(arr).any(), name
        np.savez(path, **ref)


def run(rank, port, out, form, bucket_size):
    cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP * DP, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing

    model, opt = build(TP, TP * DP, bucket_size)
    for step in range(2):  # seeded by parameter and step: DP replicas (and TP replicas of a norm) agree
        for i, p in enumerate(model.parameters()):
            gen = torch.Generator().manual_seed(1000 * step + i)
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        opt.step()
    msd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, metadata={"distrib_optim_sharding_type": form})
    if rank == 0:
        os.makedirs(os.path.join(out, form))
    dist.barrier()
    dist_checkpointing.save({"model": msd, "optimizer": osd}, os.path.join(out, form))
    dist.barrier()
    held(model, opt, TP * DP, os.path.join(out, f"reference_{form}.npz"))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for form in FORMS:
        shutil.rmtree(os.path.join(out, form), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    for form, bucket_size in FORMS.items():
        mp.spawn(run, args=(free_port(), out, form, bucket_size), nprocs=TP * DP)

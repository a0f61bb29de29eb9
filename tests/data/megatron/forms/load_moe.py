"""Have Megatron-Core load an MoE save at another parallelism, and train on from it (make_moe.py's tiny MoE GPT).

``python load_moe.py load SAVE OUT.npz TP EP WORLD [STEPS LOSSES.json]``: the MoE GPT of make_moe.py on
WORLD gloo ranks (TP x EP, data parallelism the rest), one bucket per buffer, ``dist_checkpointing.load`` of its
model and (chained) optimizer sharded state dicts (``distrib_optim_sharding_type="fully_reshardable"``),
``load_state_dict`` of both, what Megatron then holds written to OUT.npz as make_moe.py writes its references;
then STEPS training steps (forward on fixed tokens, backward, ``finish_grad_sync``, ``opt.step()``) with each
step's loss written to LOSSES.json.

``python load_moe.py reference REF.npz OUT.npz TP EP WORLD STEPS LOSSES.json``: the uninterrupted run to compare
with: the same job at the same parallelism, its weights, fp32 main parameters, Adam moments and step count set
from REF.npz (what the saving job held, make_moe.py) through the optimizer's own per-parameter setter, no
checkpoint involved (what it then holds written to OUT.npz); then the same STEPS training steps.

``MOE_EXPERTS=grouped`` or ``grouped_glu`` in the environment: the legacy GroupedMLP experts of make_moe.py's
``moe_grouped*`` samples (loaded only: its forward needs the CUDA ``grouped_gemm`` kernels).
"""

import datetime
import json
import os
import re
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_moe
from load_export import keep_step
from make_forms import cpu_shims, free_port

STEP = 2  # the optimizer steps the saving job took (make_moe.py)


def own_steps():
    """Megatron-Core 0.16.1's ``DistributedOptimizer.load_state_dict`` without Apex or TE (the torch-Adam path)
    gives every parameter's state the same ``step`` tensor (``s["step"] = step`` in a loop); torch Adam adds 1
    to each parameter's step in place, so after one resumed step the shared count has grown by the number of
    parameters, and the next updates use the wrong bias correction. This gives each parameter its own copy,
    as Megatron's HybridDeviceOptimizer branch beside it does."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    plain = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        plain(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()

    DistributedOptimizer.load_state_dict = load_state_dict


def fresh(tp, ep):
    """The job at TP x EP with Adam state allocated (one step on zero gradients, as load_export.py explains);
    its experts as ``MOE_EXPERTS`` says (make_moe.build's ``experts``: unset for SequentialMLP)."""
    ddp, opt = make_moe.build(tp, ep, None, os.environ.get("MOE_EXPERTS", ""))
    for p in ddp.module.parameters():
        p.main_grad.zero_()
    opt.step()
    return ddp, opt


def train(ddp, opt, steps):
    """``steps`` training steps on fixed tokens (every data-parallel rank the same batch); the losses.

    Two shims: Megatron's forward forks its CUDA RNG tracker around dropout; on CPU there is none, and with
    dropout 0 no random number is drawn: the fork is made a no-op. And Megatron-Core 0.16.1's router without
    transformer-engine fails ("NameError: name 'te_general_gemm' is not defined", moe_utils.py: it tests the
    name its failed TE import never bound): it is bound to None, which is the torch.mm path the code means.
    """
    import contextlib

    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils

    random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(100 + step))
        labels = torch.roll(tokens, -1, 1)
        positions = torch.arange(8).unsqueeze(0).expand(2, 8)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    return losses


def from_reference(ddp, opt, path):
    """Set the weights and every chained optimizer's per-parameter state from what the saving job held."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    with np.load(path, allow_pickle=False) as f:  # by the name without a chained optimizer's prefix
        ref = {re.sub(r"^chained_\d+\.", "", k): f[k] for k in f.files}
    meta = {sh.data: sh for sh in ddp.module.sharded_state_dict().values() if isinstance(sh, ShardedTensor)}

    def block(name, sh):
        lshape = (1,) * (len(sh.global_offset) - len(sh.local_shape)) + tuple(sh.local_shape)
        region = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, lshape, strict=True))
        return torch.from_numpy(ref[name][region].reshape(-1).copy())

    with torch.no_grad():
        for param, sh in meta.items():
            param.copy_(block(sh.key, sh).reshape(param.shape))
        for dopt in opt.chained_optimizers:
            for gbuf in dopt.gbuf_ranges:
                for buckets in gbuf.values():
                    for bucket in buckets:
                        for param, ranges in bucket["param_map"].items():
                            sh, r = meta[param], ranges["param"]
                            tensors = {s: block(f"optimizer.state.{s}.{sh.key}", sh)[r.start:r.end]
                                       for s in ("param", "exp_avg", "exp_avg_sq")}
                            tensors["step"] = torch.tensor(float(STEP))
                            dopt._set_main_param_and_optimizer_states(param, tensors)
            for group in dopt.optimizer.param_groups:
                group["step"] = STEP


def run(rank, port, mode, args):
    cpu_shims()
    keep_step()
    own_steps()
    tp, ep, world = (int(x) for x in args[2:5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing

    ddp, opt = fresh(tp, ep)
    if mode == "load":
        msd = ddp.module.sharded_state_dict()
        osd = opt.sharded_state_dict(msd, is_loading=True,
                                     metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        state = dist_checkpointing.load({"model": msd, "optimizer": osd}, args[0])
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    else:
        from_reference(ddp, opt, args[0])
    make_moe.held(ddp, opt, args[1])
    steps, out = (int(args[5]), args[6]) if len(args) > 6 else (0, None)
    losses = train(ddp, opt, steps)
    if out and rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    mp.spawn(run, args=(free_port(), mode, rest), nprocs=int(rest[4]))

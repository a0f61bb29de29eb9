"""A tiny Llama-style GPTModel under Megatron-Core 0.16 on gloo CPU ranks: saves, loads, and training steps.

The model: 2 layers, hidden 16, 4 attention heads in 2 query groups (grouped-query attention), SwiGLU MLP
(``gated_linear_unit``, silu, ffn 24), RMSNorm, RoPE, no linear biases, untied embeddings, vocabulary 32;
the local (transformer-engine-free) layer spec, bf16 (Float16Module) under DistributedDataParallel with the
distributed optimizer (fp32 main parameters, Adam). make_forms.py's CPU shims.

Every value is defined on the GLOBAL tensors, so a job's state is the same at any parallelism: the
parameters start as seeded global tensors (by checkpoint key), and the first ``--steps`` optimizer steps
use gradients seeded per key and step (each rank takes its part of the global gradient: its tensor-parallel
block, or for SwiGLU's ``linear_fc1`` its gate and up blocks). Adam being elementwise, the state after
those steps is bitwise the same on every parallelism. ``--train`` steps after them are real training
steps (forward and backward through Megatron's pipeline schedule, on seeded tokens), whose losses are
written out.

Commands (``python make_llama.py CMD ...``; run with megatron-core 0.16 and torch 2.13 on CPU):

* no command: write the checked-in samples beside this script: ``llama_dp_reshardable`` (TP=2 x PP=2 x
  DP=2, 8 ranks, bucket_size=200: several buckets per buffer) and ``llama_fully_reshardable`` (same job,
  one bucket per buffer: Megatron-Core 0.16.1's fully_reshardable save is wrong past a buffer's first
  bucket, docs/megatron.md), with ``reference_llama_<form>.npz`` (what each job's optimizer and model held,
  as make_forms.py writes it);
* ``save OUT --tp --pp --dp --form --bucket --steps``: one such save (``--bucket 0``: one bucket per buffer)
  and ``OUT.npz`` beside it;
* ``load SAVE OUT.npz --tp --pp --dp [--train N --losses L.json]``: load a ``fully_reshardable`` save (reshard's
  export) at that parallelism, write what Megatron then holds, and train N steps (with two shims for
  Megatron-Core 0.16.1's torch-Adam load path: load_export.py's ``keep_step``, and :func:`unshare_step` unless
  ``--shared-step``);
* ``reference L.json --tp --pp --dp --steps --train``: the uninterrupted run: fresh job, ``--steps`` seeded
  steps, ``--train`` training steps, no checkpoint;
* ``logits SAVE OUT.npz``: the same model in fp32 at TP1 x PP1 (one process, no Float16Module), its weights
  loaded from SAVE (``model`` only), run on a seeded ``[BATCH, SEQ]`` token batch: ``tokens``, ``logits``, and
  the RoPE and norm settings it ran with (``rotary_interleaved``, ``inv_freq``, ``layernorm_epsilon``), for
  tests/test_megatron_hf.py.
"""

import argparse
import contextlib
import datetime
import json
import os
import shutil
import sys
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_forms import cpu_shims, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, BATCH = 2, 16, 4, 2, 24, 32, 8, 2
SAMPLES = {"dp_reshardable": 200, "fully_reshardable": 0}  # form: bucket_size (0: one bucket per buffer)


def build(tp, pp, bucket_size):
    """The tiny bf16 Llama under DDP with the distributed optimizer; parameters set from the global seed."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    model = Float16Module(cfg, model)  # as Megatron-LM does for bf16: every parameter bf16
    with torch.no_grad():
        for param, local in global_values(model, 0, scale=0.2):
            param.copy_(local)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=bucket_size > 0, bucket_size=bucket_size or None,
        grad_reduce_in_fp32=True), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, use_distributed_optimizer=True,
                                                 clip_grad=0.0), [ddp])
    return cfg, ddp, opt


def shards(model):
    """Each parameter and its global pieces: [(ShardedTensor, ...)] (two for a SwiGLU factory, in local order)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for sh in model.sharded_state_dict().values():
        if isinstance(sh, ShardedTensorFactory):
            out[sh.data] = tuple(sh.build())
        elif isinstance(sh, ShardedTensor):
            out[sh.data] = (sh,)
    return out


def _seeded(key, seed, shape, scale):
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()) + 7919 * seed)
    return torch.randn(shape, generator=gen) * scale


def global_values(model, seed, scale=1.0):
    """(param, its local part of a global tensor seeded by key and ``seed``) for every parameter."""
    out = []
    for param, pieces in shards(model).items():
        parts = []
        for sh in pieces:
            whole = _seeded(sh.key, seed, sh.global_shape, scale)
            lshape = (1,) * (len(sh.global_offset) - len(sh.local_shape)) + tuple(sh.local_shape)
            block = whole[tuple(slice(o, o + n) for o, n in zip(sh.global_offset, lshape, strict=True))]
            parts.append(block.reshape(sh.local_shape))
        out.append((param, torch.cat(parts, 0).reshape(param.shape) if len(parts) > 1 else parts[0]))
    return out


def seeded_steps(ddp, opt, steps):
    for step in range(steps):
        for param, grad in global_values(ddp.module, 1 + step):
            param.main_grad.copy_(grad)
        opt.step()


def train_steps(cfg, ddp, opt, steps):
    """``steps`` real training steps on seeded tokens; the losses (on the last pipeline stage, else None)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data, model):
        tokens, labels = next(data)
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(losses):
            loss = losses.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(500 + step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(tokens[:, :-1],
                                          tokens[:, 1:])]), model=[ddp], num_microbatches=1, seq_length=SEQ,
                                          micro_batch_size=BATCH, forward_only=False)
        opt.step()
        losses.append(float(out[0]["loss"]) if out else None)
    return losses


def held(model, opt, path):
    """Gather on rank 0 what Megatron holds per parameter and write it to ``path`` (np.savez), as make_forms.py
    does: ``<state>/<key>`` whole (a SwiGLU ``linear_fc1``'s local [gate; up] placed at both its blocks)."""
    meta = shards(model)
    dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    pieces = []
    for gbuf in dopt.gbuf_ranges:
        for buckets in gbuf.values():
            for bucket in buckets:
                for param, ranges in bucket["param_map"].items():
                    r = ranges["param"]
                    states = dopt._get_main_param_and_optimizer_states(param)
                    pieces.append((_where(meta[param]), tuple(param.shape), r.start, r.end,
                                   {k: v.detach().float().numpy().copy() for k, v in states.items() if k != "step"}))
    for param, shs in meta.items():
        pieces.append((_where(shs), tuple(param.shape), 0, param.numel(),
                       {"model": param.detach().float().reshape(-1).numpy().copy()}))
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everything, dst=0)
    if dist.get_rank() == 0:
        ref = {}
        for where, pshape, start, stop, states in (p for rank in everything for p in rank):
            for state, vals in states.items():
                local = np.full(int(np.prod(pshape)), np.nan, dtype=np.float32)
                local[start:stop] = vals
                parts = np.split(local.reshape(pshape), len(where), axis=0)
                for (key, gshape, goff, lshape), part in zip(where, parts, strict=True):
                    whole = ref.setdefault(f"{state}/{key}", np.full(gshape, np.nan, dtype=np.float32))
                    block = whole[tuple(slice(o, o + n) for o, n in zip(goff, lshape, strict=True))]
                    part = part.reshape(lshape)
                    block[~np.isnan(part)] = part[~np.isnan(part)]
        for name, arr in ref.items():
            assert not np.isnan(arr).any(), name
        np.savez(path, **ref)


def _where(shs):
    return [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
             (1,) * (len(sh.global_offset) - len(sh.local_shape)) + tuple(sh.local_shape)) for sh in shs]


def keep_step():
    from load_export import keep_step as shim

    shim()


def no_rng_fork():
    """Megatron's attention forks its CUDA RNG tracker (for dropout, 0 here); on CPU there is none to fork."""
    from megatron.core.tensor_parallel import random

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    random.CudaRNGStatesTracker.fork = fork


def unshare_step(opt):
    """Megatron-Core 0.16.1's DistributedOptimizer.load_state_dict, on the torch-Adam path (no TE or apex), gives
    every parameter's state ONE ``step`` tensor (``s["step"] = step`` for all): torch Adam then adds 1 to it once
    per parameter at each step, and the bias corrections of every step after the load are wrong. This gives each
    parameter its own copy, as a job that never loaded has."""
    for state in opt.optimizer.state.values():
        if "step" in state:
            state["step"] = state["step"].clone()


def _init(rank, port, world):
    cpu_shims()
    no_rng_fork()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # its debug log's memory probe needs psutil


def run_save(rank, port, a):
    _init(rank, port, a.tp * a.pp * a.dp)
    from megatron.core import dist_checkpointing

    _, ddp, opt = build(a.tp, a.pp, a.bucket)
    seeded_steps(ddp, opt, a.steps)
    msd = ddp.module.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, metadata={"distrib_optim_sharding_type": a.form})
    if rank == 0:
        os.makedirs(a.out)
    dist.barrier()
    dist_checkpointing.save({"model": msd, "optimizer": osd}, a.out)
    dist.barrier()
    held(ddp.module, opt, a.out.rstrip("/") + ".npz")
    dist.barrier()
    dist.destroy_process_group()


def run_load(rank, port, a):
    _init(rank, port, a.tp * a.pp * a.dp)
    keep_step()
    from megatron.core import dist_checkpointing

    cfg, ddp, opt = build(a.tp, a.pp, a.bucket)
    # A fresh torch Adam has no state for DistributedOptimizer.state_dict(): one step on zero gradients makes it;
    # the load then overwrites every value (and the step count).
    for p in ddp.module.parameters():
        p.main_grad.zero_()
    opt.step()
    msd = ddp.module.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, is_loading=True, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    state = dist_checkpointing.load({"model": msd, "optimizer": osd}, a.save)
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if a.unshare_step:
        unshare_step(opt)
    held(ddp.module, opt, a.out)
    _losses(rank, a, train_steps(cfg, ddp, opt, a.train))
    dist.destroy_process_group()


def run_logits(rank, port, a):
    """The fp32 model at TP1 x PP1 (no Float16Module), its weights loaded from SAVE, on seeded tokens."""
    _init(rank, port, 1)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    msd = model.sharded_state_dict()
    model.load_state_dict(dist_checkpointing.load({"model": msd}, a.save)["model"])
    model.eval()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(77))
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), None)
    np.savez(a.out, tokens=tokens.numpy(), logits=logits.float().numpy(),
             rotary_interleaved=cfg.rotary_interleaved, inv_freq=model.rotary_pos_emb.inv_freq.numpy(),
             layernorm_epsilon=cfg.layernorm_epsilon)
    dist.destroy_process_group()


def run_reference(rank, port, a):
    _init(rank, port, a.tp * a.pp * a.dp)
    cfg, ddp, opt = build(a.tp, a.pp, a.bucket)
    seeded_steps(ddp, opt, a.steps)
    _losses(rank, a, train_steps(cfg, ddp, opt, a.train))
    dist.destroy_process_group()


def _losses(rank, a, losses):
    everything = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(losses, everything, dst=0)
    if rank == 0 and a.losses:
        last = [x for x in everything if x and x[0] is not None][-1] if a.train else []
        with open(a.losses, "w") as f:
            json.dump(last, f)
    dist.barrier()


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("cmd", nargs="?", default="samples", choices=["samples", "save", "load", "reference", "logits"])
    p.add_argument("paths", nargs="*")
    for name, default in (("tp", 2), ("pp", 2), ("dp", 1), ("bucket", 0), ("steps", 2), ("train", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--form", default="dp_reshardable")
    p.add_argument("--losses", default="")
    p.add_argument("--shared-step", dest="unshare_step", action="store_false",
                   help="keep Megatron's one shared Adam step tensor after a load (its bug, see unshare_step)")
    a = p.parse_args(argv)
    world = a.tp * a.pp * a.dp
    if a.cmd == "samples":
        out = a.paths[0] if a.paths else HERE
        for form, bucket in SAMPLES.items():
            shutil.rmtree(os.path.join(out, f"llama_{form}"), ignore_errors=True)
            main(["save", os.path.join(out, f"llama_{form}"), "--tp", "2", "--pp", "2", "--dp", "2", "--form", form,
                  "--bucket", str(bucket)])
            os.replace(os.path.join(out, f"llama_{form}.npz"), os.path.join(out, f"reference_llama_{form}.npz"))
        return
    if a.cmd == "save":
        a.out = a.paths[0]
        fn = run_save
    elif a.cmd == "load":
        a.save, a.out = a.paths
        fn = run_load
    elif a.cmd == "logits":
        a.save, a.out = a.paths
        mp.spawn(run_logits, args=(free_port(), a), nprocs=1)
        return
    else:
        a.losses = a.losses or a.paths[0]
        fn = run_reference
    mp.spawn(fn, args=(free_port(), a), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1:])

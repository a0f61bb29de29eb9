"""Write moe_*/ and reference_moe_*.npz: a tiny MoE GPT's Megatron-Core torch_dist saves, by megatron-core itself.

4 gloo ranks on CPU, expert parallelism EP=2: moe_dp_reshardable and moe_fully_reshardable at TP=1 (so data
parallelism 4 for the dense parameters and expert-data-parallelism 2 for the experts), moe_tp2_dp_reshardable at
TP=2 (the experts split over tensor parallelism too, expert TP defaulting to TP: dense DP 2, expert DP 1);
moe_grouped_<form> with the legacy GroupedMLP experts and moe_grouped_glu_<form> with SwiGLU GroupedMLP experts (see
``build``; their references rendered by Megatron's own factories, see ``held``). A 1-layer GPTModel (local layer
spec, 4 GELU experts in a SequentialMLP, router top-1 with ``moe_router_pre_softmax``, no linear biases) in bf16
(Float16Module, as Megatron-LM wraps it) under DistributedDataParallel with the distributed optimizer (fp32 main
parameters, Adam). Megatron gives the expert-parallel parameters an optimizer of their own, so
``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of two (0: dense, 1: experts). Two optimizer steps on
gradients seeded per parameter (by its global name and expert index, so every replica agrees), then
``dist_checkpointing.save`` of ``{"model": ..., "optimizer": opt.sharded_state_dict(msd,
metadata={"distrib_optim_sharding_type": form})}``. ``dp_reshardable`` is written with bucket_size=200 (several
buckets per buffer), ``fully_reshardable`` with one bucket per buffer (Megatron-Core 0.16.1 writes that form wrong
past a buffer's first bucket, docs/megatron.md). reference_<folder>.npz holds what the job held under the names
reshard imports: ``<model key>`` (the weights as float32) and ``chained_<i>.optimizer.state.<s>.<model key>``
(``param``, the fp32 main parameter, ``exp_avg``, ``exp_avg_sq``; without ``chained_<i>.`` where there is one
optimizer) gathered from each chained optimizer's own per-parameter view.

Run with megatron-core 0.16 and torch 2.13 on CPU: ``python make_moe.py [OUT [FOLDER ...]]`` (make_forms.py's
CPU shims; without psutil, the save's memory probe for a debug log is stubbed). ``build`` and ``held`` serve
load_moe.py too.
"""

import datetime
import os
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_forms import cpu_shims, free_port

WORLD, EXPERTS = 4, 4
#: sample folder -> (TP, EP, form, DDP bucket_size (None: one bucket per buffer), experts: "" (SequentialMLP),
#: "grouped" (GroupedMLP) or "grouped_glu" (GroupedMLP, SwiGLU experts))
SAVES = {"moe_dp_reshardable": (1, 2, "dp_reshardable", 200, ""),
         "moe_fully_reshardable": (1, 2, "fully_reshardable", None, ""),
         "moe_tp2_dp_reshardable": (2, 2, "dp_reshardable", 400, ""),
         "moe_grouped_dp_reshardable": (1, 2, "dp_reshardable", None, "grouped"),
         "moe_grouped_fully_reshardable": (1, 2, "fully_reshardable", None, "grouped"),
         "moe_grouped_glu_dp_reshardable": (1, 2, "dp_reshardable", None, "grouped_glu"),
         "moe_grouped_glu_fully_reshardable": (1, 2, "fully_reshardable", None, "grouped_glu")}


def build(tp, ep, bucket_size, experts=""):
    """The tiny bf16 MoE GPT under DDP with the distributed (chained) optimizer, on the current gloo job.

    ``experts`` ``"grouped"``: the experts are the legacy GroupedMLP (``moe_grouped_gemm``,
    ``moe_use_legacy_grouped_gemm``), whose constructor asserts the ``grouped_gemm`` package (CUDA kernels, not on
    this CPU machine). Its forward alone calls them; building, saving and loading do not, so the assertion is
    stubbed. ``"grouped_glu"``: the same with SwiGLU experts (``gated_linear_unit``, silu).
    """
    import torch.nn.functional as F

    grouped = experts.startswith("grouped")
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    if grouped:
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=12,
                            add_bias_linear=False, use_cpu_initialization=True, num_moe_experts=EXPERTS,
                            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, moe_router_topk=1,
                            moe_router_pre_softmax=True, moe_ffn_hidden_size=12, moe_token_dispatcher_type="allgather",
                            moe_grouped_gemm=grouped, gated_linear_unit=experts == "grouped_glu",
                            activation_func=F.silu if experts == "grouped_glu" else F.gelu,
                            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                            hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(
        num_experts=EXPERTS, moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped), vocab_size=16,
                     max_sequence_length=8, share_embeddings_and_output_weights=False)
    model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size,
        grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, use_distributed_optimizer=True,
                                                 clip_grad=0.0), [ddp])
    return ddp, opt


def global_names(ddp):
    """parameter -> (its checkpoint key, its global expert index or None), from the model's sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for sh in ddp.module.sharded_state_dict().values():
        if isinstance(sh, ShardedTensor):
            expert = sh.global_offset[1] if "experts" in sh.key else None
            out[sh.data] = (sh.key, expert)
    return out


def seeded_grads(ddp, step):
    """Gradients seeded by each parameter's key, expert and step: every replica of a parameter agrees.
    (GroupedMLP's weights, saved through factories, by their parameter name and expert-parallel rank.)"""
    from megatron.core import parallel_state as ps

    names = global_names(ddp)
    for name, p in ddp.module.named_parameters():
        key, expert = names.get(p, (name, ps.get_expert_model_parallel_rank()))
        seed = (sum(key.encode()) * 7 + 131 * (expert or 0) + 1000 * step) % (2 ** 31)
        p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def held(ddp, opt, path):
    """Gather on rank 0 what the model and each chained optimizer hold per parameter; np.savez it to ``path``.

    A parameter saved through a ShardedTensorFactory (GroupedMLP's ``weight1``/``weight2``) is rendered by
    Megatron's own factory: each state gathered whole over the data-parallel ranks that hold its ranges, then
    handed to the factory's ``build_fn`` as if it were the parameter (what the ``fully_reshardable`` save does),
    the ShardedTensors it builds naming and placing the values."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    msd = ddp.module.sharded_state_dict()
    meta = {sh.data: sh for sh in msd.values() if isinstance(sh, ShardedTensor)}
    factories = {sh.data: sh for sh in msd.values() if isinstance(sh, ShardedTensorFactory)}
    names = {p: n for n, p in ddp.module.named_parameters()}
    pieces, parts = [], []
    chained = opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]
    for i, dopt in enumerate(chained):
        prefix = f"chained_{i}." if len(chained) > 1 else ""  # as Megatron names its fully_reshardable save
        for gbuf in dopt.gbuf_ranges:
            for buckets in gbuf.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        r = ranges["param"]
                        if param in factories:
                            states = dopt._get_main_param_and_optimizer_states(param)
                            parts.append((_factory_id(names[param]), r.start, r.end, {
                                f"{prefix}optimizer.state.{k}.": v.detach().float().numpy().copy()
                                for k, v in states.items() if k != "step"}))
                            continue
                        sh = meta[param]
                        states = dopt._get_main_param_and_optimizer_states(param)
                        pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.local_shape),
                                       r.start, r.end, {f"{prefix}optimizer.state.{k}.": v.detach().float()
                                                        .numpy().copy() for k, v in states.items() if k != "step"}))
    for sh in meta.values():
        pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.local_shape), 0,
                       sh.data.numel(), {"": sh.data.detach().float().reshape(-1).numpy().copy()}))
    if factories:
        everywhere = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, parts)
        for param, fac in factories.items():
            whole = {"": param.detach().float().reshape(-1).numpy().copy()}
            for ident, start, stop, states in (p for ps_ in everywhere for p in ps_):
                if ident == _factory_id(names[param]):
                    for state, vals in states.items():
                        whole.setdefault(state, np.full(param.numel(), np.nan, dtype=np.float32))[start:stop] = vals
            for state, flat in whole.items():
                assert not np.isnan(flat).any(), (fac.key, state)
                built = fac.build_fn(fac.key, torch.from_numpy(flat).reshape(param.shape), fac.replica_id, None)
                for sh in built if isinstance(built, list) else [built]:
                    pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.local_shape),
                                   0, sh.data.numel(), {state: sh.data.reshape(-1).numpy().copy()}))
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everything, dst=0)
    if dist.get_rank() == 0:
        ref = {}
        for key, gshape, goff, lshape, start, stop, states in (p for ps_ in everything for p in ps_):
            for state, vals in states.items():
                whole = ref.setdefault(state + key, np.full(gshape, np.nan, dtype=np.float32))
                lshape = (1,) * (len(goff) - len(lshape)) + lshape  # layer and expert (prepended) axes hold one
                block = whole[tuple(slice(o, o + n) for o, n in zip(goff, lshape, strict=True))]
                block[np.unravel_index(np.arange(start, stop), lshape)] = vals
        for name, arr in ref.items():
            assert not np.isnan(arr).any(), name
        np.savez(path, **ref)


def _factory_id(name):
    """A factory-saved parameter, the same on every data-parallel rank holding a range of it: its name in the
    module, and the pipeline, expert-parallel and tensor-parallel ranks (which place it)."""
    from megatron.core import parallel_state as ps

    return (name, ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank())


def run(rank, port, out, name):
    cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # its debug log's memory probe needs psutil, absent here
    tp, ep, form, bucket_size, experts = SAVES[name]
    ddp, opt = build(tp, ep, bucket_size, experts)
    assert len(opt.chained_optimizers) == 2  # EP > 1: the experts' parameters have an optimizer of their own
    for step in range(2):
        seeded_grads(ddp, step)
        opt.step()
    msd = ddp.module.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, metadata={"distrib_optim_sharding_type": form})
    folder = os.path.join(out, name)
    if rank == 0:
        os.makedirs(folder)
    dist.barrier()
    dist_checkpointing.save({"model": msd, "optimizer": osd}, folder)
    dist.barrier()
    held(ddp, opt, os.path.join(out, f"reference_{name}.npz"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(out, exist_ok=True)
    for name in sys.argv[2:] or SAVES:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        mp.spawn(run, args=(free_port(), out, name), nprocs=WORLD)

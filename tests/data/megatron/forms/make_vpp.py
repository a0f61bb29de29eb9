"""make_llama.py's tiny Llama with virtual (interleaved) pipeline stages, under Megatron-Core 0.16 on gloo CPU ranks.

4 layers on PP=2 x VPP=2 (``virtual_pipeline_model_parallel_size=2``): each pipeline rank holds two model
chunks (one GPTModel per chunk, built with ``vp_stage=``), one layer each: pipeline rank 0 holds layers 0 and 2
(and the embedding), rank 1 layers 1 and 3 (and the output layer and final norm). Each chunk has its own
DistributedDataParallel (``disable_bucketing`` past chunk 0, as Megatron-LM does; Megatron-Core cuts buckets only
on the first pipeline rank anyway) and so its own buffer in the one distributed optimizer. The save is
Megatron-LM's ``generate_state_dict``: ``model0``, ``model1`` (each chunk's ``sharded_state_dict()``) and
``optimizer`` (``optimizer.sharded_state_dict`` of that whole dict).
Values as make_llama.py: seeded global parameters, ``--steps`` seeded Adam steps.

``python make_vpp.py``: writes ``llama_vpp_dp_reshardable`` (TP=1 x PP=2 x VPP=2 x DP=2, 4 ranks,
bucket_size=200) and ``reference_llama_vpp_dp_reshardable.npz`` beside this script.
``python make_vpp.py save OUT --tp --pp --dp --form --bucket --steps``: one such save and ``OUT.npz``.
``python make_vpp.py load SAVE OUT.npz --tp --pp --dp --vpp``: Megatron-Core loads a ``fully_reshardable`` save
(reshard's export) into the 4-layer model at TP x PP x DP, with VPP chunks per pipeline rank (``--vpp 1``: plain
pipeline stages, make_llama.py's ``build``), writes what it then holds to OUT.npz as ``save`` does, and trains
``--train N`` steps (losses to ``--losses L.json``; make_llama.py's shims for Megatron's torch-Adam load path).
``python make_vpp.py reference L.json --tp --pp --dp --vpp --steps --train``: the run that never stopped (fresh job,
``--steps`` seeded steps, ``--train`` training steps).
"""

import argparse
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_llama as ml
from make_forms import free_port

HERE = ml.HERE
LAYERS, VPP = 4, 2


class Chunks:
    """The model chunks seen as one model by make_llama's ``shards``/``global_values``/``held``."""

    def __init__(self, chunks):
        self.chunks = chunks

    def sharded_state_dict(self):
        return {f"{i}/{k}": v for i, c in enumerate(self.chunks) for k, v in c.sharded_state_dict().items()}


def build(tp, pp, bucket_size, vpp=VPP):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    if vpp == 1:
        ml.LAYERS = LAYERS
        cfg, ddp, opt = ml.build(tp, pp, bucket_size)
        return cfg, [ddp], opt
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=ml.HIDDEN, num_attention_heads=ml.HEADS,
                            num_query_groups=ml.GROUPS, ffn_hidden_size=ml.FFN, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=bucket_size > 0,
                                            bucket_size=bucket_size or None, grad_reduce_in_fp32=True)
    chunks = []
    for vp in range(vpp):
        model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=ml.VOCAB, max_sequence_length=ml.SEQ, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope",
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp), vp_stage=vp)
        chunks.append(Float16Module(cfg, model))
    with torch.no_grad():
        for param, local in ml.global_values(Chunks(chunks), 0, scale=0.2):
            param.copy_(local)
    ddps = [DistributedDataParallel(cfg, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = [d.no_sync for d in ddps]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, use_distributed_optimizer=True,
                                                 clip_grad=0.0), ddps)
    return cfg, ddps, opt


def seeded_steps(ddps, opt, steps):
    for step in range(steps):
        for param, grad in ml.global_values(Chunks([d.module for d in ddps]), 1 + step):
            param.main_grad.copy_(grad)
        opt.step()


def train_steps(ddps, opt, steps, micro=2):
    """``steps`` real training steps through Megatron's (interleaved) pipeline schedule, on make_llama.py's seeded
    tokens cut into ``micro`` microbatches (the interleaved schedule wants at least PP of them); each step's
    microbatch losses on the last pipeline stage (else None)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data, model):
        tokens, labels = next(data)
        pos = torch.arange(ml.SEQ).unsqueeze(0).expand(tokens.shape[0], ml.SEQ)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(losses):
            loss = losses.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(500 + step)
        tokens = torch.randint(0, ml.VOCAB, (ml.BATCH, ml.SEQ + 1), generator=gen)
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens.chunk(micro)]
        for d in ddps:
            d.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(forward_step_func=forward_step,
                                          data_iterator=[iter(batches) for _ in ddps] if len(ddps) > 1 else
                                          iter(batches), model=ddps, num_microbatches=micro, seq_length=ml.SEQ,
                                          micro_batch_size=ml.BATCH // micro, forward_only=False)
        opt.step()
        losses.append([float(o["loss"]) for o in out] if out else None)
    return losses


def generate_state_dict(ddps, opt, form, is_loading=False):
    """Megatron-LM's ``generate_state_dict`` for several chunks: ``model<i>`` per chunk, then the optimizer."""
    sd = {f"model{i}": d.module.sharded_state_dict() for i, d in enumerate(ddps)}
    sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=is_loading,
                                             metadata={"distrib_optim_sharding_type": form})
    return sd


def run_save(rank, port, a):
    ml._init(rank, port, a.tp * a.pp * a.dp)
    from megatron.core import dist_checkpointing

    _, ddps, opt = build(a.tp, a.pp, a.bucket)
    seeded_steps(ddps, opt, a.steps)
    sd = generate_state_dict(ddps, opt, a.form)
    if rank == 0:
        os.makedirs(a.out)
    dist.barrier()
    dist_checkpointing.save(sd, a.out)
    dist.barrier()
    ml.held(Chunks([d.module for d in ddps]), opt, a.out.rstrip("/") + ".npz")
    dist.barrier()
    dist.destroy_process_group()


def run_load(rank, port, a):
    ml._init(rank, port, a.tp * a.pp * a.dp)
    ml.keep_step()
    from megatron.core import dist_checkpointing

    _, ddps, opt = build(a.tp, a.pp, a.bucket, a.vpp)
    # A fresh torch Adam has no state for DistributedOptimizer.state_dict(): one step on zero gradients makes it.
    for d in ddps:
        for p in d.module.parameters():
            p.main_grad.zero_()
    opt.step()
    state = dist_checkpointing.load(generate_state_dict(ddps, opt, "fully_reshardable", is_loading=True), a.save)
    for i, d in enumerate(ddps):
        d.module.load_state_dict(state[f"model{i}"])
    opt.load_state_dict(state["optimizer"])
    ml.unshare_step(opt)
    ml.held(Chunks([d.module for d in ddps]), opt, a.out)
    ml._losses(rank, a, train_steps(ddps, opt, a.train))
    dist.destroy_process_group()


def run_reference(rank, port, a):
    ml._init(rank, port, a.tp * a.pp * a.dp)
    _, ddps, opt = build(a.tp, a.pp, 0, a.vpp)
    seeded_steps(ddps, opt, a.steps)
    ml._losses(rank, a, train_steps(ddps, opt, a.train))
    dist.destroy_process_group()


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("cmd", nargs="?", default="samples", choices=["samples", "save", "load", "reference"])
    p.add_argument("paths", nargs="*")
    for name, default in (("tp", 1), ("pp", 2), ("dp", 2), ("bucket", 200), ("steps", 2), ("vpp", VPP), ("train", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--form", default="dp_reshardable")
    p.add_argument("--losses", default="")
    a = p.parse_args(argv)
    if a.cmd == "samples":
        out = a.paths[0] if a.paths else HERE
        name = "llama_vpp_dp_reshardable"
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        main(["save", os.path.join(out, name)])
        os.replace(os.path.join(out, f"{name}.npz"), os.path.join(out, f"reference_{name}.npz"))
        return
    if a.cmd == "load":
        a.save, a.out = a.paths
        a.bucket = 0
        mp.spawn(run_load, args=(free_port(), a), nprocs=a.tp * a.pp * a.dp)
        return
    if a.cmd == "reference":
        a.losses = a.paths[0]
        mp.spawn(run_reference, args=(free_port(), a), nprocs=a.tp * a.pp * a.dp)
        return
    a.out = a.paths[0]
    mp.spawn(run_save, args=(free_port(), a), nprocs=a.tp * a.pp * a.dp)


if __name__ == "__main__":
    main(sys.argv[1:])

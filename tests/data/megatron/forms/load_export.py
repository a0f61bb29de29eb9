"""Have Megatron-Core load a ``fully_reshardable`` torch_dist save (reshard's export) at another parallelism.

``python load_export.py SAVE OUT.npz [TP DP]``: the tiny GPT of make_forms.py on TP x DP gloo ranks
(default TP=1, DP=2, against the TP=2 x DP=2 job that trained it), one bucket per buffer,
``dist_checkpointing.load`` of its model and optimizer sharded state dicts
(``distrib_optim_sharding_type="fully_reshardable"``), ``load_state_dict`` of both, then what
Megatron holds per parameter written to OUT.npz as make_forms.py writes its references.
"""

import datetime
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_forms


def keep_step():
    """Megatron-Core 0.16.1's fully_reshardable load on the torch-Adam path (no TE or apex) copies every state
    tensor of a parameter, ``step`` included, from the loaded ones, from which it has just left ``step`` out (it
    restores the step from the param groups instead): KeyError. This hands it the step it already restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    plain = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return plain(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def run(rank, port, save, out, tp, dp):
    make_forms.cpu_shims()
    keep_step()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp * dp, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing

    model, opt = make_forms.build(tp, tp * dp, None)
    # Without TE or apex, DistributedOptimizer.state_dict() asserts on a fresh torch Adam (no state yet): one
    # step on zero gradients creates the state; the load then overwrites every value (and the step count).
    for p in model.parameters():
        p.main_grad.zero_()
    opt.step()
    msd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, is_loading=True, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    state = dist_checkpointing.load({"model": msd, "optimizer": osd}, save)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    make_forms.held(model, opt, tp * dp, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    save, out = sys.argv[1:3]
    tp, dp = (int(x) for x in sys.argv[3:5]) if len(sys.argv) > 4 else (1, 2)
    mp.spawn(run, args=(make_forms.free_port(), save, out, tp, dp), nprocs=tp * dp)

"""TorchCheckpointManager with FSDP2 + TP (a transformers Llama) and an expert-parallel MoE, on real gloo ranks.

* A tiny ``LlamaForCausalLM`` on a (dp, tp) = (2, 2) mesh: ``parallelize_module`` on "tp" (q/k/v/gate/up
  column-, o/down row-parallel), then ``fully_shard`` on "dp" (embeddings, norms and lm_head are FSDP only,
  on the 1-d ``mesh["dp"]`` submesh, whose ranks are [0, 2] on two ranks and [1, 3] on the two others).
  Saved by an async and a sync manager, resumed at the same mesh, at (4, 1) (FSDP only) and at (1, 2) (TP
  only, 2 processes): every value of model and AdamW state equals what was saved, and the resumed jobs'
  losses equal the uninterrupted run's. The step exported to a Hugging Face folder loads with
  ``from_pretrained`` and gives the trained model's logits.
* An MoE whose stacked experts ``[E, d, f]`` are ``Shard(0)`` over "ep" of a (dp, ep) = (2, 2) mesh.
* Ranks that give one tensor different layouts: refused on every rank, naming the tensor and both layouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import reshard.store as rs
import torch
import torchproc
from reshard.store.frontends.torch import dtensor as rt

pytestmark = pytest.mark.torch

#: Steps trained before the save, and after it (by the uninterrupted run and by each resumed one).
BEFORE, AFTER = 2, 2
#: Global batch: 4 sequences of 16 tokens, split over the dp ranks.
BATCH, SEQ, VOCAB = 4, 16, 128
#: Relative tolerance of losses computed at another parallelism: TP sums a matmul's partial products in another
#: order and FSDP averages gradients over other ranks, so float32 rounding differs (measured: see the test).
LOSS_RTOL = 1e-6


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def _llama(dp: int, tp: int, seed: int = 0) -> tuple[Any, Any]:
    """The Llama on a (dp, tp) mesh (TP where tp > 1, then FSDP2 over dp), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config())
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _batch(step: int) -> Any:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def _train_step(model: Any, optim: Any, step: int, dp: int, dp_rank: int) -> float:
    """One AdamW step on this dp rank's share of the global batch; the global mean loss."""
    import torch.distributed as dist

    ids = _batch(step).chunk(dp)[dp_rank]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    out = loss.detach().clone()
    dist.all_reduce(out)
    return float(out) / dist.get_world_size()  # every rank of a dp group holds the same loss: the mean is its mean


def _state(model: Any, optim: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _full(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor gathered whole by torch itself (a collective on every rank)."""
    out = {}
    for name, _, _, value in rt._walk(state):
        if isinstance(value, torch.Tensor):
            whole = value.full_tensor() if rt._is_dtensor(value) else value
            out[name] = rt.to_numpy(whole.detach()).copy()
    return out


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def _resume(model: Any, optim: Any, mgr: Any, step: int) -> None:
    """Load ``step`` through the manager into the model and optimizer (any mesh)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optim)
    assert mgr.load(state, step=step) == step
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ------------------------------------------------------------------ the (2, 2) job
def _save_job(rank: int, world: int, port: int, root: str) -> None:
    from reshard.store.manager import TorchCheckpointManager

    torchproc.init(rank, world, port)
    try:
        dp_rank = rank // 2
        model, optim = _llama(2, 2)
        state = _state(model, optim)
        asynchronous = TorchCheckpointManager(f"{root}/async", state, max_to_keep=2, commit_timeout=60)
        synchronous = TorchCheckpointManager(f"{root}/sync", state, async_save=False, commit_timeout=60)
        head = asynchronous.layouts["model.lm_head.weight"]  # FSDP only, on mesh["dp"]: spans the (2, 2) mesh
        assert head.mesh == (2, 2) and head.ranks == (0, 2, 1, 3), head
        losses = []
        for step in range(1, BEFORE + 1):
            losses.append(_train_step(model, optim, step, 2, dp_rank))
            asynchronous.save(step, _state(model, optim), metrics={"loss": losses[-1]})
        synchronous.save(BEFORE, _state(model, optim))
        saved = _full(_state(model, optim))
        for step in range(BEFORE + 1, BEFORE + AFTER + 1):  # the uninterrupted run goes on
            losses.append(_train_step(model, optim, step, 2, dp_rank))
        asynchronous.wait(committed=True, timeout=60)
        synchronous.wait(committed=True, timeout=60)
        if rank == 0:
            np.savez(f"{root}/saved.npz", **saved)
            Path(root, "losses.json").write_text(json.dumps(losses))
        # resumed at the same mesh, in a fresh model of another initialisation: the same values, the same losses
        model, optim = _llama(2, 2, seed=1)
        _resume(model, optim, asynchronous, BEFORE)
        _same(_full(_state(model, optim)), saved)
        again = [_train_step(model, optim, step, 2, dp_rank) for step in range(BEFORE + 1, BEFORE + AFTER + 1)]
        assert again == losses[BEFORE:], (again, losses)  # same parallelism, same order of every sum: bitwise
        asynchronous.close()
        synchronous.close()
    finally:
        torchproc.done()


def _resume_job(rank: int, world: int, port: int, root: str, dp: int, tp: int) -> None:
    """A job at another parallelism resumes from the (2, 2) save and trains on."""
    from reshard.store.manager import TorchCheckpointManager

    torchproc.init(rank, world, port)
    try:
        saved = dict(np.load(f"{root}/saved.npz"))
        losses = json.loads(Path(root, "losses.json").read_text())
        model, optim = _llama(dp, tp, seed=2)
        with TorchCheckpointManager(f"{root}/async", _state(model, optim), commit_timeout=60) as mgr:
            assert BEFORE in mgr.steps()
            _resume(model, optim, mgr, BEFORE)
            _same(_full(_state(model, optim)), saved)
            got = [_train_step(model, optim, step, dp, rank // tp) for step in range(BEFORE + 1, BEFORE + AFTER + 1)]
            np.testing.assert_allclose(got, losses[BEFORE:], rtol=LOSS_RTOL, atol=0)
            if rank == 0:
                Path(root, f"losses-{dp}x{tp}.json").write_text(json.dumps(got))
        # and saves on at its own mesh (another root: the resumed jobs of this test share the first)
        state = _state(model, optim)
        with TorchCheckpointManager(f"{root}/resumed-{dp}x{tp}", state, commit_timeout=60) as mgr:
            mgr.save(BEFORE + AFTER, state)
            mgr.wait(committed=True, timeout=60)
            now = _full(state)
            ckpt = mgr.open()
            _same({n: ckpt.read(n) for n in ckpt.arrays}, now)
    finally:
        torchproc.done()


@pytest.fixture(scope="module")
def llama_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llama")
    torchproc.run(_save_job, 4, str(root), timeout=400)
    return root


def test_fsdp2_tp_llama_saved_by_async_and_sync_managers(llama_root: Path) -> None:
    saved = dict(np.load(llama_root / "saved.npz"))
    assert any(n.endswith("q_proj.weight") for n in saved) and "optim.state.lm_head.weight.exp_avg" in saved
    for name in ("async", "sync"):
        mgr = rs.CheckpointManager(str(llama_root / name))
        assert mgr.steps() == ([1, 2] if name == "async" else [2])
        ckpt = mgr.open(BEFORE)
        _same({n: ckpt.read(n) for n in ckpt.arrays}, saved)
        up = ckpt["model.model.layers.0.mlp.up_proj.weight"].layout
        assert up.origin is not None and up.origin["placements"][0].startswith("_S(0"), up.origin  # TP, then FSDP
    losses = json.loads((llama_root / "losses.json").read_text())
    assert rs.CheckpointManager(str(llama_root / "async")).metrics(2) == {"loss": losses[1]}


@pytest.mark.parametrize(("world", "dp", "tp"), [(4, 4, 1), (2, 1, 2)])
def test_resumed_at_another_mesh_gives_the_same_state_and_losses(llama_root: Path, world: int, dp: int,
                                                                 tp: int) -> None:
    torchproc.run(_resume_job, world, str(llama_root), dp, tp, timeout=400)
    got = json.loads((llama_root / f"losses-{dp}x{tp}.json").read_text())
    want = json.loads((llama_root / "losses.json").read_text())[BEFORE:]
    print(f"{dp}x{tp}: losses {got}, the (2, 2) run's {want}, relative "
          f"{[abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]}")
    assert np.allclose(got, want, rtol=LOSS_RTOL, atol=0), (got, want)


def test_export_to_hugging_face_loads_with_from_pretrained(llama_root: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    step = llama_root / "async" / "step-2"
    done = subprocess.run([sys.executable, "-m", "reshard.store.cli", "export", "safetensors", str(step), str(out),
                           "--prefix", "model.", "--max-shard-size", "100KB"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    _config().save_pretrained(out)
    hf = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    saved = dict(np.load(llama_root / "saved.npz"))
    direct = LlamaForCausalLM(_config()).eval()
    missing = direct.load_state_dict({n[len("model."):]: torch.from_numpy(v) for n, v in saved.items()
                                      if n.startswith("model.")}, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    ids = _batch(99)
    with torch.no_grad():
        np.testing.assert_array_equal(hf(input_ids=ids).logits.numpy(), direct(input_ids=ids).logits.numpy())


# ------------------------------------------------------------------ MoE: experts over "ep"
class MoE(torch.nn.Module):
    """A router (replicated: FSDP only) and stacked experts ``[E, d, f]``, ``[E, f, d]`` (expert parallel)."""

    def __init__(self, d: int = 8, f: int = 12, experts: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(experts, d, f) * 0.3)
        self.w_out = torch.nn.Parameter(torch.randn(experts, f, d) * 0.3)

    def forward(self, x: Any) -> Any:
        gates = torch.softmax(self.router(x), -1)  # [T, E]
        # every rank of an "ep" group holds the same tokens here: gather the experts (a real EP job sends
        # the tokens to the experts' ranks instead; the checkpoint is the same)
        w_in, w_out = (w.full_tensor() if rt._is_dtensor(w) else w for w in (self.w_in, self.w_out))
        y = torch.einsum("tef,efd->ted", torch.einsum("td,edf->tef", x, w_in).relu(), w_out)
        return (gates.unsqueeze(-1) * y).sum(1)


def _moe(dp: int, ep: int, seed: int = 0) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model = MoE(seed=seed)
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    for name in ("w_in", "w_out"):  # as torchtitan does: experts Shard(0) over "ep", then FSDP2 over "dp"
        setattr(model, name, torch.nn.Parameter(distribute_tensor(getattr(model, name).data, mesh["ep"], [Shard(0)])))
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _moe_job(rank: int, world: int, port: int, root: str) -> None:
    from reshard.store.manager import TorchCheckpointManager

    torchproc.init(rank, world, port)
    try:
        model, optim = _moe(2, 2)
        assert model.w_in.device_mesh.mesh_dim_names == ("dp", "ep")  # experts on the (dp, ep) mesh
        for step in (1, 2):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step * 10 + rank // 2))
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
        state = _state(model, optim)
        saved = _full(state)
        with TorchCheckpointManager(root, state, commit_timeout=60) as mgr:
            router = mgr.layouts["model.router.weight"]  # on mesh["dp"]: the two ep slices are replicas
            assert router.mesh == (2, 2) and router.ranks == (0, 2, 1, 3), router
            assert mgr.layouts["model.w_in"].origin["placements"][0].startswith("_S(0"), mgr.layouts["model.w_in"]
            mgr.save(2, state)
            for dp, ep, seed in ((2, 2, 1), (4, 1, 2)):  # the same mesh, and experts not split at all
                model, optim = _moe(dp, ep, seed=seed)
                _resume(model, optim, mgr, 2)
                _same(_full(_state(model, optim)), saved)
        if rank == 0:
            np.savez(f"{root}-saved.npz", **saved)
    finally:
        torchproc.done()


def test_moe_experts_over_an_ep_mesh_dim_saved_and_resumed(tmp_path: Path) -> None:
    torchproc.run(_moe_job, 4, str(tmp_path / "moe"), timeout=300)
    saved = dict(np.load(tmp_path / "moe-saved.npz"))
    ckpt = rs.CheckpointManager(str(tmp_path / "moe")).open()
    _same({n: ckpt.read(n) for n in ckpt.arrays}, saved)
    assert ckpt["optim.state.w_out.exp_avg"].shape == (4, 12, 8)


# ------------------------------------------------------------------ ranks that disagree
def _disagree_job(rank: int, world: int, port: int, root: str) -> None:
    from reshard.layouts import LayoutError
    from reshard.store.manager import TorchCheckpointManager
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torchproc.init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
        i, j = mesh.get_coordinate()

        def state(step: int, odd: bool = False) -> dict[str, Any]:
            """``w`` as ``[S(0), S(1)]``, or ``[R, S(1)]`` (``odd``), built locally (no collective)."""
            cols = (full * step).chunk(2, 1)[j]
            local, placements = (cols, [Replicate(), Shard(1)]) if odd else (cols.chunk(2, 0)[i], [Shard(0), Shard(1)])
            return {"w": DTensor.from_local(local.clone(), mesh, placements, run_check=False),
                    "b": torch.full((3,), float(step))}

        mgr = TorchCheckpointManager(root, state(1), commit_timeout=COMMIT_TIMEOUT, poll_max=0.05)
        for step in (1, 2):
            mgr.save(step, state(step))
        mgr.wait(committed=True, timeout=60)
        # step 3: rank 1 (not the committer's) has "w" in other placements than the manager was built with:
        # refused at that save
        both = ("'w'", "['R', 'S(1)']", "['S(0)', 'S(1)']")
        torch.distributed.barrier()
        started = time.monotonic()
        if rank == 1:
            with pytest.raises(LayoutError) as refused:
                mgr.save(3, state(3, odd=True))
            assert all(t in str(refused.value) for t in both), refused.value
        else:
            mgr.save(3, state(3))
            # given up at once (the committer reads the refusal while it waits for rank 1), never half-committed;
            # the committer's message (raised by every other rank's wait) says why rank 1 wrote nothing. A wait
            # shorter than the commit timeout: without the fail-fast it raises TimeoutError instead
            with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[1\] have not written") as lost:
                mgr.wait(committed=True, timeout=60)
            assert time.monotonic() - started < 30, "waited for the commit timeout"
            assert "rank 1 refused to save: tensor 'w'" in str(lost.value), lost.value
            assert "not waiting for the 120 s timeout" in str(lost.value), lost.value
            assert all(t in str(lost.value) for t in both), lost.value
        torch.distributed.barrier()
        # step 4: the committer's own rank refuses: it records the failure, the others raise without waiting
        if rank == 0:
            with pytest.raises(LayoutError):
                mgr.save(4, state(4, odd=True))
        else:
            mgr.save(4, state(4))
            started = time.monotonic()
            with pytest.raises(rs.UncommittedCheckpointError, match="rank 0 refused to save: tensor 'w'"):
                mgr.wait(committed=True, timeout=60)
            assert time.monotonic() - started < 6, "waited for the commit timeout"
        assert mgr.steps() == [1, 2]
        loaded = state(0)
        assert mgr.load(loaded, step=2) == 2  # the last step committed, restorable
        np.testing.assert_array_equal(loaded["w"].full_tensor().numpy(), (full * 2).numpy())
        # load() without a step on ranks that saved a given-up step: the newest committed step, with a warning
        # naming the steps given up and why
        loaded = state(0)
        with pytest.warns(RuntimeWarning, match=r"step 3 was given up .*; step 4 was given up \(rank 0 refused to "
                                                r"save: tensor 'w'.*restoring step 2, the newest committed step"):
            assert mgr.load(loaded) == 2
        np.testing.assert_array_equal(loaded["w"].full_tensor().numpy(), (full * 2).numpy())
        with pytest.warns(RuntimeWarning, match="step 4 was given up"):
            assert mgr.restorable_step() == 2  # and again, each time saying so
        mgr.close(raise_errors=False)
        torch.distributed.barrier()
        # a job whose ranks map "w" differently: every rank refuses at the start, naming both layouts
        with pytest.raises(LayoutError) as refused:
            TorchCheckpointManager(root, state(4, odd=rank == 1))
        text = str(refused.value)
        assert "ranks 0 and 1 disagree on the layout of 'w'" in text, text
        assert "rank 0 has shape [8, 6] mesh [2, 2] placements ['S(0)', 'S(1)']" in text, text
        assert "rank 1 has shape [8, 6] mesh [2, 2] placements ['R', 'S(1)']" in text, text
    finally:
        torchproc.done()


#: The disagreement job's commit timeout: far above what a refusal may take to fail a step (it must not wait for it).
COMMIT_TIMEOUT = 120


def test_layout_disagreement_is_refused_where_it_happens(tmp_path: Path) -> None:
    root = tmp_path / "run"
    torchproc.run(_disagree_job, 4, str(root), timeout=300)
    mgr = rs.CheckpointManager(str(root))
    assert mgr.steps() == [1, 2]  # earlier steps restorable, nothing of the refused ones
    np.testing.assert_array_equal(mgr.open().read("w"), np.arange(48, dtype=np.float32).reshape(8, 6) * 2)
    with pytest.raises(rs.ReshardError):
        rs.open(str(root / "step-3"))

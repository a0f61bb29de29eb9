"""torch front end: DTensor save on a (2,2) mesh, load on (3,), DCP import, export.

Real processes (tests/torchproc.py: spawned, gloo on 127.0.0.1, waits bounded), real DCP
checkpoints; values compared bit for bit with a single-process reference.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import reshard.store as rs
import torch
import torchproc
from reshard.layouts import Layout
from reshard.store.frontends import torch as rt

pytestmark = pytest.mark.torch

#: Parameter shapes: uneven under torch.chunk, some pieces empty.
SHAPES = {"fc1.weight": (7, 10), "fc1.bias": (7,), "fc2.weight": (5, 7), "fc2.bias": (5,),
          "head": (1, 5), "gate": (2,)}
SAVE_PLACEMENTS = {  # on a (2, 2) mesh
    "fc1.weight": ["S(0)", "S(1)"], "fc1.bias": ["S(0)", "S(0)"], "fc2.weight": ["R", "S(1)"],
    "fc2.bias": ["R", "R"], "head": ["S(0)", "R"], "gate": ["S(0)", "S(0)"],
}
LOAD_PLACEMENTS = {  # on a (3,) mesh
    "fc1.weight": ["S(1)"], "fc1.bias": ["S(0)"], "fc2.weight": ["S(0)"], "fc2.bias": ["R"],
    "head": ["S(1)"], "gate": ["S(0)"],
}
STEPS = 2


class Net(torch.nn.Module):
    """A small MLP-like module; the bfloat16 buffer stays a plain tensor."""

    def __init__(self, seed: int | None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed or 0)
        for name, shape in SHAPES.items():
            value = torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
            module, _, leaf = name.rpartition(".")
            owner = self
            if module:
                if not hasattr(self, module):
                    self.add_module(module, torch.nn.Module())
                owner = getattr(self, module)
            owner.register_parameter(leaf, torch.nn.Parameter(value))
        scale = torch.linspace(-3, 3, 6) if seed is not None else torch.zeros(6)
        self.register_buffer("scale", scale.to(torch.bfloat16))


def _grad(name: str, step: int) -> Any:
    gen = torch.Generator().manual_seed(1000 * step + sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=gen)


def _train(model: Any, mesh: Any = None, placements: Any = None) -> Any:
    """AdamW steps with fixed gradients (distributed like the parameters)."""
    from torch.distributed.tensor import distribute_tensor

    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    for step in range(STEPS):
        for name, p in model.named_parameters():
            g = _grad(name, step)
            p.grad = distribute_tensor(g, mesh, _objects(placements[name])) if mesh is not None else g
        optim.step()
    return optim


def _objects(placements: list[str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in placements]


def _distribute(model: Any, mesh: Any, placements: dict[str, list[str]]) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, p in list(model.named_parameters()):
        module, _, leaf = name.rpartition(".")
        owner = model.get_submodule(module) if module else model
        setattr(owner, leaf, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, _objects(placements[name]))))


def reference() -> dict[str, np.ndarray]:
    """Every value after training in one process, by checkpoint name."""
    model = Net(seed=1)
    optim = _train(model)
    out = {f"model.{n}": v.detach() for n, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for key, value in optim.state[p].items():
            out[f"optim.state.{name}.{key}"] = value
    return {n: rt.to_numpy(v).copy() for n, v in out.items()}


def _spawn(fn: Any, world: int, *args: Any) -> None:
    torchproc.run(fn, world, *args)  # every wait bounded


def _init(rank: int, world: int, port: int) -> None:
    torchproc.init(rank, world, port)


def _save_worker(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        model = Net(seed=1)
        _distribute(model, mesh, SAVE_PLACEMENTS)
        optim = _train(model, mesh, SAVE_PLACEMENTS)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "epoch": 3}
        rt.save(state, f"{root}/ckpt")
        dcp.save(state, checkpoint_id=f"{root}/dcp")
        # a pending reduction is refused on every rank (no rank is left waiting), as the LayoutError it is
        from reshard.layouts import LayoutError

        partial = DTensor.from_local(torch.ones(2), mesh, [Partial(), Partial()])
        with pytest.raises(LayoutError, match="Partial"):
            rt.save({"p": partial}, f"{root}/partial")
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, root: str, urls: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (3,))
        ref = reference()
        for url in urls:
            model = Net(seed=None)
            _distribute(model, mesh, LOAD_PLACEMENTS)
            optim = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.5)
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd}
            stats = rt.load(state, url)
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            # only this rank's regions were delivered: its local pieces plus the plain buffer
            # (parameter, exp_avg, exp_avg_sq in float32), a float32 step per parameter, 6 bfloat16
            params: dict[str, Any] = dict(model.named_parameters())
            local = sum(p.to_local().numel() * 4 * 3 for p in params.values()) + 4 * len(SHAPES) + 6 * 2
            assert stats.bytes_delivered == local
            assert optim.param_groups[0]["lr"] == 0.1 and optim.param_groups[0]["betas"] == (0.9, 0.999)
            for name, p in params.items():
                layout = rt.layout_of(p, [])
                region = layout.region(rank)
                np.testing.assert_array_equal(rt.to_numpy(p.to_local()), ref[f"model.{name}"][region])
                for key, value in optim.state[p].items():
                    want = ref[f"optim.state.{name}.{key}"]
                    got = rt.to_numpy(value.to_local() if key != "step" else value)
                    np.testing.assert_array_equal(got, want[region] if key != "step" else want)
            np.testing.assert_array_equal(rt.to_numpy(model.scale), ref["model.scale"])
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reshard checkpoint and a DCP checkpoint saved by 4 ranks on a (2, 2) mesh."""
    root = tmp_path_factory.mktemp("torch")
    _spawn(_save_worker, 4, str(root))
    return root


def test_saved_checkpoint_matches_reference(saved: Path) -> None:
    ckpt = rs.open(str(saved / "ckpt"))
    ref = reference()
    assert set(ckpt.arrays) == set(ref)
    for name, want in ref.items():
        got = ckpt.read(name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert ckpt["model.scale"].meta.dtype == "bfloat16"
    assert ckpt.leaves["epoch"] == 3
    assert ckpt.leaves["optim.param_groups"][0]["lr"] == 0.1
    layout = ckpt["model.fc1.bias"].layout
    assert layout == Layout.from_dtensor((2, 2), ["S(0)", "S(0)"], (7,))
    assert [layout.local_shape(r) for r in range(4)] == [(2,), (2,), (2,), (1,)]
    assert ckpt["model.head"].layout.local_shape(2) == (0, 5)  # an empty piece
    assert ckpt["model.scale"].layout.ranks == (0, 1, 2, 3)  # plain tensor: replicated, one writer


def test_load_on_three_ranks(saved: Path) -> None:
    imported = saved / "imported"
    rt.import_dcp(str(saved / "dcp"), str(imported))
    _spawn(_load_worker, 3, str(saved), [str(saved / "ckpt"), str(imported)])


def test_load_into_plain_state_dict_in_one_process(saved: Path) -> None:
    model = Net(seed=None)
    state = {"model": model.state_dict()}
    rt.load(state, str(saved / "ckpt"))
    ref = reference()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(rt.to_numpy(value), ref[f"model.{name}"])
    with pytest.raises(rs.TensorNotFoundError, match="missing"):
        rt.load({"missing": torch.zeros(2)}, str(saved / "ckpt"))


def test_import_dcp_keeps_chunks_and_values(saved: Path, tmp_path: Path) -> None:
    report = rt.import_dcp(str(saved / "dcp"), str(tmp_path / "out"))
    ckpt = rs.open(str(tmp_path / "out"))
    ref = reference()
    assert set(ckpt.arrays) == set(ref)
    assert report["tensors"] == len(ref) and report["skipped"] == []
    for name, want in ref.items():
        np.testing.assert_array_equal(ckpt.read(name), want, err_msg=name)
    # fc1.bias was chunked 2,2,2,1 by the nested shards: one block per saved chunk
    blocks = ckpt["model.fc1.bias"].layout.blocks()
    assert [b.region[0] for b in blocks] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    assert ckpt.leaves["epoch"] == 3
    assert ckpt.leaves["optim.param_groups"][0]["lr"] == 0.1  # DCP's per-element items joined again
    # the job's ranks, from DCP's __<rank>_0.distcp files; reshard inspect says so
    assert ckpt.leaves["reshard.source"] == {"format": "DCP", "ranks": 4}
    from reshard.store.read.display import saved_by

    assert saved_by(ckpt) == "imported from the files of 4 ranks of a DCP save"


def test_dcp_single_process_with_bfloat16_and_leaves(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(6, 4).to(torch.bfloat16), "s": torch.tensor(2.5), "n": 7, "name": "run-1"}
    with warnings.catch_warnings():  # torch: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    rt.import_dcp(str(tmp_path / "dcp"), str(tmp_path / "out"), chunk_bytes=16)
    ckpt = rs.open(str(tmp_path / "out"))
    assert ckpt["w"].meta.dtype == "bfloat16"
    np.testing.assert_array_equal(ckpt.read("w"), rt.to_numpy(state["w"]))
    assert ckpt.read("s")[()] == np.float32(2.5)
    assert ckpt.leaves == {"n": 7, "name": "run-1", "reshard.source": {"format": "DCP", "ranks": 1}}


class _Boom:
    """Unpickling this runs ``os.makedirs(path)``: what a crafted .metadata could do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.path,))


def test_dcp_metadata_unpickler_refuses_other_globals(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps({"x": _Boom(marker)}))
    assert pickle.loads((tmp_path / "evil" / ".metadata").read_bytes()) == {"x": None} and marker.exists()
    marker.rmdir()  # plain pickle would have run it; the restricted unpickler must not
    with pytest.raises(rs.FormatError, match=r"(os|posix)\.makedirs"):
        rt.import_dcp(str(tmp_path / "evil"), str(tmp_path / "out"))
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_bfloat16_and_float8_keep_every_bit(tmp_path: Path) -> None:
    bits = torch.arange(-32768, 32768, 97, dtype=torch.int32).to(torch.int16)
    bf16 = bits.view(torch.bfloat16)  # includes NaNs, infs and subnormals
    f8 = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    state = {"bf16": bf16, "e4m3": f8.view(torch.float8_e4m3fn), "e5m2": f8.view(torch.float8_e5m2)}
    rt.save(state, str(tmp_path / "ck"))
    ckpt = rs.open(str(tmp_path / "ck"))
    assert {n: ckpt[n].meta.dtype for n in ckpt} == {"bf16": "bfloat16", "e4m3": "float8_e4m3fn",
                                                     "e5m2": "float8_e5m2"}
    target = {n: torch.zeros_like(v) for n, v in state.items()}
    rt.load(target, str(tmp_path / "ck"))
    assert torch.equal(target["bf16"].view(torch.int16), bits)
    assert torch.equal(target["e4m3"].view(torch.uint8), f8)
    assert torch.equal(target["e5m2"].view(torch.uint8), f8)
    # loading into another dtype casts like copy_
    wide = {"bf16": torch.zeros(bf16.shape, dtype=torch.float32)}
    rt.load(wide, str(tmp_path / "ck"), strict=False)
    np.testing.assert_array_equal(wide["bf16"].numpy(), bf16.float().numpy())  # NaN == NaN here


def test_export_torch_for_inference(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    rt.export_torch(str(saved / "ckpt"), str(path), prefix="model.")
    model = Net(seed=None)
    model.load_state_dict(torch.load(path, weights_only=True))
    ref = reference()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(rt.to_numpy(value), ref[f"model.{name}"])
    # one safetensors file, streamed with bounded memory (reshard.store.read.export)
    pytest.importorskip("reshard.store.read.export")
    from safetensors.torch import load_file

    ckpt = rs.open(str(saved / "ckpt"))
    ckpt.export(str(tmp_path / "model.safetensors"), names=[n for n in ckpt if n.startswith("model.")])
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert loaded["model.scale"].dtype == torch.bfloat16
    for name, value in loaded.items():
        np.testing.assert_array_equal(rt.to_numpy(value), ref[name])


def test_front_ends_import_no_framework() -> None:
    code = ("import sys, reshard.store.frontends.torch, reshard.store.frontends.jax; "
            "print(sorted(m for m in ('torch', 'jax', 'orbax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dcp_import_is_importable_from_the_torch_front_end() -> None:
    from reshard.store.frontends.torch import dcp

    assert rt.import_dcp is dcp.import_dcp and rt.read_dcp_metadata is dcp.read_dcp_metadata

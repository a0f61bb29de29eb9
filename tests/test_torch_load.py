"""``Checkpoint.load(..., as_="torch", device=..., pin_memory=...)`` on CPU (the CUDA path needs a GPU).

Real checkpoints on disk; every returned value compared with a numpy read of
the same region.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import ml_dtypes
import reshard.store as rs
import torch
from reshard.layouts import Layout
from reshard.store.frontends import torch as rt
from reshard.store.read import torch_load

pytestmark = pytest.mark.torch

STATE = {
    "w": np.arange(35, dtype=np.float32).reshape(7, 5),
    "b": np.linspace(-3, 3, 6).astype(ml_dtypes.bfloat16),
    "s": np.array(2.5, dtype=np.float64),
    "e": np.zeros((0, 3), dtype=np.int32),
    "opt": {"m": np.arange(14, dtype=np.int64).reshape(7, 2)},
    "step": 3,
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tload") / "ckpt")
    rs.save(STATE, path, lambda name, shape: Layout.from_dtensor(2, ["S(0)" if shape else "R"], shape))
    return path


def _target(name: str, shape: tuple[int, ...]) -> Layout:
    return Layout.from_dtensor(3, ["S(0)" if shape else "R"], shape)


@pytest.mark.parametrize("pin", [False, True])
def test_torch_tensors_at_each_rank_region(url: str, pin: bool) -> None:
    ckpt = rs.open(url)
    for rank in range(3):
        got = ckpt.load(_target, rank, as_="torch", pin_memory=pin)
        assert got["step"] == 3
        for name in ("w", "b", "s", "e", "opt.m"):
            meta = ckpt[name].meta
            tensor = got["opt"]["m"] if name == "opt.m" else got[name]
            assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu", name
            assert str(tensor.dtype) == f"torch.{meta.dtype}", name
            want = ckpt.read(name, _target(name, meta.shape).region(rank))
            np.testing.assert_array_equal(rt.to_numpy(tensor), want, err_msg=name)
            assert tensor.is_pinned() == (pin and torch_load.can_pin()), name


def test_device_cpu_and_a_whole_load(url: str) -> None:
    ckpt = rs.open(url)
    got = ckpt.load(lambda n, s: Layout.single(s), 0, as_="torch", device="cpu")
    np.testing.assert_array_equal(got["w"].numpy(), STATE["w"])
    assert got["b"].dtype == torch.bfloat16
    np.testing.assert_array_equal(rt.to_numpy(got["b"]), STATE["b"])
    assert ckpt.last_stats.bytes_delivered == ckpt.nbytes  # every byte once, straight into the tensors


def test_out_tensors_in_place_cast_and_strided(url: str) -> None:
    ckpt = rs.open(url)
    region = _target("w", (7, 5)).region(0)
    inplace = torch.full((3, 5), -1.0)
    address = inplace.data_ptr()
    wider = torch.zeros(3, 2, dtype=torch.float64)  # another dtype: staged, cast by copy_
    strided = torch.zeros(5, 3).t()  # not contiguous: staged
    got = ckpt.load({"w": _target("w", (7, 5)), "opt.m": _target("opt.m", (7, 2)), "b": _target("b", (6,))}, 0,
                    as_="torch", out={"w": inplace, "opt": {"m": wider}, "b": strided[:, 0][:2]})
    assert got["w"] is inplace and inplace.data_ptr() == address
    np.testing.assert_array_equal(inplace.numpy(), STATE["w"][region])
    np.testing.assert_array_equal(wider.numpy(), STATE["opt"]["m"][:3].astype(np.float64))
    np.testing.assert_array_equal(strided[:, 0][:2].numpy(), STATE["b"][:2].astype(np.float32))
    with pytest.raises(rs.ShapeMismatchError, match="'w'"):
        ckpt.load({"w": _target("w", (7, 5))}, 0, as_="torch", out={"w": torch.zeros(2, 5)})


def test_bad_arguments(url: str) -> None:
    ckpt = rs.open(url)
    with pytest.raises(ValueError, match="as_"):
        ckpt.load(_target, 0, as_="jax")
    with pytest.raises(ValueError, match="as_='torch'"):
        ckpt.load(_target, 0, device="cpu")
    with pytest.raises(ValueError, match="as_='torch'"):
        ckpt.load(_target, 0, pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (runs on the lent GPU machine)")
def test_cuda_device_loads_and_out_tensors_on_the_gpu(url: str) -> None:
    ckpt = rs.open(url)
    for rank in range(3):
        got = ckpt.load(_target, rank, as_="torch", device="cuda")
        for name in ("w", "b", "s", "opt.m"):
            tensor = got["opt"]["m"] if name == "opt.m" else got[name]
            assert tensor.device.type == "cuda" and str(tensor.dtype) == f"torch.{ckpt[name].meta.dtype}", name
            want = ckpt.read(name, _target(name, ckpt[name].meta.shape).region(rank))
            np.testing.assert_array_equal(rt.to_numpy(tensor.cpu()), want, err_msg=name)
    out = torch.full((3, 5), -1.0, device="cuda")
    got = ckpt.load({"w": _target("w", (7, 5))}, 0, as_="torch", out={"w": out})
    assert got["w"] is out
    np.testing.assert_array_equal(out.cpu().numpy(), STATE["w"][:3])

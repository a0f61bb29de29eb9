"""PyTorch's own DCP test cases, ported to reshard's plugin (``reshard.torch.StorageWriter``/``StorageReader``).

Each test is named ``test_<upstream file>__<upstream test>`` after the case of
``pytorch/pytorch`` ``test/distributed/checkpoint/`` it ports (docs/torch.md
lists them, and the upstream cases left out, with the reason). The scenarios
are written here anew (no upstream code): every one runs twice, once on DCP's
own ``FileSystemWriter``/``FileSystemReader`` and once on reshard's plugin,
asserts what the upstream test asserts, and compares reshard's result with
DCP's. This file holds the one-process cases (DCP's no-dist mode) and the
helpers; test_torch_dcp_upstream_ranks.py the 4-rank ones.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

pytest.importorskip("torch")

import reshard.store as rs
import reshard.torch as rt
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

pytestmark = pytest.mark.torch


class System(NamedTuple):
    """One storage system: DCP's file system one or reshard's plugin."""

    name: str
    writer: Callable[..., Any]
    reader: Callable[..., Any]


SYSTEMS = (
    System("dcp", lambda path, **kw: dcp.FileSystemWriter(path, **kw), lambda path: dcp.FileSystemReader(path)),
    System("reshard", lambda path, **kw: rt.StorageWriter(path, **kw), lambda path: rt.StorageReader(path)),
)


def _plain(value: Any) -> Any:
    """A comparable form: tensors as (dtype, shape, values), DTensors also whole, BytesIO as bytes."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("dtensor", str(value.placements), _plain(value.to_local()), _plain(value.full_tensor()))
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.detach().cpu().tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, io.BytesIO):
        return ("BytesIO", value.getvalue())
    if hasattr(value, "state_dict"):
        return ("stateful", _plain(value.state_dict()))
    return value


def _both(scenario: Callable[[System, str], Any], root: str | Path) -> None:
    """Run ``scenario`` on DCP's storage and on reshard's; both must give the same result."""
    got = {s.name: scenario(s, f"{root}/{s.name}") for s in SYSTEMS}
    assert got["reshard"] == got["dcp"], f"reshard gave\n{got['reshard']}\nDCP gave\n{got['dcp']}"


def _seeded(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ============================================================ models of the upstream tests (own code)
class Dummy(torch.nn.Module):
    """Four linear layers 8 -> 16 -> 32 -> 64 -> 8, seeded: the e2e tests' model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = torch.nn.Linear(8, 16)
        self.net2 = torch.nn.Linear(16, 32)
        self.net3 = torch.nn.Linear(32, 64)
        self.net4 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.net1, self.net2, self.net3, self.net4):
            x = torch.relu(layer(x))
        return x


class Holder:
    """A Stateful holding a 10 x 10 tensor (the e2e tests' arbitrary object)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.data = state_dict["data"]


class TrainState:
    """Step and loss as 0-d tensors, the loss history as a BytesIO (``torch.save`` of a list), as upstream."""

    def __init__(self) -> None:
        self.step, self.current_loss, self.losses = 0, -1.0, []

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "current_loss": torch.tensor(self.current_loss, dtype=torch.float32), "losses": buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        self.current_loss = float(state_dict["current_loss"].item())
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])

    def key(self) -> tuple[int, float, list[float]]:
        return self.step, self.current_loss, list(self.losses)


def _train(model: Any, optim: Any, steps: int) -> tuple[float, TrainState]:
    torch.manual_seed(0)
    state, loss = TrainState(), None
    for _ in range(steps):
        loss = model(torch.rand(8, 8)).sum()
        loss.backward()
        state.step += 1
        state.current_loss = torch.rand(1).item()
        state.losses.append(state.current_loss)
        optim.step()
        optim.zero_grad()
    assert loss is not None
    return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()), state


# ============================================================ one-process cases (DCP's no-dist mode)
@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # torch: "assuming the intent is to save in a single process", ...
        warnings.simplefilter("ignore")
        yield


def test_e2e_save_and_load__test_stateful_and_non_stateful_loads(tmp_path: Path) -> None:
    class Watched(dict):
        def __init__(self) -> None:
            super().__init__()
            self.set_called = False

        def __setitem__(self, key: Any, value: Any) -> None:
            self.set_called = True
            super().__setitem__(key, value)

    class Foo:
        def __init__(self) -> None:
            self.loaded = False

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = True

    def scenario(system: System, path: str) -> Any:
        foo, sd = Foo(), Watched()
        dict.__setitem__(sd, "foo", foo)
        dcp.save(sd, storage_writer=system.writer(f"{path}/a"))
        dcp.load(sd, storage_reader=system.reader(f"{path}/a"))
        assert foo.loaded and not sd.set_called  # the Stateful loaded in place, not replaced
        sd = Watched()
        dict.__setitem__(sd, "foo", {"replicated": _seeded(10, 10), "bytes": [1, 2, 3, 4]})
        dcp.save(sd, storage_writer=system.writer(f"{path}/b"))
        dcp.load(sd, storage_reader=system.reader(f"{path}/b"))
        assert sd.set_called  # a plain item is replaced by the loaded one
        return _plain(dict(sd))

    _both(scenario, tmp_path)


def test_e2e_save_and_load__test_no_dist(tmp_path: Path) -> None:
    def scenario(system: System, path: str) -> Any:
        sd: dict[str, Any] = {}
        dcp.save(sd, storage_writer=system.writer(path))
        dcp.load(sd, storage_reader=system.reader(path))
        return sd

    _both(scenario, tmp_path)


def test_e2e_save_and_load__test_init_state_dict(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    def scenario(system: System, path: str) -> Any:
        model = Dummy()
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        _train(model, optim, 1)
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)},
                 storage_writer=system.writer(path))
        model_2 = Dummy()
        optim_2 = torch.optim.Adam(model_2.parameters(), lr=0.2)
        _train(model_2, optim_2, 1)  # Adam state exists, to be overwritten
        msd, osd = get_model_state_dict(model_2), get_optimizer_state_dict(model_2, optim_2)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, storage_reader=system.reader(path))
        assert sd["model"] is msd and sd["optimizer"] is osd  # loaded in place
        set_state_dict(model_2, optim_2, model_state_dict=msd, optim_state_dict=osd)
        assert _plain(get_model_state_dict(model_2)) == _plain(get_model_state_dict(model))
        assert _plain(get_optimizer_state_dict(model_2, optim_2)) == _plain(get_optimizer_state_dict(model, optim))
        assert optim_2.param_groups[0]["lr"] == 0.1
        return _plain(sd)

    _both(scenario, tmp_path)


class Module3(torch.nn.Module):
    """Two linear layers and an EmbeddingBag (the file-system tests' module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class Blob:
    """A Stateful holding raw bytes (the file-system tests' BlobState)."""

    def __init__(self, value: bytes) -> None:
        self.state: dict[str, Any] = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def _module_round_trip(system: System, path: str, *, blob: bool, no_dist: bool = False, **options: Any) -> Any:
    torch.manual_seed(1)
    saved: dict[str, Any] = dict(Module3().state_dict())
    torch.manual_seed(2)
    sd: dict[str, Any] = dict(Module3().state_dict())
    if blob:
        saved["test_blob"], sd["test_blob"] = Blob(b"SomeBlobForTesting"), Blob(b"")
    assert _plain(sd) != _plain(saved)
    if no_dist:
        dcp.save_state_dict(saved, storage_writer=system.writer(path, **options), no_dist=True)
        dcp.load_state_dict(sd, storage_reader=system.reader(path), no_dist=True)
    else:
        dcp.save(saved, storage_writer=system.writer(path, **options))
        dcp.load(sd, storage_reader=system.reader(path))
    assert _plain(sd) == _plain(saved)
    return _plain(sd)


@pytest.mark.parametrize("thread_count", [1, 2])
def test_file_system_checkpoint_cpu__test_read_write_only_tensor(tmp_path: Path, thread_count: int) -> None:
    def scenario(system: System, path: str) -> Any:  # thread_count is a FileSystemWriter option only
        return _module_round_trip(system, path, blob=False, no_dist=True,
                                  **({"thread_count": thread_count} if system.name == "dcp" else {}))

    _both(scenario, tmp_path)


def test_file_system_checkpoint_cpu__test_read_write_tensor_and_blob(tmp_path: Path) -> None:
    # upstream: DCP's Rot13 stream extension; reshard has no stream extensions, so the blob alone
    _both(lambda system, path: _module_round_trip(system, path, blob=True), tmp_path)


def test_file_system_checkpoint_cpu__test_read_write_only_tensor_zstandard(tmp_path: Path) -> None:
    # upstream TestDistributedStateDictSaveLoadZStandard: DCP's ZStandard extension; reshard's zstd chunks
    from torch.distributed.checkpoint._extension import ZStandard

    def scenario(system: System, path: str) -> Any:
        if system.name == "reshard":
            options: dict[str, Any] = {"compression": "zstd"}
        else:  # DCP's extension needs zstandard or pyzstd; without them DCP's side is plain
            options = {"_extensions": [ZStandard()]} if ZStandard.is_available() else {}
        return _module_round_trip(system, path, blob=True, **options)

    _both(scenario, tmp_path)
    assert rs.open(str(tmp_path / "reshard"))["linear_1.weight"].meta.compressor == "zstd"


def test_file_system_checkpoint_cpu__test_dtype_mismatch_casting(tmp_path: Path) -> None:
    # the default (casting) half; DefaultLoadPlanner(allow_unsafe_types=False) is newer than the torch tested here
    def scenario(system: System, path: str) -> Any:
        dcp.save({"w": _seeded(4, 3)}, storage_writer=system.writer(f"{path}/fp32"))
        narrow = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
        dcp.load(narrow, storage_reader=system.reader(f"{path}/fp32"))
        assert narrow["w"].dtype == torch.bfloat16
        dcp.save({"w": _seeded(4, 3, dtype=torch.bfloat16)}, storage_writer=system.writer(f"{path}/bf16"))
        wide = {"w": torch.zeros(4, 3)}
        dcp.load(wide, storage_reader=system.reader(f"{path}/bf16"))
        assert wide["w"].dtype == torch.float32
        return _plain({"narrow": narrow, "wide": wide})

    _both(scenario, tmp_path)


def _nested() -> dict[str, Any]:
    return {"key0": 1, "key1": [1, 2], "key2": {"1": 2, "2": 3}, "key3": torch.tensor([1]),
            "key4": [[torch.tensor(2), "x"], [1, 2, 3], {"key6": [44]}]}


def test_nested_dict__test_flattening_round_trip(tmp_path: Path) -> None:
    # upstream flattens and unflattens in memory; here the nested state dict goes through storage.
    # Through storage DCP itself gives int dict keys back as strings, so upstream's {1: 2, 2: 3} is
    # {"1": 2, "2": 3} here (reshard's result is compared with DCP's either way).
    def scenario(system: System, path: str) -> Any:
        dcp.save(_nested(), storage_writer=system.writer(path))
        template = {"key0": 0, "key1": [0, 0], "key2": {"1": 0, "2": 0}, "key3": torch.tensor([0]),
                    "key4": [[torch.tensor(0), ""], [0, 0, 0], {"key6": [0]}]}
        dcp.load(template, storage_reader=system.reader(path))
        assert _plain(template) == _plain(_nested())
        return _plain(template)

    _both(scenario, tmp_path)


def test_nested_dict__test_mapping(tmp_path: Path) -> None:
    # upstream checks flatten_state_dict's key paths; here a load with no template must rebuild the
    # nesting from them (list positions as list positions), as DCP's own reader does
    state = {"k0": [1], "k2": [torch.tensor([1]), 99, [{"k3": torch.tensor(1)}]], "k3": ["x", 99, [{"k3": "y"}]]}

    def scenario(system: System, path: str) -> Any:
        dcp.save(state, storage_writer=system.writer(path))
        got = _load_state_dict_from_keys(storage_reader=system.reader(path))
        assert _plain(got) == _plain(state)
        return _plain(got)

    _both(scenario, tmp_path)

"""The settings a docs block runs in (``<!-- docs-test: setting NAME -->``, tests/test_docs.py's ``SETTINGS``).

Each setting is a function ``(page, blocks, tmp_path, request)``: it runs the page's blocks that name it, in page
order, in one namespace per process, in a real job where the names the page assumes are defined as it says, then
checks what the blocks promise. Every setting fills the same documented stand-ins first (``PLACEHOLDERS``): a
reader replaces them with their bucket and credentials, the test with a local folder or the moto server.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: The stand-ins of the pages, and what each setting puts in their place (``{bucket}``: a local folder, or a
#: bucket of the moto server in the ``s3`` setting; ``{tmp}``: the test's folder). ``storage_options`` is then a
#: name the setting defines: None, or the moto server's options.
PLACEHOLDERS = {'"s3://bucket/': '"{bucket}/', "storage_options={...}": "storage_options=storage_options",
                '"/ckpts/': '"{tmp}/ckpts/'}
#: Seconds a background save waits for the training loop to run a step (the overlap it must show).
OVERLAP_WAIT = 60.0


def fill(code: str, bucket: str, tmp: str) -> str:
    """``code`` with every placeholder of ``PLACEHOLDERS`` replaced (the line count unchanged)."""
    for old, new in PLACEHOLDERS.items():
        code = code.replace(old, new.format(bucket=bucket, tmp=tmp))
    return code


def run(page: str, line: int, code: str, scope: dict[str, Any], output: str | None = None) -> None:
    """Run one block in ``scope`` (tracebacks name the page's lines); with ``output``, what it prints must be
    that text (leading and trailing blank space aside)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), scope)
    sys.stdout.write(out.getvalue())
    if output is not None:
        assert out.getvalue().strip() == output.strip(), \
            f"{page}:{line}: printed\n{out.getvalue()}\nthe page shows\n{output}"


def committed(root: str | Path) -> list[Path]:
    """Every committed reshard checkpoint under ``root`` (a commit marker), sorted."""
    return sorted(p.parent.parent for p in Path(root).rglob(".reshard/commit.json"))


def _codes(blocks: list[Any], bucket: str, tmp: str) -> list[tuple[int, str, str | None]]:
    return [(b.line, fill(b.code, bucket, tmp), b.output) for b in blocks]


# ---------------------------------------------------------------------------------------------- fsdp2-tp
def fsdp2_tp(page: str, blocks: list[Any], tmp_path: Path, request: Any) -> None:
    """4 gloo ranks (CPU, torch.distributed): ``model`` a tiny transformers Llama, TP on "tp" then FSDP2 on "dp"
    of a (2, 2) mesh, ``optimizer`` its AdamW, ``batch`` a token batch, ``msd``, ``osd`` ``get_state_dict``'s
    model and optimizer state dicts, ``state_dict`` DCP's state dict (both and ``"step": 0``), ``epoch = step =
    0``, ``loss`` a loss tensor, ``root`` a manager root; ``"s3://bucket/"`` is a local folder.

    Checked on every rank: each committed checkpoint holds the model's values and AdamW moments after the
    optimizer step it records (leaf ``step`` or ``epoch``); after the blocks, a ``state`` recording a step holds
    the model and moments of that step (a load restored them); every ``dcp.async_save`` overlapped the loop's
    next forward (its write waits, at most ``OVERLAP_WAIT`` s, until one ran); the job ends within its
    timeout."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torchproc

    tmp = str(tmp_path)
    torchproc.run(_fsdp2_tp_rank, 4, page, _codes(blocks, f"{tmp}/bucket", tmp), tmp, timeout=600)


def _llama() -> tuple[Any, Any]:
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model: Any, optimizer: Any) -> dict[str, np.ndarray]:
    """The model's parameters and AdamW moments, whole (torch's own ``full_tensor``: a collective of every
    rank), by their names in a checkpoint of ``{"model": msd, "optim": osd}``."""
    from torch.distributed.tensor import DTensor

    def whole(t: Any) -> np.ndarray:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    out = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = whole(p)
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in optimizer.state.get(p, {}):
                out[f"optim.state.{name}.{moment}"] = whole(optimizer.state[p][moment])
    return out


def _recorded_step(leaves: Any, where: str) -> int:
    step = leaves.get("step", leaves.get("epoch")) if isinstance(leaves, dict) else None
    assert isinstance(step, int), f"{where}: records no step (leaf 'step' or 'epoch'), so its values cannot be checked"
    return step


def _fsdp2_tp_rank(rank: int, world: int, port: int, page: str, codes: list[tuple[int, str, str | None]],
                   tmp: str) -> None:
    import reshard.store as rs
    import torch
    import torch.distributed.checkpoint as dcp
    import torchproc
    from reshard.store.frontends.torch.plugin import StorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torchproc.init(rank, world, port)
    os.chdir(tmp)
    model, optimizer = _llama()
    # after[k]: model and moments after k optimizer steps (not counting the step with lr 0 that torch's
    # get_state_dict/set_state_dict take to create an empty optimizer's state)
    after = [_full(model, optimizer)]
    optimizer.register_step_post_hook(
        lambda opt, *_: after.append(_full(model, optimizer)) if float(opt.param_groups[0]["lr"]) else None)
    forwards, started, overlapped = [0], [], []
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    real_async_save, real_write = dcp.async_save, StorageWriter.write_data

    def async_save(*args: Any, **kwargs: Any) -> Any:  # counts, then the real thing
        started.append(forwards[0])
        return real_async_save(*args, **kwargs)

    def write_data(self: Any, plan: Any, planner: Any) -> Any:  # a background save waits for the loop to step
        if threading.current_thread() is not threading.main_thread():
            mark, deadline = started[-1], time.monotonic() + OVERLAP_WAIT
            while forwards[0] <= mark and time.monotonic() < deadline:
                time.sleep(0.005)
            overlapped.append(forwards[0] > mark)
        return real_write(self, plan, planner)

    dcp.async_save, StorageWriter.write_data = async_save, write_data  # type: ignore[method-assign]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    scope: dict[str, Any] = {
        "__name__": "__docs__", "model": model, "optimizer": optimizer, "epoch": 0, "step": 0,
        "batch": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),
        "state_dict": {"model": model_sd, "optim": optim_sd, "step": 0}, "msd": model_sd, "osd": optim_sd,
        "loss": torch.tensor(4.25), "root": f"{tmp}/bucket/run-8", "storage_options": None}
    for line, code, output in codes:
        run(page, line, code, scope, output if rank == 0 else None)
    if hasattr(scope.get("mgr"), "close"):
        scope["mgr"].close()
    assert all(overlapped), f"{page}: an async save's write did not overlap a training step ({overlapped})"
    found = committed(tmp)
    assert found, f"{page}: the blocks committed no checkpoint under {tmp}"
    for url in found:
        ckpt = rs.open(str(url))
        k = _recorded_step(ckpt.leaves, str(url))
        for name, want in after[k].items():
            np.testing.assert_array_equal(ckpt[name].read(), want, err_msg=f"{page}: {url} {name}")
    state = scope.get("state")
    if isinstance(state, dict):  # what a block loaded into the model
        k = _recorded_step(state, f"{page}: the state the blocks loaded")
        now = _full(model, optimizer)
        assert set(now) >= set(after[k]), f"{page}: the load lost {sorted(set(after[k]) - set(now))}"
        for name, want in after[k].items():
            np.testing.assert_array_equal(now[name], want, err_msg=f"{page}: loaded step {k}: {name}")
    torchproc.done()


# ---------------------------------------------------------------------------------------------- torch (one process)
def torch_one(page: str, blocks: list[Any], tmp_path: Path, request: Any) -> None:
    """One process, no torch.distributed: ``model`` a tiny transformers Llama, ``url`` a reshard checkpoint of
    its state dict (``rt.save``), ``"/ckpts/dcp/step-1000"`` the same state saved by torch's ``dcp.save``.
    Checked: every committed checkpoint and every ``*.pt``/``*.safetensors`` file the blocks wrote holds the
    model's values (under ``model.``), and so does a model the blocks load as ``inference``."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import reshard.store as rs
    import reshard.torch as rt
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    want = {f"model.{n}": t.detach().numpy().copy() for n, t in model.state_dict().items()}
    url = str(tmp_path / "saved")
    rt.save({"model": model.state_dict(), "step": 1000}, url)
    dcp.save({"model": model.state_dict(), "step": 1000}, checkpoint_id=str(tmp_path / "ckpts" / "dcp" / "step-1000"),
             no_dist=True)
    scope: dict[str, Any] = {"__name__": "__docs__", "model": model, "url": url, "rs": rs, "storage_options": None}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for line, code, output in _codes(blocks, str(tmp_path / "bucket"), str(tmp_path)):
            run(page, line, code, scope, output)
    finally:
        os.chdir(cwd)
    found = committed(tmp_path)
    assert len(found) > 1, f"{page}: the blocks committed no checkpoint"
    files = sorted(tmp_path.glob("*.pt")) + sorted(tmp_path.glob("*.safetensors"))
    assert files, f"{page}: the blocks wrote no file"
    for url_ in found:
        ckpt = rs.open(str(url_))
        for name, value in want.items():
            np.testing.assert_array_equal(ckpt[name].read(), value, err_msg=f"{page}: {url_} {name}")
    if "inference" in scope:  # a model the blocks loaded from their export (from_pretrained)
        got = {f"model.{k}": v.detach().numpy() for k, v in scope["inference"].state_dict().items()}
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{page}: the model loaded back: {name}")
    for path in files:
        if path.suffix == ".pt":
            fresh = transformers.LlamaForCausalLM(cfg)
            fresh.load_state_dict(torch.load(path, weights_only=True))  # as the page's comment says
            got = {f"model.{k}": v.detach().numpy() for k, v in fresh.state_dict().items()}
        else:
            from safetensors.numpy import load_file
            got = load_file(path)
        assert set(got) == set(want), f"{page}: {path.name} holds {sorted(got)}"
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{page}: {path.name} {name}")


# ---------------------------------------------------------------------------------------------- script
def script(page: str, blocks: list[Any], tmp_path: Path, request: Any) -> None:
    """Each block is a file, run as ``python example.py`` in a fresh folder (``OMP_NUM_THREADS=1``): it exits 0
    and prints the lines the page shows after it, in any order (ranks print as they finish). Output is buffered,
    Python's default (``PYTHONUNBUFFERED`` unset): unbuffered, ranks' ``print`` calls write a line and its
    newline apart, and lines of several processes interleave."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    for block in blocks:
        assert block.output is not None, f"{page}:{block.line}: a script block shows its output after it"
        folder = tmp_path / f"line-{block.line}"
        folder.mkdir()
        (folder / "example.py").write_text(block.code)
        done = subprocess.run([sys.executable, "example.py"], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{page}:{block.line}: python example.py failed:\n{done.stderr[-6000:]}"
        assert sorted(done.stdout.strip().splitlines()) == sorted(block.output.strip().splitlines()), \
            f"{page}:{block.line}: printed\n{done.stdout}\nthe page shows\n{block.output}"


# ---------------------------------------------------------------------------------------------- jax-8-devices
def jax_8_devices(page: str, blocks: list[Any], tmp_path: Path, request: Any) -> None:
    """One process with 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before jax
    loads: a fresh interpreter); ``"s3://bucket/"`` is a local folder; ``params`` a (16, 8) array sharded over a
    (4, 2) mesh, ``state = {"params": {"w": params}, "step": 0}``... see :func:`_jax_names`. Checked: each block
    prints what the page shows after it; every committed checkpoint holds the arrays of ``state`` (by dotted
    name); a ``restored`` tree holds ``state["params"]``'s values."""
    pytest.importorskip("jax")
    if any("orbax" in b.code for b in blocks):
        pytest.importorskip("orbax.checkpoint")
    tmp = str(tmp_path)
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps({"page": page, "codes": _codes(blocks, f"{tmp}/bucket", tmp)}))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"import docsettings; docsettings._jax_main({str(spec)!r})"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page} in jax-8-devices:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _jax_names() -> dict[str, Any]:
    """``params``: a dict of a (16, 8) float32 array over a (4, 2) mesh of the 8 devices, ``state`` ``{"params":
    params, "step": 0}``, ``step = 0``, ``root`` a manager root, ``shardings_of_another_mesh`` ``params``'s
    leaves on 2 devices, ``storage_options = None``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    assert devices.size == 8, f"{devices.size} devices, not the 8 XLA_FLAGS asks for"
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    params = {"w": jax.device_put(jnp.arange(128.0).reshape(16, 8) + 1, NamedSharding(mesh, P("data", "model")))}
    return {"__name__": "__docs__", "params": params, "state": {"params": params, "step": 0}, "step": 0,
            "root": f"{os.getcwd()}/bucket/run-8", "storage_options": None,
            "shardings_of_another_mesh": {"w": NamedSharding(Mesh(devices[:2], ("x",)), P("x"))}}


def _jax_main(spec_path: str) -> None:
    import reshard.store as rs

    spec = json.loads(Path(spec_path).read_text())
    scope = _jax_names()
    for line, code, output in spec["codes"]:
        run(spec["page"], line, code, scope, output)
    if hasattr(scope.get("mgr"), "close"):
        scope["mgr"].close()
    want = {n: np.asarray(v) for n, v in _flat(scope["state"]).items() if hasattr(v, "shape")}
    found = committed(os.getcwd())
    assert found, f"{spec['page']}: the blocks committed no checkpoint"
    for url in found:
        ckpt = rs.open(str(url))
        assert set(want) <= set(ckpt), f"{url}: holds {sorted(ckpt)}, not {sorted(want)}"
        for name, value in want.items():
            got = ckpt[name].read()
            assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), f"{spec['page']}: {url} {name}"
    if "restored" in scope:
        for name, value in _flat(scope["state"]["params"]).items():
            got = np.asarray(_flat(scope["restored"]["params"])[name])
            assert got.tobytes() == np.asarray(value).tobytes(), f"{spec['page']}: restored params.{name}"


# ---------------------------------------------------------------------------------------------- s3
def s3(page: str, blocks: list[Any], tmp_path: Path, request: Any) -> None:
    """One process on the loopback moto S3 server (tests/conftest.py's ``s3_server``).

    ``"s3://bucket/"`` is a fresh bucket there and ``storage_options`` its options, also given as ``AWS_*``
    environment variables; ``url`` a root in it, ``rank = 0`` the only rank, ``step = 1000``, ``local_state`` an
    (8, 4) ``model.w`` whole under ``layouts`` (one rank) and ``target_layouts`` its columns over 2 ranks.
    Checked: a ``state`` the blocks loaded holds rank 0's columns; every manager ``mgr`` is closed (its commits
    waited for) without error."""
    import reshard.store as rs
    from reshard.layouts import Layout

    server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    env = request.getfixturevalue("monkeypatch")  # a block without storage_options: credentials from the environment
    env.setenv("AWS_ACCESS_KEY_ID", "testing")
    env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    env.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    env.setenv("AWS_DEFAULT_REGION", server.storage_options()["client_kwargs"]["region_name"])
    full = np.arange(32, dtype=np.float32).reshape(8, 4) + 1
    target = {"model.w": Layout.from_dtensor((2,), ["S(1)"], (8, 4))}
    scope: dict[str, Any] = {
        "__name__": "__docs__", "rs": rs, "storage_options": server.storage_options(), "rank": 0, "step": 1000,
        "url": f"s3://{bucket}/run-8", "layouts": {"model.w": Layout.from_dtensor((1,), ["S(0)"], (8, 4))},
        "local_state": {"model": {"w": full}}, "target_layouts": target}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        managers = []
        for line, code, output in _codes(blocks, f"s3://{bucket}", str(tmp_path)):
            run(page, line, code, scope, output)
            if isinstance(scope.get("mgr"), rs.CheckpointManager) and scope["mgr"] not in managers:
                managers.append(scope["mgr"])
        for mgr in managers:
            mgr.close()
    finally:
        os.chdir(cwd)
    if "state" in scope:
        np.testing.assert_array_equal(scope["state"]["model"]["w"], full[target["model.w"].region(0)])

"""The shell blocks of the docs, run as written (issue 37 item 3): the runner and the settings that prepare their files.

A ``console``, ``bash``, ``sh`` or ``shell`` block of README.md or docs/*.md runs in a setting
(``<!-- docs-test: setting NAME -->``, a name of :data:`SETTINGS`), is run by a named test
(``covered-by``), or is skipped with a reason; tests/test_docs.py checks that every one is.

**What runs.** A setting prepares a fresh folder with the files the page's commands name
(its function, below, says which and how they are made) and the environment they need; then
each command of each of the page's blocks that name the setting runs there, in page order,
with ``bash -c``, ``reshard`` on ``PATH`` being this checkout's command line (``python -m
reshard.store.cli``). The commands of a block are:

* ``console``: each ``$ COMMAND`` line (a line ending in ``\\`` continues on the next). The
  lines under it up to the next ``$`` are what it prints (stdout and stderr together). It
  must exit 0, unless the next command is ``echo $?``, which then prints its status.
* ``bash``, ``sh``, ``shell``: each line that is not blank or a comment (``\\`` continues
  it). It must exit 0, or the status its comment names: ``# exit 1: MESSAGE`` (MESSAGE must
  be in what it printed; ``names A, B`` there: each of A and B must).

**How output is compared** (:func:`masked`). Where a console block shows what a command
prints, the text it printed must be that text, line for line, after three things that differ
from run to run are masked on both sides: a save's random id (``gen-<hex>``), a duration
(``in 0.14 s``) and a rate (``(125 MB/s)``, and the ``seconds`` and ``MB/s`` columns of a
table whose header ends with them, whose rows are then compared with runs of spaces as one).
The names a setting substitutes (a moto bucket for ``s3://bucket/``) are put back into the
output before comparing, and so is ``./`` for the folder's absolute path (an import records
the folders it read, resolved). Every other value (tensor counts, sizes, chunk counts, max abs
differences, error messages) comes from running the command on the setting's files and must be
what the page shows: a stale page fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: The languages of the blocks this module runs.
SHELL = ("console", "bash", "sh", "shell")
#: What differs from run to run, masked on both sides (see the module docstring).
MASKS = [(re.compile(r"gen-[0-9a-f]{8,}"), "gen-<id>"), (re.compile(r"\bin \d+(\.\d+)? s\b"), "in <t> s"),
         (re.compile(r"\(\d+(\.\d+)? MB/s\)"), "(<rate>)")]
TIMED_HEADER = re.compile(r"\bseconds\s+MB/s\s*$")
EXIT = re.compile(r"\s#\s*exit (?P<status>\d+)(:\s*(?P<message>.*))?$")


@dataclass(frozen=True)
class Command:
    """One command of a block: its page line, text, the output shown (None: not shown), expected exit status
    (None: whatever a following ``echo $?`` shows) and the message a ``# exit N: MESSAGE`` comment names."""

    line: int
    text: str
    shown: str | None = None
    status: int | None = 0
    message: str = ""


def _joined(lines: list[str], first: int) -> list[tuple[int, str]]:
    """(line number, text) of each logical line: one ending in a backslash continues on the next."""
    out: list[tuple[int, str]] = []
    cont = False
    for n, line in enumerate(lines, first):
        if cont:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        else:
            out.append((n, line))
        cont = line.endswith("\\")
    return out


def commands(block: Any) -> list[Command]:
    """The commands of a shell block (see the module docstring)."""
    lines = block.code.splitlines()
    if block.lang != "console":
        out = []
        for n, text in _joined(lines, block.line):
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            m = EXIT.search(text)
            out.append(Command(n, text, None, int(m["status"]) if m else 0, (m["message"] or "") if m else ""))
        return out
    cmds: list[tuple[int, str, list[str]]] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            n, text = block.line + i, lines[i][2:]
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
            cmds.append((n, text, []))
        elif cmds:
            cmds[-1][2].append(lines[i])
        i += 1
    out = []
    for k, (n, text, shown) in enumerate(cmds):
        echoed = k + 1 < len(cmds) and cmds[k + 1][1].strip() == "echo $?"
        out.append(Command(n, text, "\n".join(shown) if shown else None, None if echoed else 0))
    return out


def masked(text: str) -> list[str]:
    """The lines of ``text`` with what differs from run to run masked (see the module docstring)."""
    out, timed = [], False
    for line in text.strip("\n").splitlines():
        line = line.rstrip()
        for pattern, repl in MASKS:
            line = pattern.sub(repl, line)
        if timed and len(line.split()) > 2 and not set(line) <= {"-", " "}:
            line = " ".join([*line.split()[:-2], "<t>", "<rate>"])
        timed = timed or bool(TIMED_HEADER.search(line))
        out.append(line)
    return out


def run_commands(page: str, blocks: list[Any], folder: Path, env: dict[str, str], subs: dict[str, str]) -> None:
    """Run every command of ``blocks`` in ``folder`` (see the module docstring); ``subs`` maps a name the page
    uses to what the setting put in its place."""
    bin_dir = folder.parent / f"{folder.name}-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "reshard").write_text(f'#!/bin/sh\nexec {sys.executable} -m reshard.store.cli "$@"\n')
    (bin_dir / "reshard").chmod(0o755)
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", **env,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    for block in blocks:
        cmds = commands(block)
        assert cmds, f"{page}:{block.line}: a shell block with no command"
        status = 0
        for cmd in cmds:
            text = cmd.text
            for name, value in subs.items():
                text = text.replace(name, value)
            done = subprocess.run(["bash", "-c", f"(exit {status}); {text}"], cwd=folder, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
            got, status = done.stdout.replace(f"{folder}/", "./"), done.returncode
            for name, value in subs.items():
                got = got.replace(value, name)
            where = f"{page}:{cmd.line}: $ {cmd.text}"
            if cmd.status is not None:
                assert status == cmd.status, f"{where}\nexited {status}, not {cmd.status}:\n{got[-4000:]}"
            if cmd.message:
                names = cmd.message.removeprefix("names ").split(", ") if cmd.message.startswith("names ") \
                    else [cmd.message]
                missing = [n for n in names if n not in got]
                assert not missing, f"{where}\nprinted\n{got}\nwithout {missing} (its comment names them)"
            if cmd.shown is not None:
                assert masked(got) == masked(cmd.shown), f"{where}\nprinted\n{got}\nthe page shows\n{cmd.shown}"


@dataclass
class Prepared:
    """What a setting made: the environment of the commands, the names it substituted, a check run after."""

    env: dict[str, str] = field(default_factory=dict)
    subs: dict[str, str] = field(default_factory=dict)
    check: Callable[[], None] | None = None


def setting(prepare: Callable[[Path, Any], Prepared]) -> Callable[[str, list[Any], Path, Any], None]:
    """A setting of tests/test_docs.py's ``SETTINGS`` that runs shell blocks in the folder ``prepare`` fills."""

    def run(page: str, blocks: list[Any], tmp_path: Path, request: Any) -> None:
        folder = tmp_path / "work"
        folder.mkdir()
        prepared = prepare(folder, request)
        run_commands(page, blocks, folder, prepared.env, prepared.subs)
        if prepared.check is not None:
            prepared.check()

    run.__doc__ = prepare.__doc__
    return run


def _cli(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "reshard.store.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"reshard {' '.join(args)}:\n{done.stderr[-4000:]}"
    return done.stdout


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


# ---------------------------------------------------------------------------------------------- cli (docs/cli.md)
def _damage(root: Path) -> None:
    """Three kinds of damage to a directory-form save: an array's zarr.json says another dtype, a byte of a
    chunk flipped, a shard gone."""
    gen = next(root.glob("gen-*"))
    meta = gen / "model/embed/weight/zarr.json"
    doc = json.loads(meta.read_text())
    doc["data_type"] = "float16"
    meta.write_text(json.dumps(doc))
    shard = gen / "model/layers/1/mlp/up/weight/c/2/0"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    (gen / "optimizer/exp_avg_sq/embed/weight/c/5/0").unlink()


def _skipping_megatron_save(folder: Path) -> None:
    """``./mc``: tests/data's Megatron-Core sample whose ``common.pt`` also holds a tensor ``table`` (not JSON:
    an import refuses it unless ``--skip``)."""
    torch = pytest.importorskip("torch")
    shutil.copytree(TESTS / "data/megatron/forms/dp_reshardable", folder / "mc")
    common = torch.load(folder / "mc/common.pt", weights_only=False)
    common["table"] = torch.arange(4.0)
    torch.save(common, folder / "mc/common.pt")


def cli(folder: Path, request: Any) -> Prepared:
    """docs/cli.md's files. ``./reshard-demo``: what ``reshard demo`` writes. ``./ckpt/step-100``: the
    ``--quick`` demo state (``model_state(100, quick=True)``, 39 tensors) on the demo's 8-rank layouts;
    ``./ckpt/step-101`` the same with ``step`` 101 and 1% of ``model_state(101)``'s embedding added to its own
    (one training step). ``./step-100``: a copy of ``./ckpt/step-100``; ``strategy.ckpt``: a MindSpore protobuf
    strategy for its 2-d ``model.*`` tensors on 2 devices; ``layouts.json``: ``{name: Layout.to_json()}`` for two
    of them. ``./damaged``: that state saved in the directory form with save_id 7, then damaged
    (:func:`_damage`). ``./mc``: :func:`_skipping_megatron_save`. On the moto S3 server, with ``AWS_*`` in the
    environment, a bucket standing for ``s3://bucket/`` (and for ``http://127.0.0.1:9000``, its endpoint) holds
    ``step-1000``, ``step-100`` and ``runs/a/step-5000``, a small state (``model.w`` (8, 4) over 2 ranks,
    ``model.b``), and ``runs/b/step-5000``, the same with 1e-3 added to the diagonal of ``model.w``. Checked
    after: every file exported holds the values of the checkpoint it came from; ``step-100-tp2`` holds
    ``./step-100``'s values."""
    import reshard.store as rs
    from reshard.layouts import Layout, dump_strategy
    from reshard.store.cli.demo import model_state, training_layouts

    _cli("demo", cwd=folder)
    state = model_state(100, quick=True)
    layouts = training_layouts(state)
    later = model_state(100, quick=True)
    embed = state["model"]["embed"]["weight"]  # one step: the embedding moves by 1% of a fresh draw
    later["model"]["embed"]["weight"] = (embed.astype(np.float32) + 0.01 * model_state(101, quick=True)["model"][
        "embed"]["weight"].astype(np.float32)).astype(embed.dtype)
    later["step"] = 101
    rs.save(state, str(folder / "ckpt/step-100"), layouts)
    rs.save(later, str(folder / "ckpt/step-101"), layouts)
    shutil.copytree(folder / "ckpt/step-100", folder / "step-100")
    rs.save(state, str(folder / "damaged"), layouts, form="directory", save_id=7)
    _damage(folder / "damaged")
    _skipping_megatron_save(folder)
    flat = {n: v for n, v in _flat(state).items() if isinstance(v, np.ndarray)}
    strategy = {n: Layout.from_mindspore([2, 1], [0] + [-1] * (v.ndim - 1), v.shape) for n, v in flat.items()
                if n.startswith("model.") and v.ndim == 2}
    (folder / "strategy.ckpt").write_bytes(dump_strategy(strategy, "protobuf"))
    two = sorted(strategy)[:2]
    (folder / "layouts.json").write_text(json.dumps({n: Layout.from_dtensor((2,), ["S(1)"], flat[n].shape).to_json()
                                                     for n in two}))
    server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    options = server.storage_options()
    small = {"model": {"w": np.arange(32, dtype=np.float32).reshape(8, 4) / 8, "b": np.ones(4, np.float32)},
             "step": 1000}
    moved = {"model": {"w": small["model"]["w"] + np.eye(8, 4, dtype=np.float32) * 1e-3, "b": small["model"]["b"]},
             "step": 1000}
    for url, value in (("step-1000", small), ("step-100", small), ("runs/a/step-5000", small),
                       ("runs/b/step-5000", moved)):
        rs.save(value, f"s3://{bucket}/{url}", {"model.w": Layout.from_dtensor((2,), ["S(0)"], (8, 4)),
                                                        "model.b": Layout.from_dtensor((2,), ["R"], (4,))},
                storage_options=options)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_ENDPOINT_URL_S3": server.endpoint_url,
           "AWS_DEFAULT_REGION": options["client_kwargs"]["region_name"]}

    def check() -> None:
        from safetensors.numpy import load_file

        def same(got: dict[str, np.ndarray], where: str) -> None:
            assert sorted(got) == sorted(flat), f"{where}: holds {sorted(got)}"
            for name, want in flat.items():
                assert got[name].tobytes() == want.tobytes(), f"{where}: {name}"

        if (folder / "model.safetensors").exists():
            same(load_file(folder / "model.safetensors"), "model.safetensors")
        if (folder / "model.npz").exists():
            with np.load(folder / "model.npz") as npz:
                got = {n: npz[n] for n in npz.files}
            assert sorted(got) == ["model.b", "model.w"] and all(
                np.array_equal(got[n], small["model"][n[6:]]) for n in got), f"model.npz: {got}"
        if (folder / "step-100-tp2").exists():
            ck = rs.open(str(folder / "step-100-tp2"))
            same({n: ck[n].read() for n in ck.arrays}, "step-100-tp2")

    return Prepared(env, {"s3://bucket/": f"s3://{bucket}/", "http://127.0.0.1:9000": server.endpoint_url}, check)


# ---------------------------------------------------------------------------------------------- docs/huggingface.md
def hf_files(folder: Path, request: Any) -> Prepared:
    """docs/huggingface.md's files: ``./gpt2``, a tiny GPT-2 (2 layers, 4 heads) transformers' ``save_pretrained``
    wrote in shards of at most 20 KB with their index; ``./model.safetensors``, its weights as one file;
    ``./run/step-9``, a training save ``{"model": those weights, "optim": {"exp_avg": ...}, "step": 9}``.
    Checked after: every checkpoint and export the commands wrote holds the weights (``ck1`` those of the one
    file, ``out-model`` the training save's ``model.`` tensors by their names without it)."""
    import reshard.store as rs
    from safetensors.numpy import load_file, save_file

    transformers = pytest.importorskip("transformers")

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder / "gpt2", max_shard_size="20KB")
    weights: dict[str, np.ndarray] = {}
    for shard in sorted((folder / "gpt2").glob("*.safetensors")):
        weights |= load_file(shard)
    save_file(weights, folder / "model.safetensors")
    rs.save({"model": weights, "optim": {"exp_avg": {k: v * 0 + 1 for k, v in weights.items()}}, "step": 9},
            str(folder / "run/step-9"))

    def check() -> None:
        def same(got: dict[str, np.ndarray], where: str) -> None:
            assert sorted(got) == sorted(weights), f"{where}: holds {sorted(got)}"
            for name, want in weights.items():
                assert got[name].tobytes() == want.tobytes(), f"{where}: {name}"

        for url in ("ck", "ck1", "ck-tp2"):
            if (folder / url).exists():
                ck = rs.open(str(folder / url))
                same({n: ck[n].read() for n in ck.arrays}, url)
        for out in ("out", "out-model"):
            if (folder / out).exists():
                same({k: v for f in (folder / out).glob("*.safetensors") for k, v in load_file(f).items()}, out)
        if (folder / "gpt2.safetensors").exists():
            same(load_file(folder / "gpt2.safetensors"), "gpt2.safetensors")

    return Prepared(check=check)


# ---------------------------------------------------------------------------------------------- docs/mindspore.md
def mindspore_files(folder: Path, request: Any) -> Prepared:
    """docs/mindspore.md's example files, written as its runnable example writes them: ``./train/rank_N/
    checkpoint_N.ckpt`` for 4 devices (``model_parallel_weight`` [2, 4] on dev_matrix [2, 2], tensor_map [1, 0],
    its ``moments.`` and a learning rate), ``./train_strategy.ckpt`` (protobuf) and ``./infer_strategy.json``
    (2 devices, [2, 1]). Checked after: ``./ckpt`` holds the whole weight; each ``./infer/rank_M`` file holds
    rank M's piece under the inference strategy, and ``./ckpt2`` the weight on that strategy's layout."""
    import reshard.store as rs
    from reshard.layouts import Layout, dump_strategy
    from reshard.store.frontends import mindspore as ms

    w = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    train = {"model_parallel_weight": Layout.from_mindspore([2, 2], [1, 0], w.shape)}
    for rank in range(4):
        piece = w[train["model_parallel_weight"].region(rank)]
        ms.write_ckpt(folder / f"train/rank_{rank}/checkpoint_{rank}.ckpt",
                      {"model_parallel_weight": piece, "moments.model_parallel_weight": piece / 10,
                       "learning_rate": np.array(0.01, np.float32)}, crc=True)
    (folder / "train_strategy.ckpt").write_bytes(dump_strategy(train, "protobuf"))
    infer = {"model_parallel_weight": Layout.from_mindspore([2, 1], [1, 0], w.shape)}
    (folder / "infer_strategy.json").write_bytes(dump_strategy(infer))

    def check() -> None:
        np.testing.assert_array_equal(rs.open(str(folder / "ckpt"))["model_parallel_weight"].read(), w)
        lay = infer["model_parallel_weight"]
        for rank in range(2):
            got = ms.read_ckpt(folder / f"infer/rank_{rank}/checkpoint_{rank}.ckpt")["model_parallel_weight"]
            np.testing.assert_array_equal(got, w[lay.region(rank)])
        ck2 = rs.open(str(folder / "ckpt2"))["model_parallel_weight"]
        assert ck2.layout.region(1) == lay.region(1)
        np.testing.assert_array_equal(ck2.read(), w)

    return Prepared(check=check)


# ---------------------------------------------------------------------------------------------- docs/oneflow.md
def oneflow_files(folder: Path, request: Any) -> Prepared:
    """docs/oneflow.md's two rank folders of OneFlow's seed-001 pipeline example, as
    ``reshard.store.frontends.oneflow.save_npz`` writes them in the job (``to_local`` of each rank's part of
    the whole state on placement [0, 1]): ``module_pipeline.m_stage<k>.linear.weight`` (k = 0..3, 5 x 16 split
    over dim 0 as 3 + 2, stage 3's 1 x 2 over dim 1), their biases whole, ``System-Train-TrainStep`` whole.
    Checked after: ``./ckpt`` holds the whole state."""
    import reshard.store as rs
    from reshard.store.frontends.oneflow import save_npz, to_local

    rng = np.random.default_rng(7)
    module = {}
    for k, shape in enumerate([(5, 16), (5, 5), (5, 5), (1, 2)]):
        module[f"m_stage{k}.linear.weight"] = rng.standard_normal(shape).astype(np.float32)
        module[f"m_stage{k}.linear.bias"] = rng.standard_normal(shape[0]).astype(np.float32)
    state = {"System-Train-TrainStep": np.array([2], np.int64), "module_pipeline": module}

    def get_sbp(sd: Any, tensor: Any) -> str:
        if tensor is sd["module_pipeline"]["m_stage3.linear.weight"]:
            return "split(1)"
        if tensor is sd["System-Train-TrainStep"] or tensor.ndim == 1:
            return "broadcast"
        return "split(0)"

    for rank in (0, 1):
        save_npz(to_local(state, [0, 1], get_sbp, rank), folder / f"graph_save_load_global_{rank}")

    def check() -> None:
        ck = rs.open(str(folder / "ckpt"))
        for name, want in _flat(state).items():
            np.testing.assert_array_equal(ck[name].read(), want, err_msg=name)

    return Prepared(check=check)


SETTINGS = {"cli": setting(cli), "hf-files": setting(hf_files), "mindspore-files": setting(mindspore_files),
            "oneflow-files": setting(oneflow_files)}

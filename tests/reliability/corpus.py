"""The hostile corpus's machinery: valid samples of every foreign and own format, their readers, the child runner.

A **parser** (:data:`PARSERS`) is a sample, built once from a real valid save by the
project's own writers (torch DCP, the DeepSpeed layout of tests/test_deepspeed.py,
the Megatron, MindSpore and OneFlow files under tests/data, reshard's own saves), and
the reader that takes it in: an import into a reshard checkpoint read back whole, or
``verify``. A case (tests/reliability/test_corpus.py) copies a sample, edits it as an
attacker would, and runs the reader with :func:`run` in a child process forked from a
server that imported everything once (``multiprocessing``'s forkserver: a fork costs
milliseconds, an interpreter with torch seconds), under a :data:`MEMORY_LIMIT`
address-space limit (``RLIMIT_AS``) and a timeout. The child reports its outcome and
its peak RSS (``ru_maxrss``), the outcome being

* ``ok``: the reader returned; ``digest`` is the sha256 of everything it gave
  (:func:`digest`), to compare with the sample's;
* ``refused``: a :class:`~reshard.layouts.errors.ReshardError` (its message);
* ``reported``: ``verify`` returned damage (its problems);
* ``crash``: anything else (a MemoryError, a raw KeyError...), or the child died;
* ``hang``: it ran past the timeout and was killed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import resource
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import reshard.store as rs
from reshard.layouts.errors import ReshardError

#: Address space a case may use beyond what the child had when it started (torch, zarr and reshard loaded).
MEMORY_LIMIT = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


# ------------------------------------------------------------------ outputs
def digest(tree: Any, root: str = "") -> str:
    """The sha256 of a reader's output: names, dtypes, shapes and bytes of arrays, plain values (``root``, the
    case's folder, replaced in strings so that copies of a sample digest alike)."""
    h = hashlib.sha256()

    def walk(at: str, value: Any) -> None:
        if isinstance(value, np.ndarray | np.generic):
            a = np.ascontiguousarray(value)
            h.update(f"{at}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{at}/{k}", value[k])
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{at}[{i}]", v)
        else:
            h.update(f"{at}={value!r}".replace(root, "<root>").encode() if root else f"{at}={value!r}".encode())

    walk("", tree)
    return h.hexdigest()


def checkpoint(url: str) -> dict[str, Any]:
    """Everything a reshard checkpoint holds: every tensor read whole, and its leaves."""
    ckpt = rs.open(url)
    return {"tensors": {n: ckpt.read(n) for n in ckpt}, "leaves": ckpt.leaves}


# ------------------------------------------------------------------ readers (run in the child)
def read_dcp(src: Path, work: Path) -> Any:
    from reshard.store.frontends.torch.dcp import import_dcp

    import_dcp(str(src), str(work / "out"))
    return checkpoint(str(work / "out"))


def read_megatron(src: Path, work: Path) -> Any:
    from reshard.store.frontends.megatron import import_megatron

    import_megatron(str(src), str(work / "out"))
    return checkpoint(str(work / "out"))


def read_deepspeed(src: Path, work: Path) -> Any:
    from reshard.store.frontends.deepspeed import import_deepspeed

    import_deepspeed(str(src), str(work / "out"))
    return checkpoint(str(work / "out"))


def read_mindspore(src: Path, work: Path) -> Any:
    from reshard.store.frontends.mindspore import import_mindspore

    strategy = next(p for p in src.iterdir() if p.name.startswith("strategy"))
    import_mindspore(src / "ranks", str(work / "out"), strategy)
    return checkpoint(str(work / "out"))


def read_oneflow(src: Path, work: Path) -> Any:
    from reshard.store.frontends.oneflow import load_flow_save

    return load_flow_save(src)


def read_safetensors(src: Path, work: Path) -> Any:
    from reshard.store.frontends.huggingface import import_safetensors

    import_safetensors(str(src / "model.safetensors"), str(work / "out"))
    return checkpoint(str(work / "out"))


def read_hf_folder(src: Path, work: Path) -> Any:
    from reshard.store.frontends.huggingface import import_safetensors

    import_safetensors(str(src), str(work / "out"))
    return checkpoint(str(work / "out"))


def read_commit(src: Path, work: Path) -> Any:
    """A save by ranks not yet committed: commit it (the trailers are merged), then read it."""
    rs.commit(str(src), ranks=list(range(4)))
    return checkpoint(str(src))


def read_reshard(src: Path, work: Path) -> Any:
    return checkpoint(str(src))


def read_verify(src: Path, work: Path) -> Any:
    """``verify`` (metadata and references only): its damage as the outcome ``reported``, else the data read."""
    report = rs.verify(str(src), data=False)
    if not report.ok:
        raise Reported("; ".join(report.problems))
    return checkpoint(str(src))


class Reported(Exception):
    """What ``verify`` found (the outcome ``reported``)."""


READERS: dict[str, Callable[[Path, Path], Any]] = {
    "dcp": read_dcp, "megatron": read_megatron, "deepspeed": read_deepspeed, "mindspore": read_mindspore,
    "oneflow": read_oneflow, "safetensors": read_safetensors, "hf-folder": read_hf_folder, "commit": read_commit,
    "reshard": read_reshard, "verify": read_verify,
}


# ------------------------------------------------------------------ the child
def _child(conn: Any, reader: str, src: str, work: str, limit: int) -> None:
    """Run one reader under the memory limit; send its outcome and peak RSS."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        out = {"outcome": "ok", "digest": digest(READERS[reader](Path(src), Path(work)), src)}
    except ReshardError as e:
        out = {"outcome": "refused", "detail": f"{type(e).__name__}: {e}"[:600]}
    except Reported as e:
        out = {"outcome": "reported", "detail": str(e)[:600]}
    except BaseException as e:
        out = {"outcome": "crash", "detail": f"{type(e).__name__}: {e}"[:300] + " | " +
               "".join(traceback.format_tb(e.__traceback__)[-2:])[-300:]}
    out["rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["start_kib"] = start
    conn.send(out)
    conn.close()


_CONTEXT: list[Any] = []


def _context() -> Any:
    """The forkserver context, its server importing torch, zarr and this module once."""
    if not _CONTEXT:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "zarr", "reshard.store", "corpus"])
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run(reader: str, src: Path, work: Path, timeout: float) -> dict[str, Any]:
    """Run ``reader`` on ``src`` in a child under :data:`MEMORY_LIMIT` and ``timeout``: its outcome (see the
    module) with ``rss_kib``, its peak RSS."""
    ctx = _context()
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, reader, str(src), str(work), MEMORY_LIMIT), daemon=True)
    child.start()
    send.close()
    out: dict[str, Any] | None = None
    try:
        if receive.poll(timeout):
            out = receive.recv()
    except EOFError:  # it died before answering
        pass
    if out is None and child.is_alive():
        child.kill()
        out = {"outcome": "hang", "detail": f"> {timeout} s", "rss_kib": -1}
    child.join(10)
    if out is None:
        out = {"outcome": "crash", "detail": f"the child died (exit code {child.exitcode})", "rss_kib": -1}
    receive.close()
    return out


# ------------------------------------------------------------------ samples (built in the test process)
def sample_dcp(folder: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(35)
    dcp.save({"model": {"w": torch.randn(6, 4, generator=g), "b": torch.arange(5, dtype=torch.int32)},
              "step": 7, "name": "corpus"}, checkpoint_id=str(folder))


def sample_deepspeed(folder: Path) -> None:
    from tests.test_deepspeed import build_save

    build_save(folder / "s", 2, 2)


def sample_megatron(folder: Path) -> None:
    shutil.copytree(DATA / "megatron" / "tp2dp2", folder)


def sample_megatron_buckets(folder: Path) -> None:
    shutil.copytree(DATA / "megatron" / "forms" / "dp_reshardable", folder)


def sample_mindspore(folder: Path, form: str = "protobuf") -> None:
    from reshard.layouts.strategy import dump_strategy, parse_strategy

    shutil.copytree(DATA / "mindspore" / "redundant", folder / "ranks")
    raw = (DATA / "mindspore" / "strategy.ckpt").read_bytes()
    if form == "json":
        shapes = json.loads((DATA / "mindspore" / "expected.json").read_text())
        shapes = {k: np.shape(v) for k, v in shapes.items() if isinstance(v, list)}
        (folder / "strategy.json").write_bytes(dump_strategy(parse_strategy(raw, shapes), "json"))
    else:
        (folder / "strategy.ckpt").write_bytes(raw)


def sample_oneflow(folder: Path) -> None:
    shutil.copytree(DATA / "oneflow" / "local", folder)


def safetensors_bytes(tensors: dict[str, np.ndarray], header: dict[str, Any] | None = None) -> bytes:
    """A safetensors file of ``tensors`` (little-endian, in order), ``header`` merged into its JSON header."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.float16): "F16"}
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, a in tensors.items():
        doc[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    doc.update(header or {})
    head = json.dumps(doc).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(a.tobytes() for a in tensors.values())


def hf_tensors() -> dict[str, np.ndarray]:
    g = np.random.default_rng(35)
    return {"embed.weight": g.standard_normal((8, 4)).astype(np.float32),
            "layers.0.weight": g.standard_normal((4, 4)).astype(np.float16),
            "layers.0.step": np.arange(3, dtype=np.int64)}


def sample_safetensors(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(safetensors_bytes(hf_tensors()))


def sample_hf_folder(folder: Path) -> None:
    """A sharded Hugging Face folder: two files and ``model.safetensors.index.json``."""
    folder.mkdir(parents=True)
    tensors = hf_tensors()
    parts = [dict(list(tensors.items())[:1]), dict(list(tensors.items())[1:])]
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        (folder / name).write_bytes(safetensors_bytes(part))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def sample_trailers(folder: Path) -> None:
    """4 ranks' third-form trailers, not committed (tests/test_trailer.py's state)."""
    from tests.test_trailer import save

    save(str(folder), commit=False)


def sample_summary(folder: Path) -> None:
    """A committed directory-form save whose root summary holds shared ``records`` and ``record_of``."""
    state = {f"layer{i}.w": np.arange(12, dtype=np.float32).reshape(3, 4) + i for i in range(8)}
    rs.save({**state, "step": 3}, str(folder), form="directory")


def sample_parquet(folder: Path) -> None:
    """A committed packed save by 4 ranks with parquet references (tests/test_trailer.py's state)."""
    from tests.test_trailer import save

    save(str(folder), parquet=True)


#: parser -> (the sample writer, the reader :func:`run` runs on a copy of it).
PARSERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "parquet references": (sample_parquet, "verify"),
    "third trailer form": (sample_trailers, "commit"),
    "summary records": (sample_summary, "reshard"),
    "DCP .metadata": (sample_dcp, "dcp"),
    "Megatron .metadata, common.pt": (sample_megatron, "megatron"),
    "Megatron flat ranges": (sample_megatron, "megatron"),
    "Megatron buckets": (sample_megatron_buckets, "megatron"),
    "DeepSpeed flat ranges": (sample_deepspeed, "deepspeed"),
    "MindSpore .ckpt": (sample_mindspore, "mindspore"),
    "MindSpore strategy (protobuf)": (sample_mindspore, "mindspore"),
    "MindSpore strategy (JSON)": (lambda f: sample_mindspore(f, "json"), "mindspore"),
    "OneFlow pickled_data": (sample_oneflow, "oneflow"),
    "safetensors header": (sample_safetensors, "safetensors"),
    "Hugging Face index": (sample_hf_folder, "hf-folder"),
}


def build(parser: str, base: Path) -> Path:
    """The sample of ``parser`` under ``base`` (built once; cases copy it)."""
    folder = base / "".join(c if c.isalnum() else "-" for c in parser)
    if not folder.exists():
        PARSERS[parser][0](folder)
    return folder


def copy(sample: Path, to: Path) -> Path:
    shutil.copytree(sample, to, symlinks=True)
    return to

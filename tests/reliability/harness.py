"""What the reliability tests share: storage backends and forms, the state saved, outcomes, figures.

A case runs on a **backend** (where the bytes live: ``file``, ``memory``, ``s3`` on
the moto server) and a **form** (how a checkpoint lays them out: ``directory``;
new forms add an entry to :data:`FORMS` with their save options and the file kinds
they make, in :data:`KIND_RULES`). Every case asserts the same thing: a read gives
the saved data bit for bit or a :class:`~reshard.store.ReshardError`; damage is
reported by ``verify``; never wrong data, never another exception, never a hang.

Settings (environment): ``RESHARD_RELIABILITY_SEED`` (default 11) seeds every
random choice; ``RESHARD_SOAK=1`` multiplies the trial counts (``tox -e soak``);
``RESHARD_RELIABILITY_REPORT=path`` appends each test's figures as one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.commit.marker import Marker, metadata_digest, read_marker, read_root_document
from reshard.store.format.consolidated import summary_seal
from reshard.store.format.meta import COMMIT_KEY
from reshard.store.format.refs import REFS_KEY
from reshard.store.format.schema import with_digest
from reshard.store.io.storage import Storage

SEED = int(os.environ.get("RESHARD_RELIABILITY_SEED", "11"))
SOAK = os.environ.get("RESHARD_SOAK", "") not in ("", "0")


def trials(ci: int, soak: int) -> int:
    """How many trials a test runs: ``ci`` by default, ``soak`` with ``RESHARD_SOAK=1``."""
    return soak if SOAK else ci


def rng_for(*names: Any) -> random.Random:
    """A generator seeded by the suite's seed and the test's own names (stable across runs)."""
    return random.Random(f"{SEED}/" + "/".join(map(str, names)))


# ------------------------------------------------------------- backends
@dataclass
class Backend:
    """Where a checkpoint's bytes live, with raw access to them (for damage)."""

    name: str
    url: str
    storage_options: dict[str, Any] | None = None
    #: Other processes see the same bytes (kill tests need it).
    shared: bool = True

    def fs(self) -> Any:
        return fsspec.core.url_to_fs(self.url, **(self.storage_options or {}))

    def files(self) -> list[str]:
        fs, root = self.fs()
        root = root.rstrip("/")
        return sorted(p[len(root) + 1:] for p in fs.find(root) if not p.endswith("/"))

    def read(self, key: str) -> bytes:
        fs, root = self.fs()
        return bytes(fs.cat_file(f"{root.rstrip('/')}/{key}"))

    def write(self, key: str, data: bytes) -> None:
        fs, root = self.fs()
        fs.pipe_file(f"{root.rstrip('/')}/{key}", data)

    def delete(self, key: str) -> None:
        fs, root = self.fs()
        fs.rm(f"{root.rstrip('/')}/{key}")


#: Backends every test runs on (the kill tests skip those other processes cannot see).
BACKENDS = ("file", "memory", "s3")

# --------------------------------------------------------------- forms
#: Storage forms: name -> options for ``rs.save`` / ``rs.create``. Add one here (e.g. a
#: packed form) and every reliability test runs on it too.
FORMS: dict[str, dict[str, Any]] = {"directory": {"form": "directory"}, "packed": {"form": "packed"}}

#: File kinds by key pattern (relative to the checkpoint root), first match wins. A new
#: form adds the kinds of files it writes.
KIND_RULES: list[tuple[str, str]] = [
    ("marker", r"^\.reshard/commit\.json$"),
    # the root's copy of the committed metadata: used only when its sha256 is the marker's, so damage to it
    # is harmless (the generation's own document is read instead); the read must still be exact
    ("head", r"^\.reshard/head\.json$"),
    ("lock", r"(^|/)\.reshard/commit\.lock$"),
    ("lease", r"^gen-[^/]+/\.reshard/lease\.json$"),  # a writer's lease: read by gc only, never by readers
    ("manifest", r"^gen-[^/]+/\.reshard/ranks/\d+\.json$"),
    ("root-json", r"^gen-[^/]+/(zarr|\.reshard/metadata)\.json$"),  # packed: .reshard/metadata.json
    ("node-json", r"^gen-[^/]+/.+/zarr\.json$"),
    ("shard", r"^gen-[^/]+/.+/c(/\d+)*$"),
    ("references", r"^gen-[^/]+/refs\.json$"),  # packed form: every document inline + shard locations
    ("data-object", r"^gen-[^/]+/packed/[^/]+\.bin$"),  # packed form: a rank's shards, then its manifest
]
#: Kinds nobody reads once committed (damage there is harmless by design).
UNREAD_KINDS = {"lock", "lease"}


def kind_of(key: str, backend: Backend | None = None) -> str:
    for kind, pattern in KIND_RULES:
        if re.search(pattern, key):
            if kind == "node-json" and backend is not None:  # array or group?
                try:
                    node = json.loads(backend.read(key)).get("node_type")
                except ValueError:
                    node = None
                return "array-json" if node == "array" else "group-json"
            return kind
    return "other"


def json_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indexes from ``node``) of every JSON value below ``node``, containers and ``node``
    itself (``path``) included: where a fuzzer may put a hostile value."""
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += json_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += json_paths(v, (*path, i))
    return out


# --------------------------------------------------------------- state
RANKS = 4


def layouts() -> dict[str, Layout]:
    """Layouts of :func:`make_state`: sharded, replicated, a single holder, a 0-d tensor."""
    return {
        "model.w": Layout.from_dtensor((RANKS,), ["S(0)"], (64, 48)),
        "model.b": Layout.single((48,)),
        "opt.m": Layout.from_dtensor((2, 2), ["S(1)", "R"], (40, 8)),
        "opt.count": Layout.from_dtensor((RANKS,), ["S(0)"], (12,)),
        "scale": Layout.single(()),
    }


def make_state(rng: random.Random) -> dict[str, Any]:
    """A state dict of several dtypes (values from ``rng``) and a leaf."""
    g = np.random.default_rng(rng.getrandbits(32))
    return {
        "model.w": g.standard_normal((64, 48), dtype=np.float32),
        "model.b": g.standard_normal(48).astype(np.float16),
        "opt.m": g.standard_normal((40, 8)),
        "opt.count": g.integers(-1000, 1000, 12, dtype=np.int32),
        "scale": np.float32(g.standard_normal()),
        "step": rng.randrange(10**6),
    }


def local(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s pieces of ``state`` (and the leaves)."""
    out: dict[str, Any] = {"step": state["step"]}
    for name, layout in layouts().items():
        if rank in layout.ranks:
            out[name] = np.asarray(state[name])[(*layout.region(rank), ...)]
    return out


def save(state: dict[str, Any], backend: Backend, form: str, save_id: Any, *, commit: bool = True,
         overwrite: bool = True) -> rs.CheckpointWriter:
    """Save ``state`` as every rank would (in this process)."""
    writer = rs.create(backend.url, layouts(), save_id=save_id, overwrite=overwrite,
                       storage_options=backend.storage_options, **FORMS[form])
    for rank in range(RANKS):
        writer.write(rank, local(state, rank))
    if commit:
        writer.commit()
    return writer


def read_back(backend: Backend) -> dict[str, Any]:
    """Everything the checkpoint holds, read through ``open`` (tensors and leaves)."""
    ckpt = rs.open(backend.url, storage_options=backend.storage_options)
    out: dict[str, Any] = {name: ckpt.read(name) for name in ckpt}
    out.update(ckpt.leaves)
    return out


def step_manifests(url: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every rank's manifest of the save committed at ``url`` (a manager's step folder), as its commit read them."""
    from reshard.store.commit.marker import generation_storage, read_marker
    from reshard.store.format.manifests import read_manifests
    from reshard.store.io.storage import Storage

    root = Storage(url, storage_options)
    found = read_marker(root)
    assert found is not None, f"{url} is not committed"
    marker = found[0]
    return list(read_manifests(generation_storage(root, marker), marker.save_id, marker.ranks).values())


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Bit for bit: the same names, dtypes, shapes and bytes; equal leaves."""
    if set(got) != set(want):
        return False
    for name, value in want.items():
        if isinstance(value, np.ndarray | np.generic):
            a, b = np.asarray(got[name]), np.asarray(value)
            if not isinstance(got[name], np.ndarray) or a.dtype != b.dtype or a.shape != b.shape \
                    or a.tobytes() != b.tobytes():
                return False
        elif got[name] != value:
            return False
    return True


# ------------------------------------------------------------- an attacker's edits
def generation(root: Path) -> tuple[Storage, Marker]:
    """The committed generation of the local checkpoint at ``root`` and its marker."""
    storage = Storage(str(root))
    found = read_marker(storage)
    assert found is not None
    return storage.child(found[0].generation), found[0]


def reseal(root: Path, **fields: Any) -> None:
    """Recompute the marker's digests of the references and the root document (and its summary), and its own,
    as an attacker would; ``fields`` replace others (``parquet_sha256``...)."""
    gen, marker = generation(root)
    doc = json.loads((root / COMMIT_KEY).read_bytes())
    doc.pop("sha256", None)
    doc.pop("summary_bytes", None), doc.pop("summary_sha256", None)
    if marker.form == "packed":
        doc["references_sha256"] = metadata_digest((Path(gen.root) / REFS_KEY).read_bytes())
    try:
        _, raw = read_root_document(gen, marker)
        doc["metadata_sha256"] = metadata_digest(raw)
        doc.update(summary_seal(raw))
    except FileNotFoundError:
        pass
    doc.update(fields)
    (root / COMMIT_KEY).write_bytes(with_digest(doc))


# ------------------------------------------------------------- outcomes
@dataclass
class Tally:
    """Outcome counts of one test, recorded as figures (see the module doc)."""

    test: str
    counts: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, outcome: str, kind: str | None = None, bad: str | None = None) -> None:
        self.counts[outcome] += 1
        if kind is not None:
            self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if bad is not None:
            self.failures.append(bad)

    def record(self) -> None:
        path = os.environ.get("RESHARD_RELIABILITY_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": self.test, "seed": SEED, "soak": SOAK, "counts": self.counts,
                                    "by_kind": self.by_kind, "failures": self.failures}) + "\n")

    def check(self) -> None:
        """Record the figures, then fail with every bad case (not just the first)."""
        self.record()
        assert not self.failures, f"{len(self.failures)} bad case(s):\n" + "\n".join(self.failures[:20])


def attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", result)``, ``("refused", error)`` for a ReshardError, ``("crash", error)`` for anything else."""
    try:
        return "ok", fn()
    except rs.ReshardError as e:
        return "refused", e
    except Exception as e:
        return "crash", e


def fork(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` in a forked process (exit 0 when it returns, 1 when it raises); its pid."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a threaded process
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fn()
        code = 0
    finally:
        os._exit(code)


def reap(pid: int, timeout: float) -> int | None:
    """Wait for ``pid`` at most ``timeout`` seconds: its wait status, or None (after killing it) if it hung."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None

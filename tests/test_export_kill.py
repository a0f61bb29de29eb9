"""Every export over an existing target: refused without overwrite, all-or-nothing with it, kill -9 included.

One rule for every format (reshard.store.io.replace): a target that exists is
refused (nothing changes) unless ``overwrite``; then the export is written
beside it and swapped in whole. Each export here is killed (SIGKILL, in a
forked child) at every step of that module in turn: ``RESHARD_TEST_KILL_STEP=k``
kills at the k-th, for k = 1, 2, ... until a child finishes. After each kill
every unit of the target (the folder or file) must hold the old export byte for byte or the new one (the files of a
reference export of the new source, byte for byte), never nothing, never a mix;
then the export runs again and must leave the new export and nothing beside it.
With ``RESHARD_TEST_TWO_STEP=1`` (no ``renameat2``) a folder is swapped in two
renames: a kill between them leaves no target, and the next export renames the
old one back first.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from dssaves import build_save
from reshard.layouts import Layout, dump_strategy
from reshard.store.io.replace import clean_leftovers
from reshard.store.write.writer import create, single_process

from tests.reliability.harness import fork, reap

MEGATRON = Path(__file__).parent / "data" / "megatron" / "forms" / "dp_reshardable"
#: Seconds a child export may take before the test calls it hung.
CHILD_TIMEOUT = 60.0
#: Exports run their read tasks inline: a forked child cannot use the dask thread pool its parent started.
SCHEDULER = "sync"

#: The MindSpore target strategy: ``w`` split over 2 ranks (``v`` whole on each).
MS_STRATEGY = {"w": Layout.from_mindspore([2, 1], [1, 0], (4, 6))}

Snapshot = dict[str, bytes]


def snapshot(path: Path) -> Snapshot | None:
    """Every file under ``path`` (or ``path`` itself) by relative name and bytes; None when missing."""
    if path.is_file():
        return {".": path.read_bytes()}
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def shifted(src: str, dst: str) -> str:
    """A copy of checkpoint ``src`` with every tensor changed (+1), its leaves as they are."""
    ckpt = rs.open(src)
    layouts = {name: Layout.single(meta.shape) for name, meta in ckpt.arrays.items()}
    writer = create(dst, layouts, **single_process({}))
    metas = {}
    for name, meta in ckpt.arrays.items():
        metas[name] = writer.meta(name, layouts[name], meta.dtype)
        arr = ckpt[name].read()
        writer.write_block(metas[name], tuple(slice(0, n) for n in meta.shape), (arr + 1).astype(arr.dtype))
    writer.write_manifests(metas, ckpt.leaves)
    writer.commit()
    return dst


def plain_source(tmp: Path) -> str:
    rng = np.random.default_rng(35)
    state = {"w": rng.standard_normal((4, 6)).astype(np.float32), "v": np.arange(5, dtype=np.float32)}
    rs.save(state, str(tmp / "a"))
    return str(tmp / "a")


def deepspeed_source(tmp: Path) -> str:
    from reshard.store.frontends.deepspeed import import_deepspeed

    build_save(tmp / "ds" / "global_step2", 2, 4)
    import_deepspeed(str(tmp / "ds"), str(tmp / "a"))
    return str(tmp / "a")


def megatron_source(tmp: Path) -> str:
    from reshard.store.frontends.megatron import import_megatron

    import_megatron(str(MEGATRON), str(tmp / "a"))
    return str(tmp / "a")


def _single(fmt: str) -> Callable[[str, str, bool], Any]:
    def run(src: str, target: str, overwrite: bool) -> Any:
        return rs.open(src).export(target, format=fmt, overwrite=overwrite, scheduler=SCHEDULER)
    return run


def _torch(src: str, target: str, overwrite: bool) -> Any:
    from reshard.store.frontends.torch import export_torch

    return export_torch(src, target, overwrite=overwrite)


def _hf(src: str, target: str, overwrite: bool) -> Any:
    from reshard.store.frontends.huggingface import export_safetensors

    return export_safetensors(src, target, max_shard_size=64, overwrite=overwrite, scheduler=SCHEDULER)


def _mindspore(src: str, target: str, overwrite: bool) -> Any:
    from reshard.store.frontends.mindspore import export_mindspore

    return export_mindspore(src, target, MS_STRATEGY, overwrite=overwrite)


def _deepspeed(src: str, target: str, overwrite: bool, dp: int = 2) -> Any:
    from reshard.store.frontends.deepspeed import export_deepspeed

    return export_deepspeed(src, target, dp, overwrite=overwrite)


def _megatron(src: str, target: str, overwrite: bool) -> Any:
    from reshard.store.frontends.megatron import export_megatron

    return export_megatron(src, target, overwrite=overwrite)


@dataclass(frozen=True)
class Format:
    """An export under test: its source, how it runs, its target's name and units, and its command line
    (``reshard export cli[0] SRC TARGET cli[1:]``)."""

    source: Callable[[Path], str]
    export: Callable[[str, str, bool], Any]
    target: str
    cli: tuple[str, ...]
    #: The replaced units under the target's folder (default: the target itself).
    units: tuple[str, ...] = ()
    #: Files whose bytes differ between two exports of one source (DCP's save id): only "fresh" is checked.
    fresh: frozenset[str] = field(default_factory=frozenset)

    def unit_paths(self, out: Path) -> dict[str, Path]:
        return {u: out / self.target / u for u in self.units} if self.units else {self.target: out / self.target}


FORMATS = {
    "safetensors": Format(plain_source, _single("safetensors"), "m.safetensors", ("safetensors",)),
    "npz": Format(plain_source, _single("npz"), "m.npz", ("npz",)),
    "torch": Format(plain_source, _torch, "m.pt", ("torch",)),
    "hf-folder": Format(plain_source, _hf, "hf", ("safetensors", "--max-shard-size", "64")),
    "mindspore": Format(plain_source, _mindspore, "ms", ("mindspore",)),
    "deepspeed": Format(deepspeed_source, _deepspeed, "ds", ("deepspeed", "--dp", "2")),
    "megatron": Format(megatron_source, _megatron, "mc", ("megatron",), fresh=frozenset({".metadata"})),
}
FOLDERS = ["hf-folder", "mindspore", "deepspeed", "megatron"]


def is_new(got: Snapshot, ref: Snapshot, old: Snapshot | None, fresh: frozenset[str]) -> bool:
    """``got`` holds the reference export's files, byte for byte (``fresh`` ones: new bytes)."""
    return set(got) == set(ref) and all(
        got[n] != (old or {}).get(n) if n in fresh else got[n] == ref[n] for n in got)


def leftovers(out: Path, fmt: Format) -> list[str]:
    """What lies beside the target's units that a complete export does not leave."""
    folders = {out / fmt.target} if fmt.units else {out}
    expected = set(fmt.units) if fmt.units else {fmt.target}
    return sorted(n for f in folders for n in os.listdir(f) if n not in expected) + \
        sorted(n for n in os.listdir(out) if n not in {fmt.target})


def _kill_at(step: int, two_step: bool, fn: Callable[[], Any]) -> None:
    os.environ["RESHARD_TEST_KILL_STEP"] = str(step)
    if two_step:
        os.environ["RESHARD_TEST_TWO_STEP"] = "1"
    fn()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, str]]:
    """Per source kind, two checkpoints whose every tensor differs (made once per module)."""
    made: dict[Callable[[Path], str], tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        kind = FORMATS[name].source
        if kind not in made:
            tmp = tmp_path_factory.mktemp(kind.__name__)
            a = kind(tmp)
            made[kind] = (a, shifted(a, str(tmp / "b")))
        return made[kind]

    return get


@pytest.mark.parametrize(("name", "two_step"), [*((n, False) for n in FORMATS), *((n, True) for n in FOLDERS)])
def test_kill_at_every_step(tmp_path: Path, sources: Callable[[str], tuple[str, str]], name: str,
                            two_step: bool) -> None:
    fmt = FORMATS[name]
    srcs = sources(name)
    refs = []
    for i, src in enumerate(srcs):  # what each source's export holds
        fmt.export(src, str(tmp_path / f"ref{i}" / fmt.target), False)
        refs.append({u: snapshot(p) for u, p in fmt.unit_paths(tmp_path / f"ref{i}").items()})
    out = tmp_path / "out"
    target = str(out / fmt.target)
    fmt.export(srcs[0], target, False)
    current, counts, step = 0, collections.Counter(), 0
    while True:
        step += 1
        new = 1 - current
        before = {u: snapshot(p) for u, p in fmt.unit_paths(out).items()}
        pid = fork(functools.partial(_kill_at, step, two_step, functools.partial(fmt.export, srcs[new], target, True)))
        status = reap(pid, CHILD_TIMEOUT)
        assert status is not None, f"step {step}: the export hung"
        if os.WIFEXITED(status):  # past the last step: the export finished
            assert os.WEXITSTATUS(status) == 0, f"step {step}: the export failed"
            assert all(is_new(snapshot(p), refs[new][u], before[u], fmt.fresh)
                       for u, p in fmt.unit_paths(out).items())
            assert leftovers(out, fmt) == []
            break
        assert os.WTERMSIG(status) == signal.SIGKILL
        for unit, path in fmt.unit_paths(out).items():
            got = snapshot(path)
            if got is None:  # only between the two renames of the two-step swap
                assert two_step, f"step {step}: {unit} is missing"
                clean_leftovers(str(path))
                got = snapshot(path)
                counts["missing, old renamed back"] += 1
                assert got == before[unit], f"step {step}: {unit} was not restored"
            elif got == before[unit]:
                counts["old"] += 1
            else:
                assert is_new(got, refs[new][unit], before[unit], fmt.fresh), f"step {step}: {unit} is mixed"
                counts["new"] += 1
        fmt.export(srcs[new], target, True)  # the next export recovers, and leaves nothing beside
        assert all(is_new(snapshot(p), refs[new][u], before[u], fmt.fresh) for u, p in fmt.unit_paths(out).items())
        assert leftovers(out, fmt) == [], f"step {step}"
        current = new
    print(f"{name}{' two-step' if two_step else ''}: {step - 1} kill points: {dict(counts)}")
    assert step - 1 >= 5 and counts["old"] and counts["new"]


@pytest.mark.parametrize("name", list(FORMATS))
def test_existing_target_refused_then_replaced(tmp_path: Path, sources: Callable[[str], tuple[str, str]],
                                               name: str) -> None:
    fmt = FORMATS[name]
    a, b = sources(name)
    out = tmp_path / "out"
    target = str(out / fmt.target)
    fmt.export(a, target, False)
    before = snapshot(out)
    with pytest.raises(rs.CheckpointExistsError, match=rf"^{re.escape(target)}.* already exists; overwrite=True "
                                                       r"\(--overwrite on the command line\) replaces it whole"):
        fmt.export(b, target, False)
    assert snapshot(out) == before
    fmt.export(b, target, True)
    assert snapshot(out) != before and leftovers(out, fmt) == []


@pytest.mark.parametrize("name", list(FORMATS))
def test_cli_refuses_then_overwrites(tmp_path: Path, sources: Callable[[str], tuple[str, str]], name: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.store.cli import main

    fmt = FORMATS[name]
    a, b = sources(name)
    target = str(tmp_path / "out" / fmt.target)
    (tmp_path / "strategy.json").write_bytes(dump_strategy(MS_STRATEGY))
    extra = [*fmt.cli[1:], *(["--strategy", str(tmp_path / "strategy.json")] if name == "mindspore" else [])]
    assert main(["export", fmt.cli[0], a, target, *extra]) == 0
    before = snapshot(tmp_path / "out")
    capsys.readouterr()
    assert main(["export", fmt.cli[0], b, target, *extra]) == 1
    err = capsys.readouterr().err
    assert target in err and "--overwrite" in err and snapshot(tmp_path / "out") == before
    assert main(["export", fmt.cli[0], b, target, *extra, "--overwrite"]) == 0
    assert snapshot(tmp_path / "out") != before and leftovers(tmp_path / "out", fmt) == []


def _import(name: str, src: str, dst: str) -> rs.Checkpoint:
    from reshard.store.frontends.deepspeed import import_deepspeed
    from reshard.store.frontends.huggingface import import_safetensors
    from reshard.store.frontends.megatron import import_megatron

    {"deepspeed": import_deepspeed, "megatron": import_megatron, "hf-folder": import_safetensors}[name](src, dst)
    return rs.open(dst)


@pytest.mark.parametrize("name", ["hf-folder", "deepspeed", "megatron"])
def test_import_reads_what_a_killed_two_step_swap_set_aside(tmp_path: Path, sources: Callable[[str], tuple[str, str]],
                                                            name: str) -> None:
    """Killed between the two renames, the target is missing: an import reads the old export set aside (with a
    warning), renaming nothing; clean_leftovers, which the next export runs first, puts it back."""
    fmt = FORMATS[name]
    a, b = sources(name)
    out = tmp_path / "out"
    target = out / fmt.target
    fmt.export(a, str(target), False)
    before = snapshot(target)
    for step in range(1, 20):
        pid = fork(functools.partial(_kill_at, step, True, functools.partial(fmt.export, b, str(target), True)))
        status = reap(pid, CHILD_TIMEOUT)
        assert status is not None and os.WIFSIGNALED(status), f"step {step}: no kill left the target missing"
        if not target.exists():
            break
    listing = sorted(os.listdir(out))
    with pytest.warns(UserWarning, match=r"is missing: an export over it was killed"):
        got = _import(name, str(target), str(tmp_path / "got"))
    assert sorted(os.listdir(out)) == listing  # read only
    fmt.export(a, str(tmp_path / "ref"), False)
    want = _import(name, str(tmp_path / "ref"), str(tmp_path / "want"))
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_array_equal(got[n].read(), want[n].read(), err_msg=n)
    clean_leftovers(str(target))
    assert snapshot(target) == before and leftovers(out, fmt) == []


def test_only_an_exports_own_leftovers_are_removed(tmp_path: Path) -> None:
    """clean_leftovers removes ``.NAME.partial-<12 hex>`` and ``.NAME.old-<12 hex>`` of dead exports only: not
    look-alike names, not another target's, not the staging a running export holds."""
    import fcntl

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "f").write_text("kept")
    keep = [".m.partial-xyz", ".m.old-0123", ".mm.partial-0123456789ab", "m.partial-0123456789ab",
            ".m.partial-0123456789ab.x", "other"]
    for name in keep:
        (tmp_path / name).write_text("x")
    dead = [tmp_path / ".m.partial-bbbbbbbbbbbb", tmp_path / ".m.old-cccccccccccc"]
    for path in dead:
        path.mkdir()
        (path / "f").write_text("x")
    live = tmp_path / ".m.partial-aaaaaaaaaaaa"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running export holds its staging
        assert sorted(clean_leftovers(str(tmp_path / "m"))) == sorted(map(str, dead))
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted([*keep, "m", live.name])
    assert (tmp_path / "m" / "f").read_text() == "kept"


def test_kinds_and_empty_folders(tmp_path: Path) -> None:
    """A folder export never replaces a file, nor a file export a folder (even with overwrite); an empty folder
    holds no export: it is replaced without overwrite."""
    from reshard.store.io.replace import replacing

    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    with pytest.raises(NotADirectoryError), replacing(str(tmp_path / "file"), overwrite=True, folder=True):
        pass
    with pytest.raises(IsADirectoryError), replacing(str(tmp_path / "folder"), overwrite=True, folder=False):
        pass
    with replacing(str(tmp_path / "folder"), overwrite=False, folder=True) as staging:
        Path(staging, "new").write_text("y")
    assert os.listdir(tmp_path / "folder") == ["new"] and sorted(os.listdir(tmp_path)) == ["file", "folder"]
    with pytest.raises(RuntimeError), replacing(str(tmp_path / "folder"), overwrite=True, folder=True) as staging:
        Path(staging, "half").write_text("z")
        raise RuntimeError("the export failed")
    assert os.listdir(tmp_path / "folder") == ["new"] and sorted(os.listdir(tmp_path)) == ["file", "folder"]

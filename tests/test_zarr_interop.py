"""Plain zarr-python reads reshard's bfloat16/float8 arrays (issue 14 item 1).

reshard declares its zarr data types under the ``zarr.data_type`` entry-point group.
zarr-python >= 3.4.1 loads that group on its own; 3.0 to 3.4.0 collect it but never
load it, so there a process needs ``import reshard.store`` first. Each test runs
in a fresh interpreter that imports only zarr and checks whichever of the two
behaviours the installed zarr promises (README, "Which tools read what").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from importlib.metadata import entry_points, version
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.format.zarr_dtypes import ZARR_DTYPES

from tests.paths import zarr_root

ROOT = Path(__file__).resolve().parents[1]
FIRST_LOADING = (3, 4, 1)  # the first zarr-python release that loads zarr.data_type entry points

#: Run in a fresh interpreter: argv[1] is the save's zarr folder. Imports zarr and
#: nothing of reshard; prints, per array, its bytes as hex or the error it raised.
PROBE = r"""
import json, sys
import zarr
root = sys.argv[1]
out = {"zarr": zarr.__version__, "arrays": {}}
for path in ("model/embed/weight", "model/f8a", "model/f8b"):
    try:
        a = zarr.open_array(f"{root}/{path}", mode="r")
        out["arrays"][path] = {"dtype": str(a.dtype), "hex": a[...].tobytes().hex()}
    except Exception as e:
        out["arrays"][path] = {"error": f"{type(e).__name__}: {e}"}
out["reshard_imported"] = "reshard.store" in sys.modules
if len(sys.argv) > 2 and "error" not in out["arrays"]["model/embed/weight"]:
    import dask.array as da
    x = da.from_zarr(f"{root}/model/embed/weight")
    out["dask_sum"] = float(x.astype("float64").sum().compute())
print(json.dumps(out))
"""

#: Same, after ``import reshard.store`` (the way for zarr < 3.4.1).
PROBE_REGISTERED = "import reshard.store\n" + PROBE


def _zarr_loads_entry_points(zarr_version: str) -> bool:
    parts = tuple(int(p) for p in zarr_version.split(".")[:3] if p.isdigit())
    return parts >= FIRST_LOADING


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    """A committed checkpoint with one bfloat16 and two float8 tensors, saved by 2 ranks."""
    rng = np.random.default_rng(14)
    truth = {
        "model/embed/weight": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
        "model/f8a": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "model/f8b": rng.standard_normal((3, 5)).astype(ml_dtypes.float8_e5m2),
    }
    url = str(tmp_path_factory.mktemp("interop") / "ck")
    state = {"model": {"embed": {"weight": truth["model/embed/weight"]},
                       "f8a": truth["model/f8a"], "f8b": truth["model/f8b"]}, "step": 3}
    layouts = {
        "model.embed.weight": Layout.from_dtensor((2,), ["S(0)"], (8, 6)),
        "model.f8a": Layout.from_dtensor((2,), ["S(1)"], (4, 4)),
        "model.f8b": Layout.from_dtensor((2,), ["R"], (3, 5)),
    }
    rs.save(state, url, layouts, form="directory")  # plain zarr opens the folder (packed: tests/test_packed.py)
    return str(zarr_root(url)), truth


def _run(python: str, script: str, *args: str, timeout: float = 120) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_reads(result: dict, truth: dict[str, np.ndarray]) -> None:
    for path, want in truth.items():
        got = result["arrays"][path]
        assert "error" not in got, f"{path}: {got}"
        assert got["dtype"] == str(want.dtype)
        assert got["hex"] == want.tobytes().hex(), path


def _check_documented(result: dict, truth: dict[str, np.ndarray]) -> None:
    """zarr >= 3.4.1 reads every array by itself; older zarr names the missing data type."""
    if _zarr_loads_entry_points(result["zarr"]):
        _check_reads(result, truth)
        assert result["reshard_imported"]  # zarr loaded reshard's data types through the entry points
    else:
        for path, want in truth.items():
            err = result["arrays"][path].get("error", "")
            assert "No Zarr data type found" in err and str(want.dtype) in err, (path, err)
        assert not result["reshard_imported"]


def test_entry_points_declare_every_extra_dtype() -> None:
    found = {e.name: e for e in entry_points(group="zarr.data_type") if e.value.startswith("reshard.")}
    assert set(found) == set(ZARR_DTYPES) == {"bfloat16", "float8_e4m3fn", "float8_e5m2"}
    for name, ep in found.items():
        cls = ep.load()
        assert cls is ZARR_DTYPES[name] and cls._zarr_v3_name == name


def test_plain_zarr_in_a_new_process(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    root, truth = saved
    result = _run(sys.executable, PROBE, root, "dask")
    assert result["zarr"] == version("zarr")
    _check_documented(result, truth)
    if _zarr_loads_entry_points(result["zarr"]):
        want = float(truth["model/embed/weight"].astype(np.float64).sum())
        assert result["dask_sum"] == pytest.approx(want, rel=1e-12)


def test_zarr_after_import_reshard_store(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    root, truth = saved
    _check_reads(_run(sys.executable, PROBE_REGISTERED, root), truth)


@pytest.mark.parametrize("form", ["directory", "packed"])
def test_xarray_opens_the_checkpoint_as_a_tree(saved: tuple[str, dict[str, np.ndarray]], form: str,
                                               tmp_path: Path) -> None:
    """Issue 14 item 2: every array names its dimensions ``<tensor>.<axis>``, unique per tensor."""
    xr = pytest.importorskip("xarray")
    root, truth = saved
    if form == "packed":  # the same save in the packed form, read through Checkpoint.zarr_store()
        rs.convert(str(Path(root).parent), str(tmp_path / "packed"), form="packed")
        root = rs.open(str(tmp_path / "packed")).zarr_store()
    tree = xr.open_datatree(root, engine="zarr")
    weight = tree["model/embed"].dataset["weight"]
    assert weight.dims == ("model.embed.weight.0", "model.embed.weight.1")
    assert weight.dtype == truth["model/embed/weight"].dtype
    assert weight.values.tobytes() == truth["model/embed/weight"].tobytes()
    assert tree.attrs["reshard"]["leaves"] == {"step": 3}
    # f8a (4, 4) and f8b (3, 5) share a group: their own dimension names keep the sizes apart
    model = xr.open_zarr(root, group="model")  # consolidated metadata (in every save's root document)
    assert dict(model.sizes) == {"model.f8a.0": 4, "model.f8a.1": 4, "model.f8b.0": 3, "model.f8b.1": 5}
    assert model["f8b"].values.tobytes() == truth["model/f8b"].tobytes()


@pytest.mark.installs
def test_fresh_venv_installs_reshard_alone_and_zarr_reads_bf16(
    saved: tuple[str, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """``pip install reshard`` (no extras) into a new venv; plain zarr there reads bfloat16.

    pip resolves reshard's dependencies from the configured index, so zarr is the
    newest release reshard allows on this Python. Set RESHARD_SKIP_INSTALLS=1 to skip
    where no package index can be reached.
    """
    if os.environ.get("RESHARD_SKIP_INSTALLS"):
        pytest.skip("RESHARD_SKIP_INSTALLS is set")
    root, truth = saved
    src, env_dir = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    for part in ("pyproject.toml", "README.md", "layouts", "store"):  # a copy: no build/ left in the tree
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy)(ROOT / part, src / part)
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    result = _run(python, PROBE, root)
    _check_documented(result, truth)
    _check_reads(_run(python, PROBE_REGISTERED, root), truth)


# ----------------------------------------------- no folder reads fill values (issue 23 item 1)
def _numbered_state() -> dict[str, np.ndarray]:
    """Values that are nowhere zero: an array read as its fill value cannot pass for them."""
    return {"model.w": np.arange(1, 13, dtype=np.float32).reshape(3, 4),
            "model.layer0.bias": np.arange(1, 9, dtype=ml_dtypes.bfloat16),
            "step_table": np.arange(5, 11, dtype=np.int64).reshape(2, 3)}


def _what_plain_zarr_finds(root: Path) -> dict[str, np.ndarray]:
    """Every array plain zarr-python opens in any folder under ``root``, by ``folder::array path``, read whole."""
    import zarr

    found: dict[str, np.ndarray] = {}
    for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        try:
            node = zarr.open(str(folder), mode="r")
        except FileNotFoundError:  # zarr's NodeNotFoundError: nothing zarr recognises here
            continue
        where = folder.relative_to(root).as_posix()
        members = [("", node)] if isinstance(node, zarr.Array) else node.members(max_depth=None)
        for path, member in members:
            if isinstance(member, zarr.Array):
                found[f"{where}::{path}"] = member[...]
    return found


@pytest.mark.parametrize("form", ["directory", "packed"])
def test_no_folder_of_a_save_reads_as_fill_values(form: str, tmp_path: Path) -> None:
    """A packed save's folder held a root ``zarr.json`` (every array's metadata) and no chunk objects: zarr-python
    opened it and read every array as zeros, without an error. Now whatever plain zarr opens anywhere in a
    checkpoint (here and in a moved copy) reads the saved values, and a packed save's ``zarr_url`` refuses,
    naming ``zarr_store()``, which reads them."""
    import zarr

    state = _numbered_state()
    layouts = {n: Layout.from_dtensor((2,), ["S(0)"], a.shape) for n, a in state.items()}
    url = tmp_path / "ck"
    rs.save(state, str(url), layouts, form=form)
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(url, moved)
    shutil.rmtree(url)  # the copy must not lean on the original
    ckpt = rs.open(str(moved))
    assert ckpt.form == form
    for name, want in state.items():
        assert ckpt[name].read().tobytes() == want.tobytes(), name
    found = _what_plain_zarr_finds(moved)
    gen = Path(ckpt.storage.url).relative_to(moved).as_posix()
    for key, got in found.items():
        where, path = key.split("::")
        name = ".".join(p for p in f"{where}/{path}".removeprefix(f"{gen}").split("/") if p)
        assert got.tobytes() == ckpt[name].read().tobytes(), f"plain zarr at {key} reads other values ({got!r})"
    if form == "directory":
        assert {k.split("::")[1] for k in found if k.startswith(f"{gen}::")} == {
            "model/w", "model/layer0/bias", "step_table"}  # the save's folder is the whole hierarchy
        group = zarr.open_group(ckpt.zarr_url, mode="r")
        assert group["model/w"][...].tobytes() == state["model.w"].tobytes()
    else:
        assert found == {}  # nothing under a packed checkpoint looks like a zarr hierarchy
        with pytest.raises(rs.FormatError, match=r"packed form.*zarr_store\(\)"):
            ckpt.zarr_url  # noqa: B018
    group = zarr.open_group(ckpt.zarr_store(), mode="r")  # either form, from the moved copy
    for name, want in state.items():
        assert group[name.replace(".", "/")][...].tobytes() == want.tobytes(), name

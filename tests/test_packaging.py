"""pyproject's dependencies and extras match what the code imports (issue 14 item 5).

* a module-level import anywhere in ``layouts/`` or ``store/`` is a core dependency
  (``pip install reshard`` alone must be able to import every module);
* an import inside a function names a package its extra declares (``OPTIONAL``);
* the notebooks run with ``reshard[notebooks]``: every package they import, and every
  package the reshard modules they import need, is in that extra's closure;
* each extra's packages are used by what it is for (no dead entries);
* ``pip install "reshard[s3]" "moto[server]"`` resolves (marker ``installs``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: Where a third-party import (top-level module name) may come from: its extra and distribution.
OPTIONAL = {
    "torch": ("torch", "torch"),
    "jax": ("jax", "jax"),
    "orbax": ("jax", "orbax-checkpoint"),
    "etils": ("jax", "etils"),
    "distributed": ("dask", "distributed"),
    "tqdm": ("dask", "tqdm"),
    "matplotlib": ("notebooks", "matplotlib"),
    "s3fs": ("s3", "s3fs"),
    "moto": ("testing", "moto"),
    "boto3": ("testing", "boto3"),
    "botocore": ("testing", "botocore"),
    "cheroot": ("testing", "cheroot"),
    "pyarrow": ("parquet", "pyarrow"),
    "pandas": ("parquet", "pandas"),
}
#: Modules that only run with an extra installed, and are never imported by ``import reshard.store``:
#: their module-level imports belong to that extra (a DCP storage plugin subclasses torch's classes).
OPTIONAL_MODULES = {"store/frontends/torch/plugin.py": "torch"}
#: Core import name -> distribution, where they differ.
CORE_NAMES = {"dask": "dask", "ml_dtypes": "ml-dtypes"}
#: Used without an import statement: fsspec loads s3fs for s3:// URLs; aiobotocore is s3fs's
#: client, pinned so the line above resolves; the kernel, runner and reader of notebooks.
USED_INDIRECTLY = {"s3fs", "aiobotocore", "ipykernel", "nbclient", "nbformat", "xarray"}


def _name(req: str) -> str:
    """Normalised distribution name of a requirement string."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0]).lower()


def _closure(extra: str) -> set[str]:
    """Distribution names an extra brings, following ``reshard[...]`` self-references."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    out: set[str] = set()
    todo, seen = [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for req in extras[e]:
            if _name(req) == "reshard":
                todo.extend(x.strip() for x in req.split("[", 1)[1].rstrip("]").split(","))
            else:
                out.add(_name(req))
    return out


CORE = {_name(r) for r in PYPROJECT["project"]["dependencies"]}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """Third-party top-level modules a file imports: (at module level, inside functions)."""
    tree = ast.parse(path.read_text())
    top, inner = set(), set()
    body_ids = {id(n) for stmt in tree.body for n in ast.walk(stmt)
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
        for name in names:
            root = name.split(".")[0]
            if root in sys.stdlib_module_names or root in ("reshard", "__future__"):
                continue
            (top if id(node) in body_ids else inner).add(root)
    return top, inner


def _code_files() -> list[Path]:
    return sorted(p for d in ("layouts", "store") for p in (ROOT / d).rglob("*.py"))


def _dist(module: str) -> str:
    return CORE_NAMES.get(module) or OPTIONAL.get(module, (None, module))[1]


def test_module_level_imports_are_core_dependencies() -> None:
    bad = set()
    for p in _code_files():
        extra = OPTIONAL_MODULES.get(str(p.relative_to(ROOT)))
        allowed = CORE | (_closure(extra) if extra else set())
        bad |= {f"{p.relative_to(ROOT)}: {m}" for m in _imports(p)[0] if _name(_dist(m)) not in allowed}
    assert not bad, f"imported when the module loads but not a core dependency: {sorted(bad)}"


def test_function_imports_are_in_their_extra() -> None:
    for path in _code_files():
        for module in _imports(path)[1]:
            if _name(_dist(module)) in CORE:
                continue
            assert module in OPTIONAL, f"{path.relative_to(ROOT)} imports {module}: name its extra in OPTIONAL"
            extra, dist = OPTIONAL[module]
            assert _name(dist) in _closure(extra), f"{path.relative_to(ROOT)} imports {module}: [{extra}] lacks {dist}"


def _notebook_imports(path: Path) -> set[str]:
    nb = json.loads(path.read_text())
    found: set[str] = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        src = "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    return found


def _module_files(module: str) -> list[Path]:
    """The source files of a reshard module (a package: the files of its folder, not of sub-packages)."""
    rel = module.split(".")[1:]
    base = ROOT.joinpath(*rel)
    if base.is_dir():
        return sorted(base.glob("*.py"))
    return [base.with_suffix(".py")] if base.with_suffix(".py").exists() else []


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_notebooks_extra_brings_what_the_notebooks_import(notebook: str) -> None:
    have = CORE | _closure("notebooks") | {"ipython"}  # IPython comes with ipykernel
    missing = set()
    for module in _notebook_imports(ROOT / "notebooks" / notebook):
        root = module.split(".")[0]
        if root in sys.stdlib_module_names:
            continue
        if root == "reshard":
            for path in _module_files(module):  # what that part of reshard imports, even lazily
                top, inner = _imports(path)
                missing |= {f"{module} needs {m}" for m in top | inner if _name(_dist(m)) not in have}
        elif _name(_dist(root)) not in have:
            missing.add(root)
    assert not missing, f"{notebook}: reshard[notebooks] does not bring {sorted(missing)}"


def test_every_extra_entry_is_used() -> None:
    imported = {m for p in _code_files() for part in _imports(p) for m in part}
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        imported |= {m.split(".")[0] for m in _notebook_imports(nb)}
    used = {_name(_dist(m)) for m in imported} | USED_INDIRECTLY
    for extra in ("s3", "dask", "torch", "jax", "notebooks", "testing"):
        unused = _closure(extra) - used - CORE
        assert not unused, f"[{extra}] declares {sorted(unused)}, which nothing imports"


def test_torch_extra_is_a_range() -> None:
    (torch,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["torch"] if _name(r) == "torch"]
    assert "==" not in torch and ">=" in torch and "<" in torch, torch


@pytest.mark.installs
def test_s3_and_moto_server_resolve_in_one_pip_command(tmp_path: Path) -> None:
    """The line docs/cloud.md gives, ``pip install "reshard[s3]" "moto[server]"``, resolves.

    A dry run in a new virtual environment against the configured index (the
    resolver's answer, nothing installed). Needs the package index; set
    RESHARD_SKIP_INSTALLS=1 to skip.
    """
    if os.environ.get("RESHARD_SKIP_INSTALLS"):
        pytest.skip("RESHARD_SKIP_INSTALLS is set")
    src, env_dir, report = tmp_path / "src", tmp_path / "venv", tmp_path / "report.json"
    src.mkdir()
    for part in ("pyproject.toml", "README.md", "layouts", "store"):  # a copy: no build/ left in the tree
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy)(ROOT / part, src / part)
    venv.create(env_dir, with_pip=False)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "--dry-run",
         "--quiet", "--report", str(report), f"{src}[s3]", "moto[server]"],
        capture_output=True, text=True, timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = {_name(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert {"s3fs", "aiobotocore", "botocore", "boto3", "moto"} <= set(got)
    assert got["boto3"] == got["botocore"]  # boto3 pins its botocore exactly; aiobotocore accepted it


def test_every_package_folder_is_in_the_wheel() -> None:
    # a folder with an __init__.py that pyproject's packages list lacks is left out of the wheel: imports pass in
    # a checkout and fail once installed (reshard.layouts.presets did, 2026-11-29)
    dirs = {(ROOT / folder).resolve(): pkg for pkg, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}
    found = set()
    for init in [*(ROOT / "layouts").rglob("__init__.py"), *(ROOT / "store").rglob("__init__.py")]:
        home = max((d for d in dirs if init.parent == d or d in init.parent.parents), key=lambda d: len(d.parts))
        found.add(".".join([dirs[home], *init.parent.relative_to(home).parts]))
    assert found == set(PYPROJECT["tool"]["setuptools"]["packages"])

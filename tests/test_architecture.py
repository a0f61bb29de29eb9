"""The shape of the code: ``layouts`` is pure math, ``store`` imports flow one way.

Imports are read from the source (module level and inside functions; imports
under ``if TYPE_CHECKING:`` are annotations only and do not count).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]




def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["reshard", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module(p): p for top in ("store", "layouts") for p in (ROOT / top).rglob("*.py")}
MODULES = set(FILES)


def _runtime_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & MODULES
            found.update(submodules or {target})  # `from .io import pool` imports the module, not io's __init__
    return found


def _graph() -> dict[str, set[str]]:
    files, known = FILES, MODULES

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for i in _runtime_imports(p) if (o := owner(i)) and o != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if not state.get(nxt) and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for n in sorted(graph):
        if not state.get(n) and (found := visit(n)):
            return found
    return None


def test_layouts_never_imports_store():
    graph = _graph()
    bad = {m: sorted(t for t in ts if t.startswith("reshard.store")) for m, ts in graph.items()
           if m.startswith("reshard.layouts")}
    assert not {m: ts for m, ts in bad.items() if ts}


@pytest.mark.parametrize("top", ["reshard.store", "reshard.layouts"])
def test_no_import_cycles(top):
    graph = _graph()
    assert _cycle({m: ts for m, ts in graph.items() if m.startswith(top)}) is None


def test_runtime_package_does_not_import_test_servers():
    graph = _graph()
    users = sorted(m for m, ts in graph.items() if "reshard.store.testing" in ts and not m.startswith(
        "reshard.store.testing"))
    assert users == []


#: store's wings, lowest first, and the wings each may import. A wing imports only wings
#: below it; ``write`` and ``read`` sit side by side and never import each other.
WINGS = {
    "io": set(),
    "format": {"io"},
    "commit": {"io", "format"},
    "write": {"io", "format", "commit"},
    "read": {"io", "format", "commit"},
    "ops": {"io", "format", "commit", "write", "read"},
    "frontends": {"io", "format", "commit", "write", "read", "ops"},
    "manager": {"io", "format", "commit", "write", "read", "ops", "frontends"},
    "cli": {"io", "format", "commit", "write", "read", "ops", "frontends", "manager"},
    "testing": set(),
}


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["reshard", "store"] else None


def test_every_store_module_sits_in_a_wing():
    loose = sorted(m for m in MODULES if m.startswith("reshard.store.") and _wing(m) not in WINGS)
    assert loose == [], "store/ modules outside the wings; add them to a wing folder (or WINGS)"


def _wing_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if (w := _wing(m)) in WINGS
                  for t in ts if (tw := _wing(t)) and tw != w and tw not in WINGS[w])


def test_wings_import_only_the_wings_below():
    assert _wing_violations(_graph()) == []


def test_wing_check_reports_an_upward_import():
    graph = {"reshard.store.read.fetch": {"reshard.store.write.writer", "reshard.store.format.meta"},
             "reshard.store.format.meta": {"reshard.store.io.storage"}}
    assert _wing_violations(graph) == ["reshard.store.read.fetch -> reshard.store.write.writer"]


#: The framework folders of ``store/frontends/`` and the other framework folders each may import: its shared
#: base. DeepSpeed and Megatron-Core write ``torch.save`` pickles (``.pt``), and Megatron-Core's ``torch_dist``
#: is a DCP folder: both read them with ``torch/`` (``pt_files``, ``dcp``). MindSpore >= 2.4 writes its rank
#: files as safetensors, read with ``huggingface/`` (``read``). Any other import between frameworks is a defect.
FRAMEWORK_BASES = {"torch": set(), "deepspeed": {"torch"}, "megatron": {"torch"}, "mindspore": {"huggingface"},
                   "oneflow": set(), "huggingface": set(), "jax": set()}
#: What stays loose in ``store/frontends/``: its docs, the importers' shared checks, and ``reshard.torch``.
LOOSE_FRONTENDS = {"reshard.store.frontends", "reshard.store.frontends.sources",
                   "reshard.store.frontends.torch_namespace"}


def _framework(module: str) -> str | None:
    parts = module.split(".")
    return parts[3] if len(parts) > 3 and parts[:3] == ["reshard", "store", "frontends"] else None


def _framework_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if (fm := _framework(m)) in FRAMEWORK_BASES
                  for t in ts if (ft := _framework(t)) in FRAMEWORK_BASES and ft != fm
                  and ft not in FRAMEWORK_BASES[fm])


def test_every_frontend_module_sits_in_a_framework_folder():
    loose = sorted(m for m in MODULES if m.startswith("reshard.store.frontends") and m not in LOOSE_FRONTENDS
                   and _framework(m) not in FRAMEWORK_BASES)
    assert loose == [], "front-end modules outside the framework folders (or FRAMEWORK_BASES)"
    folders = {p.name for p in (ROOT / "store" / "frontends").iterdir() if (p / "__init__.py").exists()}
    assert folders - {"torch_namespace"} == set(FRAMEWORK_BASES)


def test_framework_folders_import_no_other_framework():
    assert _framework_violations(_graph()) == []


def test_framework_check_reports_a_cross_import():
    graph = {"reshard.store.frontends.megatron.read": {"reshard.store.frontends.torch.dcp",
                                                      "reshard.store.frontends.deepspeed.read"},
             "reshard.store.frontends.jax.orbax": {"reshard.store.frontends.sources"}}
    assert _framework_violations(graph) == ["reshard.store.frontends.megatron.read -> "
                                            "reshard.store.frontends.deepspeed.read"]

"""The code blocks of the docs run as pasted (issue 14 item 9).

Every fenced ``python`` block of a page in ``PAGES`` runs, in page order, in one
namespace per page and in a fresh working directory, as a reader pasting them one
after the other would. A block that cannot run here (it needs S3 credentials, a
cluster, a GPU) is preceded by ``<!-- docs-test: skip REASON -->`` on the line
just before its fence; the reason is required. A failure names the page and the
line in it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from reshard.layouts import Layout

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ["usage.md", "dask.md", "layouts.md"]
MARKER = re.compile(r"<!--\s*docs-test:\s*skip\b(?P<reason>.*?)-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its first code line (1-based), language, code and skip reason."""

    line: int
    lang: str
    code: str
    skip: str | None


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the skip reason of a marker right above it."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = MARKER.search(before)
        start, i = i + 1, i + 1
        while i < len(lines) and not FENCE.match(lines[i]):
            i += 1
        out.append(Block(start + 1, m["lang"], "\n".join(lines[start:i]),
                         marker["reason"].strip() if marker else None))
        i += 1
    return out


def test_blocks_parser() -> None:
    text = "# t\n```python\na = 1\n```\n<!-- docs-test: skip needs S3 -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
    got = blocks(text)
    assert [(b.line, b.lang, b.code, b.skip) for b in got] == [
        (3, "python", "a = 1", None), (7, "python", "b = 2", "needs S3"), (10, "bash", "ls", None)]


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_pasted(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "__docs__"}
    ran = 0
    for block in blocks((DOCS / page).read_text()):
        if block.lang != "python":
            continue
        if block.skip is not None:
            assert block.skip, f"docs/{page}:{block.line}: a docs-test skip marker needs a reason"
            continue
        code = compile("\n" * (block.line - 1) + block.code, str(DOCS / page), "exec")  # tracebacks: page lines
        exec(code, scope)
        ran += 1
    assert ran, f"docs/{page} has no python block that runs"
    # an example that asks for optimizer sharding shows it taking effect (issue 14 item 9:
    # opt_shard_size=-1 on dev[2,4] tmap[1,0] has no replicas to shard and did nothing)
    for value in scope.values():
        for lay in value.values() if isinstance(value, dict) else [value]:
            if isinstance(lay, Layout) and lay.opt_shard is not None:
                assert lay.opt_sharded, f"docs/{page}: {lay.describe()} asks for optimizer sharding that does nothing"


def test_every_skip_says_why() -> None:
    for page in sorted(DOCS.glob("*.md")):
        for n, line in enumerate(page.read_text().splitlines(), 1):
            m = MARKER.search(line)
            if m:
                assert m["reason"].strip(), f"{page.name}:{n}: a docs-test skip marker needs a reason"


# -------------------------------------------- the interop recipes, by values (issue 23 item 1)
ROOT = DOCS.parent
#: Every documented expression that opens a save with another tool, by page, and the storage forms it is
#: documented for. Each runs as written (``url``: the checkpoint, ``gen``: its marker's generation, ``zarr_url``)
#: and must return what reshard reads; a new recipe in these pages must be added here (test below).
RECIPES: dict[str, dict[str, tuple[str, ...]]] = {
    "README.md": {
        'zarr.open_group(rs.open(url).zarr_store(), mode="r")': ("directory", "packed"),
        'zarr.open_group(rs.open(url).zarr_url, mode="r")': ("directory",),
        'zarr.open_group(f"{url}/{gen}", mode="r")': ("directory",),
        'zarr.open_group(zarr.storage.FsspecStore.from_url("reference://", read_only=True, storage_options={"fo": '
        'f"{url}/{gen}/refs.json", "template_overrides": {"root": url}}), mode="r")': ("packed",),
        'ts.open({"driver": "zarr3", "kvstore": f"file://{url}/{gen}/model/w"}).result()': ("directory",),
        'xr.open_datatree(rs.open(url).zarr_store(), engine="zarr")': ("directory", "packed"),
    },
    "docs/format.md": {
        'zarr.open_group(zarr_url, mode="r")': ("directory",),
        '{"driver": "zarr3", "kvstore": f"file://{zarr_url}/model/layer0/weight"}': ("directory",),
        'zarr.open_group(rs.open(url).zarr_store(), mode="r")': ("directory", "packed"),
    },
}
#: What makes a backticked span a recipe of another tool.
TOOL_CALL = re.compile(r"zarr\.open_\w+\(|open_datatree\(|ts\.open\(|\"driver\": \"zarr3\"|from_zarr\(")
#: The saved state: names the recipes use, values nowhere zero (a fill value cannot pass for them).
STATE_SHAPES = {"model.w": ((4, 6), "float32"), "model.layer0.weight": ((8, 6), "bfloat16"),
                "model.layer0.bias": ((6,), "int32")}


def test_every_documented_recipe_is_tested() -> None:
    pages = ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]
    assert set(RECIPES) <= set(pages)
    for page in pages:
        recipes = RECIPES.get(page, {})
        text = (ROOT / page).read_text()
        spans = {s for s in re.findall(r"`([^`\n]+)`", text) if TOOL_CALL.search(s)}
        assert spans == set(recipes), f"{page}: recipes not in RECIPES: {sorted(spans - set(recipes))}; " \
                                      f"in RECIPES, not in the page: {sorted(set(recipes) - spans)}"


def _saved(url: Path, form: str) -> dict[str, np.ndarray]:
    import ml_dtypes
    import reshard.store as rs

    state = {n: (np.arange(np.prod(shape)) + 1).astype(ml_dtypes.bfloat16 if dt == "bfloat16" else dt).reshape(shape)
             for n, (shape, dt) in STATE_SHAPES.items()}
    layouts = {n: Layout.from_dtensor((2,), ["S(0)"], a.shape) for n, a in state.items()}
    rs.save({**state, "step": 7}, str(url), layouts, form=form)
    return state


def _values(result: object, expr: str, names: list[str]) -> dict[str, np.ndarray]:
    """What a recipe's result holds, by tensor name: every tensor of a group or tree, the one array of a
    TensorStore spec or handle (named by its path in the expression)."""
    import dask.array as da
    import tensorstore as ts
    import xarray as xr
    import zarr

    if isinstance(result, dict):  # a TensorStore spec
        result = ts.open(result).result()
    if isinstance(result, zarr.Group):
        out = {n: result[n.replace(".", "/")][...] for n in names}
        out.update({f"dask {n}": da.from_zarr(result[n.replace(".", "/")]).compute() for n in names})
        return out
    if isinstance(result, xr.DataTree):
        return {n: result["/".join(n.split(".")[:-1])].dataset[n.split(".")[-1]].values for n in names}
    if isinstance(result, ts.TensorStore):
        (name,) = [n for n in names if f"/{n.replace('.', '/')}\"" in expr]
        return {name: result.read().result()}
    raise AssertionError(f"{expr}: unexpected result {type(result).__name__}")


@pytest.mark.parametrize("form", ["directory", "packed"])
def test_documented_recipes_read_what_reshard_reads(form: str, tmp_path: Path) -> None:
    """Each recipe of README.md and docs/format.md, run as written on a save of each form, in place and on a copy
    moved to another folder, returns the values reshard reads (the packed form's folder used to read as zeros)."""
    pytest.importorskip("xarray")
    pytest.importorskip("tensorstore")
    import dask.array as da
    import reshard.store as rs
    import tensorstore as ts
    import xarray as xr
    import zarr

    state = _saved(tmp_path / "ck", form)
    moved = tmp_path / "other" / "place"
    for url in (tmp_path / "ck", moved):
        if url == moved:
            shutil.copytree(tmp_path / "ck", moved)
            shutil.rmtree(tmp_path / "ck")  # the copy must not lean on the original
        ckpt = rs.open(str(url))
        truth = {n: ckpt[n].read() for n in state}
        for name, want in state.items():
            assert truth[name].tobytes() == want.tobytes(), name
        gen = json.loads((url / ".reshard" / "commit.json").read_text())["generation"]
        scope = {"rs": rs, "zarr": zarr, "xr": xr, "ts": ts, "da": da, "url": str(url), "gen": gen}
        if form == "directory":
            scope["zarr_url"] = ckpt.zarr_url
        ran = 0
        for page, recipes in RECIPES.items():
            for expr, forms in recipes.items():
                if form not in forms:
                    continue
                got = _values(eval(expr, dict(scope)), expr, list(state))
                for key, value in got.items():
                    name = key.removeprefix("dask ")
                    assert value.dtype == truth[name].dtype and value.tobytes() == truth[name].tobytes(), \
                        f"{page}: {expr} on the {form} form at {url}: {key} = {value!r}"
                ran += 1
        if form == "packed":  # docs/format.md's python block, as pasted
            block = next(b for b in blocks((DOCS / "format.md").read_text()) if "reference://" in b.code)
            run = dict(scope)
            exec(compile("\n" * (block.line - 1) + block.code, str(DOCS / "format.md"), "exec"), run)
            want = truth["model.layer0.weight"].tobytes()
            assert run["weight"].tobytes() == want and run["lazy"].compute().tobytes() == want
            with pytest.raises(rs.FormatError, match=r"zarr_store\(\)"):
                ckpt.zarr_url  # noqa: B018
        assert ran >= 4


def test_readme_quick_start_by_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's first example, run as written (S3 swapped for a local folder, each rank's lines once per rank):
    what it loads, exports and redivides holds the saved values."""
    st = pytest.importorskip("safetensors.numpy")
    import reshard.store as rs

    monkeypatch.chdir(tmp_path)
    block = next(b for b in blocks((ROOT / "README.md").read_text()) if b.lang == "python" and "rs.create(" in b.code)
    code = block.code.replace('"s3://bucket/', f'"{tmp_path}/bucket/').replace("storage_options={...}",
                                                                              "storage_options=None")
    assert code.count(str(tmp_path)) == 3 and "{...}" not in code
    lines = code.splitlines()
    barrier = next(i for i, ln in enumerate(lines) if ln.startswith("# after a barrier"))
    later = next(i for i, ln in enumerate(lines) if ln.startswith("# later, anywhere"))

    def part(start: int, stop: int) -> object:  # tracebacks name README's lines
        return compile("\n" * (block.line - 1 + start) + "\n".join(lines[start:stop]), str(ROOT / "README.md"),
                       "exec")

    full = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024) + 1
    new_layouts = {"model.w": Layout.from_dtensor((2,), ["S(1)"], (4096, 1024))}
    for rank in range(8):  # every rank, in its own process
        local_piece = full[Layout.from_dtensor((8,), ["S(0)"], (4096, 1024)).region(rank)]
        scope: dict[str, object] = {"rank": rank, "local_piece": local_piece, "new_layouts": new_layouts}
        exec(part(0, barrier), scope)
    exec(part(barrier, later), scope)  # any one rank commits
    exec(part(later, len(lines)), scope)
    seven = Layout.from_dtensor((7,), ["S(0)"], (4096, 1024))
    assert np.array_equal(scope["mine"]["model"]["w"], full[seven.region(3)])  # type: ignore[index]
    assert np.array_equal(scope["ckpt"]["model.w"][:16].read(), full[:16])  # type: ignore[index]
    assert np.array_equal(st.load_file("model.safetensors")["model.w"], full)
    tp2 = rs.open(f"{tmp_path}/bucket/step-1000-tp2")
    assert tp2["model.w"].layout == new_layouts["model.w"] and np.array_equal(tp2["model.w"].read(), full)
    assert tp2["step"] == 1000

"""The code blocks of the docs run, as pasted or in the setting they name (issue 14 item 9, issue 37 item 3).

Every fenced ``python`` block of a page in ``PAGES`` runs, in page order, in one
namespace per page and in a fresh working directory, as a reader pasting them one
after the other would; a block followed by an unlabelled fence (its output) must
print that text. A marker on the line just before a block's fence says
otherwise, and every python block of every page and README is either run as pasted
or carries one (``test_every_python_block_is_run_or_skipped``):

* ``<!-- docs-test: setting NAME -->``: the block runs in that setting, a real job
  in which the names the page assumes (``model``, ``optimizer``, ``state``...) are
  defined as the page says; the setting checks what the blocks promise (values
  saved and loaded equal, the printed output the page shows). The blocks of one
  page and setting run in page order in one namespace. ``SETTINGS`` lists them;
  each is a function of ``tests/docsettings.py``.
* ``<!-- docs-test: covered-by tests/FILE.py::TEST -->``: a specific test runs the
  block (it reads the page's blocks with :func:`blocks` and compares values); the
  check verifies that the test exists and reads this page.
* ``<!-- docs-test: skip REASON -->``: it cannot run here (a GPU, a real cloud
  account); the reason is required.

Shell blocks (``console``, ``bash``, ``sh``, ``shell``) are never run as pasted: each needs
files, so each names a setting of tests/docshell.py (a folder holding the files its commands
name; every command runs there as written, its exit status and the output the page shows
compared, timings and save ids masked: see that module), a covered-by test, or a skip with a
reason (``test_every_block_is_run_or_skipped``).

A failure names the page and the line in it.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import docsettings
import docshell
import numpy as np
import pytest
from reshard.layouts import Layout

DOCS = Path(__file__).resolve().parents[1] / "docs"
ROOT = DOCS.parent
#: Pages whose python blocks run as pasted (those with a marker excepted).
PAGES = ["usage.md", "dask.md", "layouts.md", "huggingface.md", "mindspore.md", "oneflow.md", "torch.md"]
#: The settings a block may name, each a function ``(page, blocks, tmp_path, request)`` of tests/docsettings.py.
SETTINGS = {
    "fsdp2-tp": docsettings.fsdp2_tp,            # 4 gloo ranks: a tiny Llama, TP then FSDP2 on a (2, 2) mesh, AdamW
    "jax-8-devices": docsettings.jax_8_devices,  # one process, 8 CPU devices (XLA_FLAGS)
    "s3": docsettings.s3,                        # the loopback moto S3 server of tests/conftest.py
    "torch": docsettings.torch_one,              # one process: a tiny Llama, its checkpoint and DCP save
    "script": docsettings.script,                # the block is a file: python example.py, printing what is shown
    **docshell.SETTINGS,                         # shell blocks, each command run as written (tests/docshell.py)
}
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>skip|setting|covered-by)\b(?P<arg>.*?)-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its first code line (1-based), language, code, marker and the output shown after it.

    ``kind`` and ``arg`` are the marker's (``"skip"``/``"setting"``/``"covered-by"`` and its reason, setting or
    test), ``output`` the text of an unlabelled fence right after the block (what it prints), if any.
    """

    line: int
    lang: str
    code: str
    kind: str | None = None
    arg: str = ""
    output: str | None = None

    @property
    def skip(self) -> str | None:
        """The reason of a skip marker; None without one."""
        return self.arg if self.kind == "skip" else None

    @property
    def setting(self) -> str | None:
        return self.arg if self.kind == "setting" else None


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the marker right above it and the output right after it."""
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
        end = i
        i += 1
        nxt = next((j for j in range(i, len(lines)) if lines[j].strip()), len(lines))
        output = None
        if nxt < len(lines) and lines[nxt].strip() == "```":
            close = next((j for j in range(nxt + 1, len(lines)) if FENCE.match(lines[j])), len(lines))
            output = "\n".join(lines[nxt + 1:close])
        out.append(Block(start + 1, m["lang"], "\n".join(lines[start:end]),
                         marker["kind"] if marker else None, marker["arg"].strip() if marker else "", output))
    return out


def test_blocks_parser() -> None:
    text = ("# t\n```python\na = 1\n```\n<!-- docs-test: skip needs S3 -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
            "<!-- docs-test: setting fsdp2-tp -->\n```python\nprint(3)\n```\n\n```\n3\n```\n")
    got = blocks(text)
    assert [(b.line, b.lang, b.code, b.skip, b.setting, b.output) for b in got] == [
        (3, "python", "a = 1", None, None, None), (7, "python", "b = 2", "needs S3", None, None),
        (10, "bash", "ls", None, None, None), (14, "python", "print(3)", None, "fsdp2-tp", "3")]


def test_shell_commands_and_what_a_stale_page_shows(tmp_path: Path) -> None:
    """The shell runner: a console block's ``$`` lines (a backslash continues one) with their output, ``echo $?``
    seeing the status before it; a bash block's lines with ``# exit N: MESSAGE``; timings and save ids masked,
    any other difference fails, as does a wrong status or a missing message."""
    text = ("```console\n$ printf 'a\\nb\\n' \\\n  | tail -n 1\nb\n$ false\n$ echo $?\n1\n```\n"
            "```bash\n# a comment\nls missing   # exit 2: No such file\necho ok\n```\n")
    console, bash = blocks(text)
    assert [(c.line, c.text, c.shown, c.status) for c in docshell.commands(console)] == [
        (2, "printf 'a\\nb\\n' \\\n  | tail -n 1", "b", 0), (5, "false", None, None), (6, "echo $?", "1", 0)]
    assert [(c.line, c.text, c.status, c.message) for c in docshell.commands(bash)] == [
        (11, "ls missing   # exit 2: No such file", 2, "No such file"), (12, "echo ok", 0, "")]
    docshell.run_commands("new.md", [console, bash], tmp_path, {}, {})
    assert docshell.masked("done in 0.14 s (125 MB/s) gen-3f0b784a2d12") == ["done in <t> s (<rate>) gen-<id>"]
    assert docshell.masked("x  seconds  MB/s\n---\nsave  42.0    0.316   133") == \
        ["x  seconds  MB/s", "---", "save 42.0 <t> <rate>"]
    for stale in ("```console\n$ echo 3 tensors in 0.1 s\n4 tensors in 0.1 s\n```\n",
                  "```console\n$ false\n```\n", "```bash\nls missing  # exit 2: no such thing\n```\n"):
        with pytest.raises(AssertionError, match=r"new\.md:2"):
            docshell.run_commands("new.md", blocks(stale), tmp_path, {}, {})


def all_pages() -> list[str]:
    """README.md and every docs page, as paths from the repository root."""
    return ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_pasted(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "__docs__"}
    ran = 0
    for block in blocks((DOCS / page).read_text()):
        if block.lang != "python":
            continue
        if block.kind is not None:  # skipped, run in a setting or by another test: checked below
            continue
        docsettings.run(f"docs/{page}", block.line, block.code, scope, block.output)  # prints what it shows
        ran += 1
    assert ran, f"docs/{page} has no python block that runs"
    # an example that asks for optimizer sharding shows it taking effect (issue 14 item 9:
    # opt_shard_size=-1 on dev[2,4] tmap[1,0] has no replicas to shard and did nothing)
    for value in scope.values():
        for lay in value.values() if isinstance(value, dict) else [value]:
            if isinstance(lay, Layout) and lay.opt_shard is not None:
                assert lay.opt_sharded, f"docs/{page}: {lay.describe()} asks for optimizer sharding that does nothing"


def test_every_skip_says_why() -> None:
    for page in all_pages():
        for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            m = MARKER.search(line)
            if m:
                assert m["arg"].strip(), f"{page}:{n}: a docs-test {m['kind']} marker needs its argument"
            else:
                assert "docs-test" not in line, f"{page}:{n}: a docs-test marker that is not skip/setting/covered-by"


def _marked() -> list[tuple[str, str]]:
    """Every (page, setting) that some block names."""
    return sorted({(page, b.setting) for page in all_pages() for b in blocks((ROOT / page).read_text())
                   if b.setting is not None})


#: (page, setting) pairs that fail for a known bug of reshard outside the docs: strict, so the fix shows (XPASS
#: fails) and the entry goes.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


#: The suites' marks of the settings that need a framework.
SETTING_MARKS = {"fsdp2-tp": pytest.mark.torch, "torch": pytest.mark.torch, "script": pytest.mark.torch,
                 "jax-8-devices": pytest.mark.jax, "cli": pytest.mark.torch, "hf-files": pytest.mark.torch}


def _setting_params() -> list[object]:
    out = []
    for page, setting in _marked():
        marks = [SETTING_MARKS[setting]] if setting in SETTING_MARKS else []
        if (page, setting) in KNOWN_BUGS:
            marks.append(pytest.mark.xfail(reason=KNOWN_BUGS[page, setting], strict=True))
        out.append(pytest.param(page, setting, marks=marks))
    return out


@pytest.mark.parametrize(("page", "setting"), _setting_params())
def test_blocks_run_in_their_setting(page: str, setting: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The blocks of a page that name a setting, in page order, run there; the setting checks what they promise."""
    assert setting in SETTINGS, f"{page}: unknown docs-test setting {setting!r}; known: {sorted(SETTINGS)}"
    SETTINGS[setting](page, [b for b in blocks((ROOT / page).read_text()) if b.setting == setting], tmp_path, request)


def _covering_test(page: str, block: Block) -> str | None:
    """Why a covered-by marker does not hold (None when it does): the test must exist and read the page's blocks."""
    path, _, name = block.arg.partition("::")
    if not (ROOT / path).is_file() or not name:
        return f"no test file {path!r} (the marker reads 'covered-by tests/FILE.py::TEST')"
    tree = ast.parse((ROOT / path).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    if not found:
        return f"{path} has no test {name}"
    source = ast.get_source_segment((ROOT / path).read_text(), found[0]) or ""
    if Path(page).name not in source or "blocks(" not in source:
        return f"{path}::{name} does not read {page}'s blocks (blocks(... {Path(page).name} ...))"
    return None


def uncovered(page: str, text: str) -> list[str]:
    """What is wrong with the markers of a page's blocks: a python block neither run as pasted (its page in
    ``PAGES``) nor marked, a skip without a reason, an unknown setting, a covered-by naming no test that reads it."""
    problems = []
    for block in blocks(text):
        where = f"{page}:{block.line}"
        if block.kind == "skip" and not block.arg:
            problems.append(f"{where}: a docs-test skip marker needs a reason")
        elif block.kind == "setting" and block.arg not in SETTINGS:
            problems.append(f"{where}: unknown docs-test setting {block.arg!r} (known: {sorted(SETTINGS)})")
        elif block.kind == "covered-by" and (why := _covering_test(page, block)) is not None:
            problems.append(f"{where}: covered-by: {why}")
        elif block.kind is None and block.lang == "python" and page.removeprefix("docs/") not in PAGES:
            problems.append(f"{where}: a python block neither run nor skipped (add the page to PAGES, or a marker "
                            "'<!-- docs-test: setting NAME | covered-by tests/FILE.py::TEST | skip REASON -->')")
        elif block.kind is None and block.lang in docshell.SHELL:
            problems.append(f"{where}: a {block.lang} block neither run nor skipped (a marker '<!-- docs-test: "
                            "setting NAME | covered-by tests/FILE.py::TEST | skip REASON -->', NAME a setting of "
                            "tests/docshell.py)")
    return problems


def test_every_block_is_run_or_skipped() -> None:
    """Every python block of README.md and docs/*.md runs as pasted, runs in a known setting, is run by a named
    test, or is skipped with a reason, and so does every shell block (``console``, ``bash``, ``sh``, ``shell``;
    never run as pasted: each needs a setting's files): a new block without any of these fails here."""
    problems = [p for page in all_pages() for p in uncovered(page, (ROOT / page).read_text())]
    assert not problems, "\n".join(problems)


def test_uncovered_blocks_are_found() -> None:
    readme = "tests/test_docs.py::test_readme_quick_start_by_values"
    text = ("```python\na = 1\n```\n<!-- docs-test: setting nowhere -->\n```python\nb = 2\n```\n"
            f"<!-- docs-test: covered-by {readme} -->\n```python\nc = 3\n```\n"
            "<!-- docs-test: covered-by tests/test_docs.py::test_nothing -->\n```python\nd = 4\n```\n"
            "<!-- docs-test: setting s3 -->\n```python\ne = 5\n```\n```bash\nls\n```\n"
            "<!-- docs-test: skip needs a GPU -->\n```console\n$ nvidia-smi\n```\n```json\n{}\n```\n")
    assert [p.split(": ", 1)[0] for p in uncovered("docs/new.md", text)] == [
        "docs/new.md:2", "docs/new.md:6", "docs/new.md:10", "docs/new.md:14", "docs/new.md:21"]  # c's test
    assert [p.split(": ", 1)[0] for p in uncovered("README.md", text)] == [  # does not read new.md
        "README.md:2", "README.md:6", "README.md:14", "README.md:21"]
    assert uncovered("docs/usage.md", text)[0].startswith("docs/usage.md:6: unknown docs-test setting")


# -------------------------------------------- the interop recipes, by values (issue 23 item 1)
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

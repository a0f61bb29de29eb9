"""The code blocks of the docs run as pasted (issue 14 item 9).

Every fenced ``python`` block of a page in ``PAGES`` runs, in page order, in one
namespace per page and in a fresh working directory, as a reader pasting them one
after the other would. A block that cannot run here (it needs S3 credentials, a
cluster, a GPU) is preceded by ``<!-- docs-test: skip REASON -->`` on the line
just before its fence; the reason is required. A failure names the page and the
line in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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

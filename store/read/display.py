"""Pictures and HTML for notebooks: shard maps, checkpoint and tensor tables.

:func:`shard_map_svg` draws how a tensor is divided across ranks: one
rectangle per block of the layout (the first two dims of an n-d tensor, a bar
for a vector), coloured by the rank that writes it and labelled with every
rank that holds it. ``Checkpoint._repr_html_`` and ``LazyTensor._repr_html_``
call :func:`checkpoint_html` and :func:`tensor_html`.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

from reshard.layouts import Layout

if TYPE_CHECKING:
    from .checkpoint import Checkpoint, LazyTensor

Region = tuple[slice, ...]
#: Soft fill colours, one per writing rank (cycled).
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
           "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")
MAX_ROWS = 200


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def ranks_label(ranks: tuple[int, ...] | list[int]) -> str:
    """Short label of a block's holders: ``r3``, ``r0,4``, ``r0-7``, ``r0,2,...(+6)``."""
    r = list(ranks)
    if len(r) > 2 and r == list(range(r[0], r[0] + len(r))):
        return f"r{r[0]}-{r[-1]}"
    if len(r) <= 3:
        return "r" + ",".join(map(str, r))
    return f"r{r[0]},{r[1]},...(+{len(r) - 2})"


def _plane(shape: tuple[int, ...], region: Region) -> tuple[int, int, int, int]:
    """(row0, row1, col0, col1) of a region on the drawn plane (first two dims)."""
    if len(shape) == 0:
        return 0, 1, 0, 1
    if len(shape) == 1:
        return 0, 1, region[0].start, region[0].stop
    return region[0].start, region[0].stop, region[1].start, region[1].stop


def shard_cells(layout: Layout) -> tuple[int, int, list[tuple[int, int, int, int, tuple[int, ...]]]]:
    """Rows, cols and the cells to draw: ``(row0, row1, col0, col1, ranks)``.

    One cell per block for 0-d, 1-d and 2-d layouts. For n-d layouts blocks
    that cover the same area of the first two dims are drawn as one cell
    holding all their ranks.
    """
    shape = tuple(layout.shape)
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1]) if shape else (1, 1)
    cells: dict[tuple[int, int, int, int], list[int]] = {}
    for block in layout.blocks():
        held = cells.setdefault(_plane(shape, block.region), [])
        held += [r for r in block.ranks if r not in held]
    return rows, cols, [(*k, tuple(v)) for k, v in cells.items()]


def _size(rows: int, cols: int, ndim: int, size: int) -> tuple[float, float]:
    if ndim < 2:
        return float(size), 28.0 if ndim == 1 else float(size) / 3
    ratio = rows / max(cols, 1)
    if ratio >= 1:
        return size / min(ratio, 4.0), float(size)
    return float(size), size * max(ratio, 0.15)


def shard_map_svg(layout: Layout, *, size: int = 240, caption: str | None = None,
                  highlight: Region | None = None) -> str:
    """An SVG picture of how a tensor is divided across ranks.

    Parameters
    ----------
    layout : Layout
        The layout to draw.
    size : int
        Pixels of the longer side of the drawing.
    caption : str, optional
        Text under the drawing (default: shape and ``layout.describe()``).
    highlight : tuple of slice, optional
        A global region to outline (dashed), e.g. what a reader asked for.

    Returns
    -------
    str
        An ``<svg>`` document with one ``<rect>`` per drawn cell (one per block
        up to 2-d; see :func:`shard_cells`) and nothing else drawn as a rect.
    """
    rows, cols, cells = shard_cells(layout)
    w, h = _size(rows, cols, layout.ndim, size)
    pad, text_h = 4, 16
    caption = caption if caption is not None else f"{list(layout.shape)}  {layout.describe()}"
    width = max(w + 2 * pad, 7 * len(caption) * 0.9)
    height = h + 2 * pad + text_h
    sx, sy = w / max(cols, 1), h / max(rows, 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.1f} {height:.1f}" font-family="sans-serif" font-size="10">']
    labels = []
    for r0, r1, c0, c1, ranks in cells:
        x, y = pad + c0 * sx, pad + r0 * sy
        cw, ch = max((c1 - c0) * sx, 0.5), max((r1 - r0) * sy, 0.5)
        where = f"{r0}:{r1}, {c0}:{c1}" if layout.ndim >= 2 else f"{c0}:{c1}" if layout.ndim else ""
        tip = f"[{where}] held by ranks {list(ranks)} (rank {ranks[0]} writes it)"
        out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{cw:.2f}" height="{ch:.2f}" '
                   f'fill="{PALETTE[ranks[0] % len(PALETTE)]}" stroke="#333" stroke-width="0.6">'
                   f"<title>{html.escape(tip)}</title></rect>")
        label = ranks_label(ranks)
        if cw >= 6.2 * len(label) + 2 and ch >= 11:
            labels.append(f'<text x="{x + cw / 2:.2f}" y="{y + ch / 2 + 3.5:.2f}" text-anchor="middle">'
                          f"{html.escape(label)}</text>")
    if highlight is not None:
        r0, r1, c0, c1 = _plane(tuple(layout.shape), highlight)
        x0, y0, x1, y1 = pad + c0 * sx, pad + r0 * sy, pad + c1 * sx, pad + r1 * sy
        out.append(f'<polygon points="{x0:.2f},{y0:.2f} {x1:.2f},{y0:.2f} {x1:.2f},{y1:.2f} {x0:.2f},{y1:.2f}" '
                   'fill="none" stroke="#d62728" stroke-width="2" stroke-dasharray="4,2"/>')
    out += labels
    out.append(f'<text x="{pad}" y="{h + 2 * pad + 11:.2f}" fill="#444">{html.escape(caption)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def shard_map_png(layout: Layout, path: str, *, title: str | None = None, dpi: int = 100) -> str:
    """Draw the shard map with matplotlib (Agg) into a PNG file; returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    rows, cols, cells = shard_cells(layout)
    w, h = _size(rows, cols, layout.ndim, 240)
    fig = Figure(figsize=(max(w / 60, 2.5), max(h / 60, 1.2) + 0.5), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r0, r1, c0, c1, ranks in cells:
        ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=PALETTE[ranks[0] % len(PALETTE)],
                               edgecolor="#333", linewidth=0.6))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, ranks_label(ranks), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)
    ax.set_xlabel("dim 1" if layout.ndim >= 2 else "dim 0" if layout.ndim else "")
    ax.set_ylabel("dim 0" if layout.ndim >= 2 else "")
    ax.set_title(title if title is not None else f"{list(layout.shape)}  {layout.describe()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# ----------------------------------------------------------------- HTML
_STYLE = ("<style>.reshard td,.reshard th{padding:2px 8px;text-align:left;font-family:monospace}"
          ".reshard .num{text-align:right}</style>")


def _row(cells: list[str], num: tuple[int, ...] = ()) -> str:
    tds = "".join(f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>" for i, c in enumerate(cells))
    return f"<tr>{tds}</tr>"


def saved_by(ckpt: Checkpoint) -> str:
    """Who saved ``ckpt``: "saved by N ranks", or for an import the ranks that wrote the files it read.

    An import's layouts number the pieces the framework saved, which may outnumber its ranks (a
    Megatron rank saves a flat range of each parameter's state, and a SwiGLU weight as two blocks);
    the importer records the job in the leaf ``reshard.source`` (:data:`~reshard.store.format.tree.SOURCE_LEAF`).
    """
    from ..format.tree import SOURCE_LEAF

    pieces = len(set().union(*(m.layout.ranks for m in ckpt.arrays.values()))) if ckpt.arrays else 0
    source = ckpt.leaves.get(SOURCE_LEAF)
    if not isinstance(source, dict):  # saved as part of a state dict (rs.save), the record is flattened
        source = {k.removeprefix(f"{SOURCE_LEAF}."): v for k, v in ckpt.leaves.items()
                  if k.startswith(f"{SOURCE_LEAF}.")}
    ranks = source.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:  # untrusted: a leaf of the file
        return f"saved by {pieces} ranks"
    text = f"imported from the files of {ranks} ranks of a {str(source.get('format', 'framework'))[:40]} save"
    return text if pieces == ranks else f"{text}; its layouts number {pieces} saved pieces"


def checkpoint_html(ckpt: Checkpoint) -> str:
    """HTML summary of a checkpoint: one table row per tensor, and the shard map of the largest."""
    e = html.escape
    metas = list(ckpt.arrays.values())
    state = "committed" if ckpt.committed else '<b style="color:#c00">UNCOMMITTED</b>'
    leaves = ", ".join(f"{e(k)}={e(repr(v))[:40]}" for k, v in list(ckpt.leaves.items())[:8])
    head = (f"<p><b>reshard checkpoint</b> <code>{e(ckpt.url)}</code>: {state}, {len(metas)} tensors, "
            f"{human_bytes(ckpt.nbytes)}, {e(saved_by(ckpt))}"
            + (f"; leaves: {leaves}" if leaves else "") + "</p>")
    rows = [_row([e(m.name), e(m.dtype), e(str(list(m.shape))), e(m.layout.describe()),
                  human_bytes(m.nbytes), str(math.prod(m.grid))], num=(4, 5))
            for m in metas[:MAX_ROWS]]
    if len(metas) > MAX_ROWS:
        rows.append(f'<tr><td colspan="6">... and {len(metas) - MAX_ROWS} more</td></tr>')
    table = ("<table><thead><tr><th>tensor</th><th>dtype</th><th>shape</th><th>layout</th><th>size</th>"
             "<th>shards</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
    figure = ""
    if metas:
        big = max(metas, key=lambda m: m.nbytes)
        figure = (f"<figure style='margin:0'>{shard_map_svg(big.layout)}"
                  f"<figcaption>largest: <code>{e(big.name)}</code></figcaption></figure>")
    return (f'<div class="reshard">{_STYLE}{head}<div style="display:flex;gap:24px;align-items:flex-start">'
            f"{table}{figure}</div></div>")


def tensor_html(t: LazyTensor) -> str:
    """HTML of a lazy tensor (or view): its facts and its shard map, the view outlined."""
    e, m = html.escape, t.meta
    whole = all(r.start == 0 and r.stop == n for r, n in zip(t.region, m.shape, strict=True))
    facts = [("tensor", f"<code>{e(m.name)}</code>"), ("shape", e(str(list(t.shape)))),
             ("dtype", e(m.dtype)), ("size", human_bytes(t.nbytes)), ("layout", e(m.layout.describe())),
             ("saved by", f"{m.layout.size} ranks, {len(m.layout.blocks())} blocks"),
             ("shards", f"{math.prod(m.grid)} of {e(str(list(m.shard)))}"),
             ("inner chunk", e(str(list(m.chunk)))),
             ("checksums", "crc32c" if m.checksums else "none")]
    if not whole:
        facts.insert(2, ("view of", e(str(list(m.shape))) + " at ["
                         + ", ".join(f"{r.start}:{r.stop}" for r in t.region) + "]"))
    table = "<table>" + "".join(_row([f"<b>{k}</b>", v]) for k, v in facts) + "</table>"
    svg = shard_map_svg(m.layout, highlight=None if whole else t.region)
    return (f'<div class="reshard">{_STYLE}<div style="display:flex;gap:24px;align-items:flex-start">'
            f"{table}{svg}</div></div>")


"""Shard maps (SVG and PNG) and the HTML shown for checkpoints and tensors in notebooks."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.read import display
from reshard.store.read.display import checkpoint_html, ranks_label, shard_map_png, shard_map_svg, tensor_html

SVG = "{http://www.w3.org/2000/svg}"
LAYOUTS = {
    "mindspore tp4 dp2, optimizer-sharded": Layout.from_mindspore([2, 4], [0, -1], (64, 32), opt_shard_size=-1),
    "seed 000: [2,2] on 4 devices": Layout.from_mindspore([2, 2], [1, 0], (2, 4)),
    "balanced vector": Layout((10,), (3,), dims=((0,),), split="balanced"),
    "ceil with an empty piece": Layout.from_dtensor((3,), ["S(0)"], (2, 4)),
    "replicated scalar": Layout((), (4,)),
    "single": Layout.single((5, 7)),
}


def rects(svg: str) -> list[ET.Element]:
    return ET.fromstring(svg).findall(f".//{SVG}rect")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_svg_has_one_rect_per_block(name):
    layout = LAYOUTS[name]
    found = rects(shard_map_svg(layout))
    assert len(found) == len(layout.blocks())
    for rect, block in zip(found, layout.blocks(), strict=True):
        title = rect.find(f"{SVG}title")
        assert title is not None and f"held by ranks {list(block.ranks)}" in (title.text or "")
        assert float(rect.get("width", 0)) > 0 and float(rect.get("height", 0)) > 0


def test_svg_geometry_follows_the_regions():
    layout = LAYOUTS["seed 000: [2,2] on 4 devices"]  # rank 0 [1,2], rank 1 [3,4], rank 2 [5,6], rank 3 [7,8]
    found = rects(shard_map_svg(layout, size=200))
    by_rank = {int(re.search(r"ranks \[(\d+)\]", r.find(f"{SVG}title").text).group(1)): r for r in found}
    x = {r: float(e.get("x")) for r, e in by_rank.items()}
    y = {r: float(e.get("y")) for r, e in by_rank.items()}
    assert y[0] == y[1] < y[2] == y[3] and x[0] == x[2] < x[1] == x[3]
    assert float(by_rank[0].get("width")) == pytest.approx(100)  # half of 200 px
    texts = [t.text for t in ET.fromstring(shard_map_svg(layout)).iter(f"{SVG}text")]
    assert {"r0", "r1", "r2", "r3"} <= set(texts) and texts[-1] == "[2, 4]  dev[2,2] tmap[1,0]"


def test_svg_replicas_share_a_rect_and_highlight_is_not_a_rect():
    layout = Layout.from_mindspore([2, 3], [1, -1], (2, 3))  # REFERENCE example B: ranks 0,1,2 and 3,4,5
    svg = shard_map_svg(layout, highlight=(slice(0, 1), slice(1, 3)))
    assert len(rects(svg)) == 2
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "r0-2" in texts and "r3-5" in texts
    assert len(ET.fromstring(svg).findall(f".//{SVG}polygon")) == 1


def test_svg_nd_draws_the_first_two_dims():
    layout = Layout((8, 6, 4), (2, 2), dims=((0,), (), (1,)))  # dim 2 split: 4 blocks, 2 cells on the plane
    svg = shard_map_svg(layout)
    assert len(layout.blocks()) == 4 and len(rects(svg)) == 2
    assert "held by ranks [0, 1]" in svg and "held by ranks [2, 3]" in svg


def test_png_is_a_png(tmp_path):
    path = tmp_path / "map.png"
    assert shard_map_png(LAYOUTS["mindspore tp4 dp2, optimizer-sharded"], str(path)) == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    shard_map_png(LAYOUTS["replicated scalar"], str(tmp_path / "s.png"))
    assert os.path.getsize(tmp_path / "s.png") > 0


def test_labels_and_sizes():
    assert ranks_label((3,)) == "r3" and ranks_label((0, 4)) == "r0,4" and ranks_label(range(8)) == "r0-7"
    assert ranks_label((0, 2, 4, 6, 8)) == "r0,2,...(+3)"
    assert display.human_bytes(100) == "100 B" and display.human_bytes(1536) == "1.5 KiB"
    assert display.human_bytes(3 << 40) == "3.0 TiB"


@pytest.fixture
def ckpt(tmp_path):
    state = {"model": {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "b": np.ones(32, np.float32),
                       "<odd>": np.zeros(4, np.int8)}, "step": 7}
    layouts = {"model.w": LAYOUTS["mindspore tp4 dp2, optimizer-sharded"],
               "model.b": Layout.from_mindspore([2, 4], [-1], (32,)),
               "model.<odd>": Layout.single((4,))}
    rs.save(state, str(tmp_path / "c"), layouts)
    return rs.open(str(tmp_path / "c"))


def test_checkpoint_html(ckpt):
    page = ckpt._repr_html_()
    assert page == checkpoint_html(ckpt)
    body = re.search(r"<tbody>(.*)</tbody>", page, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    assert len(rows) == 3
    assert "<td>model.w</td><td>float32</td><td>[64, 32]</td><td>dev[2,4] tmap[0,-1] opt2</td>" in page
    assert "<td>model.&lt;odd&gt;</td>" in page  # names are escaped
    svg = re.search(r"<svg.*?</svg>", page, re.S).group(0)
    assert len(rects(svg)) == len(ckpt.arrays["model.w"].layout.blocks())  # the largest tensor's map
    assert "committed" in page and "step=7" in page and "saved by 8 ranks" in page


def test_checkpoint_html_truncates_and_flags_uncommitted(ckpt, monkeypatch):
    monkeypatch.setattr(display, "MAX_ROWS", 2)
    page = checkpoint_html(ckpt)
    assert "... and 1 more" in page
    os.remove(os.path.join(ckpt.url, ".reshard", "commit.json"))
    assert "UNCOMMITTED" in checkpoint_html(rs.open(ckpt.url, allow_uncommitted=True))


def test_tensor_html_whole_and_view(ckpt):
    whole = ckpt["model.w"]._repr_html_()
    assert whole == tensor_html(ckpt["model.w"])
    assert "view of" not in whole and "<polygon" not in whole and "crc32c" in whole
    view = ckpt["model.w"][10:30, :16]._repr_html_()
    assert "view of</b></td><td>[64, 32] at [10:30, 0:16]" in view and "[20, 16]" in view
    svg = re.search(r"<svg.*?</svg>", view, re.S).group(0)
    assert len(rects(svg)) == 8 and len(ET.fromstring(svg).findall(f".//{SVG}polygon")) == 1

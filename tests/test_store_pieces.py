"""The store with ranks holding several blocks (a GLU's gate and up halves, a fused q/k/v: Layout.pieces).

Each rank writes its local array (its blocks concatenated as Megatron holds them), in both forms; loads by rank
(numpy, torch, many ranks at once), redivisions to and from such a layout and verify give the values back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout

F, H, TP, DP = 8, 6, 2, 2


def glu() -> Layout:
    """[2F, H] rows [gate; up] over TP x DP ranks (rank = d * TP + t): rank t holds gate[t] then up[t]."""
    step = F // TP
    return Layout.from_blocks((2 * F, H), [(d * TP + t, (j * F + t * step, 0), (step, H), d, (j * step, 0))
                                            for d in range(DP) for t in range(TP) for j in range(2)])


def qkv() -> Layout:
    """Conv1D [H, 3H] columns [q; k; v]: rank t holds the t-th slice of each, side by side."""
    step = H // TP
    return Layout.from_blocks((H, 3 * H), [(t, (0, j * H + t * step), (H, step), 0, (0, j * step))
                                           for t in range(TP) for j in range(3)])


def megatron_local(full: np.ndarray, t: int, axis: int, parts: int) -> np.ndarray:
    return np.concatenate([np.split(p, TP, axis=axis)[t] for p in np.split(full, parts, axis=axis)], axis=axis)


STATE = {"fc1": np.arange(2 * F * H, dtype=np.float32).reshape(2 * F, H),
         "qkv": np.arange(3 * H * H, dtype=np.float32).reshape(H, 3 * H) * -1}
WANT = {"fc1": (0, 2), "qkv": (1, 3)}  # the axis the blocks sit along, the parts


def _local(name: str, rank: int) -> np.ndarray:
    axis, parts = WANT[name]
    return megatron_local(STATE[name], rank % TP, axis, parts)


@pytest.mark.parametrize("form", ["directory", "packed"])
def test_each_rank_writes_and_loads_its_blocks(tmp_path: Path, form: str) -> None:
    layouts = {"fc1": glu(), "qkv": qkv()}
    pieces = {r: {n: _local(n, r) for n, lay in layouts.items() if lay.has_rank(r)} for r in range(TP * DP)}
    rs.save_pieces(pieces, str(tmp_path / "ck"), layouts, form=form)
    ckpt = rs.open(str(tmp_path / "ck"))
    assert ckpt["fc1"].layout == layouts["fc1"] and ckpt["fc1"].meta.shard == (F // TP, H)
    for name in STATE:
        np.testing.assert_array_equal(ckpt[name].read(), STATE[name])
    many = ckpt.load_many(layouts, range(TP * DP))
    for r in range(TP * DP):
        got, tensors = ckpt.load(layouts, r), ckpt.load(layouts, r, as_="torch")
        for name in pieces[r]:
            np.testing.assert_array_equal(got[name], pieces[r][name])
            np.testing.assert_array_equal(many[r][name], pieces[r][name])
            np.testing.assert_array_equal(tensors[name].numpy(), pieces[r][name])
    report = rs.verify(str(tmp_path / "ck"))
    assert report.ok, report.problems


def test_redivide_to_and_from_several_blocks_a_rank(tmp_path: Path) -> None:
    rs.save(STATE, str(tmp_path / "whole"))
    layouts = {"fc1": glu(), "qkv": qkv()}
    rs.redivide(str(tmp_path / "whole"), str(tmp_path / "pieces"), layouts)
    ckpt = rs.open(str(tmp_path / "pieces"))
    for r in range(TP * DP):
        for name, value in ckpt.load(layouts, r).items():
            np.testing.assert_array_equal(value, _local(name, r))
    rows = {n: Layout(a.shape, (3,), dims=((), (0,))) for n, a in STATE.items()}  # columns over 3 ranks
    rs.redivide(str(tmp_path / "pieces"), str(tmp_path / "cols"), rows)
    back = rs.open(str(tmp_path / "cols"))
    for name, value in STATE.items():
        np.testing.assert_array_equal(back[name].read(), value)
        for r in range(3):
            np.testing.assert_array_equal(back.load(rows, r)[name], value[rows[name].region(r)])

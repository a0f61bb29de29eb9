"""Reductions of bfloat16 tensors accumulate in float64 (issue 14 item 3).

numpy and dask sum a bfloat16 array in bfloat16 (8 significant bits), so a mean
over a million values is wrong in its first digit. ``reshard show --stats`` and
the recipes in docs/dask.md cast first; these tests hold them to a float64 truth
with a precision no bfloat16 accumulation reaches.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    rng = np.random.default_rng(3)
    x = (0.5 + 0.06 * rng.standard_normal((1024, 1024))).astype(ml_dtypes.bfloat16)
    url = str(tmp_path_factory.mktemp("bf16") / "ck")
    rs.save({"w": x}, url, {"w": Layout.from_dtensor((4,), ["S(0)"], x.shape)})
    return url, x


def test_show_stats_accumulate_in_float64(saved: tuple[str, np.ndarray], capsys: pytest.CaptureFixture) -> None:
    url, x = saved
    assert main(["show", url, "w", "--stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    truth = x.astype(np.float64)
    assert stats["mean"] == pytest.approx(truth.mean(), rel=1e-12)
    assert stats["std"] == pytest.approx(truth.std(), rel=1e-9)
    assert stats["norm"] == pytest.approx(math.sqrt((truth * truth).sum()), rel=1e-12)
    naive = float(np.asarray(x).mean())  # what the issue saw: numpy accumulating in bfloat16
    assert abs(naive - truth.mean()) > 1e-3 * abs(truth.mean())


def test_dask_recipes_accumulate_in_float64(saved: tuple[str, np.ndarray]) -> None:
    """docs/dask.md's ``x.mean(dtype=np.float64)`` and ``norm(x.astype(np.float64))``."""
    import dask.array as da

    url, x = saved
    lazy = rs.open(url)["w"].to_dask()
    assert lazy.dtype == x.dtype  # the stored dtype: casting is the caller's choice
    truth = x.astype(np.float64)
    assert float(lazy.mean(dtype=np.float64).compute()) == pytest.approx(truth.mean(), rel=1e-12)
    assert float(lazy.sum(dtype=np.float64).compute()) == pytest.approx(truth.sum(), rel=1e-12)
    assert float(da.linalg.norm(lazy.astype(np.float64)).compute()) == pytest.approx(
        np.linalg.norm(truth), rel=1e-12)


def test_docs_dask_recipe_lines_accumulate_in_float64(saved: tuple[str, np.ndarray]) -> None:
    """Every ``float(...)`` reduction line of docs/dask.md's first recipe, run on a bfloat16 ``x``."""
    import pathlib

    import dask.array as da

    url, x = saved
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "dask.md").read_text()
    block = text.split("## A tensor as a dask array", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.startswith("float(")]
    assert any("mean" in ln for ln in lines) and any("norm" in ln for ln in lines), lines
    truth = x.astype(np.float64)
    want = {"mean": truth.mean(), "norm": float(np.linalg.norm(truth))}
    scope = {"x": rs.open(url)["w"].to_dask(), "da": da, "np": np}
    for line in lines:
        (kind,) = [k for k in want if k in line]
        assert eval(line, scope) == pytest.approx(want[kind], rel=1e-9), line

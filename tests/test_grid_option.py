"""``--grid regular`` on ``reshard import`` and ``reshard convert``: uneven imports that zarr 3.1 and TensorStore open.

A OneFlow state saved by 3 ranks with balanced splits (10 rows as 4, 3, 3: OneFlow's own rule) imports under
uneven blocks: by default one shard per block on zarr's rectilinear grid, which zarr-python 3.1 and TensorStore
do not read. With ``--grid regular`` (at import, or by ``convert`` afterwards) every tensor is on a regular
grid, and plain zarr-python and TensorStore read the values reshard reads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
import zarr
from reshard.store.cli import main

WHOLE = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.arange(10, dtype=np.float32)}


def _rank_folders(tmp: Path) -> list[str]:
    """Three ranks' local parts (rows 4, 3, 3), as the OneFlow job writes them with save_npz."""
    from reshard.store.frontends.oneflow import save_npz

    bounds = [(0, 4), (4, 7), (7, 10)]
    return [str(save_npz({n: v[a:b] for n, v in WHOLE.items()}, tmp / f"rank_{r}")) for r, (a, b) in enumerate(bounds)]


def _rectilinear(url: str) -> list[str]:
    return sorted(n for n, m in rs.open(url).arrays.items() if m.edges is not None)


def test_import_and_convert_with_a_regular_grid(tmp_path: Path) -> None:
    exact, regular = str(tmp_path / "exact"), str(tmp_path / "regular")
    ranks = ["--placement", "[0, 1, 2]", "--sbp", "S(0)"]
    assert main(["import", "oneflow", *_rank_folders(tmp_path), exact, *ranks]) == 0
    assert main(["import", "oneflow", *_rank_folders(tmp_path), regular, *ranks, "--grid", "regular"]) == 0
    uneven = _rectilinear(exact)
    assert uneven == ["b", "w"]
    assert _rectilinear(regular) == []
    assert main(["convert", exact, str(tmp_path / "converted"), "--grid", "regular", "--form", "directory"]) == 0
    assert main(["convert", exact, str(tmp_path / "nothing")]) == 2  # neither --form nor --grid
    converted = rs.open(str(tmp_path / "converted"))
    assert _rectilinear(converted.url) == [] and converted.form == "directory"
    a, b = rs.open(exact), rs.open(regular)
    for name in uneven:
        want = a[name].read()
        np.testing.assert_array_equal(want, WHOLE[name])
        np.testing.assert_array_equal(b[name].read(), want, err_msg=name)
        np.testing.assert_array_equal(converted[name].read(), want, err_msg=name)
        # plain zarr-python 3.1 (no rectilinear support) and TensorStore read the directory form's folder
        np.testing.assert_array_equal(zarr.open_group(converted.zarr_url, mode="r")[name.replace(".", "/")][...],
                                      want, err_msg=name)
    ts = pytest.importorskip("tensorstore")
    name = uneven[0]
    array = ts.open({"driver": "zarr3", "kvstore": f"file://{converted.zarr_url}/{name.replace('.', '/')}"}).result()
    np.testing.assert_array_equal(array.read().result(), a[name].read())

"""``python -m bench.cloud_save`` at a tiny size over the shaped cloud: every row is there, with its floor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from reshard.store.testing.shaped import unavailable

_REASON = unavailable()


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_bench_cloud_save_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("moto.server")
    pytest.importorskip("torch")
    pytest.importorskip("tensorstore")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the bench sets them for TensorStore's s3 kvstore
        monkeypatch.setenv(name, "testing")
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import cloud_save

    out = tmp_path / "save.md"
    cloud_save.main(["--rate", "200", "--rtt", "5", "--mib", "1", "--reps", "1", "--out", str(out)])
    rows = {cells[2]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in out.read_text().splitlines() if line.startswith("| 5 ms"))}
    assert sorted(rows) == sorted(["raw PUT (8 objects side by side, multipart, 8 MiB parts)",
                                   "raw PUT (8 objects side by side, one PUT each)", "save (8 ranks + commit)",
                                   "commit alone (8 ranks)", "save (FsspecWriter, 8 ranks)",
                                   "save (8 ranks + commit, directory form)"]), rows
    for cells in rows.values():
        assert float(cells[4]) > 0 and float(cells[5]) >= 0.015  # time, and a floor of at least 3 RTTs
    assert float(rows["save (8 ranks + commit)"][7]) > 0  # against the raw PUT of the same bytes
    assert float(rows["save (8 ranks + commit)"][8]) >= 0  # moto's CPU, measured
    assert 0 < int(rows["commit alone (8 ranks)"][10]) <= 8 + 2 + 5  # the commit's own requests

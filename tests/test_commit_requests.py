"""The commit's own requests on S3 (issue 38): counted on the wire by the proxy in front of a real moto server.

A packed save of N ranks commits with a lock, one read of each rank's trailer (side by side), one read of the
records' carrier, the gc check, the references, the root document and the root's copy of it (side by side),
the marker and the lock's "done": N + 2 GETs and 6 PUTs whatever N, no listing, no HEAD.
"""

from __future__ import annotations

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.testing import LocalS3Server, S3Proxy

pytest.importorskip("s3fs")


@pytest.mark.parametrize("ranks", [2, 8, 24])
def test_a_packed_commit_reads_each_trailer_once_and_writes_six_objects(
        s3_server: LocalS3Server, s3_proxy: S3Proxy, ranks: int) -> None:
    url, opts = f"s3://{s3_server.make_bucket()}/ck", s3_proxy.storage_options()
    lay = {f"t{i}": Layout.from_dtensor((ranks,), ["S(0)"], (ranks * 4, 8)) for i in range(5)}
    full = {k: np.arange(ranks * 32, dtype=np.float32).reshape(ranks * 4, 8) + i for i, k in enumerate(lay)}
    writer = rs.create(url, lay, storage_options=opts, save_id=3)
    for r in range(ranks):
        writer.write(r, {k: full[k][lay[k].region(r)] for k in lay})
    s3_proxy.reset_counters()
    writer.commit()
    log = s3_proxy.records()
    by = s3_proxy.requests_by_method
    assert set(by) == {"GET", "PUT"}  # no HEAD, no DELETE, no multipart
    assert not any("list-type" in r.query or "prefix=" in r.query for r in log)  # no listing
    trailers = [r for r in log if r.method == "GET" and r.path.endswith(".bin")]
    assert sorted({r.path.rsplit("/", 1)[-1] for r in trailers}) == sorted(f"{r}.bin" for r in range(ranks))
    assert by["GET"] == ranks + 2 and len(trailers) == ranks + 1  # + the records' carrier, + gc's mark
    assert sorted(r.path.split("/", 2)[-1] for r in log if r.method == "PUT") == sorted(
        ["gen-3/.reshard/commit.lock"] * 2 + ["gen-3/refs.json", "gen-3/.reshard/metadata.json",
                                             ".reshard/head.json", ".reshard/commit.json"])
    back = rs.open(url, storage_options=opts).read_all()
    assert all(np.array_equal(back[k], v) for k, v in full.items())

"""S3 GETs through presigned URLs (:mod:`reshard.store.io.s3client`): the same bytes and the same errors as
s3fs's own GETs, on a real moto server behind the counting, fault-injecting proxy."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.io.storage import Storage
from reshard.store.testing import S3Proxy
from test_cloud import full_state, source_layouts

SIGNED = ("Signature=", "X-Amz-Signature=")


def _signed(query: str) -> bool:
    return any(s in query for s in SIGNED)


def test_every_get_of_a_load_is_presigned_and_exact(s3_proxy: S3Proxy, s3_bucket: str, form: str) -> None:
    opts = s3_proxy.storage_options()
    url = f"s3://{s3_bucket}/presigned-{form}"
    rs.save({**full_state(), "step": 7}, url, source_layouts(), storage_options=opts, form=form)
    s3_proxy.reset_counters()
    got = rs.open(url, storage_options=opts).read_all()
    for name, want in full_state().items():
        node: Any = got
        for part in name.split("."):
            node = node[part]
        np.testing.assert_array_equal(node, want)
    gets = s3_proxy.records("GET")
    assert len(gets) >= 3 and all(_signed(r.query) for r in gets), [(r.path, r.query[:40]) for r in gets]


def test_per_request_options_keep_s3fs_gets(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    """Requester pays (a header every GET must carry): s3fs's own signed requests, no presigned URL."""
    plain = Storage(f"s3://{s3_bucket}/payer", s3_proxy.storage_options())
    plain.write("k", b"abc")
    payer = Storage(f"s3://{s3_bucket}/payer", s3_proxy.storage_options(requester_pays=True))
    assert plain._remote.presigned is not None and payer._remote.presigned is None
    s3_proxy.reset_counters()
    assert payer.read("k") == plain.read("k") == b"abc"
    assert [_signed(r.query) for r in s3_proxy.records("GET")] == [False, True]


@pytest.mark.parametrize("case", ["missing key", "missing bucket", "denied", "suffix too long"])
def test_errors_are_the_ones_s3fs_gets_give(s3_proxy: S3Proxy, s3_bucket: str, case: str) -> None:
    def attempt(storage: Storage) -> BaseException | bytes:
        try:
            if case == "suffix too long":
                return storage.read_suffix("k", 10)
            return storage.read("nothing" if case == "missing key" else "k")
        except Exception as e:
            return e

    bucket = "no-such-bucket-here" if case == "missing bucket" else s3_bucket
    presigned = Storage(f"s3://{bucket}/errors", s3_proxy.storage_options())
    botocore = Storage(f"s3://{bucket}/errors", s3_proxy.storage_options(requester_pays=True))
    if case != "missing bucket":
        presigned.write("k", b"abc")
    if case == "denied":
        s3_proxy.deny("*/errors/k", "GET")
    s3_proxy.reset_counters()
    ours, theirs = attempt(presigned), attempt(botocore)
    assert isinstance(ours, BaseException) and type(ours) is type(theirs), (ours, theirs)
    expected = {"missing key": (FileNotFoundError, "nothing"), "missing bucket": (rs.StorageError, "bucket"),
                "denied": (rs.StorageError, "PermissionError"), "suffix too long": (rs.StorageError, "shorter")}
    kind, words = expected[case]
    assert isinstance(ours, kind) and words in str(ours), ours
    assert s3_proxy.requests == 2  # one GET each: none of these is retried


def test_a_retried_get_is_the_same_request_to_the_proxy(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    storage = Storage(f"s3://{s3_bucket}/retried", s3_proxy.storage_options())
    storage.write("k", b"0123456789")
    s3_proxy.reset_counters()
    s3_proxy.fail_rate, s3_proxy.max_streak = 1.0, 2  # every GET fails, but never more than twice in a row
    buf = bytearray(4)
    storage.read_into("k", 3, [memoryview(buf)])
    assert bytes(buf) == b"3456" and storage.stats.retries == 2
    assert [r.status for r in s3_proxy.records("GET")] == [503, 503, 206]
    # a retry's signature may differ (a new expiry): still the same request to the proxy's bound on a streak
    s3_proxy.reset_counters()
    for n in range(3):
        url = f"{s3_proxy.endpoint_url}/{s3_bucket}/retried/k?AWSAccessKeyId=testing&Signature=s{n}&Expires={n}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                assert n == 2 and answer.read() == b"0123456789"
        except urllib.error.HTTPError as e:
            assert n < 2 and e.code == 503


def test_an_empty_object_reads_as_empty(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    """S3 answers a range of an empty object with 416; it has no bytes, which is what a read gives."""
    storage = Storage(f"s3://{s3_bucket}/empty", s3_proxy.storage_options())
    storage.write("e", b"")
    assert storage.read("e") == b"" and storage.read_tail("e", 8) == b""

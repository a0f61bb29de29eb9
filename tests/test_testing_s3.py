"""Tests of ``reshard.store.testing``: a real moto server behind the counting proxy, and the shaped cloud's
S3 server (``motoserve``)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from typing import Any

import pytest
import torchproc
from reshard.store.testing import LocalS3Server, S3Proxy

s3fs = pytest.importorskip("s3fs")


def _fs(proxy: S3Proxy, **extra: Any) -> Any:
    return s3fs.S3FileSystem(**proxy.storage_options(**extra))


def _objects(bucket: str, n: int = 20) -> dict[str, bytes]:
    return {f"{bucket}/obj{i}": os.urandom(10_000 + i) for i in range(n)}


def test_write_then_read_is_counted(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    data = os.urandom(1000)
    fs.pipe_file(f"{s3_bucket}/a", data)
    assert s3_proxy.requests == 1
    (put,) = s3_proxy.log
    assert (put.method, put.path, put.status) == ("PUT", f"{s3_bucket}/a", 200)
    assert s3_proxy.bytes_received == 1000

    s3_proxy.reset_counters()
    assert s3_proxy.requests == 0
    assert fs.cat_file(f"{s3_bucket}/a", max_concurrency=1) == data
    assert s3_proxy.requests_by_method == Counter({"GET": 1})
    assert s3_proxy.bytes_sent == 1000
    assert s3_proxy.bytes_received == 0


def test_whole_object_cat_heads_first(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    fs.pipe_file(f"{s3_bucket}/a", b"x" * 100)
    s3_proxy.reset_counters()
    assert fs.cat(f"{s3_bucket}/a") == b"x" * 100
    assert [r.method for r in s3_proxy.log] == ["HEAD", "GET"]
    assert s3_proxy.bytes_sent == 100


def test_ranged_read_fetches_only_the_range(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    data = os.urandom(1 << 20)
    path = f"{s3_bucket}/big"
    fs.pipe_file(path, data)
    s3_proxy.reset_counters()

    assert fs.cat_file(path, start=1000, end=5000) == data[1000:5000]
    (get,) = s3_proxy.log
    assert (get.method, get.range, get.status) == ("GET", "bytes=1000-4999", 206)
    assert s3_proxy.bytes_sent == 4000

    # cat_ranges: one GET per range, adjacent ranges are not merged
    s3_proxy.reset_counters()
    starts, ends = [0, 10, 20, 5000], [10, 20, 30, 6000]
    out = fs.cat_ranges([path] * 4, starts, ends)
    assert out == [data[s:e] for s, e in zip(starts, ends, strict=True)]
    assert s3_proxy.requests_by_method == Counter({"GET": 4})
    assert sorted(r.range or "" for r in s3_proxy.log) == sorted(
        f"bytes={s}-{e - 1}" for s, e in zip(starts, ends, strict=True)
    )
    assert s3_proxy.bytes_sent == 1030


def test_pipe_64mib_is_one_put(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    data = os.urandom(64 << 20)
    fs.pipe_file(f"{s3_bucket}/big", data)
    assert [(r.method, r.query) for r in s3_proxy.log] == [("PUT", "")]
    assert s3_proxy.bytes_received == len(data)


def test_fail_rate_is_retried(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    objs = _objects(s3_bucket)
    fs.pipe(objs)
    s3_proxy.reset_counters()
    s3_proxy.seed = 7
    s3_proxy.fail_rate = 0.3
    s3_proxy.max_streak = 2  # bounds botocore's exponential backoff
    assert fs.cat(list(objs), max_concurrency=1) == objs  # GETs only, no HEADs
    failed = s3_proxy.records(fault="fail")
    assert failed
    assert all(r.status == 503 for r in failed)
    assert s3_proxy.faults == len(failed)
    assert s3_proxy.requests == len(objs) + len(failed)


def test_reset_rate_is_retried(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    objs = _objects(s3_bucket)
    s3_proxy.seed = 3
    s3_proxy.reset_rate = 0.3
    s3_proxy.max_streak = 2
    fs.pipe(objs)
    assert fs.cat(list(objs)) == objs
    resets = s3_proxy.records(fault="reset")
    assert resets
    assert all(r.status == 0 and r.bytes_sent == 0 for r in resets)


def test_max_faults_caps_injection(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    s3_proxy.fail_rate = 1.0
    s3_proxy.max_faults = 2
    fs.pipe_file(f"{s3_bucket}/a", b"1")
    assert [r.status for r in s3_proxy.log] == [503, 503, 200]


def test_deny_fails_fast_without_retries(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    fs = _fs(s3_proxy)
    fs.pipe_file(f"{s3_bucket}/secret/x", b"1")
    s3_proxy.deny(f"{s3_bucket}/secret/*")
    s3_proxy.deny(re.compile(r"/readonly/"), methods="PUT")
    fs.pipe_file(f"{s3_bucket}/public", b"1")  # not matched
    s3_proxy.reset_counters()

    t0 = time.monotonic()
    with pytest.raises(PermissionError):
        fs.cat_file(f"{s3_bucket}/secret/x", start=0, end=1)
    assert s3_proxy.requests == 1
    with pytest.raises(PermissionError):
        fs.pipe_file(f"{s3_bucket}/secret/y", b"1")
    assert s3_proxy.requests == 2
    with pytest.raises(PermissionError):
        fs.pipe_file(f"{s3_bucket}/readonly/y", b"1")
    assert s3_proxy.requests == 3
    assert time.monotonic() - t0 < 2
    assert [(r.status, r.fault) for r in s3_proxy.log] == [(403, "deny")] * 3
    assert s3_proxy.faults == 0  # denials are not counted against max_faults


def test_conditional_put_boto3(s3_server: LocalS3Server, s3_bucket: str) -> None:
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(client.exceptions.ClientError) as info:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"1"


@pytest.mark.parametrize("how", ["pipe_file", "open_xb"])
def test_conditional_create_s3fs(s3_proxy: S3Proxy, s3_bucket: str, how: str) -> None:
    fs = _fs(s3_proxy)
    path = f"{s3_bucket}/once"

    def create(data: bytes) -> None:
        if how == "pipe_file":
            fs.pipe_file(path, data, mode="create")
        else:
            with fs.open(path, "xb") as f:
                f.write(data)

    create(b"1")
    with pytest.raises(FileExistsError):
        create(b"2")
    assert [(r.method, r.status, r.headers.get("if-none-match")) for r in s3_proxy.log] == [
        ("PUT", 200, "*"),
        ("PUT", 412, "*"),
    ]
    assert fs.cat_file(path, max_concurrency=1) == b"1"


def test_conditional_create_with_lost_ack(s3_proxy: S3Proxy, s3_bucket: str) -> None:
    """The write lands, its response is lost, botocore retries, and the retry gets 412."""
    fs = _fs(s3_proxy)
    s3_proxy.reset_after_rate = 1.0
    s3_proxy.max_faults = 1
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{s3_bucket}/once", b"1", mode="create")
    assert [(r.status, r.fault) for r in s3_proxy.log] == [(0, "reset-after"), (412, None)]
    assert fs.cat_file(f"{s3_bucket}/once", max_concurrency=1) == b"1"


def test_server_restarts_and_reset() -> None:
    for _ in range(2):
        with LocalS3Server() as server:
            bucket = server.make_bucket()
            client = server.client()
            client.put_object(Bucket=bucket, Key="k", Body=b"1")
            server.reset()
            names = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
            assert bucket not in names
        assert not server.running
        server.stop()  # idempotent


def test_proxy_stops_with_idle_keepalive_client(s3_server: LocalS3Server) -> None:
    proxy = S3Proxy(s3_server.endpoint_url).start()
    port = int(proxy.endpoint_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /nope/k HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 ")
        t0 = time.monotonic()
        proxy.stop()  # the client keeps its connection open
        assert time.monotonic() - t0 < 2
    proxy.stop()


def test_import_without_moto() -> None:
    code = (
        "import sys; sys.modules['moto'] = None; sys.modules['moto.server'] = None\n"
        "from reshard.store import testing\n"
        "assert testing.s3_storage_options('http://h:1')['endpoint_url'] == 'http://h:1'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_motoserve_serves_s3_straight_and_resets(tmp_path) -> None:
    """The shaped cloud's S3 server (``motoserve``, its own process as in the cloud) answers S3 without moto's
    service dispatcher: a bucket, a write and a ranged read through s3fs, a refused conditional create, a
    presigned GET (no ``Authorization`` header to dispatch on); ``/moto-api/reset`` empties it."""
    pytest.importorskip("cheroot")
    from reshard.store.testing import motoserve
    from reshard.store.testing.service import s3_request, s3_storage_options

    port = torchproc.free_port()
    log = open(tmp_path / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, motoserve.__file__, "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "moto.log").read_text()
                time.sleep(0.1)
        s3_request(endpoint, "PUT", "/straight")
        fs = s3fs.S3FileSystem(**s3_storage_options(endpoint))
        data = os.urandom(100_000)
        fs.pipe_file("straight/a", data)
        assert fs.cat_file("straight/a", start=10, end=1000) == data[10:1000]
        with pytest.raises(FileExistsError):
            fs.pipe_file("straight/a", b"x", mode="create")
        assert fs.cat_file("straight/a") == data
        url = fs.sign("straight/a")
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.read() == data
        s3_request(endpoint, "POST", "/moto-api/reset")
        fs.invalidate_cache()
        with pytest.raises(FileNotFoundError):
            fs.cat_file("straight/a")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


_RANGES_SCRIPT = r"""
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
import motoserve
from moto.s3.models import FakeKey
from werkzeug.test import Client

whole, reads = FakeKey.__dict__["value"], []
FakeKey.value = property(lambda key: reads.append(1) or whole.fget(key), whole.fset)  # counts whole reads
if sys.argv[2] == "ranged":
    app = motoserve.S3Only()
else:
    from moto.moto_server.werkzeug_app import create_backend_app
    app = create_backend_app("s3")
client = Client(app)
auth = {"Authorization": "AWS4-HMAC-SHA256 Credential=testing/20000101/us-east-1/s3/aws4_request, "
                         "SignedHeaders=host, Signature=0", "Host": "127.0.0.1:5000"}
data = bytes(range(256)) * (6 << 12)  # 6 MiB: past moto's 5 MiB in memory, so kept in a file
assert client.put("/bkt", headers=auth).status_code == 200
assert client.put("/bkt/k", data=data, headers=auth).status_code == 200
answers = []
for rng in json.loads(sys.argv[3]):
    got = client.get("/bkt/k", headers={**auth, "Range": rng} if rng else auth)
    body = got.data if got.status_code < 300 else b""  # an error's body holds a random request id
    answers.append([rng, got.status_code, got.headers.get("Content-Range"), got.headers.get("Content-Length"),
                    hashlib.sha256(body).hexdigest()])
print(json.dumps({"answers": answers, "whole_reads": len(reads), "first": answers[0][4] ==
                  hashlib.sha256(data[10:1000]).hexdigest()}))
"""


def test_motoserve_reads_only_the_range_a_get_asks() -> None:
    """The shaped cloud's moto answers a ranged GET from the range alone (``motoserve.read_ranges_only``): every
    answer (status, Content-Range, length, bytes) is plain moto's, on an object moto keeps in a file, but only
    the GETs moto answers whole read the object whole. Each in a process of its own (the patch is global)."""
    pytest.importorskip("cheroot")
    import json

    from reshard.store.testing import motoserve

    ranges = ["bytes=10-999", "bytes=-1000", "bytes=6000000-", "bytes=5-99999999", "bytes=7000000-",
              "bytes=0-1,5-9", None]
    got = {}
    for mode in ("ranged", "plain"):
        out = subprocess.run([sys.executable, "-c", _RANGES_SCRIPT, os.path.dirname(motoserve.__file__), mode,
                              json.dumps(ranges)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ranged"]["answers"] == got["plain"]["answers"]
    assert got["ranged"]["first"]
    assert [a[1] for a in got["plain"]["answers"]] == [206, 206, 206, 206, 416, 200, 200]
    assert got["plain"]["whole_reads"] == len(ranges)  # plain moto reads the object whole for each GET
    assert got["ranged"]["whole_reads"] == 1  # the GET without a range (the multi-range one, answered whole too,
    # is read through the range reader)

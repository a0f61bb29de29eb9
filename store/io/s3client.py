"""reshard's S3 client: writes in one round trip each, GETs without botocore's per-request work.

**Writes.** botocore (1.43, through aiobotocore 3.10 and s3fs) sends ``Expect: 100-continue`` with every
``PutObject`` and ``UploadPart``, even a 300-byte one: the client sends the headers, waits for the
server's ``100 Continue``, and only then sends the body. Each write thus costs two round trips.
Over a link of 50 ms that put about 0.35 s into every commit (metadata, refs, the root's copy, the
marker and the lock: 5 writes one after another) and one round trip into each multipart part.
The wait buys one thing: a refused request (a wrong signature, no such bucket) does not send its
body. reshard's writes are expected to succeed, and a refused one fails the save either way, so the
header is dropped from every request of the s3fs client a :class:`~reshard.store.io.storage.Storage`
uses (:func:`one_round_trip_writes`). The body of a refused write is then sent once, in vain.

**Reads.** A GET through botocore (``get_object``) costs about 3 ms of CPU on this machine's cores:
the user agent rebuilt, the endpoint rules resolved, the response's headers parsed into a dict of
Python objects. A load of the directory form makes a request per chunk (259 for W1's 64 MiB), so
that CPU, not the link, bounded S3 loads. :class:`PresignedGets` asks botocore for a presigned URL
instead (0.3-0.6 ms: the same credentials, endpoint and signature) and sends the GET on the client's
own HTTP session (its pool of connections, its TLS and proxy settings, its timeouts): 0.8 ms.
An error answer is read as s3fs reads it (:func:`s3fs.errors.translate_boto_error`), so a missing
key is a FileNotFoundError, a missing bucket says ``NoSuchBucket``, a denial is a PermissionError,
whatever the path. A filesystem with per-request options (requester pays, SSE-C keys, versions)
keeps s3fs's own GETs (:func:`presigned_gets` returns None).

**Connections.** botocore keeps at most 10 connections per client (``max_pool_connections``), fewer
than the remote I/O threads that keep requests in flight (:func:`~reshard.store.io.pool.io_threads`:
cores + 16) and the parts of an upload: the rest waited for a connection, a queue that grew with the
round-trip time. :func:`with_connections` asks for enough (:func:`connections`) unless the options
say otherwise; fsspec's http filesystem allows 100.
"""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import Sequence
from typing import Any

from . import multipart, pool

_HANDLER_ID = "reshard-no-expect-continue"
#: Seconds a presigned URL is valid: it is made for one request, sent at once.
_EXPIRES = 900


def connections() -> int:
    """Connections an S3 client may keep: the remote I/O threads, and an upload's parts on top, at least 64."""
    return max(64, pool.io_threads(local=False) + multipart.concurrency())


def with_connections(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for an ``s3://`` URL's filesystem with :func:`connections` in its botocore config, unless
    they set ``max_pool_connections`` themselves; other URLs' options unchanged."""
    config = dict(options.get("config_kwargs") or {})
    if not url.startswith(("s3://", "s3a://")) or "max_pool_connections" in config:
        return options
    return {**options, "config_kwargs": {**config, "max_pool_connections": connections()}}


def _drop_expect(request: Any, **kwargs: Any) -> None:
    request.headers.pop("Expect", None)


def _client(fs: Any) -> Any:
    """s3fs's botocore client (made now if not yet: no request is sent); None if it cannot be made here."""
    try:
        return fs.s3
    except Exception:  # e.g. an asynchronous=True filesystem, or no region: the first request says what is wrong
        return None


def one_round_trip_writes(fs: Any) -> None:
    """Make ``fs`` (an s3fs filesystem; anything else is left alone) send its writes without waiting
    for ``100 Continue``.

    The handler goes on the client's events and on the session it came from, so a client s3fs makes
    again from that session has it too. Registering twice is a no-op.
    """
    if not multipart.supported(fs) or (client := _client(fs)) is None:
        return
    client.meta.events.register("before-send.s3", _drop_expect, unique_id=_HANDLER_ID)
    session = getattr(fs, "session", None)
    if session is not None:
        session.register("before-send.s3", _drop_expect, unique_id=_HANDLER_ID)


def presigned_gets(fs: Any) -> PresignedGets | None:
    """GETs through presigned URLs for ``fs``, or None: not s3fs, per-request options, or a client without
    the HTTP session this needs (then s3fs's own GETs are used)."""
    if not multipart.supported(fs) or getattr(fs, "version_aware", False):
        return None
    if getattr(fs, "req_kw", None) or getattr(fs, "s3_additional_kwargs", None):
        return None  # requester pays, SSE-C keys...: headers every request must carry
    client = _client(fs)
    if client is None or not hasattr(getattr(getattr(client, "_endpoint", None), "http_session", None), "send"):
        return None
    return PresignedGets(fs)


def range_header(start: int, end: int | None) -> str:
    """The ``Range`` of bytes ``[start, end)``; a negative ``start`` with no end: the last ``-start`` bytes."""
    if start < 0:
        if end is not None:
            raise ValueError("a suffix range has no end")
        return f"bytes={start}"
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"


class PresignedGets:
    """Ranged GETs of an s3fs filesystem's objects, each a presigned URL sent on its client's HTTP session.

    Parameters
    ----------
    fs : s3fs.S3FileSystem
        The filesystem (credentials, endpoint, region and HTTP session are its client's).
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def cat(self, path: str, start: int, end: int | None) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (``bucket/key``): one GET (see :func:`range_header`)."""
        from fsspec.asyn import sync

        return bytes(sync(self.fs.loop, self._get, path, start, end))

    def cat_ranges(self, path: str, cuts: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each ``[start, end)`` of ``path``, in parallel: a GET each."""
        from fsspec.asyn import sync

        async def gather() -> list[bytes]:
            return list(await asyncio.gather(*(self._get(path, a, b) for a, b in cuts)))

        return sync(self.fs.loop, gather)

    async def _get(self, path: str, start: int, end: int | None) -> bytes:
        from botocore.awsrequest import AWSRequest
        from botocore.exceptions import HTTPClientError

        if end is not None and start >= 0 and end <= start:
            return b""
        client = await self.fs.set_session()
        bucket, key, _ = self.fs.split_path(path)
        url = await client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                  ExpiresIn=_EXPIRES)
        request = AWSRequest(method="GET", url=url, headers={"Range": range_header(start, end)}).prepare()
        try:
            response = await client._endpoint.http_session.send(request)
            body = await response.content
        except HTTPClientError as e:  # connection refused, closed or timed out: worth another attempt
            raise ConnectionError(f"{path}: {e}") from e
        if response.status_code in (200, 206):
            return body
        if response.status_code == 416 and start == 0:  # an empty object has no byte 0
            return b""
        raise _error(response.status_code, body, path)


def _error(status: int, body: bytes, path: str) -> OSError:
    """The exception s3fs raises for this error answer (its table of S3 error codes)."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    def field(name: str) -> str:
        found = re.search(rb"<%s>([^<]{0,512})</%s>" % (name.encode(), name.encode()), body)
        return found.group(1).decode("utf-8", "replace") if found else ""

    code, message = field("Code") or str(status), field("Message") or f"HTTP {status}"
    error = ClientError({"Error": {"Code": code, "Message": message},
                         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    if code in ("NoSuchKey", "404"):
        return FileNotFoundError(errno.ENOENT, message, path)
    translated = translate_boto_error(error)
    return translated if isinstance(translated, OSError) else OSError(errno.EIO, f"{code}: {message}", path)

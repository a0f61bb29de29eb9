"""Local S3 test helpers: an in-process moto server and a counting, fault-injecting proxy.

Everything here talks to ``127.0.0.1`` only; nothing reaches real AWS or the instance
metadata service.  ``moto`` is imported lazily, so importing this module is cheap and works
without it installed.

Typical use (tests, notebooks, benchmark scripts)::

    with LocalS3Server() as server, S3Proxy(server.endpoint_url) as proxy:
        server.make_bucket("ckpt")
        fs = s3fs.S3FileSystem(**proxy.storage_options())
        fs.pipe("ckpt/a", b"x" * 100)
        assert proxy.requests_by_method["PUT"] == 1

Observed behaviour (s3fs 2026.9, aiobotocore 3.10, botocore 1.43, moto 5.2.5), checked on
the wire through :class:`S3Proxy` (``tests/test_testing_s3.py`` pins the important ones):

* ``fs.cat_file(path, start=s, end=e)`` (keywords! the second positional parameter is
  ``version_id``) is one ``GET`` with ``Range: bytes=s-(e-1)``, no ``HEAD``; ``bytes_sent``
  is the range length.  ``start=-n`` sends ``bytes=-n``.
* ``fs.cat_ranges(paths, starts, ends)`` is one ranged ``GET`` per range, issued
  concurrently; adjacent or overlapping ranges are never merged.
* ``fs.cat_file(path)`` / ``fs.cat(path)`` without a range is ``HEAD`` + ``GET``; objects
  larger than ``default_block_size`` (50 MiB) are fetched as concurrent 50 MiB ranged
  ``GET``s.  ``max_concurrency=1`` (or ``start=0``) skips the ``HEAD``.
* ``fs.pipe_file(path, data)`` is a single ``PutObject`` when
  ``len(data) < 2 * chunksize`` (``chunksize`` = 50 MiB by default): a 64 MiB ``pipe`` is
  one 64 MiB ``PUT``.  From 100 MiB on it is a multipart upload (``POST ?uploads``, 50 MiB
  part ``PUT``s, ``POST ?uploadId``).
* Conditional create: moto honours ``If-None-Match: *``; a second
  ``client.put_object(Bucket=b, Key=k, Body=..., IfNoneMatch="*")`` fails with ``412
  PreconditionFailed``.  ``fs.pipe_file(path, data, mode="create")`` sends
  ``If-None-Match: *`` on the ``PUT`` (on ``CompleteMultipartUpload`` for multipart, after
  uploading the parts; the upload is aborted on 412) and raises ``FileExistsError``;
  ``fs.open(path, "xb")`` does the same on its ``PUT`` at close.
* Caveat: a create whose acknowledgement is lost (``reset_after_rate``) is retried by
  botocore, gets 412 and raises ``FileExistsError`` although the caller's write succeeded.
* Retries: botocore retries 503 ``SlowDown`` and dropped connections (``max_attempts`` in
  ``config_kwargs["retries"]``; :func:`s3_storage_options` sets 10, mode ``standard``), and
  s3fs wraps each call in up to 5 attempts of its own (0.1 s, 0.17 s, ... sleeps).
  ``403`` is not retried: one request, then ``PermissionError``.

Notes
-----
moto keeps its backends per *process*: two :class:`LocalS3Server` in one process share
buckets, and :meth:`LocalS3Server.reset` wipes all of them.
"""

from __future__ import annotations

import uuid
from typing import Any

from .service import REGION, LocalService, s3_request, s3_storage_options

__all__ = ["LocalS3Server"]



class LocalS3Server(LocalService):
    """An in-process moto S3 server on ``127.0.0.1`` and a free port.

    Parameters
    ----------
    port : int, optional
        Port to listen on; by default a free one is picked by the OS (bind to port 0).

    Examples
    --------
    >>> with LocalS3Server() as server:  # doctest: +SKIP
    ...     server.make_bucket("b")
    ...     fs = s3fs.S3FileSystem(**server.storage_options())
    """

    def __init__(self, port: int | None = None) -> None:
        self._port = port
        self._server: Any = None

    def start(self) -> LocalS3Server:
        """Start the server (idempotent) and return ``self``."""
        if self._server is not None:
            return self
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self._port or 0, verbose=False)
        server.start()
        wsgi = getattr(server, "_server", None)
        if wsgi is not None:  # silence werkzeug's per-request access log
            base = wsgi.RequestHandlerClass
            wsgi.RequestHandlerClass = type("QuietMotoRequestHandler", (base,), {"log_request": lambda *a, **k: None})
        self._server = server
        return self

    def stop(self) -> None:
        """Stop the server and release its socket (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.stop()
        wsgi = getattr(server, "_server", None)
        if wsgi is not None:
            wsgi.server_close()

    @property
    def running(self) -> bool:
        """Whether the server is started."""
        return self._server is not None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the running server."""
        if self._server is None:
            raise RuntimeError("LocalS3Server is not started")
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options pointing at this server; see :func:`s3_storage_options`."""
        return s3_storage_options(self.endpoint_url, **extra)

    def client(self) -> Any:
        """Return a fresh ``boto3`` S3 client bound to this server."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}),
        )

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (``reshard-test-<random>`` if no name is given); return its name."""
        name = name or f"reshard-test-{uuid.uuid4().hex[:12]}"
        self._post(f"/{name}", method="PUT")
        return name

    def reset(self) -> None:
        """Delete all moto state (all buckets) in this process."""
        self._post("/moto-api/reset", method="POST")

    def _post(self, path: str, method: str) -> None:
        s3_request(self.endpoint_url, method, path)

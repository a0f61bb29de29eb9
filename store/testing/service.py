"""What the local S3 test services share: starting and stopping as a context, the region they
answer for, and the s3fs options that reach one (:class:`reshard.store.testing.LocalS3Server`,
:class:`reshard.store.testing.S3Proxy`)."""

from __future__ import annotations

import http.client
import urllib.parse
from types import TracebackType
from typing import Any, TypeVar

#: The region every local test endpoint answers for.
REGION = "us-east-1"

_S = TypeVar("_S", bound="LocalService")


class LocalService:
    """``with service:`` starts it and stops it; subclasses define ``start`` (returning self) and ``stop``."""

    def start(self: _S) -> _S:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

def s3_request(endpoint_url: str, method: str, path: str, timeout: float = 30) -> bytes:
    """Send one unsigned admin request (``PUT /bucket``, ``POST /moto-api/reset``) to a moto endpoint.

    Raises
    ------
    RuntimeError
        On an HTTP status of 300 or more (the status and the start of the body are named).
    """
    url = urllib.parse.urlsplit(endpoint_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    try:
        # A minimal SigV4-shaped header lets moto dispatch the call to S3.
        auth = ("AWS4-HMAC-SHA256 Credential=testing/20000101/us-east-1/s3/aws4_request, "
                "SignedHeaders=host, Signature=0")
        conn.request(method, path, headers={"Authorization": auth, "Content-Length": "0"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {body[:300]!r}")
        return body
    finally:
        conn.close()


def s3_storage_options(endpoint_url: str, **extra: Any) -> dict[str, Any]:
    """Return s3fs storage options for a local, credential-free S3 endpoint.

    Parameters
    ----------
    endpoint_url : str
        ``http://host:port`` of the S3 endpoint (a :class:`LocalS3Server` or
        :class:`S3Proxy`).
    **extra
        Merged on top; ``client_kwargs`` and ``config_kwargs`` dicts are merged one level
        deep rather than replaced.

    Returns
    -------
    dict
        Options for ``s3fs.S3FileSystem(**opts)`` or ``fsspec``'s ``storage_options``.
        Explicit key/secret/region and path-style addressing mean botocore never consults
        the environment credential chain or the instance metadata service.
    """
    opts: dict[str, Any] = {
        "key": "testing",
        "secret": "testing",
        "token": None,
        "anon": False,
        "endpoint_url": endpoint_url,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": REGION},
        "config_kwargs": {
            "s3": {"addressing_style": "path"},
            "retries": {"max_attempts": 10, "mode": "standard"},
            "connect_timeout": 5,
            "read_timeout": 30,
        },
        "cache_regions": False,
        "skip_instance_cache": True,
    }
    for name, value in extra.items():
        if name in ("client_kwargs", "config_kwargs") and isinstance(value, dict):
            opts[name] = {**opts[name], **value}
        else:
            opts[name] = value
    return opts

"""A counting, fault-injecting HTTP proxy in front of a local S3 server (tests, benchmarks).

:class:`S3Proxy` forwards every request to a server such as
:class:`reshard.store.testing.LocalS3Server`, records each one (:class:`ProxyRecord`:
method, key, range, status, bytes on the wire) and can fail a fraction of requests with
503, reset connections, or deny keys with 403. The observed s3fs/botocore behaviour it
was used to pin down is listed in :mod:`reshard.store.testing`.
"""

from __future__ import annotations

import fnmatch
import http.client
import http.server
import random
import re
import socket
import struct
import threading
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .service import LocalService, s3_storage_options

__all__ = ["ProxyRecord", "S3Proxy"]

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)

#: Query parameters of a presigned URL's signature, new with every signing (a retry is the same request).
_SIGNING = ("X-Amz-", "Signature=", "AWSAccessKeyId=", "Expires=")


def _unsigned(query: str) -> str:
    """``query`` without the parameters of a presigned signature."""
    return "&".join(p for p in query.split("&") if not p.startswith(_SIGNING))


@dataclass
class ProxyRecord:
    """One request seen by :class:`S3Proxy`.

    Attributes
    ----------
    method : str
        HTTP method.
    path : str
        Unquoted ``bucket/key`` (no leading slash, no query).
    query : str
        Raw query string (``uploads``, ``partNumber=1&uploadId=...``).
    range : str or None
        The ``Range`` request header.
    status : int
        Status sent to the client; 0 when the connection was reset.
    bytes_sent : int
        Response body bytes sent to the client.
    bytes_received : int
        Request body bytes received from the client.
    fault : str or None
        ``"fail"``, ``"reset"``, ``"reset-after"`` or ``"deny"`` if a fault was injected.
    headers : dict
        Request headers (lower-cased names).
    """

    method: str
    path: str
    query: str
    range: str | None
    status: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    fault: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _error_xml(code: str, message: str, resource: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>/{resource}</Resource><RequestId>{uuid.uuid4().hex[:16]}</RequestId>"
        "</Error>"
    ).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyHTTPServer
    _conn: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        proxy = self.server.proxy
        split = urllib.parse.urlsplit(self.path)
        body = self._read_body()
        rec = ProxyRecord(
            method=self.command,
            path=urllib.parse.unquote(split.path.lstrip("/")),
            query=split.query,
            range=self.headers.get("Range"),
            bytes_received=len(body),
            headers={k.lower(): v for k, v in self.headers.items()},
        )
        self._pending: ProxyRecord | None = rec
        try:
            fault = proxy._choose_fault(rec)
            rec.fault = fault
            if fault == "deny":
                self._reply(rec, 403, _error_xml("AccessDenied", "Access Denied", rec.path))
            elif fault == "fail":
                msg = "Please reduce your request rate."
                self._reply(rec, 503, _error_xml("SlowDown", msg, rec.path))
            elif fault == "reset":
                self._reset()
            else:
                try:
                    status, headers, payload = self._forward(body)
                except (OSError, http.client.HTTPException) as exc:
                    error = _error_xml("InternalError", f"proxy upstream: {exc}", rec.path)
                    self._reply(rec, 502, error)
                    return
                if fault == "reset-after":
                    self._reset()
                else:
                    self._reply(rec, status, payload, headers)
        finally:
            if self._pending is not None:  # no response sent: reset or error
                proxy._record(self._pending)
                self._pending = None

    def _reply(
        self,
        rec: ProxyRecord,
        status: int,
        payload: bytes,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.send_response_only(status)
        has_length = False
        for name, value in headers or [("Content-Type", "application/xml")]:
            low = name.lower()
            if low in _HOP_BY_HOP:
                continue
            if low == "content-length":
                if self.command != "HEAD":
                    continue
                has_length = True
            self.send_header(name, value)
        if not has_length:
            self.send_header("Content-Length", str(len(payload)))
        rec.status = status
        send_body = self.command != "HEAD" and status not in (204, 304)
        rec.bytes_sent = len(payload) if send_body else 0
        # Record before the client can see the response, so counters are exact on return.
        self.server.proxy._record(rec)
        self._pending = None
        self.end_headers()
        if send_body and payload:
            self.wfile.write(payload)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        # One keep-alive upstream connection per client connection, closed in finish().
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(*self.server.proxy._upstream, timeout=60)
            conn = self._conn
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST", "PATCH"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                resp = conn.getresponse()
                payload = resp.read()
                if resp.will_close:
                    conn.close()
                return resp.status, resp.getheaders(), payload
            except (ConnectionError, http.client.HTTPException):
                conn.close()  # stale keep-alive connection: reconnect once
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _reset(self) -> None:
        self.close_connection = True
        # SO_LINGER 0: close sends RST, like a dropped connection.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _handle


class _ProxyHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # The listen backlog (socketserver's default is 5): a client opening more connections at once than the
    # backlog holds has its SYN dropped and retried after a second, which read as 1 s stalls of single requests.
    request_queue_size = 128
    proxy: S3Proxy


class S3Proxy(LocalService):
    """Threaded HTTP reverse proxy that counts requests and injects S3-style faults.

    Every request is forwarded verbatim (method, path, query, headers including ``Range``
    and ``Host``, body) to ``upstream`` over a per-thread keep-alive connection.

    Parameters
    ----------
    upstream : str
        ``http://host:port`` to forward to, e.g. :attr:`LocalS3Server.endpoint_url`.
    fail_rate : float
        Fraction of requests answered ``503 SlowDown`` without forwarding.
    reset_rate : float
        Fraction of requests whose connection is reset (RST) without a response, before
        forwarding.
    reset_after_rate : float
        Fraction of requests that are forwarded (so they take effect upstream) and whose
        connection is then reset: a lost acknowledgement.
    seed : int or None
        Seed of the :class:`random.Random` choosing faults.
    max_faults : int or None
        Cap on injected 503s and resets (``deny`` is not counted); ``None`` is no cap.
    max_streak : int or None
        At most this many 503s/resets in a row for one request (same method, path, query
        and ``Range``): the next attempt is forwarded.  Bounds retry chains, so tests with
        a client's exponential backoff stay fast; ``None`` is no bound.

    Attributes
    ----------
    log : list of ProxyRecord
        Every request, in completion order.
    faults : int
        503s and resets injected so far.

    Notes
    -----
    ``fail_rate``, ``reset_rate``, ``reset_after_rate``, ``max_faults``, ``max_streak`` can
    be changed at any time; assigning ``seed`` reseeds the generator.
    """

    def __init__(
        self,
        upstream: str,
        *,
        fail_rate: float = 0.0,
        reset_rate: float = 0.0,
        reset_after_rate: float = 0.0,
        seed: int | None = 0,
        max_faults: int | None = None,
        max_streak: int | None = None,
    ) -> None:
        url = urllib.parse.urlsplit(upstream)
        self._upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self.fail_rate = fail_rate
        self.reset_rate = reset_rate
        self.reset_after_rate = reset_after_rate
        self.max_faults = max_faults
        self.max_streak = max_streak
        self._streaks: dict[tuple[str, str, str, str | None], int] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._seed = seed
        self._denied: list[tuple[re.Pattern[str], frozenset[str] | None, re.Pattern[str] | None]] = []
        self._server: _ProxyHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.log: list[ProxyRecord] = []
        self.faults = 0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> S3Proxy:
        """Start serving on ``127.0.0.1`` and a free port (idempotent); return ``self``."""
        if self._server is None:
            server = _ProxyHTTPServer(("127.0.0.1", 0), _Handler)
            server.proxy = self
            self._server = server
            self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close all sockets (idempotent, does not wait for clients)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        if self._server is None:
            raise RuntimeError("S3Proxy is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options pointing at the proxy; see :func:`s3_storage_options`."""
        return s3_storage_options(self.endpoint_url, **extra)

    # -- faults ------------------------------------------------------------------------
    @property
    def seed(self) -> int | None:
        """Seed of the fault generator; assigning reseeds it."""
        return self._seed

    @seed.setter
    def seed(self, value: int | None) -> None:
        with self._lock:
            self._seed = value
            self._rng.seed(value)

    def deny(self, pattern: str | re.Pattern[str], methods: str | None = None, query: str | None = None) -> None:
        """Answer ``403 AccessDenied`` to every request whose ``bucket/key`` matches.

        Parameters
        ----------
        pattern : str or re.Pattern
            A glob (``fnmatch``, ``*`` also matches ``/``) on ``bucket/key``, or a compiled
            regex (``search`` semantics).
        methods : str, optional
            Space- or comma-separated HTTP methods to restrict the denial to, e.g. ``"PUT"``.
        query : str, optional
            A glob the raw query string must match too, e.g. ``"*partNumber=2*"``: one part of a
            multipart upload.
        """
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(fnmatch.translate(pattern))
        meths = frozenset(methods.replace(",", " ").upper().split()) if methods else None
        asked = re.compile(fnmatch.translate(query)) if query is not None else None
        with self._lock:
            self._denied.append((regex, meths, asked))

    def clear_faults(self) -> None:
        """Turn all faults off: rates to 0, no denials, no caps, fault count to 0."""
        with self._lock:
            self.fail_rate = self.reset_rate = self.reset_after_rate = 0.0
            self.max_faults = self.max_streak = None
            self._denied.clear()
            self._streaks.clear()
            self.faults = 0

    def _choose_fault(self, rec: ProxyRecord) -> str | None:
        with self._lock:
            for regex, meths, asked in self._denied:
                if (meths is None or rec.method in meths) and regex.search(rec.path) \
                        and (asked is None or asked.match(rec.query)):
                    return "deny"
            key = (rec.method, rec.path, _unsigned(rec.query), rec.range)
            streak = self._streaks.pop(key, 0)
            if self.max_faults is not None and self.faults >= self.max_faults:
                return None
            if self.max_streak is not None and streak >= self.max_streak:
                return None
            x = self._rng.random()
            fault = None
            if x < self.fail_rate:
                fault = "fail"
            elif x < self.fail_rate + self.reset_rate:
                fault = "reset"
            elif x < self.fail_rate + self.reset_rate + self.reset_after_rate:
                fault = "reset-after"
            if fault is not None:
                self.faults += 1
                self._streaks[key] = streak + 1
            return fault

    # -- counters ----------------------------------------------------------------------
    def _record(self, rec: ProxyRecord) -> None:
        with self._lock:
            self.log.append(rec)

    def reset_counters(self) -> None:
        """Clear :attr:`log` (all counters derive from it) and the fault count."""
        with self._lock:
            self.log = []
            self.faults = 0

    def records(self, method: str | None = None, fault: str | None = None) -> list[ProxyRecord]:
        """Snapshot of :attr:`log`, optionally filtered by method and/or fault kind."""
        with self._lock:
            recs = list(self.log)
        return [r for r in recs if (method is None or r.method == method) and (fault is None or r.fault == fault)]

    @property
    def requests(self) -> int:
        """Total requests seen (including faulted ones)."""
        return len(self.log)

    @property
    def requests_by_method(self) -> Counter[str]:
        """Request count per HTTP method."""
        return Counter(r.method for r in self.records())

    @property
    def bytes_sent(self) -> int:
        """Response body bytes sent to clients (what they fetched)."""
        return sum(r.bytes_sent for r in self.records())

    @property
    def bytes_received(self) -> int:
        """Request body bytes received from clients (what they uploaded)."""
        return sum(r.bytes_received for r in self.records())

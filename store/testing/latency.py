"""A TCP relay that adds a round trip to every request: the latency half of the shaped test cloud.

Run as a script (``python latency.py --rtt 0.02 --route LISTEN=UPSTREAM ...``), normally inside
the network namespace of :class:`reshard.store.testing.ShapedCloud`. Every byte a client sends
is delivered upstream ``rtt`` seconds after it arrived; the answer flows back at once. So each
HTTP request on a keep-alive connection costs one round trip before its first response byte,
whatever the connection carried before (one RTT per request, not per connection), while a
long upload or download streams at the link's rate (the delay is a pipeline, not a pause).
A new connection costs one more round trip, as a TCP handshake does: its first bytes go
upstream no earlier than ``2 * rtt`` after it was accepted. ``--conn-mbit`` caps what one
connection downloads (an object store gives each connection a fraction of the link; here TCP
itself sees no delay, so without the cap one connection could fill the link).

No HTTP parsing happens here: bytes are relayed, so keep-alive, pipelining, chunked bodies
and ``Expect: 100-continue`` behave as with a direct connection. The script imports nothing
from reshard, so it runs from its file path in any interpreter.

``--log FILE`` records each connection's opening, each request's line and ``Range`` header as it
arrives and the first byte of its answer, with ``time.monotonic()`` stamps (one clock for every
process here): :mod:`reshard.store.testing.chain` reads it to count the round trips a client
made one after another (the critical path of a load, as the link saw it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import socket
import sys
import threading
import time

_CHUNK = 1 << 20
_PACED_CHUNK = 64 << 10
_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


class _Log:
    """The request log (``--log``): one tab-separated line an event, written whole under a lock."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - open for the relay's life
        self.lock = threading.Lock()
        self.conns = 0

    def new_conn(self, port: int) -> int:
        with self.lock:
            self.conns += 1
            n = self.conns
        self.write(n, "open", str(port))
        return n

    def write(self, conn: int, kind: str, detail: str = "") -> None:
        if self.file is not None:
            with self.lock:
                self.file.write(f"{time.monotonic():.6f}\t{conn}\t{kind}\t{detail}\n")


def _request_line(data: bytes) -> str | None:
    """``METHOD PATH RANGE`` of a request that starts ``data`` (RANGE ``-`` when none), else None."""
    if not data.startswith(_METHODS):
        return None
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    method, _, rest = head[0].partition(" ")
    rng = next((h.split(":", 1)[1].strip() for h in head[1:] if h.lower().startswith("range:")), "-")
    return f"{method} {rest.rsplit(' ', 1)[0]} {rng.replace(' ', '')}"


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Pipe:
    """One client connection relayed to one upstream connection."""

    def __init__(self, client: socket.socket, upstream: tuple[str, int], rtt: float, conn_rate: float,
                 log: _Log | None = None, port: int = 0) -> None:
        self.client = client
        self.log = log if log is not None and log.file is not None else None
        self.conn = self.log.new_conn(port) if self.log is not None else 0
        self.unanswered = 0  # requests logged whose answer's first byte was not seen yet
        self.conn_rate = conn_rate
        self.upstream_addr = upstream
        self.rtt = rtt
        self.accepted = time.monotonic()
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.upstream: socket.socket | None = None

    def run(self) -> None:
        threading.Thread(target=self._client_to_queue, daemon=True).start()
        self._queue_to_upstream()

    def _client_to_queue(self) -> None:
        """Read what the client sends; stamp each piece with the time it may go upstream."""
        ready = self.accepted + self.rtt  # the handshake's round trip
        try:
            while True:
                data = self.client.recv(_CHUNK)
                due = max(time.monotonic(), ready) + self.rtt
                if self.log is not None and (line := _request_line(data)) is not None:
                    with self.cond:
                        self.unanswered += 1
                    self.log.write(self.conn, "req", line)
                with self.cond:
                    self.queue.append((due, data))
                    self.cond.notify()
                if not data:
                    return
        except OSError:
            with self.cond:
                self.queue.append((time.monotonic(), b""))
                self.cond.notify()

    def _queue_to_upstream(self) -> None:
        try:
            self.upstream = socket.create_connection(self.upstream_addr, timeout=30)
            self.upstream.settimeout(None)
            _nodelay(self.upstream)
        except OSError:
            self.client.close()
            return
        back = threading.Thread(target=self._upstream_to_client, daemon=True)
        back.start()
        try:
            while True:
                with self.cond:
                    while not self.queue:
                        self.cond.wait()
                    due, data = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    self.upstream.shutdown(socket.SHUT_WR)
                    break
                self.upstream.sendall(data)
        except OSError:
            pass
        back.join()
        self.upstream.close()
        self.client.close()

    def _upstream_to_client(self) -> None:
        assert self.upstream is not None
        paced = self.conn_rate > 0
        buf = bytearray(_PACED_CHUNK if paced else _CHUNK)
        view = memoryview(buf)
        # Pacing: a token bucket of _PACED_CHUNK * 4 bytes filled at conn_rate bytes/s.
        tokens, last = float(_PACED_CHUNK * 4), time.monotonic()
        try:
            while True:
                n = self.upstream.recv_into(buf)
                if not n:
                    break
                if self.log is not None and self.unanswered:
                    with self.cond:
                        self.unanswered -= 1
                    self.log.write(self.conn, "resp")
                if paced:
                    now = time.monotonic()
                    tokens = min(float(_PACED_CHUNK * 4), tokens + (now - last) * self.conn_rate) - n
                    last = now
                    if tokens < 0:
                        time.sleep(-tokens / self.conn_rate)
                self.client.sendall(view[:n])
            self.client.shutdown(socket.SHUT_WR)
        except OSError:
            with contextlib.suppress(OSError):  # the client went away: stop the upstream side too
                self.upstream.shutdown(socket.SHUT_RDWR)


def _serve(listener: socket.socket, upstream: tuple[str, int], rtt: float, conn_rate: float,
           log: _Log | None = None) -> None:
    port = listener.getsockname()[1]
    while True:
        client, _ = listener.accept()
        _nodelay(client)
        threading.Thread(target=_Pipe(client, upstream, rtt, conn_rate, log, port).run, daemon=True).start()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    """Relay each ``--route LISTEN=UPSTREAM`` (``host:port=host:port``) with ``--rtt`` seconds added."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt", type=float, required=True, help="seconds added to each request")
    parser.add_argument("--route", action="append", required=True, help="LISTEN_HOST:PORT=UPSTREAM_HOST:PORT")
    parser.add_argument("--conn-mbit", type=float, default=0.0,
                        help="cap each connection's downloads at this many Mbit/s (0: no cap)")
    parser.add_argument("--ready", help="file to create once every route listens")
    parser.add_argument("--log", help="append each connection, request and answer's first byte to this file")
    args = parser.parse_args(argv)
    log = _Log(args.log)
    threads = []
    for route in args.route:
        listen, _, upstream = route.partition("=")
        listener = socket.create_server(_addr(listen), backlog=512)
        serve = (listener, _addr(upstream), args.rtt, args.conn_mbit * 1e6 / 8, log)
        threads.append(threading.Thread(target=_serve, args=serve, daemon=True))
    for t in threads:
        t.start()
    if args.ready:
        with open(args.ready, "w") as f:
            f.write(str(os.getpid()))
    sys.stdout.flush()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()

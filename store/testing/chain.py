"""Round trips one after another, from the latency relay's request log (``latency.py --log``).

The relay stamps each connection's opening, each request as it arrives and the first byte of
its answer, on ``time.monotonic()`` (one clock for every process of the machine). A request
*depends* on every earlier request whose answer had begun before it was sent: no client can
send it sooner, as far as the link can tell. So its **depth**, the round trips on the longest
chain that ends with it, is one more than the deepest of those, and one more again when it went
out on a connection still in its handshake (the relay holds a new connection's first bytes one
round trip, as TCP's handshake would), itself one deeper than the answers begun before the
connection opened. Requests sent together (a thread pool's burst) have equal depths: their
answers cannot begin before one round trip, and they leave within milliseconds of each other.

Depths count waits, not bytes: the last level of a load is its data, however long it streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Relayed:
    """One request the relay passed on."""

    conn: int
    #: The listening port it came in on (the http or the S3 route).
    port: int
    method: str
    #: Its path, without the query string.
    path: str
    #: Its ``Range`` header (``-`` when none), e.g. ``bytes=-65536``.
    range: str
    #: When it arrived at the relay, and when its answer's first byte came back (None: never).
    sent: float
    answered: float | None
    #: When its connection was opened.
    opened: float


def read_log(path: str | Path, since: float = 0.0, until: float = float("inf")) -> list[Relayed]:
    """The requests in a relay log sent in ``[since, until)`` (``time.monotonic()`` values), in order sent."""
    opened: dict[int, tuple[float, int]] = {}
    pending: dict[int, list[int]] = {}
    rows: list[tuple[int, str, str, str, float]] = []
    answered: list[float | None] = []
    for line in Path(path).read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 4:
            continue  # a line cut short by a relay that was stopped
        t, conn, kind, detail = float(parts[0]), int(parts[1]), parts[2], parts[3]
        if kind == "open":
            opened[conn] = (t, int(detail))
        elif kind == "req":
            method, target, rng = [*detail.split(" ", 2), "", ""][:3]
            path_ = target.split("?", 1)[0]  # a presigned S3 GET carries its signature in the query
            pending.setdefault(conn, []).append(len(rows))
            rows.append((conn, method, path_, rng or "-", t))
            answered.append(None)
        elif kind == "resp" and pending.get(conn):
            answered[pending[conn].pop(0)] = t
    out = []
    for (conn, method, path_, rng, sent), answer in zip(rows, answered, strict=True):
        at, port = opened.get(conn, (sent, 0))
        if since <= sent < until:
            out.append(Relayed(conn, port, method, path_, rng, sent, answer, at))
    return out


def depths(requests: list[Relayed], rtt: float) -> list[int]:
    """Each request's depth: the round trips on the longest chain of dependent ones ending with it
    (a handshake counted as one), in the order given (see the module's docstring)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].sent)
    depth = [0] * len(requests)
    done: list[tuple[float, int]] = []  # (answered, depth) of the requests placed so far

    def before(t: float) -> int:
        return max((d for a, d in done if a <= t), default=0)

    for i in order:
        r = requests[i]
        d = before(r.sent)
        if r.sent < r.opened + rtt:  # its connection's handshake was still under way: one round trip more
            d = max(d, 1 + before(r.opened))
        depth[i] = d + 1
        if r.answered is not None:
            done.append((r.answered, depth[i]))
    return depth


def critical_path(requests: list[Relayed], rtt: float) -> list[Relayed]:
    """One longest chain of dependent requests, first to last (handshakes not listed)."""
    if not requests:
        return []
    d = depths(requests, rtt)
    last = max(range(len(requests)), key=lambda i: (d[i], -requests[i].sent))
    chain = [last]
    while d[chain[-1]] > 1:
        r = requests[chain[-1]]
        earlier = [i for i in range(len(requests)) if d[i] == d[chain[-1]] - 1
                   and requests[i].answered is not None and requests[i].answered <= r.sent]  # type: ignore[operator]
        if not earlier:  # the step before was the handshake of its connection
            earlier = [i for i in range(len(requests)) if d[i] == d[chain[-1]] - 2
                       and requests[i].answered is not None and requests[i].answered <= r.opened]  # type: ignore[operator]
        if not earlier:
            break
        chain.append(max(earlier, key=lambda i: requests[i].sent))
    return [requests[i] for i in reversed(chain)]

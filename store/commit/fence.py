"""Fencing tokens: which job may save to a root, decided by storage, never by clocks or process ids.

Each job that opens a root for writing (the committer's process of a
:class:`~reshard.store.CheckpointManager`) takes the next **token**: it creates
``root/.reshard/fence/<N>.json`` (``N`` zero-padded to 12 digits) with a
create-if-absent write (local ``O_EXCL``, S3 ``If-None-Match: *``), starting
from the highest one it lists plus one and going up while one exists. Tokens
are therefore dense (``1..N`` all exist) and each is created by exactly one
job: the newest job holds the highest token, and a job holding ``N`` is
**superseded** exactly when ``<N+1>.json`` exists (one GET, no listing,
no clock). Once its start-up clean-up is done, the job writes
``<N>.ready``; the ranks of its other processes bind to the newest ready token
at their first write. Every rank's manifest records its job's token
(``"fence": N``); a commit refuses ranks that carry different tokens.

Nothing here reads a clock or a process id to decide anything: ``host``,
``pid`` and ``time`` in a token object are there to name the job in messages.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from reshard.layouts.errors import (
    CheckpointExistsError,
    CommitConflictError,
    JobSupersededError,
    UncommittedCheckpointError,
)

from ..io.storage import Storage

#: The folder of a root's fencing tokens.
FENCE_DIR = ".reshard/fence"
#: The manifest field that records the token of the job that wrote it.
MANIFEST_FIELD = "fence"
#: Most tokens a job tries to create in a row before it gives up (each failure: another job took that one).
MAX_TRIES = 1000
#: First and longest pause between two looks for a ready token (seconds).
POLL_MIN, POLL_MAX = 0.005, 1.0


def token_key(token: int) -> str:
    """Key (under the root) of token ``token``'s object."""
    return f"{FENCE_DIR}/{token:012d}.json"


def ready_key(token: int) -> str:
    """Key (under the root) of the mark that job ``token`` finished its start-up clean-up."""
    return f"{FENCE_DIR}/{token:012d}.ready"


@dataclass(frozen=True)
class Fence:
    """One job's token and, to name the job in messages only, where and when it started.

    Attributes
    ----------
    token : int
        The token (1, 2, ...): a higher one supersedes a lower one.
    job : str
        A random id of the job (two jobs never share one).
    host, pid, time :
        Where and when (this host's wall clock) the job took it: for messages, never for a decision.
    """

    token: int
    job: str
    host: str
    pid: int
    time: float

    def to_json(self) -> bytes:
        """The token object's bytes."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, token: int, raw: bytes | None) -> Fence:
        """A token object (unreadable fields become unknowns: the token number is what counts)."""
        try:
            doc = json.loads(raw) if raw is not None else {}
        except ValueError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}

        def field(name: str, kind: Any, default: Any) -> Any:
            value = doc.get(name)
            return value if isinstance(value, kind) and not isinstance(value, bool) else default

        return cls(token=token, job=field("job", str, "?"), host=field("host", str, "?"),
                   pid=field("pid", int, -1), time=float(field("time", int | float, float("nan"))))

    def describe(self) -> str:
        """``job 7 (started 2026-11-28 20:01:02 UTC by its host's clock, on host h, pid 1)``."""
        when = "at an unknown time" if self.time != self.time else \
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.time))
        return f"job {self.token} (started {when} by its host's clock, on host {self.host}, pid {self.pid})"


def _listed(root: Storage) -> int:
    """The highest token listed (0: none). A listing may be stale (a cache): callers probe upward by key."""
    found = [int(n[:-5]) for n in root.list(FENCE_DIR) if n.endswith(".json") and n[:-5].isdigit()]
    return max(found, default=0)


def read_fence(root: Storage, token: int) -> Fence | None:
    """Token ``token``'s object (one GET), or None if no job took it."""
    raw = root.read_if_exists(token_key(token))
    return None if raw is None else Fence.parse(token, raw)


def take(root: Storage) -> Fence:
    """Take the next token of ``root`` (one LIST, then one create-if-absent write per token tried).

    Raises
    ------
    CommitConflictError
        If :data:`MAX_TRIES` tokens in a row were taken by other jobs meanwhile.
    """
    token = _listed(root) + 1
    for _ in range(MAX_TRIES):
        fence = Fence(token=token, job=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(),
                      time=time.time())
        try:
            root.write_new(token_key(token), fence.to_json())
            return fence
        except CheckpointExistsError:
            token += 1  # another job took it: the next one (tokens stay dense)
    raise CommitConflictError(f"{root.url}: {MAX_TRIES} fencing tokens in a row were taken by other jobs "
                              f"starting on this root at the same time ({root.url}/{FENCE_DIR})")


def successor(root: Storage, fence: Fence) -> Fence | None:
    """The job that superseded ``fence`` (one GET of the next token), or None if it is still the newest."""
    return read_fence(root, fence.token + 1)


def superseded_error(root: Storage, fence: Fence, newer: Fence) -> JobSupersededError:
    """The error a superseded job gets, naming both jobs."""
    return JobSupersededError(
        f"{root.url}: this job, {fence.describe()}, was superseded by {newer.describe()}, which opened "
        "this root for writing since: this job saves and commits nothing more here (the newer job owns "
        "the root; no step mixes the two). Stop this job, or save to another root")


def check_current(root: Storage, fence: Fence) -> None:
    """Refuse a superseded job (one GET).

    Raises
    ------
    JobSupersededError
        If another job took a newer token of this root.
    """
    newer = successor(root, fence)
    if newer is not None:
        raise superseded_error(root, fence, newer)


def mark_ready(root: Storage, fence: Fence) -> None:
    """Say that job ``fence`` finished its start-up clean-up: its ranks may write."""
    root.write_atomic(ready_key(fence.token), fence.to_json())


def wait_ready(root: Storage, timeout: float, stop: threading.Event | None = None) -> Fence:
    """The newest token once its job is ready: what a rank of another process binds to at its first write.

    One LIST, then GETs only (the next token, the ready mark), polled with backoff.

    Raises
    ------
    UncommittedCheckpointError
        If no job is ready within ``timeout`` seconds.
    """
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout
    delay = POLL_MIN
    token = _listed(root)
    while True:
        while root.has(token_key(token + 1)):  # newer than the listing says
            token += 1
        if token and root.has(ready_key(token)) and not root.has(token_key(token + 1)):
            found = read_fence(root, token)
            if found is not None:
                return found
        if time.monotonic() >= deadline or stop.is_set():
            raise UncommittedCheckpointError(
                f"{root.url}: the job's committer has not started its manager here within {timeout:.0f} s "
                f"(no ready token in {root.url}/{FENCE_DIR}): a rank writes only once it has, so that the "
                "committer's start-up clean-up of unknown step folders never removes a save in progress")
        stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, POLL_MAX)


def manifest_token(manifest: Mapping[str, Any]) -> int | None:
    """The token a rank's manifest records (None: written without one, by a save outside a manager or before)."""
    value = manifest.get(MANIFEST_FIELD)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def describe_token(root: Storage | None, token: int | None) -> str:
    """A token as a message names it (reading its object when ``root`` is given)."""
    if token is None:
        return "no job token (a save outside a manager, or by an older reshard)"
    found = read_fence(root, token) if root is not None else None
    return found.describe() if found is not None else f"job {token}"


def check_one_job(url: str, manifests: Mapping[int, Mapping[str, Any]], root: Storage | None = None) -> None:
    """Refuse a save whose ranks were written by different jobs (their manifests carry different tokens).

    Raises
    ------
    CommitConflictError
        Naming a rank of each job, and the jobs.
    """
    by_token: dict[int | None, int] = {}
    for rank in sorted(manifests):
        by_token.setdefault(manifest_token(manifests[rank]), rank)
    if len(by_token) > 1:
        (a, ra), (b, rb) = sorted(by_token.items(), key=lambda kv: kv[1])[:2]
        raise CommitConflictError(
            f"{url}: ranks of two jobs wrote this save: rank {ra} by {describe_token(root, a)}, rank {rb} by "
            f"{describe_token(root, b)}; it is not committed (a step never mixes two jobs)")

"""Who may touch a generation: the writers' lease, ``gc``'s collected marks, the commit lock.

* a writer's **lease** (``<generation>/.reshard/lease.json``) tells ``gc`` the save is live;
* ``gc`` **marks** a generation collected (``url/.reshard/collected/<generation>``) before
  deleting it: that save never commits and its save_id is never used again at that URL;
* the **commit lock** (``<generation>/.reshard/commit.lock``, a create-if-absent write) lets
  one process commit a generation; a dead or finished holder's lock is broken.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from reshard.layouts.errors import (
    CheckpointExistsError,
    CommitConflictError,
)

from ..format.meta import (
    LOCK_KEY,
)
from ..io.storage import Storage
from .marker import (
    GENERATION_PREFIX,
    generation_of,
    read_marker,
)

#: Seconds after which a commit lock whose holder did not finish is broken by the next committer.
DEFAULT_LOCK_LEASE = 600.0
#: ``gc``'s mark of a generation it collected: ``url/.reshard/collected/<generation>``. That generation
#: never commits again, and its name is never used again at this URL (a reader of it can only find it gone).
COLLECTED_DIR = ".reshard/collected"
#: A save's lease, ``<generation>/.reshard/lease.json``: written by each writer before its first shard and
#: renewed by later writes; ``gc`` keeps a generation whose lease is younger than its ``min_age``.
LEASE_KEY = ".reshard/lease.json"
#: Seconds between two renewals of a writer's lease (a write call renews it when it is older).
LEASE_RENEW = 60.0


def collected_key(generation: str) -> str:
    """The key (under the checkpoint root) of ``gc``'s mark of a collected generation."""
    return f"{COLLECTED_DIR}/{generation}"


def check_not_collected(root: Storage, generation: str) -> None:
    """Refuse a generation that ``gc`` collected (one GET).

    Raises
    ------
    CommitConflictError
        If ``gc`` marked it collected: some of its objects may be gone, and its name is not reused.
    """
    if root.read_if_exists(collected_key(generation)) is not None:
        raise CommitConflictError(
            f"{root.url}: save {generation[len(GENERATION_PREFIX):]!r} was removed by `reshard gc` (it looked "
            f"abandoned: see {root.url}/{collected_key(generation)}); a collected save never commits and its "
            "save_id is not used again at this URL: save under a new save_id")


class Lease:
    """A writer's lease on its generation: ``gc`` leaves a generation alone while its lease is young.

    :meth:`renew` is called by each write call (one rank's write, a block
    writer's block); it writes the lease if this writer never did or did more
    than :data:`LEASE_RENEW` seconds ago, checking that ``gc`` did not collect
    the generation (a save_id is never reused after ``gc``). One small object
    per generation.
    """

    def __init__(self, root: Storage, generation: str) -> None:
        self.root, self.generation = root, generation
        self._renewed: float | None = None
        self._lock = threading.Lock()

    def renew(self, check: bool = False) -> None:
        """Write the lease if never done, or more than :data:`LEASE_RENEW` s ago, refusing a collected generation.

        The check costs one GET. It is made when the lease is written and, with
        ``check``, every call (a rank's write: a save gc collected meanwhile
        writes no more); a block writer's blocks skip it (its commit refuses).
        """
        with self._lock:
            now = time.monotonic()
            due = self._renewed is None or now - self._renewed >= LEASE_RENEW
            if check or due:
                check_not_collected(self.root, self.generation)
            if not due:
                return
            body = json.dumps({"time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}).encode()
            self.root.child(self.generation).write_atomic(LEASE_KEY, body)  # ranks of many processes renew it
            self._renewed = now


# ---------------------------------------------------------------------- lock
def lock_body(lease: float) -> bytes:
    """A lock's content: a fresh token, the time, this host and process, the lease in seconds."""
    return json.dumps({"token": uuid.uuid4().hex, "time": time.time(), "host": socket.gethostname(),
                       "pid": os.getpid(), "lease": lease}).encode()


def lock_is_stale(holder: Any, now: float) -> bool:
    """Whether a lock may be broken: its lease ran out, its holder is a dead process of this host, or unreadable."""
    if not isinstance(holder, dict) or holder.get("done") is True:  # unreadable, or its commit finished
        return True
    try:
        if now - float(holder["time"]) > float(holder.get("lease", DEFAULT_LOCK_LEASE)):
            return True
        if holder.get("host") == socket.gethostname():
            os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (KeyError, TypeError, ValueError):
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def lock_is_live(gen: Storage, key: str = LOCK_KEY) -> bool:
    """Whether a commit of this generation is in progress: its lock is there and its holder looks alive."""
    raw = gen.read_if_exists(key)
    if raw is None:
        return False
    try:
        holder = json.loads(raw)
    except ValueError:
        return False
    return not lock_is_stale(holder, time.time())


def take_lock(root: Storage, gen: Storage, save_id: str, *, force: bool = False,
              lease: float = DEFAULT_LOCK_LEASE) -> bytes:
    """Take the commit lock of one generation (create-if-absent), breaking a dead or finished holder's; its body.

    Raises
    ------
    CommitConflictError
        If the generation is committed already, or a live process holds its lock.
    """
    body = lock_body(lease)
    try:
        gen.write_new(LOCK_KEY, body)
        return body
    except CheckpointExistsError:
        pass
    current = read_marker(root)
    if current is not None and current[0].generation == gen.url.rsplit("/", 1)[-1]:
        raise CommitConflictError(f"{root.url}: save {save_id!r} is committed already")
    try:
        holder = json.loads(gen.read(LOCK_KEY))
    except (FileNotFoundError, ValueError):
        holder = None
    if not (force or lock_is_stale(holder, time.time())):
        age = time.time() - float(holder["time"])
        raise CommitConflictError(
            f"{root.url}: save {save_id!r} is being committed by {holder.get('host')} pid {holder.get('pid')} "
            f"(lock taken {age:.0f} s ago, lease {holder.get('lease')} s). If that process is dead, "
            f"run `reshard unlock {root.url} --save-id {save_id}` or commit(..., force=True); "
            "a lock older than its lease is broken by the next commit")
    gen.delete(LOCK_KEY, recursive=False)
    try:
        gen.write_new(LOCK_KEY, body)
    except CheckpointExistsError:
        raise CommitConflictError(f"{root.url}: another process took the commit lock of save {save_id!r}") from None
    return body


def unlock(url: str | Storage, save_id: Any = None, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Remove the commit lock of a save (``reshard unlock``); True if there was one.

    For a committer that died holding the lock. A lock older than its lease is
    broken by the next commit anyway; this is for not waiting that long.
    """
    root = url if isinstance(url, Storage) else Storage(url, storage_options)
    gen = root.child(generation_of(save_id))
    existed = gen.exists(LOCK_KEY)
    gen.delete(LOCK_KEY)
    return existed



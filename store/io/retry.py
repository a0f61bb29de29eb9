"""Which storage failures are worth another attempt, and the attempts: :meth:`Storage._call` for every call.

A remote store's request can fail for a moment (a dropped connection, a throttled
request, a 5xx): those are retried with exponential backoff. A missing object, a
missing bucket, a refusal (permissions, no space, a link, a name too long) is not: no
retry cures it, and it is raised at once, as a :class:`StorageError` naming the object
(a missing object stays a FileNotFoundError: callers tell "not written" from "broken").
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import TypeVar

from reshard.layouts.errors import StorageError

T = TypeVar("T")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
#: Errors no retry can cure: denied, no space, a link or a loop of links, a name too long, not seekable.
_PERMANENT_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENOSPC, errno.ELOOP, errno.ENAMETOOLONG, errno.ESPIPE,
                     errno.ENXIO)


def call(where: str, fn: Callable[[], T], retries: int, retried: Callable[[], None]) -> T:
    """``fn()``, again after a transient failure (at most ``retries`` more times, backing off up to 2 s);
    ``retried()`` is called before each new attempt. Errors name ``where``."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except FileNotFoundError as e:
            if missing_bucket(e):  # not "nothing there": the store itself is not there
                raise StorageError(f"{where}: {e}") from e
            raise
        except FileExistsError:
            raise
        except _PERMANENT as e:
            raise StorageError(f"{where}: {type(e).__name__}: {e}") from e
        except (OSError, TimeoutError, ConnectionError) as e:
            if attempt == retries or not transient(e):
                raise StorageError(f"{where}: failed after {attempt + 1} attempt(s): {e}") from e
            retried()
            time.sleep(min(2.0, 0.05 * 2**attempt))
    raise AssertionError("unreachable")


def missing_bucket(e: FileNotFoundError) -> bool:
    """Whether a "not found" is about the bucket (S3 ``NoSuchBucket``, GCS/Azure alike), not a key."""
    causes = [e, e.__cause__, e.__context__]
    text = " ".join(f"{type(c).__name__} {c}" for c in causes if c is not None).lower()
    return "nosuchbucket" in text or "bucket does not exist" in text or "containernotfound" in text


def transient(e: BaseException) -> bool:
    """Whether another attempt may succeed (not an errno no retry cures)."""
    return not (isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS)

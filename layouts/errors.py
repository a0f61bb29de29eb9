"""Every error reshard raises.

One module for the whole project (``reshard.store`` re-exports it). Each error
derives from :class:`ReshardError` and from the built-in a caller would
naturally catch (``ValueError``, ``KeyError``, ``FileNotFoundError``...), and its
message names the bad value.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Base class of every reshard error."""


class LayoutError(ReshardError, ValueError):
    """A layout that cannot exist: bad mesh, bad axis, a split that does not divide."""


class UnsupportedError(LayoutError):
    """A valid framework layout that reshard cannot represent exactly (e.g. some strided DTensor shards)."""


class RankError(LayoutError):
    """A rank id that is not part of the layout's mesh."""


class ShapeMismatchError(ReshardError, ValueError):
    """An array whose shape differs from what the layout or checkpoint says."""


class DTypeMismatchError(ReshardError, TypeError):
    """An array whose dtype differs from what the checkpoint says, or is unsupported."""


class BadNameError(ReshardError, ValueError):
    """A tensor or group name that is empty, malformed or would escape the checkpoint root."""


class FormatError(ReshardError, ValueError):
    """Bytes that do not follow a format reshard reads (zarr metadata, protobuf, JSON)."""


class CheckpointNotFoundError(ReshardError, FileNotFoundError):
    """Nothing that looks like a checkpoint at a URL."""


class TensorNotFoundError(ReshardError, KeyError):
    """A tensor name that the checkpoint does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UncommittedCheckpointError(ReshardError, RuntimeError):
    """A checkpoint whose commit marker is missing, or whose ranks did not all write."""


class CheckpointExistsError(ReshardError, FileExistsError):
    """Saving into a URL that already holds a committed checkpoint (without overwrite)."""


class CommitConflictError(ReshardError, RuntimeError):
    """Two writers raced to commit the same URL; this one lost."""


class JobSupersededError(CommitConflictError):
    """A job whose fencing token a newer job superseded on its root: it saves and commits nothing more there."""


class CheckpointReplacedError(ReshardError, RuntimeError):
    """An open checkpoint whose URL was committed anew (or garbage-collected) since it was opened."""


class ChecksumError(ReshardError, OSError):
    """Stored bytes whose crc32c does not match: corruption, named by tensor and chunk."""


class StorageError(ReshardError, OSError):
    """A storage request that failed for good (after retries), named by URL and key."""

__all__ = [name for name, obj in list(globals().items())
           if isinstance(obj, type) and issubclass(obj, ReshardError)]

"""Counters of storage requests and bytes (:class:`IOStats`), kept by :class:`~reshard.store.io.storage.Storage`."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class IOStats:
    """Counters of one operation (or of a storage's life).

    Attributes
    ----------
    requests : int
        Read requests sent to storage (one coalesced range is one request).
    bytes_fetched : int
        Bytes read from storage.
    bytes_delivered : int
        Bytes of tensor data handed to the caller.
    writes : int
        Objects written.
    bytes_written : int
        Bytes written.
    tasks : int
        Tasks run (thread-pool jobs or dask tasks).
    retries : int
        Requests repeated after a transient failure.
    """

    requests: int = 0
    bytes_fetched: int = 0
    bytes_delivered: int = 0
    writes: int = 0
    bytes_written: int = 0
    tasks: int = 0
    retries: int = 0

    def add(self, **counts: int) -> None:
        for k, v in counts.items():
            setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> IOStats:
        return IOStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: IOStats) -> IOStats:
        return IOStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

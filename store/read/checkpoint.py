"""Reading a checkpoint: a lazy :class:`Checkpoint`, lazy tensors, explicit reads.

:func:`reshard.store.read.open.open` reads the commit marker and the root ``zarr.json``
(which carries the consolidated metadata of every array): two small reads, no data,
and makes the :class:`Checkpoint`. Indexing a
tensor builds a lazy view; ``.read()``, ``np.asarray`` or ``load`` do the I/O,
touching only the inner chunks that intersect what is asked for.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import (
    CheckpointReplacedError,
    FormatError,
    ShapeMismatchError,
    TensorNotFoundError,
)

from ..commit.locate import Locator
from ..format.meta import COMMIT_KEY, ArrayMeta
from ..format.tree import LayoutSpec, flatten, from_json, resolve_layout, suggest, unflatten
from ..io import progress
from ..io.gcpause import gc_paused
from ..io.stats import IOStats
from ..io.storage import Storage
from .fetch import Fetcher, target_region
from .lazy import LazyTensor, Region

if TYPE_CHECKING:
    from .graph import LoadResult

class Checkpoint(Mapping[str, "LazyTensor"]):
    """An open checkpoint: a mapping of dotted names to lazy tensors.

    Use :func:`open` to get one.
    """

    def __init__(self, storage: Storage, arrays: dict[str, ArrayMeta], leaves: dict[str, Any],
                 committed: bool, engine: str = "fast", gap: int | None = None, *,
                 root: Storage | None = None, marker: bytes | None = None,
                 locator: Locator | None = None) -> None:
        #: The generation this view reads: its folder (``url/gen-<save_id>``), in either form.
        self.storage = storage
        #: The checkpoint's URL, whose marker names the committed generation.
        self.root = root if root is not None else storage
        self.arrays = arrays
        #: The non-tensor leaves, as saved (bytes-like ones decoded by :func:`from_json`).
        self.leaves = {k: from_json(v) for k, v in leaves.items()}
        self.committed = committed
        #: The marker's bytes when opened: reads check the checkpoint was not replaced since.
        self.marker = marker
        #: The save_id of the save this view reads (None for format version 1).
        self.save_id: str | None = None
        self.check_replaced = True
        #: What the ranks' manifests disagree on (an uncommitted save opened for forensics).
        self.conflicts: list[str] = []
        #: The one I/O path of every read (shard indexes are cached there).
        self.fetcher = Fetcher(storage, engine, gap, locator=locator, root=self.root)

    # ----------------------------------------------------------- mapping
    def __getitem__(self, name: str) -> Any:
        """A tensor's lazy view; also a leaf's value (``ck["step"]``) or a sub-tree (``ck["model"]``).

        Iteration, ``len`` and ``in`` cover the tensors only (the mapping's keys).

        Raises
        ------
        TensorNotFoundError
            No tensor, leaf or group has that name (close matches are suggested).
        """
        meta = self.arrays.get(name)
        if meta is not None:
            return LazyTensor(self, meta)
        if name in self.leaves:
            return self.leaves[name]
        from .subtree import SubTree

        tree = SubTree(self, name)
        if tree.names or tree.leaf_names:
            return tree
        raise TensorNotFoundError(f"{self.url}: no tensor named {name!r}{suggest(name, self.names())}")

    def tensor(self, name: str) -> ArrayMeta:
        """The record of tensor ``name`` (a leaf or a group is not one: :class:`TensorNotFoundError`)."""
        meta = self.arrays.get(name)
        if meta is None:
            what = "a leaf" if name in self.leaves else None
            if what is None and any(n.startswith(name + ".") for n in self.arrays):
                what = "a group of tensors"
            raise TensorNotFoundError(f"{self.url}: no tensor named {name!r}"
                                      + (f" (it is {what})" if what else suggest(name, self.names())))
        return meta

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def names(self) -> list[str]:
        """Every tensor and leaf name (dotted)."""
        return [*self.arrays, *self.leaves]

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def url(self) -> str:
        return self.root.url

    @property
    def zarr_url(self) -> str:
        """The folder of the opened save, a zarr v3 hierarchy: directory form only.

        ``zarr.open_group(zarr_url)``, ``dask.array.from_zarr(f"{zarr_url}/model/w")``,
        TensorStore's ``zarr3`` driver. :meth:`zarr_store` serves zarr-python,
        xarray and dask in either form.

        Raises
        ------
        FormatError
            The save is in the packed form: its chunks are byte ranges of its
            ranks' data objects, so no folder of it is a zarr hierarchy (packed
            saves before 2026-11-27 left a ``zarr.json`` there that zarr-python
            opened and read as fill values). The message gives the ways that read it.
        """
        if self.fetcher.locator is not None:
            raise FormatError(
                f"{self.url}: the save is in the packed form, whose chunks are byte ranges of its data objects: no "
                "folder of it is a zarr hierarchy. For zarr-python, xarray and dask use "
                f"rs.open({self.url!r}).zarr_store() (or fsspec's reference:// over {self.references_url}, "
                "docs/format.md); for a folder TensorStore and zarr.open_group open, "
                f"`reshard convert {self.url} DST --form directory`")
        return self.storage.url

    @property
    def form(self) -> str:
        """The storage form: ``"packed"`` or ``"directory"``."""
        return "directory" if self.fetcher.locator is None else "packed"

    @property
    def references_url(self) -> str | None:
        """Packed form: the save's kerchunk references (``fsspec`` ``reference://``); None otherwise."""
        return None if self.fetcher.locator is None else self.fetcher.locator.references_url

    def zarr_store(self) -> Any:
        """The opened save as a read-only zarr-python store, in either form: for zarr, xarray and dask.

        ``zarr.open_group(ckpt.zarr_store(), mode="r")``,
        ``xarray.open_datatree(ckpt.zarr_store(), engine="zarr")``. The
        directory form is the generation's folder; the packed form goes through
        fsspec's ``reference://`` filesystem over :attr:`references_url` (the
        recipe of docs/format.md, which needs no reshard code). Open groups
        with their consolidated metadata (zarr's default; every save has it):
        zarr's ``FsspecStore`` cannot list a reference filesystem's top level.
        Every location the store may request is checked first, as reshard's own
        reads are (:meth:`reshard.store.read.fetch.Fetcher.general_store`).
        """
        return self.fetcher.general_store(self.arrays.values())

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.arrays.values())

    @property
    def stats(self) -> IOStats:
        """Counters of every request this checkpoint made so far."""
        return self.storage.stats

    def tree(self) -> dict[str, Any]:
        """Nested dict of lazy tensors and leaves (the state dict's shape)."""
        return unflatten({**self.leaves, **{n: self[n] for n in self.arrays}})

    def __repr__(self) -> str:
        state = "" if self.committed else ", UNCOMMITTED"
        return f"<reshard.Checkpoint {self.url!r}: {len(self)} tensors, {_human(self.nbytes)}{state}>"

    def _repr_html_(self) -> str:
        from .display import checkpoint_html

        return checkpoint_html(self)

    # ------------------------------------------------------------ reading
    @property
    def engine(self) -> str:
        return self.fetcher.engine

    @property
    def gap(self) -> int:
        return self.fetcher.gap

    def read_regions(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]]) -> IOStats:
        """Fill destinations from stored regions; see :meth:`reshard.store.read.fetch.Fetcher.read_regions`.

        Raises
        ------
        CheckpointReplacedError
            The URL was committed anew (or its save deleted) since this view was opened.
        FormatError
            An object of the save is missing (a snapshot whose save was deleted, or an incomplete copy).
        """
        check = self._check_alongside()
        try:
            stats = self.fetcher.read_regions(jobs)
        except (FileNotFoundError, FormatError) as e:
            if check is not None:
                check.join()
            self.check_current()  # a missing object of a replaced save says so
            if isinstance(e, FileNotFoundError):  # a snapshot (check_current=False) whose save is gone, or a copy
                raise FormatError(f"{self.url}: {e.filename or e} is missing: the save this view reads was "
                                  "deleted (gc or retention) or copied incompletely") from None
            raise
        if check is None:
            self.check_current()  # after the read: what it returns was the checkpoint when it returned
        else:  # the marker read while the data was: what it returns was the checkpoint during the read
            check.join()
            check.result()
        progress.advance(sum(dest.nbytes for _, _, dest in jobs),
                         tensors=sum(dest.shape == meta.shape for meta, _, dest in jobs))
        return stats

    def _check_alongside(self) -> _Check | None:
        """Remote: :meth:`check_current` started now, in a thread of its own, to run while the data is read
        (no round trip after the data's); None locally or when there is nothing to check."""
        if self.marker is None or not self.check_replaced or self.root.local:
            return None
        check = _Check(self.check_current)
        check.start()
        return check

    def check_current(self) -> None:
        """Raise :class:`CheckpointReplacedError` if the URL's marker is no longer the one opened.

        One small read, made after every read through this view (``load``,
        ``read``, ``LazyTensor.read``; not inside dask graphs). A view opened on
        a committed save reads that save's immutable objects; this check makes
        it refuse rather than silently serve a save that is no longer the
        checkpoint (reopen to read the new one). ``open(..., check_current=False)``
        turns it off: the view then reads its save as a snapshot while it exists.
        """
        if self.marker is None or not self.check_replaced:
            return
        try:
            now = self.root.read(COMMIT_KEY)
        except FileNotFoundError:
            now = None
        if now != self.marker:
            state = "was uncommitted or deleted" if now is None else "was replaced by a newer save"
            raise CheckpointReplacedError(f"{self.url}: the checkpoint {state} after it was opened; open it again")

    @gc_paused()
    def read(self, name: str, region: Region | None = None) -> np.ndarray:
        """Read one tensor (or a region of it) into a new numpy array."""
        meta = self.tensor(name).resolve()
        region = region if region is not None else tuple(slice(0, n) for n in meta.shape)
        dest = np.empty(tuple(r.stop - r.start for r in region), dtype=meta.np_dtype)
        self.read_regions([(meta, region, dest)])
        return dest

    @gc_paused()
    def load(self, layouts: LayoutSpec, rank: int, *, names: Any = None,
             out: Mapping[str, Any] | None = None, as_: str = "numpy", device: Any = None,
             pin_memory: bool = False) -> dict[str, Any]:
        """One rank's local pieces under target layouts (nested like the saved state).

        Parameters
        ----------
        layouts : mapping or callable
            ``{name: Layout}`` or ``(name, shape) -> Layout`` for the target.
            With a mapping, only the tensors it names are loaded.
        rank : int
            The target rank; tensors whose target layout does not include it are
            left out.
        names : iterable of str, optional
            Restrict to these tensors.
        out : mapping, optional
            Destination arrays to fill in place (nested or dotted names, each of
            the rank's local shape and the stored dtype, C-contiguous), e.g. the
            buffers of already allocated framework tensors: no new memory.
            With ``as_="torch"``: torch tensors of the local shape, on any
            device and of any dtype (other than in place, they get a copy).
        as_ : {"numpy", "torch"}
            What the arrays are returned as.
        device : str or torch.device, optional
            With ``as_="torch"``: where new tensors go (default CPU); for an
            accelerator the reads land in pinned host memory, then one
            asynchronous copy per tensor, synchronised before returning.
        pin_memory : bool
            With ``as_="torch"``: return CPU tensors in page-locked memory
            (ignored when torch sees no accelerator, as pinning needs one).

        Returns
        -------
        dict
            Nested dict of numpy arrays (or torch tensors), plus the non-tensor
            leaves. The arrays this call allocates are views of one buffer (see
            :func:`allocate`): its memory is freed once the last of them is dropped.
        """
        if as_ not in ("numpy", "torch"):
            raise ValueError(f"as_ must be 'numpy' or 'torch', got {as_!r}")
        if as_ == "numpy" and (device is not None or pin_memory):
            raise ValueError("device and pin_memory need as_='torch'")
        if as_ == "torch":
            from .torch_load import load_torch

            wanted = [(n, m, lay.local_shape(rank), target_region(lay, rank)) for n, m in self._select(layouts, names)
                      if (lay := self._target(layouts, m)).has_rank(rank)]
            return unflatten({**self.leaves, **load_torch(self, wanted, out, device, pin_memory)})
        given = flatten(out, self.arrays)[0] if out is not None else {}
        wanted = []
        for name, meta in self._select(layouts, names):
            layout = self._target(layouts, meta)
            if layout.has_rank(rank):
                wanted.append((name, meta, layout.local_shape(rank), target_region(layout, rank)))
        fresh = iter(allocate([(shape, meta.np_dtype) for name, meta, shape, _ in wanted if name not in given]))
        jobs = []
        result: dict[str, Any] = dict(self.leaves)
        for name, meta, shape, region in wanted:
            dest = given[name] if name in given else next(fresh)
            if dest.shape != shape or dest.dtype != meta.np_dtype:
                raise ShapeMismatchError(
                    f"tensor {meta.name!r}: out buffer is {dest.dtype}{list(dest.shape)}, "
                    f"rank {rank} needs {meta.dtype}{list(shape)}")
            jobs.append((meta, region, dest))
            result[name] = dest
        self.last_stats = self.read_regions(jobs)
        return unflatten(result)

    def load_many(self, layouts: LayoutSpec, ranks: Iterable[int], **options: Any) -> LoadResult:
        """Load many target ranks at once as one dask graph; see :func:`reshard.store.read.graph.load_many`.

        Options: ``names``, ``scheduler`` (threads, ``"sync"`` or a
        ``dask.distributed.Client``), ``fusion``, ``fuse_bytes``, ``gap``, ``progress``.
        """
        from .graph import load_many

        return load_many(self, layouts, ranks, **options)

    def read_all(self) -> dict[str, Any]:
        """Every tensor whole (integration onto one host) plus the leaves."""
        return self.load(lambda n, s: Layout.single(s), rank=0)

    def _select(self, layouts: LayoutSpec, names: Any) -> list[tuple[str, ArrayMeta]]:
        if names is None:
            names = list(layouts) if isinstance(layouts, Mapping) else list(self.arrays)
        return [(n, self.tensor(n).resolve()) for n in names]  # checked before buffers are sized by them

    @staticmethod
    def _target(layouts: LayoutSpec, meta: ArrayMeta) -> Layout:
        layout = resolve_layout(layouts, meta.name, None if isinstance(layouts, Mapping) else meta.shape)
        if tuple(layout.shape) != meta.shape:
            raise ShapeMismatchError(
                f"tensor {meta.name!r}: target layout is for shape {tuple(layout.shape)}, "
                f"the checkpoint holds {meta.shape}")
        return layout

    def export(self, path: str, format: str = "safetensors", **options: Any) -> IOStats:
        """Stream every tensor into one file (an existing one only with ``overwrite=True``); see
        :func:`reshard.store.read.export.export`."""
        from .export import export

        return export(self, path, format=format, **options)


class _Check(threading.Thread):
    """A call run in a thread of its own; :meth:`result` raises what it raised."""

    def __init__(self, fn: Any) -> None:
        super().__init__(daemon=True, name="reshard-check")
        self.fn = fn
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # handed to the caller by result()
            self.error = e

    def result(self) -> None:
        if self.error is not None:
            raise self.error


#: Alignment of each array inside a buffer from :func:`allocate` (a cache line).
ALIGN = 64


def allocate(specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[np.ndarray]:
    """New C-contiguous arrays of the given shapes and dtypes, as views of one buffer.

    One large allocation instead of many: numpy asks the kernel for transparent
    huge pages on allocations from 4 MiB up, and the first write to fresh
    memory (the page faults) is what dominates loading from the page cache.
    Measured on the bench machine: first touch of 256 KiB to 3 MiB arrays
    runs at about 1.2 GiB/s, of one large buffer at about 7 GiB/s.
    """
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // ALIGN) * ALIGN
    buf = np.empty(total, dtype=np.uint8)
    return [buf[at : at + n].view(dtype).reshape(shape)
            for at, n, (shape, dtype) in zip(starts, sizes, specs, strict=True)]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"

"""dask graphs of checkpoint reads.

``build``: read tasks, dask arrays, ``load_many``. ``schedule``: fusion of small
reads, the in-flight byte budget, running a graph (progress bars: :mod:`reshard.store.io.progress`).
"""

from ...io.progress import progress_bar
from .build import (
    LoadResult,
    ReadOp,
    ReadTask,
    Source,
    chunk_step,
    count_home,
    load_many,
    open_source,
    read_block,
    read_ops,
    read_task,
    source_of,
    to_dask,
    total,
)
from .schedule import (
    DEFAULT_BUDGET,
    DEFAULT_FUSE_BYTES,
    DEFAULT_FUSION_CAP,
    Budget,
    BudgetRef,
    budget,
    fuse,
    fusion_cap,
    release,
    run,
)

__all__ = [
    "DEFAULT_BUDGET", "DEFAULT_FUSE_BYTES", "DEFAULT_FUSION_CAP", "Budget", "BudgetRef", "LoadResult", "ReadOp",
    "ReadTask", "Source", "budget", "chunk_step", "count_home", "fuse", "fusion_cap", "load_many", "open_source",
    "progress_bar", "read_block", "read_ops", "read_task", "release", "run", "source_of", "to_dask", "total",
]

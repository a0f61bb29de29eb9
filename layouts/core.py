"""The :class:`Layout`: how one tensor's pieces sit on the ranks of a device mesh.

A layout is pure data (frozen, hashable, JSON round-trip). Everything derived
from it (each rank's region and replica id, the distinct blocks) is computed
once per distinct layout by :mod:`._table` and cached.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, cast

from . import _ranks, _table, adapters, jsonform
from ._blocks import Explicit, check_blocks
from ._geometry import Geometry, geometry
from ._pieces import Pieces
from ._ranks import all_ranks  # noqa: F401  (re-exported)
from ._ranks import check_ints as _ints
from ._ranks import short as _short
from ._split import check_dims
from .errors import LayoutError, RankError
from .records import Block


@dataclass(frozen=True)
class Layout:
    """How a tensor of global `shape` is divided over the ranks of a mesh.

    Parameters
    ----------
    shape : tuple of int
        Global tensor shape.
    mesh : tuple of int
        Mesh shape (each axis at least 1).
    ranks : tuple of int, optional
        Global rank ids laid row-major over the mesh, last axis fastest.
        Distinct, ``prod(mesh)`` of them. Empty (the default) means
        ``range(prod(mesh))``.
    dims : tuple of tuple of int, optional
        One entry per tensor dim: the mesh axes splitting it, outer first;
        ``()`` = not split. An axis splits at most one dim; unused axes
        replicate. Empty (the default) means no dim is split.
    split : {"even", "ceil", "balanced"}
        How a dim of size S is cut into k pieces: ``even`` (S % k == 0
        required), ``ceil`` (``torch.chunk``), ``balanced`` (OneFlow: the first
        S % k pieces get one more).
    nested : bool
        With several axes on one dim: ``False`` cuts S once into the product of
        their sizes (MindSpore, JAX); ``True`` lets each axis cut the extent
        already narrowed by the previous ones (OneFlow, DTensor).
    opt_shard : int, optional
        MindSpore optimizer sharding: ``None`` off, ``-1`` the whole replica
        group, ``s > 0`` groups of s. See :attr:`opt_sharded`.
    explicit : tuple, optional
        Blocks given directly, ``(rank, global_offset, local_shape,
        replica_id)`` per rank (Megatron); then `mesh` is the number of
        distinct ranks and `ranks` them in order of first appearance. A rank
        listed in several blocks holds them all, each block with a fifth
        element, its offset in the rank's local array (see :meth:`pieces`).
    origin : dict, optional
        The framework's own description (JSON-able). Not compared or hashed.
    """

    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    ranks: tuple[int, ...] = ()
    dims: tuple[tuple[int, ...], ...] = ()
    split: str = "even"
    nested: bool = False
    opt_shard: int | None = None
    explicit: Explicit | None = None
    origin: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    #: Subclasses by the ``kind`` their JSON form names (``class FlatLayout(Layout, kind="flat")``).
    _kinds: ClassVar[dict[str, type[Layout]]] = {}

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            Layout._kinds[kind] = cls

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("shape", _ints(self.shape, "shape"))
        put("mesh", _ints(self.mesh, "mesh", minimum=1))
        n = math.prod(self.mesh)
        ranks = _ranks.run(0, n) if not self.ranks else _ranks.rank_set(self.ranks)  # checked once per list
        put("ranks", ranks.ranks)
        put("_rankset", ranks)
        if len(self.ranks) != n:
            raise LayoutError(f"mesh {list(self.mesh)} has {n} positions but {len(self.ranks)} ranks")
        if not ranks.distinct:
            dup = sorted({r for r in self.ranks if self.ranks.count(r) > 1})
            raise LayoutError(f"ranks {dup} appear more than once in the layout")
        if not self.dims and self.shape:
            put("dims", ((),) * len(self.shape))
        put("dims", check_dims(self.shape, self.mesh, self.dims, self.split))
        if self.opt_shard == 0:
            put("opt_shard", None)
        if self.opt_shard is not None and (int(self.opt_shard) < -1 or isinstance(self.opt_shard, bool)):
            raise LayoutError(f"opt_shard {self.opt_shard!r} must be None, -1 or a positive int")
        put("nested", bool(self.nested))
        if self.explicit is not None:
            self._check_explicit()

    def _check_explicit(self) -> None:
        blocks = check_blocks(self.shape, self.explicit or ())
        object.__setattr__(self, "explicit", blocks)
        want = tuple(dict.fromkeys(b[0] for b in blocks))
        if self.mesh != (len(want),) or self.ranks != want:
            raise LayoutError(f"explicit layout must have mesh [{len(want)}] and ranks {list(want)}")
        if any(self.dims) or self.opt_shard is not None:
            raise LayoutError("explicit layout cannot also split dims or shard the optimizer")

    def __hash__(self) -> int:
        """The hash of the compared fields, computed once (the ranks' hash once per rank list)."""
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = hash((self.shape, self.mesh, self._rankset.hash, self.dims, self.split,
                                                   self.nested, self.opt_shard, self.explicit))
        return found

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the fields only (the cached tables are rebuilt on demand)."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ----------------------------------------------------------------- derived

    @cached_property
    def _rankset(self) -> _ranks.RankSet:
        """The checked rank list (set by the constructor; looked up again after unpickling or :meth:`single`)."""
        return _ranks.rank_set(self.ranks)

    @cached_property
    def _geo(self) -> Geometry:
        """Mesh layouts: the O(ndim) answers (region, replica id, holders, regularity)."""
        return geometry(self.shape, self.mesh, self._rankset, self.dims, self.split, self.nested, self.opt_shard)

    @cached_property
    def _info(self) -> _table.GridInfo | _table.ExplicitInfo:
        """The block table: explicit layouts always, mesh layouts only for :meth:`blocks`."""
        if self.explicit is not None:
            return _table.ExplicitInfo(self)
        return _table.GridInfo(self)

    @property
    def _ex(self) -> _table.ExplicitInfo:
        """:attr:`_info` of an explicit layout (callers check ``explicit is not None``)."""
        return cast(_table.ExplicitInfo, self._info)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def ndim(self) -> int:
        """Number of tensor dims."""
        return len(self.shape)

    @property
    def opt_sharded(self) -> bool:
        """Whether optimizer sharding took effect (see `opt_shard`)."""
        return self.explicit is None and self.opt_shard is not None and self._geo.opt > 0

    @property
    def opt_group_size(self) -> int:
        """Ranks sharing one model-parallel block under optimizer sharding (1 if off)."""
        return self._geo.opt if self.opt_sharded else 1

    def has_rank(self, rank: int) -> bool:
        """Whether `rank` is one of the layout's ranks (O(1), where ``rank in layout.ranks`` scans them)."""
        return self._rankset.position(rank) is not None

    def _pos(self, rank: int) -> int:
        p = self._rankset.position(rank)
        if p is None:
            raise RankError(f"rank {rank!r} is not in the layout's ranks {_short(self.ranks)}")
        return p

    def _bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        if self.explicit is not None:
            return self._info.bounds(self._pos(rank))
        return self._geo.bounds(self._pos(rank))

    def region(self, rank: int) -> tuple[slice, ...]:
        """Global region held by `rank`, as ``slice(start, stop)`` per dim.

        Raises
        ------
        LayoutError
            If `rank` holds several blocks (:meth:`pieces`).
        """
        if self._one_whole(rank):
            return tuple(slice(0, n) for n in self.shape)
        if self.explicit is not None and self._ex.multi:
            found = self._ex.pieces[self._pos(rank)]
            if len(found) > 1:
                raise LayoutError(f"rank {rank} holds {len(found)} blocks of this tensor ({self.describe()}, e.g. a "
                                  "GLU linear_fc1's gate and up halves or a fused q/k/v), not one region: use "
                                  "Layout.pieces(rank)")
        return tuple(slice(lo, hi) for lo, hi in self._bounds(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of `rank`'s local array (a rank holding several blocks: the box they tile, :meth:`pieces`)."""
        if self._one_whole(rank):
            return self.shape
        if self.explicit is not None:
            return self._ex.shapes[self._pos(rank)]
        return tuple(hi - lo for lo, hi in self._bounds(rank))

    def pieces(self, rank: int) -> Pieces:
        """`rank`'s blocks as ``(global region, region of its local array)`` each, in the order given.

        One piece, ``(region(rank), the whole local array)``, for every rank of
        a layout without :attr:`multi_piece`; a rank of an explicit layout
        listed in several blocks holds them all, its local array the box their
        local offsets tile (Megatron's GLU ``linear_fc1``: ``gate[t]`` then
        ``up[t]`` along dim 0).
        """
        if self.explicit is not None:
            return self._ex.pieces[self._pos(rank)]
        region = self.region(rank)
        return ((region, tuple(slice(0, s.stop - s.start) for s in region)),)

    @property
    def multi_piece(self) -> bool:
        """Whether some rank holds several blocks (then :meth:`region` refuses it: use :meth:`pieces`)."""
        return self.explicit is not None and self._ex.multi

    def _one_whole(self, rank: int) -> bool:
        """Whether this is one rank's whole tensor and `rank` is that rank (a quick answer without the block
        table: an integration builds one such layout per tensor)."""
        return len(self.ranks) == 1 and rank == self.ranks[0] and self._whole

    def replica_id(self, rank: int) -> int:
        """0 for the rank that writes its region, 1, 2... for the other holders.

        Ranks with an empty region get an id too (they write nothing).
        """
        if self.explicit is not None:
            return self._info.replica(self._pos(rank))
        return self._geo.replica(self._pos(rank))

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of `rank` (row-major, last axis fastest)."""
        p = self._pos(rank)
        return (p,) if self.explicit is not None else _table.mesh_coords(p, self.mesh)

    def blocks(self) -> tuple[Block, ...]:
        """Every distinct non-empty region with its holders, in C order of starts (O(blocks): built on demand)."""
        return self._info.blocks()

    def boundaries(self, dim: int) -> tuple[int, ...]:
        """Sorted distinct block starts and stops along `dim` (always 0 and the size)."""
        if not 0 <= dim < self.ndim:
            raise LayoutError(f"dim {dim} out of range for shape {list(self.shape)}")
        if self._whole:
            return (0, self.shape[dim]) if self.shape[dim] else (0,)
        if self.explicit is None:
            return self._geo.boundaries(dim)
        return self._explicit_boundaries[dim]

    def block_shape(self) -> tuple[int, ...]:
        """The shape of the block at the origin: a regular layout's grid cell (O(ndim)).

        Edge blocks of a regular layout may be smaller. The shape itself when
        the layout has no block (a dim of size 0) or is one whole block.
        """
        if self._whole:
            return self.shape
        if self.explicit is None:
            return self._geo.cell()
        blocks = self.blocks()
        return blocks[0].shape if blocks else self.shape

    @cached_property
    def _whole(self) -> bool:
        """One block, the whole tensor (no dim split, no optimizer sharding): the quick answers below."""
        return self.explicit is None and self.opt_shard is None and not any(self.dims)

    @cached_property
    def _explicit_boundaries(self) -> tuple[tuple[int, ...], ...]:
        out = [{0, size} for size in self.shape]
        for b in self.blocks():
            for found, s in zip(out, b.region, strict=True):
                found.update((s.start, s.stop))
        return tuple(tuple(sorted(found)) for found in out)

    def owner(self, point: Sequence[int]) -> int:
        """The first holder (replica 0) of the block holding the element at `point`.

        Raises
        ------
        LayoutError
            If `point` lies outside the tensor.
        """
        if self.explicit is None and not self._whole:
            return self._geo.owner(self._inside(point))
        return self.holders(point)[0]

    def _inside(self, point: Sequence[int]) -> tuple[int, ...]:
        point = tuple(point)
        if len(point) != self.ndim or not all(0 <= x < n for x, n in zip(point, self.shape, strict=True)):
            raise LayoutError(f"point {list(point)} lies outside shape {list(self.shape)}")
        return point

    def holders(self, point: Sequence[int]) -> tuple[int, ...]:
        """The ranks holding the block that holds the element at `point`, by replica id (replica 0 first).

        Raises
        ------
        LayoutError
            If `point` lies outside the tensor.
        """
        point = self._inside(point)
        if self._whole:  # every rank holds the whole tensor, in mesh order
            return self.ranks
        if self.explicit is None:
            return self._geo.holders(point)
        for b in self.blocks():
            if all(s.start <= x < s.stop for s, x in zip(b.region, point, strict=True)):
                return b.ranks
        raise LayoutError(f"no block of {self.describe()} holds point {list(point)}")  # pragma: no cover

    def is_regular(self) -> bool:
        """True iff the blocks are the cells of a regular grid (edge cells may be smaller).

        The cell shape is the first block's shape (:meth:`block_shape`); this is
        the layout zarr can store with one shard per block.
        """
        return self._regular

    @cached_property
    def _regular(self) -> bool:
        if self._whole:
            return True
        if self.explicit is None:
            return self._geo.regular
        blocks = self.blocks()
        if not blocks:
            return True
        cell = blocks[0].shape
        count = 1
        for d, (size, c) in enumerate(zip(self.shape, cell, strict=True)):
            want = (*range(0, size, c), size)
            if self.boundaries(d) != want:
                return False
            count *= len(want) - 1
        return len(blocks) == count

    # ------------------------------------------------------------ constructors

    @classmethod
    def single(cls, shape: Sequence[int], rank: int = 0) -> Layout:
        """One device, `rank`, holds the whole tensor."""
        if cls is not Layout:
            return cls(tuple(shape), (1,), (rank,))
        # the fields __post_init__ would give, without its checks (none can fail here beyond the ints):
        # an integration builds one such layout per tensor
        shape, (rank,) = _ints(shape, "shape"), _ints((rank,), "rank")
        obj = object.__new__(cls)
        obj.__dict__.update(shape=shape, mesh=(1,), ranks=(rank,), dims=((),) * len(shape), split="even",
                            nested=False, opt_shard=None, explicit=None, origin=None)
        return obj

    @classmethod
    def from_mindspore(
        cls,
        dev_matrix: Sequence[int],
        tensor_map: Sequence[int | Sequence[int]],
        shape: Sequence[int],
        opt_shard_size: int | None = None,
        ranks: Sequence[int] | None = None,
        stage: int = 0,
    ) -> Layout:
        """From a MindSpore device matrix and tensor map (see :mod:`.adapters`)."""
        return adapters.from_mindspore(Layout, dev_matrix, tensor_map, shape, opt_shard_size, ranks, stage)

    @classmethod
    def from_sharded_state_dict(
        cls,
        shard: Sequence[int],
        shape: Sequence[int],
        total_rank: int,
        stage_rank_size: int | None = None,
        stage: int = 0,
    ) -> Layout:
        """From a MindSpore ``sharded_state_dict`` entry (seed 002)."""
        return adapters.from_sharded_state_dict(Layout, shard, shape, total_rank, stage_rank_size, stage)

    @classmethod
    def from_oneflow(cls, ranks: Any, sbp: Any, shape: Sequence[int]) -> Layout:
        """From a OneFlow placement's rank array and its (N-d) SBP."""
        return adapters.from_oneflow(Layout, ranks, sbp, shape)

    @classmethod
    def from_dtensor(
        cls,
        mesh_shape: int | Sequence[int],
        placements: Any,
        shape: Sequence[int],
        ranks: Sequence[int] | None = None,
    ) -> Layout:
        """From a torch DTensor mesh shape and placements (``Shard``/``Replicate``)."""
        return adapters.from_dtensor(Layout, mesh_shape, placements, shape, ranks)

    @classmethod
    def from_jax(
        cls,
        mesh_axes: Mapping[str, int] | Sequence[tuple[str, int]],
        partition_spec: Sequence[Any],
        shape: Sequence[int],
        ranks: Sequence[int] | None = None,
    ) -> Layout:
        """From a JAX mesh's named axes and a ``PartitionSpec``."""
        return adapters.from_jax(Layout, mesh_axes, partition_spec, shape, ranks)

    @classmethod
    def from_blocks(cls, shape: Sequence[int], blocks: Sequence[Sequence[Any]]) -> Layout:
        """From explicit ``(rank, global_offset, local_shape, replica_id)`` blocks."""
        return adapters.from_blocks(Layout, shape, blocks)

    @classmethod
    def from_megatron(cls, shape: Sequence[int], blocks: Sequence[Sequence[Any]]) -> Layout:
        """From Megatron-Core ``ShardedTensor`` offsets; same as :meth:`from_blocks`."""
        return cls.from_blocks(shape, blocks)

    # -------------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        """Stable JSON-able form (``"version": 1``); see :meth:`from_json`. Do not modify the result (it is cached)."""
        return self._json

    @cached_property
    def _json(self) -> dict[str, Any]:
        return jsonform.to_json(self)

    def to_json_text(self) -> str:
        """:meth:`to_json` as compact JSON text (``separators=(",", ":")``; cached: manifests repeat it)."""
        return self._json_text

    @cached_property
    def _json_text(self) -> str:
        return json.dumps(self._json, separators=(",", ":"))

    @classmethod
    def from_json(cls, obj: Any) -> Layout:
        """Inverse of :meth:`to_json`; raises FormatError on anything else."""
        return jsonform.from_json(obj, Layout, Layout._kinds)

    def describe(self) -> str:
        """Short human form, e.g. ``dev[2,4] tmap[-1,0] opt2`` or ``mesh[2,4] dims[0,-] even``."""
        return jsonform.describe(self)

    def __repr__(self) -> str:
        return f"Layout(shape={list(self.shape)}, {self.describe()}, ranks={_short(self.ranks)})"

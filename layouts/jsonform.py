"""JSON form and short description of a :class:`~reshard.layouts.Layout`.

Version 1::

    {"version": 1, "shape": [8, 6], "mesh": [2, 4],
     "ranks": {"range": [0, 8]}          # or an explicit list of ints
     "dims": [[0], []], "split": "even", "nested": false,
     "opt_shard": null, "explicit": null, "origin": {...} | null}

``explicit`` (when not null) is a list of ``[rank, offset, local_shape,
replica_id]``, with a fifth element, ``local_offset``, for a rank listed in
several blocks (where the block sits in the rank's local array). A
contiguous run of ranks is written as ``{"range": [start, stop]}`` to keep
metadata small for large meshes.

A flattened-range layout (:class:`~reshard.layouts.flat.FlatLayout`) is::

    {"version": 1, "kind": "flat", "shape": [8, 6],
     "ranges": [[rank, start, stop, replica_id], ...]       # ranges of the whole tensor
           or  [[rank, offset, block, start, stop, replica_id], ...],   # of (TP-local) blocks
     "origin": {...} | null}

or, for the even cut of :meth:`FlatLayout.even` (ZeRO-3: every rank a range of every
parameter), ``"even": ranks`` (a list, or ``{"range": [start, stop]}``) in place of
``"ranges"``: O(1) bytes where the ranges would be O(ranks).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from . import _ranks
from .errors import FormatError, LayoutError

if TYPE_CHECKING:
    from .core import Layout
    from .flat import FlatLayout

VERSION = 1
#: Most mesh positions a stored layout may describe (a bound on what parsing allocates).
MAX_RANKS = 1 << 24
_KEYS = {"version", "shape", "mesh", "ranks", "dims", "split", "nested", "opt_shard", "explicit", "origin"}
_FLAT_KEYS = {"version", "kind", "shape", "ranges", "even", "origin"}
#: Most dims a stored flat layout may have (its checks and boxes go dim by dim).
MAX_FLAT_NDIM = 64


def to_json(layout: Layout) -> dict[str, Any]:
    """Return the JSON-able dict of `layout` (lists, ints, strings, bools, None)."""
    found = layout._rankset
    ranks: Any = {"range": [found.start, found.start + layout.size]} if found.start is not None else found.as_list
    explicit = None
    if layout.explicit is not None:
        explicit = [[rk, list(off), list(shp), rid, *(list(v) for v in local)]
                    for rk, off, shp, rid, *local in layout.explicit]
    return {
        "version": VERSION,
        "shape": list(layout.shape),
        "mesh": list(layout.mesh),
        "ranks": ranks,
        "dims": [list(a) for a in layout.dims],
        "split": layout.split,
        "nested": layout.nested,
        "opt_shard": layout.opt_shard,
        "explicit": explicit,
        "origin": layout.origin,
    }


def _int_list(obj: Any, what: str) -> list[int]:
    if type(obj) is not list or not all(type(v) is int for v in obj):  # JSON ints only: no bools
        raise FormatError(f"layout JSON field {what!r} must be a list of ints, got {obj!r}")
    return obj


def from_json(obj: Any, layout: type[Layout], kinds: Mapping[str, type[Layout]]) -> Layout:
    """Build a layout from :func:`to_json` output (a dict, or a JSON string).

    Raises
    ------
    FormatError
        Not a dict of the known fields, an unknown version, wrong types, or
        values describing an impossible layout.
    """
    if isinstance(obj, (str, bytes)):
        try:
            obj = json.loads(obj)
        except ValueError as e:
            raise FormatError(f"layout JSON does not parse: {e}") from None
    if not isinstance(obj, dict):
        raise FormatError(f"layout JSON must be an object, got {type(obj).__name__}")
    if obj.get("version") != VERSION:
        raise FormatError(f"layout JSON version {obj.get('version')!r} is not supported (want {VERSION})")
    if "kind" in obj:
        return _flat_from_json(obj, kinds)
    unknown = set(obj) - _KEYS
    if unknown:
        raise FormatError(f"layout JSON has unknown fields {sorted(unknown)}")
    mesh = _int_list(obj.get("mesh"), "mesh")
    positions = math.prod(mesh)
    if positions > MAX_RANKS:
        raise FormatError(f"layout JSON mesh {mesh} has {positions} positions, over {MAX_RANKS}")
    ranks = obj.get("ranks")
    if isinstance(ranks, dict):
        bounds = _int_list(ranks.get("range"), "ranks.range")
        if len(bounds) != 2 or bounds[1] - bounds[0] != positions:
            raise FormatError(f"layout JSON ranks.range {bounds} must be [start, start + {positions}] for mesh {mesh}")
        ranks = _ranks.run(bounds[0], positions).ranks if bounds[0] >= 0 else list(range(*bounds))
    dims = obj.get("dims", [])
    if not isinstance(dims, list):
        raise FormatError(f"layout JSON field 'dims' must be a list, got {dims!r}")
    explicit = obj.get("explicit")
    blocks = None
    if explicit is not None:
        if not isinstance(explicit, list):
            raise FormatError(f"layout JSON field 'explicit' must be a list, got {explicit!r}")
        blocks = []
        for b in explicit:
            if not (isinstance(b, list) and len(b) in (4, 5) and type(b[0]) is int and type(b[3]) is int):
                raise FormatError("layout JSON explicit block must be [rank, offset, shape, replica] or [rank, "
                                  f"offset, shape, replica, local_offset], got {b!r}")
            local = (tuple(_int_list(b[4], "local_offset")),) if len(b) == 5 else ()
            blocks.append((b[0], tuple(_int_list(b[1], "offset")), tuple(_int_list(b[2], "shape")), b[3], *local))
    split, nested = obj.get("split", "even"), obj.get("nested", False)
    opt, origin = obj.get("opt_shard"), obj.get("origin")
    if not isinstance(split, str) or not isinstance(nested, bool):
        raise FormatError(f"layout JSON split/nested must be str/bool, got {split!r}/{nested!r}")
    if opt is not None and (not isinstance(opt, int) or isinstance(opt, bool)):
        raise FormatError(f"layout JSON opt_shard must be an int or null, got {opt!r}")
    if origin is not None and not isinstance(origin, dict):
        raise FormatError(f"layout JSON origin must be an object or null, got {origin!r}")
    if (mesh == [1] and blocks is None and opt is None and origin is None and split == "even" and not nested
            and isinstance(ranks, (list, tuple)) and len(ranks) == 1 and type(ranks[0]) is int and ranks[0] >= 0
            and all(a == [] for a in dims)):  # one rank's whole tensor (the most common record): no checks left
        shape = _int_list(obj.get("shape"), "shape")
        if len(dims) == len(shape) and all(n >= 0 for n in shape):
            return layout.single(shape, ranks[0])
    try:
        return layout(
            shape=tuple(_int_list(obj.get("shape"), "shape")),
            mesh=tuple(mesh),
            ranks=ranks if type(ranks) is tuple else tuple(_int_list(ranks, "ranks")),  # a run: checked once
            dims=tuple(tuple(_int_list(a, "dims")) for a in dims),
            split=split,
            nested=nested,
            opt_shard=opt,
            explicit=tuple(blocks) if blocks is not None else None,
            origin=origin,
        )
    except (LayoutError, ValueError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"layout JSON describes an impossible layout: {e}") from e


def flat_to_json(layout: FlatLayout) -> dict[str, Any]:
    """The JSON-able dict of a flat layout (short ranges when every block is the whole tensor)."""
    r = layout.ranks
    if (all(rid == 0 for *_, rid in layout.ranges) and all(b == layout.shape for _, _, b, _, _, _ in layout.ranges)
            and type(layout).even(layout.shape, r) == layout):
        even: Any = {"range": [r[0], r[0] + len(r)]} if r == tuple(range(r[0], r[0] + len(r))) else list(r)
        return {"version": VERSION, "kind": "flat", "shape": list(layout.shape), "even": even,
                "origin": layout.origin}
    whole = all(block == layout.shape for _, _, block, _, _, _ in layout.ranges)
    ranges = [[rank, start, stop, rid] if whole else [rank, list(off), list(block), start, stop, rid]
              for rank, off, block, start, stop, rid in layout.ranges]
    return {"version": VERSION, "kind": "flat", "shape": list(layout.shape), "ranges": ranges,
            "origin": layout.origin}


def _flat_from_json(obj: dict[str, Any], kinds: Mapping[str, type[Layout]]) -> FlatLayout:
    if obj.get("kind") != "flat":
        raise FormatError(f"layout JSON kind {obj.get('kind')!r} is not supported (want 'flat')")
    flat = cast("type[FlatLayout]", kinds["flat"])
    unknown = set(obj) - _FLAT_KEYS
    if unknown:
        raise FormatError(f"layout JSON has unknown fields {sorted(unknown)}")
    shape = _int_list(obj.get("shape"), "shape")
    if len(shape) > MAX_FLAT_NDIM:
        raise FormatError(f"layout JSON flat layout has {len(shape)} dims, over {MAX_FLAT_NDIM}")
    ranges, origin = obj.get("ranges"), obj.get("origin")
    if origin is not None and not isinstance(origin, dict):
        raise FormatError(f"layout JSON origin must be an object or null, got {origin!r}")
    if "even" in obj:
        if ranges is not None:
            raise FormatError("layout JSON flat layout has both 'even' and 'ranges'")
        even = obj["even"]
        if isinstance(even, dict):
            bounds = _int_list(even.get("range"), "even.range")
            if len(bounds) != 2 or not 0 < bounds[1] - bounds[0] <= MAX_RANKS:
                raise FormatError(f"layout JSON even.range {bounds} must be [start, stop] of 1 to {MAX_RANKS} ranks")
            even = list(range(*bounds))
        even = _int_list(even, "even")
        if not even or len(even) > MAX_RANKS:
            raise FormatError(f"layout JSON field 'even' must name 1 to {MAX_RANKS} ranks")
        try:
            return flat.even(shape, even, origin)
        except (LayoutError, ValueError) as e:
            raise FormatError(f"layout JSON describes an impossible flat layout: {e}") from e
    if type(ranges) is not list or not ranges or len(ranges) > MAX_RANKS:
        raise FormatError(f"layout JSON field 'ranges' must be a non-empty list of at most {MAX_RANKS} ranges")
    entries: list[tuple[Any, ...]] = []
    for r in ranges:
        if type(r) is list and len(r) == 4:
            entries.append(tuple(_int_list(r, "ranges")))
        elif type(r) is list and len(r) == 6:
            rank, off, block, start, stop, rid = r
            head = _int_list([rank, start, stop, rid], "ranges")
            entries.append((head[0], tuple(_int_list(off, "offset")), tuple(_int_list(block, "block")), *head[1:]))
        else:
            raise FormatError(f"layout JSON flat range must be [rank, start, stop, replica] or "
                              f"[rank, offset, block, start, stop, replica], got {r!r}")
    try:
        return flat.from_ranges(shape, entries, origin)
    except (LayoutError, ValueError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"layout JSON describes an impossible flat layout: {e}") from e


def _nums(values: Any) -> str:
    parts = []
    for v in values:
        parts.append("(" + ",".join(map(str, v)) + ")" if isinstance(v, (list, tuple)) else str(v))
    return "[" + ",".join(parts) + "]"


def describe(layout: Layout) -> str:
    """Short human form of `layout`.

    MindSpore origin: ``dev[2,4] tmap[-1,0]`` plus `` opt2`` when optimizer
    sharding took effect and `` stage1`` for a pipeline stage other than 0
    (its ranks are ``stage * prod(dev) + local``). Otherwise ``mesh[2,4] dims[0,-] even`` where each
    dim lists its mesh axes (``0.1`` = axes 0 then 1, ``-`` = not split),
    followed by ``nested`` and ``optN`` when they apply; explicit layouts are
    ``blocks[N] explicit``, plus `` pieces[k]`` when a rank holds up to k > 1 of them.
    """
    opt = f" opt{layout.opt_group_size}" if layout.opt_sharded else ""
    origin = layout.origin or {}
    if origin.get("framework") == "mindspore" and "dev_matrix" in origin and "tensor_map" in origin:
        stage = f" stage{origin['stage']}" if origin.get("stage") else ""
        return f"dev{_nums(origin['dev_matrix'])} tmap{_nums(origin['tensor_map'])}{opt}{stage}"
    if layout.explicit is not None:
        several = f" pieces[{max(len(layout.pieces(r)) for r in layout.ranks)}]" if layout.multi_piece else ""
        return f"blocks[{len(layout.explicit)}] explicit{several}"
    dims = ",".join(".".join(map(str, a)) if a else "-" for a in layout.dims)
    nested = " nested" if layout.nested and any(len(a) > 1 for a in layout.dims) else ""
    return f"mesh{_nums(layout.mesh)} dims[{dims}] {layout.split}{nested}{opt}"

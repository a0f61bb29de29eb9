"""The ``reshard`` commands that read: ``inspect``, ``show``, ``diff`` (``verify`` is in :mod:`.verify`).

Also the helpers every command shares: ``--storage-option`` parsing
(:func:`storage_options`), opening a checkpoint for a command
(:func:`open_url`), ``--json`` output (:func:`emit`). The argument parser and
``main`` are in :mod:`reshard.store.cli`; ``redivide``, ``export`` and
``demo`` in :mod:`reshard.store.cli.write`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..format.meta import ArrayMeta
from ..format.tree import SKIPPED_LEAF, json_leaves
from ..io.progress import progress_bar
from ..read.display import human_bytes, saved_by

Region = tuple[slice, ...]
#: Bytes of one tensor read at a time by ``diff``, ``verify`` (bounded memory).
SLAB_BYTES = 32 << 20


# ------------------------------------------------------------ helpers
def storage_options(items: Sequence[str]) -> dict[str, Any] | None:
    """``["key=value", "a.b=1"]`` -> ``{"key": "value", "a": {"b": 1}}`` (None if empty)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {item!r} is not KEY=VALUE")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out or None


def parse_region(text: str) -> tuple[Any, ...]:
    """``"0:4,:"`` -> ``(slice(0, 4), slice(None))``; ints and ``...`` allowed; no steps."""
    key: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if part == "...":
            key.append(Ellipsis)
        elif ":" in part:
            bounds = part.split(":")
            if len(bounds) != 2:
                raise ValueError(f"region part {part!r}: use start:stop (no step)")
            key.append(slice(*(int(b) if b.strip() else None for b in bounds)))
        else:
            key.append(int(part))
    return tuple(key)


def open_url(url: str, args: argparse.Namespace, **kw: Any) -> Any:
    """Open a checkpoint with the command's ``--storage-option`` values (a bad one is a usage error)."""
    from ..read.open import open as open_checkpoint

    try:
        opts = storage_options(args.storage_option)
    except ValueError as e:
        args.parser.error(str(e))
    return open_checkpoint(url, storage_options=opts, **kw)


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print ``data`` as JSON with ``--json``, else ``text``."""
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def slabs(meta: ArrayMeta, max_bytes: int = SLAB_BYTES) -> Iterator[Region]:
    """Regions of at most about ``max_bytes`` along dim 0 (whole chunks) covering a tensor."""
    if not meta.shape:
        yield ()
        return
    rest = tuple(slice(0, n) for n in meta.shape[1:])
    row = meta.np_dtype.itemsize * math.prod(meta.shape[1:])
    step = max(1, max_bytes // max(row, 1))
    if step >= meta.chunk[0]:
        step -= step % meta.chunk[0]
    for i in range(0, meta.shape[0], step):
        yield (slice(i, min(i + step, meta.shape[0])), *rest)


def _read(ckpt: Any, meta: ArrayMeta, region: Region) -> np.ndarray:
    dest = np.empty(tuple(r.stop - r.start for r in region), dtype=meta.np_dtype)
    ckpt.read_regions([(meta, region, dest)])
    return dest


def _natural(name: str) -> list[tuple[int, Any]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]


def _match(name: str, pattern: str | None) -> bool:
    if pattern is None:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")


# ------------------------------------------------------------ inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    """``reshard inspect URL [PATTERN]``: the tensor tree with dtypes, shapes, layouts and sizes."""
    from reshard.layouts.errors import TensorNotFoundError, UncommittedCheckpointError

    try:
        ckpt = open_url(args.url, args, allow_uncommitted=args.uncommitted)
    except UncommittedCheckpointError as e:
        raise UncommittedCheckpointError(f"{e} ('reshard inspect --uncommitted' shows what was written)") from None
    names = sorted((n for n in ckpt.arrays if _match(n, args.pattern)), key=_natural)
    if args.pattern and not names:
        from ..format.tree import suggest

        hint = suggest(args.pattern, ckpt.names())
        raise TensorNotFoundError(f"{ckpt.url}: no tensor matches {args.pattern!r}{hint}")
    metas = [ckpt.arrays[n] for n in names]
    ranks = sorted(set().union(*(m.layout.ranks for m in ckpt.arrays.values()))) if ckpt.arrays else []
    info = {n: {"dtype": m.dtype, "shape": list(m.shape), "layout": m.layout.describe(), "nbytes": m.nbytes,
                "shards": math.prod(m.grid), "shard": list(m.shard), "chunk": list(m.chunk),
                "layout_json": m.layout.to_json()} for n, m in zip(names, metas, strict=True)}
    totals = {"tensors": len(metas), "nbytes": sum(m.nbytes for m in metas),
              "shards": sum(math.prod(m.grid) for m in metas), "ranks": len(ranks)}
    data = {"url": ckpt.url, "committed": ckpt.committed, "save_id": ckpt.save_id, "form": ckpt.form,
            "zarr_url": ckpt.zarr_url if ckpt.form == "directory" else None,  # packed: no zarr folder
            "references_url": ckpt.references_url, "tensors": info, "leaves": json_leaves(ckpt.leaves),
            "totals": totals, "skipped": _skipped(ckpt.leaves)}
    if args.json:
        emit(args, data, "")
        return 0
    lines: list[tuple[str, str | None]] = []
    _tree(_nested(names), 0, lines)
    rows = [(label, *(("", "", "", "", "") if n is None else (
        info[n]["dtype"], str(info[n]["shape"]), info[n]["layout"], human_bytes(info[n]["nbytes"]),
        str(info[n]["shards"])))) for label, n in lines]
    head = ("tensor", "dtype", "shape", "saving layout", "size", "shards")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    state = "committed" if ckpt.committed else "UNCOMMITTED"
    print(f"{ckpt.url}  ({state}, {saved_by(ckpt)})")
    if ckpt.references_url is None:
        print(f"zarr group (plain zarr, TensorStore, dask): {ckpt.zarr_url}")
    else:  # no folder of a packed save is a zarr hierarchy: its chunks are byte ranges of the ranks' objects
        print(f"packed form; zarr-python, xarray, dask: rs.open(url).zarr_store(), or fsspec reference:// over "
              f"{ckpt.references_url} (docs/format.md)")
    for r in (head, *rows):
        print("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
              .rstrip())
    leaves = ", ".join(f"{k}={summarize_leaf(v)}" for k, v in ckpt.leaves.items()
                       if k != SKIPPED_LEAF and _match(k, args.pattern))  # a pattern filters the leaves too
    print(f"total: {totals['tensors']} tensors, {human_bytes(totals['nbytes'])}, {totals['shards']} shards"
          + (f"; leaves: {leaves}" if leaves else ""))
    for record in data["skipped"]:
        print(f"skipped at import: {_skip_line(record)}")
    for text in ckpt.conflicts:
        print(f"conflict: {text} (commit would refuse this save)")
    return 0


def _skipped(leaves: Any) -> list[Any]:
    """What an import left out (:data:`SKIPPED_LEAF`), as a list of records."""
    found = leaves.get(SKIPPED_LEAF, [])
    return found if isinstance(found, list) else [found]


def _skip_line(record: Any) -> str:
    """One record of :data:`SKIPPED_LEAF` as text (any JSON: the leaf is the file's, not trusted)."""
    if isinstance(record, dict):
        return f"{record.get('name')!s}: {record.get('what')!s}: {record.get('why')!s}"
    return json.dumps(record)


#: Leaves whose JSON is longer than this are summarized in ``inspect``'s footer.
LEAF_CHARS = 40


def bytes_as_sizes(value: Any) -> Any:
    """A leaf's value with every ``bytes`` in it (a Hugging Face folder's carried files) as ``"<N bytes>"``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {k: bytes_as_sizes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bytes_as_sizes(v) for v in value]
    return value


def summarize_leaf(value: Any, width: int = LEAF_CHARS) -> str:
    """A leaf's value as JSON, or a short summary of a long one (``param_groups``: groups and their keys).

    ``reshard show URL NAME`` and ``inspect --json`` print the whole value (bytes by their size).
    """
    value = bytes_as_sizes(value)
    text = json.dumps(value)
    if len(text) <= width:
        return text
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = list(dict.fromkeys(k for group in value for k in group))
        same = {k: value[0][k] for k in keys if all(k in g and g[k] == value[0][k] for g in value)}
        shown = [f"{k}={json.dumps(v)}" for k, v in same.items() if len(json.dumps(v)) <= 16 and k != "params"]
        shown += [k for k in keys if k not in same]
        word = "group" if len(value) == 1 else "groups"
        return f"[{len(value)} {word}: {', '.join(shown[:6])}{', ...' if len(shown) > 6 else ''}]"
    if isinstance(value, list):
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        names = list(value)
        return "{" + f"{len(names)} keys: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}" + "}"
    return text[: width - 3] + "..."


def _nested(names: list[str]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for name in names:
        *groups, last = name.split(".")
        node = root
        for g in groups:
            node = node.setdefault(g, {})
        node[last] = name
    return root


def _tree(node: dict[str, Any], depth: int, out: list[tuple[str, str | None]]) -> None:
    """Indented ``(label, tensor name or None)`` lines; single-child groups are joined (``attn.qkv.weight``)."""
    for label, child in node.items():
        while isinstance(child, dict) and len(child) == 1:
            (key, child), = child.items()
            label += "." + key
        out.append(("  " * depth + label, child if isinstance(child, str) else None))
        if isinstance(child, dict):
            _tree(child, depth + 1, out)


# --------------------------------------------------------------- show
def tensor_stats(t: Any) -> dict[str, Any]:
    """Statistics of a lazy tensor (or view), streamed with dask, over its finite values."""
    import warnings

    import dask
    import dask.array as da

    x = t.to_dask().astype(np.float64)
    fin = da.isfinite(x)
    y = da.where(fin, x, np.nan)
    parts = {"finite": fin.sum(), "nan": da.isnan(x).sum(), "inf": da.isinf(x).sum(),
             "min": da.where(fin, x, np.inf).min(), "max": da.where(fin, x, -np.inf).max(),
             "mean": da.nanmean(y), "std": da.nanstd(y), "norm": da.sqrt(da.nansum(y * y))}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        (got,) = dask.compute(parts, scheduler="threads")
    out: dict[str, Any] = {"count": math.prod(t.shape)}
    out |= {k: int(got[k]) for k in ("finite", "nan", "inf")}
    out |= {k: float(got[k]) if out["finite"] else None for k in ("min", "max", "mean", "std", "norm")}
    return out


def cmd_show(args: argparse.Namespace) -> int:
    """``reshard show URL TENSOR``: values of a region, their statistics, or a leaf's value."""
    ckpt = open_url(args.url, args)
    if args.tensor in ckpt.leaves and args.tensor not in ckpt.arrays:  # a step counter, a learning rate...
        value = bytes_as_sizes(ckpt.leaves[args.tensor])
        emit(args, {"leaf": args.tensor, "value": value}, f"{args.tensor} = {json.dumps(value)}")
        return 0
    t = ckpt[args.tensor]
    if not hasattr(t, "meta"):  # a group: ck["model"] is a sub-tree
        from reshard.layouts.errors import TensorNotFoundError

        raise TensorNotFoundError(f"{ckpt.url}: {args.tensor!r} is a group of {len(t)} tensors, e.g. "
                                  f"'{args.tensor}.{next(iter(t), '')}'; 'reshard inspect URL {args.tensor}' "
                                  "lists them")
    note = ""
    if args.region is not None:
        try:
            key = parse_region(args.region)
        except ValueError as e:
            args.parser.error(f"--region {args.region!r}: {e}")
        view = t[key]
    elif args.stats or math.prod(t.shape) <= 1000:
        view = t
    else:
        view = t[tuple(slice(0, 8) for _ in t.shape)]
        note = " (a corner; pass --region for more)"
    where = "[" + ", ".join(f"{r.start}:{r.stop}" for r in view.region) + "]"
    head = f"{t.name}  {t.meta.dtype} {list(t.shape)}  region {where}{note}"
    if args.stats:
        stats = tensor_stats(view)
        text = "\n".join([head] + [f"  {k:7s} {v:.6g}" if isinstance(v, float) else f"  {k:7s} {v}"
                                   for k, v in stats.items()])
        emit(args, {"tensor": t.name, "region": where, "dtype": t.meta.dtype, "stats": stats}, text)
        return 0
    values = view.read()
    shown = values if values.dtype.kind in "biu" else values.astype(np.float64)
    text = head + "\n" + np.array2string(values, threshold=1000, edgeitems=4, max_line_width=120)
    emit(args, {"tensor": t.name, "region": where, "dtype": t.meta.dtype, "values": shown.tolist()}, text)
    return 0


# --------------------------------------------------------------- diff
def compare(ckpt_a: Any, ckpt_b: Any, name: str, atol: float = 0.0, rtol: float = 0.0) -> dict[str, Any]:
    """Stream one tensor of two checkpoints, slab by slab.

    Returns max abs difference, max relative difference (``|a-b| / max(|a|,|b|)``),
    whether the bytes are equal, and ``same``: every ``|a-b| <= atol + rtol*|b|``
    (NaN equals NaN, inf equals inf of the same sign).
    """
    ma, mb = ckpt_a.arrays[name], ckpt_b.arrays[name]
    worst_abs, worst_rel, same, bitwise = 0.0, 0.0, True, True
    for region in slabs(ma):
        a, b = _read(ckpt_a, ma, region), _read(ckpt_b, mb, region)
        if a.tobytes() == b.tobytes():
            continue
        bitwise = False
        with np.errstate(all="ignore"):
            fa, fb = a.astype(np.float64), b.astype(np.float64)
            d = np.where((fa == fb) | (np.isnan(fa) & np.isnan(fb)), 0.0, np.abs(fa - fb))
            d[np.isnan(d)] = np.inf
            scale = np.maximum(np.abs(fa), np.abs(fb))
            rel = np.where(d == 0, 0.0, d / np.where(scale == 0, 1.0, scale))
            rel[np.isnan(rel)] = np.inf
            same = same and bool(np.all(d <= atol + (rtol * np.abs(fb) if rtol else 0.0)))
        worst_abs = max(worst_abs, float(d.max(initial=0)))
        worst_rel = max(worst_rel, float(rel.max(initial=0)))
    return {"max_abs": worst_abs, "max_rel": worst_rel, "bitwise_equal": bitwise, "same": same}


def cmd_diff(args: argparse.Namespace) -> int:
    """``reshard diff A B``: compare names, shapes, dtypes, values and leaves; 0 same, 1 differ.

    A tensor both store on the same shard grid with equal shard hashes (packed
    saves record them) is identical without reading its data.
    """
    from ..write.incremental import same_by_hash, shard_hashes

    a, b = open_url(args.url_a, args), open_url(args.url_b, args)
    added = sorted(set(b.arrays) - set(a.arrays), key=_natural)
    removed = sorted(set(a.arrays) - set(b.arrays), key=_natural)
    common = sorted(set(a.arrays) & set(b.arrays), key=_natural)
    changed = {n: f"{a.arrays[n].dtype}{list(a.arrays[n].shape)} -> {b.arrays[n].dtype}{list(b.arrays[n].shape)}"
               for n in common if (a.arrays[n].dtype, a.arrays[n].shape) != (b.arrays[n].dtype, b.arrays[n].shape)}
    la, lb = json_leaves(a.leaves), json_leaves(b.leaves)
    leaves = {k: [la.get(k), lb.get(k)] for k in sorted(set(la) | set(lb))
              if la.get(k) != lb.get(k) or (k in la) != (k in lb)}
    hashes_a, hashes_b = shard_hashes(a), shard_hashes(b)
    by_hash = [n for n in common if n not in changed and same_by_hash(a, b, n, hashes_a, hashes_b)]
    tensors: dict[str, Any] = {n: {"same": True, "max_abs": 0.0, "max_rel": 0.0, "by_hash": True} for n in by_hash}
    with progress_bar(sum(a.arrays[n].nbytes for n in common if n not in changed and n not in tensors), "diff",
                      unit="B") as bar:
        for n in common:
            if n not in changed and n not in tensors:
                tensors[n] = compare(a, b, n, args.atol, args.rtol)
                if bar is not None:
                    bar.update(a.arrays[n].nbytes)
    differ = sorted((n for n, r in tensors.items() if not r["same"]), key=_natural)
    lines = [f"+ {n}  {b.arrays[n].dtype}{list(b.arrays[n].shape)}" for n in added]
    lines += [f"- {n}  {a.arrays[n].dtype}{list(a.arrays[n].shape)}" for n in removed]
    lines += [f"! {n}  {c}" for n, c in changed.items()]
    lines += [f"~ {n}  max abs {tensors[n]['max_abs']:.4g}  max rel {tensors[n]['max_rel']:.4g}" for n in differ]
    lines += [f"leaf {k}: {json.dumps(va)} -> {json.dumps(vb)}" for k, (va, vb) in leaves.items()]
    same = not (added or removed or changed or differ or leaves)
    summary = (f"{'same' if same else 'differ'}: {len(common)} tensors compared ({len(by_hash)} identical by their "
               f"shard hashes, not read), {len(differ)} differ in values, "
               f"{len(changed)} in shape/dtype, {len(added)} added, {len(removed)} removed, "
               f"{len(leaves)} leaves differ")
    data = {"same": same, "added": added, "removed": removed, "changed": changed, "differ": differ,
            "leaves": leaves, "tensors": tensors}
    emit(args, data, "\n".join([*lines, summary]))
    return 0 if same else 1

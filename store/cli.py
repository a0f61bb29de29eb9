"""The ``reshard`` command line (see ``docs/cli.md``).

Commands: ``inspect``, ``show``, ``diff``, ``verify``, ``redivide``, ``export``,
``demo``; framework ``import`` commands are added by
``reshard.store.frontends.register_import(subparsers, common)`` when it exists.
Exit codes: 0 success (``diff``: same), 1 failure (``diff``: differ), 2 usage.
A failure prints one line, ``reshard: error: ...``, unless ``--debug``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .display import human_bytes
from .format import ArrayMeta

Region = tuple[slice, ...]
#: Bytes of one tensor read at a time by ``diff``, ``verify`` (bounded memory).
SLAB_BYTES = 32 << 20
#: Name components that mark optimizer states for ``redivide --opt-shard``.
OPT_WORDS = ("optimizer", "optim", "exp_avg", "exp_avg_sq", "moments", "adam_m", "adam_v")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (never raises, unless ``--debug``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except SystemExit as e:  # parser.error() from inside a command
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print("reshard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` & co: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if args.debug:
            raise
        from reshard.layouts.errors import ReshardError

        known = isinstance(e, ReshardError | OSError)
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"reshard: error: {text if known else f'{type(e).__name__}: {text}'}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="reshard", description="Distributed-training checkpoints as zarr v3 arrays: look inside, compare, "
        "verify, redivide, export. 'reshard COMMAND --help' describes each command; docs/cli.md has examples.")
    parser.add_argument("--version", action="version", version=f"reshard {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-S", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; VALUE parsed as JSON when it is; "
                             "dotted keys nest, e.g. client_kwargs.region_name=eu-west-1)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], text: str, json_out: bool = True) -> Any:
        p = sub.add_parser(name, parents=[common, out] if json_out else [common], help=text, description=text)
        p.set_defaults(func=func, parser=p)
        return p

    p = add("inspect", cmd_inspect, "tensors, dtypes, shapes, saving layouts, sizes, shards (reads no data)")
    p.add_argument("url")
    p.add_argument("pattern", nargs="?", help="glob on dotted names ('*.exp_avg.*'); without wildcards: "
                                              "that name or everything under it")
    p.add_argument("--uncommitted", action="store_true", help="describe a never-committed checkpoint "
                                                              "from its ranks' manifests")
    p = add("show", cmd_show, "values of a tensor region, or their statistics (--stats); or a leaf's value")
    p.add_argument("url")
    p.add_argument("tensor")
    p.add_argument("--region", help="numpy basic index, e.g. '0:4,:' or '3' or '...,0:2' "
                                    "(default: a corner of at most 8 per dim; with --stats the whole tensor)")
    p.add_argument("--stats", action="store_true", help="min/max/mean/std/norm and NaN/Inf counts, "
                                                        "streamed chunk by chunk with dask")
    p = add("diff", cmd_diff, "compare two checkpoints; exit 0 same, 1 differ")
    p.add_argument("url_a")
    p.add_argument("url_b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: equal values)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, |a-b| <= atol + rtol*|b|")
    p = add("verify", cmd_verify, "commit state, every shard, every chunk's crc32c; exit 1 on any problem")
    p.add_argument("url")
    p = add("redivide", cmd_redivide, "write SRC again at DST under new layouts", json_out=False)
    p.add_argument("src")
    p.add_argument("dst")
    spec = p.add_mutually_exclusive_group(required=True)
    spec.add_argument("--layout", metavar="SPEC", help="MindSpore strategy file (protobuf or JSON) or a JSON "
                                                       "file {name: Layout.to_json()}")
    spec.add_argument("--tp", type=int, help="short form: tensors of 2+ dims split dim 0 over tp ranks")
    p.add_argument("--dp", type=int, default=1, help="short form: data-parallel replicas (default 1)")
    p.add_argument("--opt-shard", action="store_true", help="short form: optimizer states also split "
                                                            "over dp (MindSpore optimizer sharding)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.add_argument("--compression", choices=["zstd"], help="compress the new chunks")
    p = add("export", cmd_export, "stream every tensor into one file (safetensors, npz, torch), "
            "or into MindSpore per-rank files", json_out=False)
    p.add_argument("src")
    p.add_argument("file", help="the output file (a folder for --format mindspore)")
    p.add_argument("--format", choices=["safetensors", "npz", "torch", "mindspore"],
                   help="default from FILE's extension: .npz, .pt/.pth (torch), else safetensors")
    p.add_argument("--strategy", help="mindspore only: the target strategy file (rank_N/ folders are written)")
    p.add_argument("--prefix", default="", help="torch only: export the tensors under PREFIX, named without it "
                                                "(--prefix model. gives a file for model.load_state_dict)")
    p = add("demo", cmd_demo, "save from 8 ranks, redivide to 7 and to 1, verify every byte")
    p.add_argument("--out", default="./reshard-demo", help="folder or URL for the demo's files")
    p.add_argument("--ranks", type=int, default=8, choices=[1, 2, 4, 8, 16],
                   help="saving ranks (tp = ranks/2, dp = 2); the demo redivides to ranks-1")
    p.add_argument("--quick", action="store_true", help="a tiny model")
    register_import(sub, common)
    return parser


def register_import(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Let the framework front ends add their ``import`` commands.

    Calls ``reshard.store.frontends.register_import(subparsers, common)`` if the
    front ends define it. It adds subcommands with ``parents=[common]`` (for
    ``--storage-option``) and ``set_defaults(func=f)``, ``f(args) -> int``.
    """
    from . import frontends

    hook = getattr(frontends, "register_import", None)
    if hook is not None:
        hook(subparsers, common)


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


def _open(url: str, args: argparse.Namespace, **kw: Any) -> Any:
    from .reader import open as open_checkpoint

    try:
        opts = storage_options(args.storage_option)
    except ValueError as e:
        args.parser.error(str(e))
    return open_checkpoint(url, storage_options=opts, **kw)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def _progress(total: int, desc: str) -> Any:
    """A tqdm bar over bytes, silent when stderr is not a terminal (or tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the [dask] extra
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, disable=not sys.stderr.isatty())


class _NoBar:  # pragma: no cover
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


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
    from reshard.layouts.errors import TensorNotFoundError, UncommittedCheckpointError

    try:
        ckpt = _open(args.url, args, allow_uncommitted=args.uncommitted)
    except UncommittedCheckpointError as e:
        raise UncommittedCheckpointError(f"{e} ('reshard inspect --uncommitted' shows what was written)") from None
    names = sorted((n for n in ckpt.arrays if _match(n, args.pattern)), key=_natural)
    if args.pattern and not names:
        raise TensorNotFoundError(f"{ckpt.url}: no tensor matches {args.pattern!r}")
    metas = [ckpt.arrays[n] for n in names]
    ranks = sorted(set().union(*(m.layout.ranks for m in ckpt.arrays.values()))) if ckpt.arrays else []
    info = {n: {"dtype": m.dtype, "shape": list(m.shape), "layout": m.layout.describe(), "nbytes": m.nbytes,
                "shards": math.prod(m.grid), "shard": list(m.shard), "chunk": list(m.chunk),
                "layout_json": m.layout.to_json()} for n, m in zip(names, metas, strict=True)}
    totals = {"tensors": len(metas), "nbytes": sum(m.nbytes for m in metas),
              "shards": sum(math.prod(m.grid) for m in metas), "ranks": len(ranks)}
    data = {"url": ckpt.url, "committed": ckpt.committed, "tensors": info, "leaves": ckpt.leaves, "totals": totals}
    if args.json:
        _emit(args, data, "")
        return 0
    lines: list[tuple[str, str | None]] = []
    _tree(_nested(names), 0, lines)
    rows = [(label, *(("", "", "", "", "") if n is None else (
        info[n]["dtype"], str(info[n]["shape"]), info[n]["layout"], human_bytes(info[n]["nbytes"]),
        str(info[n]["shards"])))) for label, n in lines]
    head = ("tensor", "dtype", "shape", "saving layout", "size", "shards")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    state = "committed" if ckpt.committed else "UNCOMMITTED"
    print(f"{ckpt.url}  ({state}, saved by {len(ranks)} ranks)")
    for r in (head, *rows):
        print("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
              .rstrip())
    leaves = ", ".join(f"{k}={json.dumps(v)}" for k, v in ckpt.leaves.items())
    print(f"total: {totals['tensors']} tensors, {human_bytes(totals['nbytes'])}, {totals['shards']} shards"
          + (f"; leaves: {leaves}" if leaves else ""))
    return 0


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
    ckpt = _open(args.url, args)
    if args.tensor in ckpt.leaves and args.tensor not in ckpt.arrays:  # a step counter, a learning rate...
        value = ckpt.leaves[args.tensor]
        _emit(args, {"leaf": args.tensor, "value": value}, f"{args.tensor} = {json.dumps(value)}")
        return 0
    t = ckpt[args.tensor]
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
        _emit(args, {"tensor": t.name, "region": where, "dtype": t.meta.dtype, "stats": stats}, text)
        return 0
    values = view.read()
    shown = values if values.dtype.kind in "biu" else values.astype(np.float64)
    text = head + "\n" + np.array2string(values, threshold=1000, edgeitems=4, max_line_width=120)
    _emit(args, {"tensor": t.name, "region": where, "dtype": t.meta.dtype, "values": shown.tolist()}, text)
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
    a, b = _open(args.url_a, args), _open(args.url_b, args)
    added = sorted(set(b.arrays) - set(a.arrays), key=_natural)
    removed = sorted(set(a.arrays) - set(b.arrays), key=_natural)
    common = sorted(set(a.arrays) & set(b.arrays), key=_natural)
    changed = {n: f"{a.arrays[n].dtype}{list(a.arrays[n].shape)} -> {b.arrays[n].dtype}{list(b.arrays[n].shape)}"
               for n in common if (a.arrays[n].dtype, a.arrays[n].shape) != (b.arrays[n].dtype, b.arrays[n].shape)}
    leaves = {k: [a.leaves.get(k), b.leaves.get(k)] for k in sorted(set(a.leaves) | set(b.leaves))
              if a.leaves.get(k) != b.leaves.get(k) or (k in a.leaves) != (k in b.leaves)}
    tensors = {}
    bar = _progress(sum(a.arrays[n].nbytes for n in common if n not in changed), "diff")
    for n in common:
        if n not in changed:
            tensors[n] = compare(a, b, n, args.atol, args.rtol)
            bar.update(a.arrays[n].nbytes)
    bar.close()
    differ = sorted((n for n, r in tensors.items() if not r["same"]), key=_natural)
    lines = [f"+ {n}  {b.arrays[n].dtype}{list(b.arrays[n].shape)}" for n in added]
    lines += [f"- {n}  {a.arrays[n].dtype}{list(a.arrays[n].shape)}" for n in removed]
    lines += [f"! {n}  {c}" for n, c in changed.items()]
    lines += [f"~ {n}  max abs {tensors[n]['max_abs']:.4g}  max rel {tensors[n]['max_rel']:.4g}" for n in differ]
    lines += [f"leaf {k}: {json.dumps(va)} -> {json.dumps(vb)}" for k, (va, vb) in leaves.items()]
    same = not (added or removed or changed or differ or leaves)
    summary = (f"{'same' if same else 'differ'}: {len(common)} tensors compared, {len(differ)} differ in values, "
               f"{len(changed)} in shape/dtype, {len(added)} added, {len(removed)} removed, "
               f"{len(leaves)} leaves differ")
    data = {"same": same, "added": added, "removed": removed, "changed": changed, "differ": differ,
            "leaves": leaves, "tensors": tensors}
    _emit(args, data, "\n".join([*lines, summary]))
    return 0 if same else 1


# ------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace) -> int:
    from reshard.layouts.errors import ReshardError, UncommittedCheckpointError

    problems: list[str] = []
    try:
        ckpt = _open(args.url, args)
    except UncommittedCheckpointError as e:
        problems.append(str(e))
        ckpt = _open(args.url, args, allow_uncommitted=True)
    t0, checked, chunks = time.perf_counter(), 0, 0
    bar = _progress(ckpt.nbytes, "verify")
    for name, meta in ckpt.arrays.items():
        try:
            for region in slabs(meta):
                _read(ckpt, meta, region)
                bar.update(math.prod(r.stop - r.start for r in region) * meta.np_dtype.itemsize)
            checked += meta.nbytes
            chunks += math.prod(-(-n // c) for n, c in zip(meta.shape, meta.chunk, strict=True))
        except (ReshardError, OSError) as e:
            text = " ".join(str(e).split())
            problems.append(text if repr(name) in text else f"tensor {name!r}: {text}")
    bar.close()
    seconds = time.perf_counter() - t0
    unchecked = sorted(n for n, m in ckpt.arrays.items() if not m.checksums)
    data = {"url": ckpt.url, "committed": ckpt.committed, "ok": not problems, "problems": problems,
            "tensors": len(ckpt.arrays), "bytes_checked": checked, "chunks_checked": chunks,
            "without_checksums": unchecked, "seconds": seconds}
    if problems:
        text = "\n".join([f"FAILED: {ckpt.url}: {len(problems)} problem(s)", *(f"  {p}" for p in problems)])
    else:
        text = (f"VERIFIED: {ckpt.url}: committed, {len(ckpt.arrays)} tensors, {human_bytes(checked)}, "
                f"{chunks} chunks read and crc32c-checked in {seconds:.2f} s"
                + (f"; {len(unchecked)} tensors stored without checksums" if unchecked else ""))
    _emit(args, data, text)
    return 0 if not problems else 1


# ----------------------------------------------------------- redivide
def short_layouts(arrays: dict[str, ArrayMeta], tp: int, dp: int = 1, opt_shard: bool = False) -> dict[str, Any]:
    """The ``--tp/--dp`` rule: mesh ``[dp, tp]`` (rank = d*tp + t), dim 0 of 2+-d tensors over tp.

    Vectors and scalars are replicated on every rank. With ``opt_shard``, tensors
    with a name component in :data:`OPT_WORDS` are also split over dp (MindSpore
    optimizer sharding, when dim 0 of the tp piece divides by dp). Splits that
    do not divide give the first pieces one more row (``balanced``).
    """
    from reshard.layouts import Layout

    if tp < 1 or dp < 1:
        raise ValueError(f"--tp and --dp must be at least 1, got tp={tp} dp={dp}")
    out = {}
    for name, meta in arrays.items():
        dims = ((1,),) + ((),) * (len(meta.shape) - 1) if len(meta.shape) >= 2 else ((),) * len(meta.shape)
        opt = -1 if opt_shard and dp > 1 and set(name.split(".")) & set(OPT_WORDS) else None
        out[name] = Layout(meta.shape, (dp, tp), dims=dims, split="balanced", opt_shard=opt)
    return out


def load_layout_spec(path: str, arrays: dict[str, ArrayMeta]) -> dict[str, Any]:
    """Layouts from a MindSpore strategy file (protobuf or JSON) or a ``{name: Layout.to_json()}`` file."""
    from reshard.layouts import Layout, parse_strategy

    raw = Path(path).read_bytes()
    shapes = {n: list(m.shape) for n, m in arrays.items()}  # lists: parse_strategy drops tuple shapes
    try:
        obj = json.loads(raw)
    except ValueError:
        return parse_strategy(raw, shapes)  # protobuf
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a layout file must hold a JSON object")
    if "parallel_layout_item" in obj or any(isinstance(v, dict) and "dev_matrix" in v for v in obj.values()):
        return parse_strategy(obj, shapes)
    return {name: Layout.from_json(doc) for name, doc in obj.items()}


def cmd_redivide(args: argparse.Namespace) -> int:
    from reshard.layouts.errors import CheckpointExistsError

    from .ops import redivide

    ckpt = _open(args.src, args)
    opts = storage_options(args.storage_option)
    if args.layout is not None:
        if args.dp != 1 or args.opt_shard:
            args.parser.error("--dp and --opt-shard belong to the short form (--tp)")
        layouts = load_layout_spec(args.layout, ckpt.arrays)
        unknown = sorted(set(layouts) - set(ckpt.arrays))
        if unknown:
            print(f"note: {len(unknown)} layouts name tensors {args.src} lacks, e.g. {unknown[:3]}", file=sys.stderr)
    else:
        layouts = short_layouts(ckpt.arrays, args.tp, args.dp, args.opt_shard)
    t0 = time.perf_counter()
    try:
        stats = redivide(ckpt, args.dst, layouts, overwrite=args.overwrite, compression=args.compression,
                         storage_options=opts)
    except CheckpointExistsError:
        raise CheckpointExistsError(f"{args.dst} already holds a committed checkpoint (--overwrite replaces it)"
                                    ) from None
    seconds = time.perf_counter() - t0
    kept = len([n for n in ckpt.arrays if n not in layouts])
    print(f"redivided {len(ckpt.arrays) - kept} tensors ({kept} kept their layout), {human_bytes(ckpt.nbytes)}, "
          f"{args.src} -> {args.dst} in {seconds:.2f} s; read {stats.requests} requests, "
          f"{human_bytes(stats.bytes_fetched)}")
    return 0


# ------------------------------------------------------ export, demo
def cmd_export(args: argparse.Namespace) -> int:
    fmt = args.format or {".npz": "npz", ".pt": "torch", ".pth": "torch"}.get(Path(args.file).suffix, "safetensors")
    if args.prefix and fmt != "torch":
        args.parser.error("--prefix applies to --format torch only")
    if (fmt == "mindspore") != bool(args.strategy):
        args.parser.error("--format mindspore needs --strategy, and --strategy needs --format mindspore")
    t0 = time.perf_counter()
    if fmt == "mindspore":
        from .frontends.mindspore import export_mindspore

        files = export_mindspore(args.src, args.file, Path(args.strategy).read_bytes(),
                                 storage_options=storage_options(args.storage_option))
        print(f"exported {len(files)} rank files under {args.file} in {time.perf_counter() - t0:.2f} s")
        return 0
    if fmt == "torch":  # torch.save needs every tensor in memory at once
        from .frontends.torch import export_torch

        stats = export_torch(args.src, args.file, prefix=args.prefix,
                             storage_options=storage_options(args.storage_option))
    else:
        stats = _open(args.src, args).export(args.file, format=fmt)
    seconds = time.perf_counter() - t0
    print(f"exported {human_bytes(stats.bytes_delivered)} of tensors to {args.file} ({fmt}) in {seconds:.2f} s "
          f"({stats.bytes_delivered / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    rows = run_demo(args.out, ranks=args.ranks, quick=args.quick, echo=None if args.json else print)
    if args.json:
        _emit(args, [{"phase": r.phase, "tensors": r.tensors, "bytes": r.nbytes, "seconds": r.seconds}
                     for r in rows], "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

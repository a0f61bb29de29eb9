"""The ``reshard`` commands that write: ``redivide``, ``export``, ``demo``.

The argument parser and ``main`` are in :mod:`reshard.store.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..format.meta import ArrayMeta
from ..io.progress import tracking
from ..read.display import human_bytes
from .commands import emit, open_url, storage_options
from .frameworks import EXPORT_FORMATS, FRAMEWORKS, export_file

#: Name components that mark optimizer states for ``redivide --opt-shard``.
OPT_WORDS = ("optimizer", "optim", "exp_avg", "exp_avg_sq", "moments", "adam_m", "adam_v")


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
    """Layouts from a MindSpore strategy file (protobuf or JSON) or a ``{name: Layout.to_json()}`` file.

    A strategy file names parameters only; their optimizer state (``adam_m.X``,
    ``moments.X``...) takes the parameter's layout, as in MindSpore
    (:func:`reshard.layouts.strategy_layouts`).
    """
    from reshard.layouts import Layout, parse_strategy, strategy_layouts

    raw = Path(path).read_bytes()
    shapes = {n: list(m.shape) for n, m in arrays.items()}  # lists: parse_strategy drops tuple shapes
    try:
        obj = json.loads(raw)
    except ValueError:
        return strategy_layouts(parse_strategy(raw, shapes), shapes)  # protobuf
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a layout file must hold a JSON object")
    if "parallel_layout_item" in obj or any(isinstance(v, dict) and "dev_matrix" in v for v in obj.values()):
        return strategy_layouts(parse_strategy(obj, shapes), shapes)
    return {name: Layout.from_json(doc) for name, doc in obj.items()}


def cmd_redivide(args: argparse.Namespace) -> int:
    """``reshard redivide SRC DST``: write SRC again under ``--layout`` or ``--tp/--dp`` layouts."""
    from reshard.layouts.errors import CheckpointExistsError

    from ..ops.redivide import redivide

    ckpt = open_url(args.src, args)
    opts = storage_options(args.storage_option)
    if not args.preset and (args.pp != 1 or args.ep != 1 or args.heads is not None or args.kv_heads is not None):
        args.parser.error("--pp, --ep, --heads and --kv-heads belong to --preset megatron")
    if args.layout is None and args.tp is None:
        if not args.preset:
            args.parser.error("give --layout SPEC, --tp N or --preset megatron")
        args.tp = 1
    if args.layout is not None:
        if args.dp != 1 or args.opt_shard or args.preset:
            args.parser.error("--dp, --opt-shard and --preset belong to the short form (--tp)")
        layouts = load_layout_spec(args.layout, ckpt.arrays)
        unknown = sorted(set(layouts) - set(ckpt.arrays))
        if unknown:
            print(f"note: {len(unknown)} layouts name tensors {args.src} lacks, e.g. {unknown[:3]}", file=sys.stderr)
    elif args.preset:
        if args.opt_shard:
            args.parser.error("--opt-shard does not combine with --preset")
        from .preset import preset_layouts_for

        layouts = preset_layouts_for(ckpt, args)
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


def cmd_convert(args: argparse.Namespace) -> int:
    """``reshard convert SRC DST [--form F] [--grid G]``: write SRC again in storage form F / shard grid G,
    same layouts."""
    from reshard.layouts.errors import CheckpointExistsError

    from ..ops.redivide import convert

    if args.form is None and args.grid is None:
        args.parser.error("give --form (the storage form to write), --grid (the shard grid), or both")
    ckpt = open_url(args.src, args)
    form = args.form or ckpt.form
    grid = {"grid": args.grid} if args.grid else {}
    t0 = time.perf_counter()
    try:
        stats = convert(ckpt, args.dst, form, overwrite=args.overwrite,
                        storage_options=storage_options(args.storage_option), **grid)
    except CheckpointExistsError:
        raise CheckpointExistsError(f"{args.dst} already holds a committed checkpoint (--overwrite replaces it)"
                                    ) from None
    seconds = time.perf_counter() - t0
    print(f"converted {len(ckpt.arrays)} tensors, {human_bytes(ckpt.nbytes)}, {args.src} ({ckpt.form}) -> "
          f"{args.dst} ({form}{', grid ' + args.grid if args.grid else ''}) in {seconds:.2f} s; "
          f"wrote {stats.writes} objects")
    return 0


# ------------------------------------------------------ export, demo


def cmd_export(args: argparse.Namespace) -> int:
    """``reshard export [FORMAT] SRC FILE``: one safetensors, npz or torch file, or MindSpore rank files."""
    if len(args.paths) == 3 and args.paths[0] in EXPORT_FORMATS and args.format in (None, args.paths[0]):
        args.format = args.paths[0]
    elif len(args.paths) != 2:
        args.parser.error(f"expected [FORMAT] SRC FILE with FORMAT one of {', '.join(EXPORT_FORMATS)} "
                          f"(agreeing with --format), got {' '.join(args.paths)}")
    args.src, args.file = args.paths[-2:]
    fmt = args.format or {".npz": "npz", ".pt": "torch", ".pth": "torch"}.get(Path(args.file).suffix, "safetensors")
    if args.prefix and fmt not in ("torch", "safetensors"):
        args.parser.error("--prefix applies to --format torch and to safetensors folders only")
    if args.max_shard_size is not None and fmt not in ("safetensors", "llama"):
        args.parser.error("--max-shard-size applies to --format safetensors and llama only")
    llama_only = [o for o, v in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--rope-theta",
                  args.rope_theta), ("--norm-eps", args.norm_eps), ("--max-positions", args.max_positions),
                  ("--config", args.config)) if v is not None]
    if llama_only and fmt != "llama":
        args.parser.error(f"{', '.join(llama_only)} apply to the llama format only (this export writes {fmt})")
    if fmt == "mindspore" and not args.strategy:
        args.parser.error("export mindspore needs --strategy FILE (the target strategy)")
    if args.strategy and fmt != "mindspore":
        args.parser.error(f"--strategy applies to the mindspore format only (this export writes {fmt})")
    if getattr(args, "ms_format", None) and fmt != "mindspore":
        args.parser.error("--ms-format applies to --format mindspore only")
    if (fmt == "deepspeed") != (args.dp is not None):
        args.parser.error("--format deepspeed needs --dp, and --dp needs --format deepspeed")
    if fmt != "deepspeed" and (args.tp is not None or args.tp_split):
        args.parser.error("--tp and --tp-split apply to --format deepspeed only")
    if args.ep is not None and fmt != "megatron":
        args.parser.error("--ep applies to --format megatron only")
    t0 = time.perf_counter()
    row = FRAMEWORKS.get(fmt)
    if row is not None and row.run_export is not None:
        with tracking(f"export {fmt}") as bar:
            if bar is not None:  # the export reads every tensor once (the bar's total)
                ckpt = open_url(args.src, args)
                bar.expect(ckpt.nbytes, tensors=len(ckpt.arrays))
            return row.run_export(args, t0)
    return export_file(args, fmt, t0)


def cmd_demo(args: argparse.Namespace) -> int:
    """``reshard demo``: run :func:`reshard.store.cli.demo.run_demo` (a table, or its rows with ``--json``)."""
    from .demo import run_demo

    rows = run_demo(args.out, ranks=args.ranks, quick=args.quick, echo=None if args.json else print)
    if args.json:
        emit(args, [{"phase": r.phase, "tensors": r.tensors, "bytes": r.nbytes, "seconds": r.seconds}
                     for r in rows], "")
    return 0


# ------------------------------------------------------------ maintenance
def cmd_gc(args: argparse.Namespace) -> int:
    """``reshard gc``: delete replaced and abandoned saves (see :func:`reshard.store.commit.gc.gc`)."""
    from ..commit.gc import gc

    done = gc(args.url, min_age=args.min_age, dry_run=args.dry_run, storage_options=storage_options(
        args.storage_option))
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {name}" for name in done.removed]
    lines += [f"kept {name} (written in the last {args.min_age:.0f} s: may be in progress)" for name in done.kept_young]
    if done.legacy:
        lines.append(f"{verb} the format-version-1 save at the root")
    emit(args, {"removed": list(done.removed), "kept_young": list(done.kept_young), "legacy": done.legacy,
                "dry_run": args.dry_run}, "\n".join(lines) or "nothing to remove")
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    """``reshard unlock``: remove the commit lock of a save whose committer died."""
    from ..commit.locks import unlock

    found = unlock(args.url, args.save_id, storage_options=storage_options(args.storage_option))
    emit(args, {"unlocked": found}, f"removed the commit lock of save {args.save_id!r}" if found
         else f"save {args.save_id!r} had no commit lock")
    return 0

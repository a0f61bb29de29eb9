"""The frameworks on the command line: ``reshard import FRAMEWORK`` and ``reshard export FORMAT``, in one table.

:data:`FRAMEWORKS` has a row per command word: the folder under ``store/frontends/`` that does the work,
its docs page, and the functions that add its ``import`` arguments, run its import and run its export.
Adding a framework touches its folder, a row here and its docs page. Each framework is imported only
when its command runs.

``reshard import dcp SRC DST``, ``reshard import orbax SRC DST``,
``reshard import deepspeed SRC DST [--tag TAG]``, ``reshard import megatron SRC DST``,
``reshard import safetensors SRC DST``,
``reshard import mindspore SRC DST [--strategy FILE] [--file NAME]`` and
``reshard import oneflow SRC_DIR... DST --placement RANKS --sbp SBP
[--sbp-for NAME=SBP ...]``; ``reshard export torch|mindspore|deepspeed|megatron|safetensors|llama SRC DST``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ONEFLOW_HELP = ("a OneFlow state dict saved by the ranks of a model-file placement: one flow.save folder per rank "
                "(read without OneFlow; its pickled_data is decoded, never unpickled) or one save_npz folder per rank")


def register_import(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``import`` command and one subcommand per framework of :data:`FRAMEWORKS` that imports."""
    top = subparsers.add_parser("import", help="convert a framework's checkpoint into a reshard checkpoint",
                                description="Convert a framework's checkpoint into a reshard checkpoint.")
    sub = top.add_subparsers(dest="framework", required=True, metavar="FRAMEWORK")
    for name, row in FRAMEWORKS.items():
        if row.run_import is None:
            continue
        p = sub.add_parser(name, parents=[common], help=row.import_help, description=row.import_help)
        row.import_args(p)
        p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
        p.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                       help="let the import leave out what it does not decode whose name matches PATTERN (a glob, "
                            "or a dotted prefix; repeatable), recorded in the leaf reshard.skipped; without it, "
                            "anything not decoded is an error naming it")
        grid_option(p)
        p.set_defaults(func=_flags(row.run_import), parser=p)


def grid_option(p: argparse.ArgumentParser) -> None:
    """``--grid``: the shard grid of tensors whose blocks are uneven (``reshard import``, ``reshard convert``)."""
    p.add_argument("--grid", choices=["exact", "regular"], default=None,
                   help="tensors whose blocks are uneven (balanced splits, Megatron blocks, flat ranges): 'exact' "
                        "(default), one shard per block on zarr's rectilinear grid (reshard, zarr-python >= 3.2); "
                        "'regular', a regular grid every zarr 3.1 and TensorStore reader opens")


def _src_dst(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the framework's checkpoint (folder or URL)")
    p.add_argument("dst", help="URL of the reshard checkpoint to write")


def _orbax_args(p: argparse.ArgumentParser) -> None:
    _src_dst(p)
    p.add_argument("--step", type=int, default=None, help="with a CheckpointManager folder: the step to import")


def _mindspore_args(p: argparse.ArgumentParser) -> None:
    _src_dst(p)
    p.add_argument("--strategy", default=None,
                   help="strategy file (protobuf or JSON, pipeline-merged too); without it every file holds whole "
                        "tensors (a single-device or integrated save)")
    p.add_argument("--file", default=None, metavar="NAME",
                   help="the file (name or glob; {rank} is the rank) to import from each rank_N folder, or from a "
                        "single-device folder (default: its latest, by epoch and step)")


def _deepspeed_args(p: argparse.ArgumentParser) -> None:
    _src_dst(p)
    p.add_argument("--tag", default=None, help="the save under SRC to import (default: the one SRC/latest names)")
    p.add_argument("--tp-split", action="append", default=[], metavar="PATTERN=RULE",
                   help="model-parallel saves: the parameters whose names match the regex PATTERN (at the start; "
                        "repeatable, the first match wins) are split over the TP ranks along dim RULE, or RULE is "
                        "'replicated' or 'average'; before the save's universal_checkpoint_info")


def _oneflow_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="+", metavar="SRC_DIR",
                   help="one folder per placement rank, in the order of --placement's ranks: what flow.save wrote "
                        "(pickled_data + tensor_N/meta + tensor_N/out), a save_npz folder, or a bare .npz file")
    p.add_argument("dst", metavar="DST_URL", help="URL of the reshard checkpoint to write")
    p.add_argument("--placement", default=None, metavar="RANKS",
                   help="the model-file placement's ranks as JSON: '[0, 1]', or '[[0, 1], [2, 3]]' for 2-d "
                        "(default: one rank per SRC_DIR, 0..n-1)")
    p.add_argument("--sbp", default=None, metavar="SBP",
                   help="SBP of every tensor: 'S(0)', 'split(1)', 'B'; a JSON list for an N-d placement "
                        "(required with several SRC_DIRs; one SRC_DIR holds whole tensors: B)")
    p.add_argument("--sbp-for", action="append", default=[], metavar="NAME=SBP",
                   help="SBP of the tensors whose dotted name matches the glob NAME (repeatable, the first match "
                        "wins), e.g. --sbp-for System-Train-TrainStep=B")


def _flags(func: Any) -> Any:
    """Run an import command; errors that name a keyword argument name the command-line flag instead."""
    import functools

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        from reshard.layouts.errors import CheckpointExistsError, CheckpointNotFoundError

        from ..io.progress import tracking

        try:
            with tracking(f"import {args.framework}"):
                return int(func(args))
        except CheckpointNotFoundError as e:  # SRC may be another framework's: name the import that reads it
            raise CheckpointNotFoundError(f"{e}{_other_format(args, str(e))}") from None
        except CheckpointExistsError as e:
            if args.overwrite or "overwrite=True" not in str(e):
                raise
            raise CheckpointExistsError(f"{args.dst} already holds a committed checkpoint (--overwrite replaces it)"
                                        ) from None

    return run



def _other_format(args: argparse.Namespace, error: str) -> str:
    """The hint for an import whose SRC holds another framework's checkpoint (else "", or when ``error`` has it)."""
    from ..frontends.sources import local_path
    from ..io.storage import Storage
    from ..read.foreign import detect, foreign_hint

    src = Storage(local_path(args.src[0] if isinstance(args.src, list) else args.src))
    found = detect(src)
    wrong = found is not None and found.command != args.framework and "`reshard import" not in error
    return foreign_hint(src) if wrong else ""


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from .commands import storage_options

    grid = {"grid": args.grid} if args.grid else {}
    return {"storage_options": storage_options(args.storage_option), "overwrite": args.overwrite,
            "skip": tuple(args.skip), **grid}


def _report(what: str, args: argparse.Namespace, t0: float, result: Any) -> int:
    seconds = time.perf_counter() - t0
    detail = json.dumps(result) if isinstance(result, dict) else ""
    src = " ".join(args.src) if isinstance(args.src, list) else args.src
    print(f"imported {what} {src} -> {args.dst} in {seconds:.2f} s {detail}".rstrip())
    return 0


def _opened(ckpt: Any) -> dict[str, Any]:
    """What an import that returns the opened checkpoint reports: its tensors, bytes and what it skipped."""
    from ..format.tree import SKIPPED_LEAF

    skipped = ckpt.leaves.get(SKIPPED_LEAF, [])
    return {"tensors": len(ckpt), "bytes": ckpt.nbytes, "skipped": [r["name"] for r in skipped]}


def _import_dcp(args: argparse.Namespace) -> int:
    from ..frontends.torch import import_dcp

    t0 = time.perf_counter()
    return _report("DCP checkpoint", args, t0, import_dcp(args.src, args.dst, **_options(args)))


def _import_orbax(args: argparse.Namespace) -> int:
    from ..frontends.jax import import_orbax

    t0 = time.perf_counter()
    return _report("Orbax checkpoint", args, t0, import_orbax(args.src, args.dst, step=args.step, **_options(args)))


def _import_mindspore(args: argparse.Namespace) -> int:
    from ..frontends.mindspore import import_mindspore

    t0 = time.perf_counter()  # the strategy by its path: errors name the file
    ckpt = import_mindspore(args.src, args.dst, args.strategy, file_name=args.file, **_options(args))
    return _report("MindSpore checkpoint", args, t0, _opened(ckpt))


def _import_deepspeed(args: argparse.Namespace) -> int:
    from ..frontends.deepspeed import import_deepspeed

    t0 = time.perf_counter()
    return _report("DeepSpeed checkpoint", args, t0, import_deepspeed(
        args.src, args.dst, tag=args.tag, tp_split=tp_split_option(args.parser, args.tp_split), **_options(args)))


def tp_split_option(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str] | None:
    """``--tp-split PATTERN=RULE`` options as a dict (in order), or None when none were given."""
    out = {}
    for item in items:
        pattern, sep, rule = item.rpartition("=")
        if not sep or not pattern:
            parser.error(f"--tp-split {item!r}: expected PATTERN=RULE (RULE a dim, 'replicated' or 'average')")
        out[pattern] = rule
    return out or None


def _import_megatron(args: argparse.Namespace) -> int:
    from ..frontends.megatron import import_megatron

    t0 = time.perf_counter()
    return _report("Megatron torch_dist checkpoint", args, t0, import_megatron(args.src, args.dst, **_options(args)))


def _import_safetensors(args: argparse.Namespace) -> int:
    from ..frontends.huggingface import import_safetensors

    t0 = time.perf_counter()
    options = _options(args)  # -S applies to SRC and DST alike
    ckpt = import_safetensors(args.src, args.dst, src_storage_options=options["storage_options"], **options)
    return _report("safetensors", args, t0, _opened(ckpt))


def _sbp_arg(text: str) -> Any:
    text = text.strip()
    return json.loads(text) if text.startswith("[") else text


def _import_oneflow(args: argparse.Namespace) -> int:
    from fnmatch import fnmatchcase

    from ..frontends.oneflow import global_shapes, load_local, placement_ranks, save_oneflow, tensor_paths
    from ..frontends.sources import refuse_empty
    from ..write.writer import single_process

    ranks = json.loads(args.placement) if args.placement is not None else list(range(len(args.src)))
    flat = placement_ranks(ranks)
    if len(args.src) != len(flat):
        args.parser.error(f"--placement {args.placement} has {len(flat)} ranks but {len(args.src)} SRC_DIRs were given")
    if args.sbp is None and len(flat) > 1:
        args.parser.error(f"--sbp is required with {len(flat)} ranks (how the tensors are divided among them)")
    default = _sbp_arg(args.sbp) if args.sbp is not None else "B"
    rules = []
    for rule in args.sbp_for:
        name, sep, value = rule.partition("=")
        if not sep or not name:
            args.parser.error(f"--sbp-for wants NAME=SBP, got {rule!r}")
        rules.append((name, _sbp_arg(value)))

    t0 = time.perf_counter()
    names: dict[int, str] = {}

    def spec(state: Any, tensor: Any) -> Any:
        name = names[id(tensor)]
        return next((value for pattern, value in rules if fnmatchcase(name, pattern)), default)

    def known(state: Any) -> Any:
        names.update({id(tensor): name for name, (_, tensor) in tensor_paths(state).items()})
        return state

    # plan from the headers (exact global shapes, even for uneven splits), then one rank in memory at a time
    heads = {rank: known(load_local(src, headers_only=True)) for rank, src in zip(flat, args.src, strict=True)}
    shapes = global_shapes(heads, ranks, spec)
    refuse_empty("OneFlow", " ".join(args.src), len(shapes))
    # every rank's part from this one process: one fresh save_id; OneFlow's reader refuses what it does not decode,
    # so --skip has nothing to leave out
    options = single_process({k: v for k, v in _options(args).items() if k != "skip"})
    for i, (rank, src) in enumerate(zip(flat, args.src, strict=True)):
        save_oneflow(known(load_local(src)), args.dst, ranks, spec, rank=rank, shapes=shapes,
                     commit=i == len(flat) - 1, **options)
    return _report("OneFlow state", args, t0, {"ranks": len(flat), "tensors": len(shapes)})


# ------------------------------------------------------------ export
def _export_deepspeed(args: argparse.Namespace, t0: float) -> int:
    from ..frontends.deepspeed import export_deepspeed
    from .commands import storage_options

    done = export_deepspeed(args.src, args.file, args.dp, tag=args.tag, tp=args.tp,
                            tp_split=tp_split_option(args.parser, args.tp_split),
                            storage_options=storage_options(args.storage_option), overwrite=args.overwrite)
    print(f"exported a ZeRO-{done['stage']} save for {done['dp']} data-parallel x {done['tp']} model-parallel "
          f"ranks to {done['folder']} "
          f"({done['files']} files) in {time.perf_counter() - t0:.2f} s")
    return 0


def _export_megatron(args: argparse.Namespace, t0: float) -> int:
    from ..frontends.megatron import export_megatron
    from .commands import storage_options

    done = export_megatron(args.src, args.file, storage_options=storage_options(args.storage_option),
                           overwrite=args.overwrite, ep=args.ep)
    print(f"exported a Megatron-Core torch_dist save (fully_reshardable, {done['tensors']} tensors, "
          f"{done['states']} optimizer states) to {done['folder']} in {time.perf_counter() - t0:.2f} s")
    return 0


def _export_mindspore(args: argparse.Namespace, t0: float) -> int:
    from ..frontends.mindspore import export_mindspore
    from .commands import storage_options

    files = export_mindspore(args.src, args.file, Path(args.strategy).read_bytes(),
                             format=getattr(args, "ms_format", None) or "ckpt",
                             storage_options=storage_options(args.storage_option), overwrite=args.overwrite)
    print(f"exported {len(files)} rank files under {args.file} in {time.perf_counter() - t0:.2f} s")
    return 0


def _export_safetensors(args: argparse.Namespace, t0: float) -> int:
    """A Hugging Face folder (``--max-shard-size``, or FILE an existing folder), else one file."""
    if args.max_shard_size is None and not Path(args.file).is_dir():
        if args.prefix:
            args.parser.error("--prefix with safetensors writes a Hugging Face folder: give --max-shard-size")
        return export_file(args, "safetensors", t0)
    from ..frontends.huggingface import DEFAULT_SHARD_SIZE, export_safetensors, parse_size
    from ..read.display import human_bytes
    from .commands import open_url

    try:
        size = parse_size(args.max_shard_size or DEFAULT_SHARD_SIZE)
    except ValueError as e:
        args.parser.error(f"--max-shard-size: {e}")
    done = export_safetensors(open_url(args.src, args), args.file, max_shard_size=size,
                              overwrite=args.overwrite, prefix=args.prefix)
    seconds = time.perf_counter() - t0
    print(f"exported {human_bytes(done['total_size'])} of tensors to {args.file}: {len(done['files'])} "
          f"safetensors file(s)" + (f" and {Path(done['index']).name}" if done["index"] else "")
          + f" in {seconds:.2f} s")
    return 0


def _export_llama(args: argparse.Namespace, t0: float) -> int:
    """A Megatron-Core Llama-style import as a Hugging Face LlamaForCausalLM folder."""
    from ..frontends.huggingface import DEFAULT_SHARD_SIZE
    from ..frontends.huggingface.llama import export_llama
    from ..read.display import human_bytes
    from .commands import storage_options

    config = None
    if args.config:
        config = json.loads(Path(args.config).read_text())
        if not isinstance(config, dict):
            args.parser.error(f"--config {args.config}: not a JSON object")
    done = export_llama(args.src, args.file, heads=args.heads, kv_heads=args.kv_heads, rope_theta=args.rope_theta,
                        norm_eps=args.norm_eps, max_positions=args.max_positions, config=config,
                        max_shard_size=args.max_shard_size or DEFAULT_SHARD_SIZE,
                        storage_options=storage_options(args.storage_option), overwrite=args.overwrite)
    cfg = done["config"]
    print(f"exported a LlamaForCausalLM ({cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads in "
          f"{cfg['num_key_value_heads']} groups, {human_bytes(done['total_size'])}) to {args.file}: "
          f"{len(done['files'])} safetensors file(s) and config.json in {time.perf_counter() - t0:.2f} s")
    return 0


def _export_torch(args: argparse.Namespace, t0: float) -> int:
    """One ``torch.save`` file (it needs every tensor in memory at once)."""
    from ..frontends.torch import export_torch
    from .commands import storage_options

    stats = export_torch(args.src, args.file, prefix=args.prefix, storage_options=storage_options(args.storage_option),
                         overwrite=args.overwrite)
    return _exported(args, "torch", t0, stats)


def export_file(args: argparse.Namespace, fmt: str, t0: float) -> int:
    """One file of a format :meth:`Checkpoint.export` writes itself (safetensors, npz), streaming."""
    from .commands import open_url

    return _exported(args, fmt, t0, open_url(args.src, args).export(args.file, format=fmt, overwrite=args.overwrite))


def _exported(args: argparse.Namespace, fmt: str, t0: float, stats: Any) -> int:
    from ..read.display import human_bytes

    seconds = time.perf_counter() - t0
    print(f"exported {human_bytes(stats.bytes_delivered)} of tensors to {args.file} ({fmt}) in {seconds:.2f} s "
          f"({stats.bytes_delivered / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
    return 0


# ------------------------------------------------------------ the table
@dataclass(frozen=True)
class Framework:
    """One command word of ``reshard import`` / ``reshard export``.

    Attributes
    ----------
    package : str
        The folder under ``store/frontends/`` that does the work.
    doc : str
        Its docs page.
    import_help : str
        The help of ``reshard import NAME`` ("" when it does not import).
    import_args : callable
        Adds the import's arguments (SRC and DST included) to its parser.
    run_import : callable or None
        Runs ``reshard import NAME`` (None: no import).
    run_export : callable or None
        Runs ``reshard export NAME`` with ``(args, t0)`` (None: no export).
    """

    package: str
    doc: str
    import_help: str = ""
    import_args: Callable[[argparse.ArgumentParser], None] = _src_dst
    run_import: Callable[[argparse.Namespace], int] | None = None
    run_export: Callable[[argparse.Namespace, float], int] | None = None


#: Every framework the command line knows, by command word.
FRAMEWORKS: dict[str, Framework] = {
    "dcp": Framework("torch", "docs/torch.md", "torch.distributed.checkpoint folder (.metadata + *.distcp)",
                     run_import=_import_dcp),
    "torch": Framework("torch", "docs/torch.md", run_export=_export_torch),
    "orbax": Framework("jax", "docs/jax.md", "Orbax checkpoint folder (StandardCheckpointer / PyTreeCheckpointer), "
                       "a step folder, or a CheckpointManager folder (its latest finished step, or --step)",
                       _orbax_args, _import_orbax),
    "mindspore": Framework("mindspore", "docs/mindspore.md", "MindSpore per-rank rank_N/*.ckpt (or *.safetensors) "
                           "files plus the training strategy file; or a single-device save: a .ckpt / .safetensors "
                           "file, or a ModelCheckpoint folder (its latest file, or --file)",
                           _mindspore_args, _import_mindspore, _export_mindspore),
    "deepspeed": Framework("deepspeed", "docs/deepspeed.md", "DeepSpeed ZeRO-1/2/3 save (model states + "
                           "zero_pp_rank_*_optim_states.pt), read without DeepSpeed: every parameter's fp32 copy and "
                           "optimizer state under its flat-range layout",
                           _deepspeed_args, _import_deepspeed, _export_deepspeed),
    "megatron": Framework("megatron", "docs/megatron.md", "Megatron-Core dist_checkpointing save in the torch_dist "
                          "format; the distributed optimizer's flattened ranges become each tensor in its own shape "
                          "under a flat-range layout", run_import=_import_megatron, run_export=_export_megatron),
    "safetensors": Framework("huggingface", "docs/huggingface.md", "a safetensors file, or a Hugging Face folder "
                             "(model.safetensors, or model.safetensors.index.json and its "
                             "model-0000k-of-0000n.safetensors shards); one tensor in memory at a time",
                             run_import=_import_safetensors, run_export=_export_safetensors),
    "oneflow": Framework("oneflow", "docs/oneflow.md", ONEFLOW_HELP, _oneflow_args, _import_oneflow),
    "llama": Framework("huggingface", "docs/huggingface.md", run_export=_export_llama),
}


#: ``reshard export`` formats: npz (no framework) and those of :data:`FRAMEWORKS` that export.
EXPORT_FORMATS = ("npz", *(name for name, row in FRAMEWORKS.items() if row.run_export is not None))

"""The ``reshard`` command line (see ``docs/cli.md``): the argument parser and ``main``.

Commands: ``inspect``, ``show``, ``diff``, ``verify`` (in
:mod:`reshard.store.cli.commands`), ``redivide``, ``export``, ``demo`` (in
:mod:`reshard.store.cli.write`); framework ``import`` commands (in
:mod:`reshard.store.cli.frameworks`).
Exit codes: 0 success (``diff``: same), 1 failure (``diff``: differ), 2 usage.
A failure prints one line, ``reshard: error: ...``, unless ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import __version__
from .frameworks import EXPORT_FORMATS, grid_option, register_import

#: Where the commands and their helpers live. The parser needs none of them, and ``--help`` or a usage
#: error should not pay for zarr and numpy: each is imported when a command runs (:func:`_command`) or
#: when it is asked for by name (``from reshard.store.cli.app import compare``: module ``__getattr__``).
_HOMES = {
    **dict.fromkeys(["SLAB_BYTES", "cmd_diff", "cmd_inspect", "cmd_show", "compare", "parse_region", "slabs",
                     "storage_options", "tensor_stats"], "commands"),
    **dict.fromkeys(["OPT_WORDS", "cmd_convert", "cmd_demo", "cmd_export", "cmd_gc", "cmd_redivide", "cmd_unlock",
                     "load_layout_spec", "short_layouts"], "write"),
    "cmd_verify": "verify",
}

__all__ = ["Parser", "build_parser", "main", "register_import", *_HOMES]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__package__}.{_HOMES[name]}"), name)


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name``, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        return int(__getattr__(name)(args) or 0)

    run.__name__ = name
    return run


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
    from ..io.progress import quiet

    try:
        with quiet(args.quiet):
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


class Parser(argparse.ArgumentParser):
    """An argument parser whose "invalid choice" errors suggest the close matches (``inspekt`` -> ``inspect``)."""

    def error(self, message: str) -> NoReturn:
        import difflib
        import re

        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1), choices, n=3, cutoff=0.5)
            if close:
                message += f"; did you mean {' or '.join(map(repr, close))}?"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = Parser(
        prog="reshard", description="Distributed-training checkpoints as zarr v3 arrays: look inside, compare, "
        "verify, redivide, export. 'reshard COMMAND --help' describes each command; docs/cli.md has examples.")
    parser.add_argument("--version", action="version", version=f"reshard {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bars (drawn on a terminal only: imports, exports, redivide, convert, "
                             "verify, diff)")
    common = Parser(add_help=False)
    common.add_argument("-S", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; VALUE parsed as JSON when it is; "
                             "dotted keys nest, e.g. client_kwargs.region_name=eu-west-1)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    out = Parser(add_help=False)
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    def add(name: str, text: str, json_out: bool = True) -> Any:  # runs cmd_<name>
        p = sub.add_parser(name, parents=[common, out] if json_out else [common], help=text, description=text)
        p.set_defaults(func=_command(f"cmd_{name}"), parser=p)
        return p

    p = add("inspect", "tensors, dtypes, shapes, saving layouts, sizes, shards (reads no data)")
    p.add_argument("url")
    p.add_argument("pattern", nargs="?", help="glob on dotted names ('*.exp_avg.*'); without wildcards: "
                                              "that name or everything under it")
    p.add_argument("--uncommitted", action="store_true", help="describe a never-committed checkpoint "
                                                              "from its ranks' manifests")
    p = add("show", "values of a tensor region, or their statistics (--stats); or a leaf's value")
    p.add_argument("url")
    p.add_argument("tensor")
    p.add_argument("--region", help="numpy basic index, e.g. '0:4,:' or '3' or '...,0:2' "
                                    "(default: a corner of at most 8 per dim; with --stats the whole tensor)")
    p.add_argument("--stats", action="store_true", help="min/max/mean/std/norm and NaN/Inf counts, "
                                                        "streamed chunk by chunk with dask")
    p = add("diff", "compare two checkpoints; exit 0 same, 1 differ")
    p.add_argument("url_a")
    p.add_argument("url_b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: equal values)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, |a-b| <= atol + rtol*|b|")
    p = add("verify", "commit state, every shard, every chunk's crc32c; exit 1 on any problem")
    p.add_argument("url")
    p = add("redivide", "write SRC again at DST under new layouts", json_out=False)
    p.add_argument("src")
    p.add_argument("dst")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--layout", metavar="SPEC", help="MindSpore strategy file (protobuf or JSON) or a JSON "
                                                       "file {name: Layout.to_json()}")
    spec.add_argument("--tp", type=int, help="short form: tensors of 2+ dims split dim 0 over tp ranks (with --preset: "
                                                "Megatron's tensor parallelism, default 1)")
    p.add_argument("--preset", choices=["megatron"],
                   help="short form: split each tensor as Megatron-LM does, by its Megatron-Core or Hugging Face name "
                        "(column-, row-, vocab-parallel over --tp, layers over --pp stages, experts over --ep; rank "
                        "order tp-cp-ep-dp-pp, tp fastest; docs/megatron.md, docs/huggingface.md)")
    p.add_argument("--pp", type=int, default=1, help="--preset megatron: pipeline stages (default 1)")
    p.add_argument("--ep", type=int, default=1, help="--preset megatron: expert-parallel size (default 1)")
    p.add_argument("--heads", type=int, metavar="H", help="--preset megatron: attention heads, when the checkpoint "
                                                           "carries no config naming them")
    p.add_argument("--kv-heads", type=int, metavar="G", help="--preset megatron: key-value heads (query groups); "
                                                              "default: read from the shapes")
    p.add_argument("--dp", type=int, default=1, help="short form: data-parallel replicas (default 1)")
    p.add_argument("--opt-shard", action="store_true", help="short form: optimizer states also split "
                                                            "over dp (MindSpore optimizer sharding)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.add_argument("--compression", choices=["zstd"], help="compress the new chunks")
    p = add("convert", "write SRC again at DST in another storage form (same layouts)", json_out=False)
    p.add_argument("src")
    p.add_argument("dst", help="where the converted checkpoint goes; SRC itself with --overwrite converts in place")
    p.add_argument("--form", choices=["directory", "packed"], default=None,
                   help="directory: one object per shard (TensorStore reads it); packed: one data object per rank "
                        "plus kerchunk references (default: SRC's form; --form or --grid is needed)")
    grid_option(p)
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p = add("export", "stream every tensor into one file (safetensors, npz, torch), "
            "or into MindSpore per-rank files, a DeepSpeed ZeRO save or a Megatron-Core torch_dist save",
            json_out=False)
    p.usage = ("%(prog)s [-h] [-S KEY=VALUE] [--format F] [--strategy FILE] [--max-shard-size SIZE] [--dp N] "
               "[--ep N] [--prefix P] [--heads H --rope-theta T --norm-eps E --max-positions N | --config F] "
               "[--overwrite] [FORMAT] SRC FILE")
    p.add_argument("paths", nargs="+", metavar="[FORMAT] SRC FILE",
                   help="FORMAT, if given, is --format (reshard export mindspore SRC DIR --strategy FILE); "
                        "FILE is the output file (a folder for mindspore)")
    p.add_argument("--format", choices=EXPORT_FORMATS,
                   help="default from FILE's extension: .npz, .pt/.pth (torch), else safetensors")
    p.add_argument("--strategy", help="mindspore only: the target strategy file (rank_N/ folders are written)")
    p.add_argument("--ms-format", choices=["ckpt", "safetensors"], default=None,
                   help="mindspore only: rank_N/checkpoint_N.ckpt (default) or .safetensors (MindSpore >= 2.4)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors only: FILE is a folder of Hugging Face shards of at most SIZE ('5GB', '500MiB') "
                        "with model.safetensors.index.json (one model.safetensors when everything fits); the "
                        "default when FILE is an existing folder: 5GB")
    p.add_argument("--dp", type=int, default=None, metavar="N",
                   help="deepspeed only: the data-parallel size to write the ZeRO save for (DIR/TAG, DIR/latest)")
    p.add_argument("--tag", default="reshard", help="deepspeed only: the save's folder name under DIR")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="deepspeed only: the model-parallel size to write for (default: the imported save's)")
    p.add_argument("--tp-split", action="append", default=[], metavar="PATTERN=RULE",
                   help="deepspeed only: how the tensors whose names match PATTERN split over --tp ranks (a dim, "
                        "'replicated', 'average'), before what the import recorded")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="megatron only: the expert-parallel size of the loading job, where it changes the "
                        "optimizer's structure (1: one optimizer, a chained import's merged; default: the import's)")
    p.add_argument("--heads", type=int, default=None, metavar="H",
                   help="llama only: attention heads (Megatron's num_attention_heads)")
    p.add_argument("--kv-heads", type=int, default=None, metavar="G",
                   help="llama only: query groups (read from the shapes; checked when given)")
    p.add_argument("--rope-theta", type=float, default=None, metavar="THETA",
                   help="llama only: the RoPE base (Megatron's rotary_base, its default 10000)")
    p.add_argument("--norm-eps", type=float, default=None, metavar="EPS",
                   help="llama only: RMSNorm epsilon (Megatron's layernorm_epsilon / --norm-epsilon, default 1e-5)")
    p.add_argument("--max-positions", type=int, default=None, metavar="N",
                   help="llama only: max_position_embeddings of config.json (Megatron's --max-position-embeddings)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="llama only: a Hugging Face config.json to start from (what the options above leave out "
                        "is taken from it; its sizes must match the tensors')")
    p.add_argument("--prefix", default="", help="torch and safetensors folders: export the tensors under PREFIX, "
                                                "named without it (--prefix model. gives a file for "
                                                "model.load_state_dict, or a folder for from_pretrained)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing FILE (a folder: one that is not empty) whole: the export is written "
                        "beside it, then swapped in; without it an existing FILE is refused")
    p = add("gc", "delete the saves a checkpoint no longer uses: replaced ones and abandoned attempts")
    p.add_argument("url")
    p.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                   help="keep saves written in the last SECONDS: they may be in progress (default 3600; 0: none)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p = add("unlock", "remove the commit lock of a save whose committer died")
    p.add_argument("url")
    p.add_argument("--save-id", default="0", help="the save whose lock to remove (default '0')")
    p = add("demo", "save from 8 ranks, redivide to 7 and to 1, verify every byte")
    p.add_argument("--out", default="./reshard-demo", help="folder or URL for the demo's files")
    p.add_argument("--ranks", type=int, default=8, choices=[1, 2, 4, 8, 16],
                   help="saving ranks (tp = ranks/2, dp = 2); the demo redivides to ranks-1")
    p.add_argument("--quick", action="store_true", help="a tiny model")
    register_import(sub, common)
    return parser



"""``reshard import ...``: the framework importers on the command line.

``reshard import dcp SRC DST``, ``reshard import orbax SRC DST``,
``reshard import mindspore SRC_DIR DST --strategy FILE`` and
``reshard import oneflow SRC DST --placement RANKS --sbp SBP``. Each
framework is imported only when its command runs.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def register_import(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``import`` command and one subcommand per framework."""
    top = subparsers.add_parser("import", help="convert a framework's checkpoint into a reshard checkpoint",
                                description="Convert a framework's checkpoint into a reshard checkpoint.")
    sub = top.add_subparsers(dest="framework", required=True, metavar="FRAMEWORK")

    def add(name: str, func: Any, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        p.add_argument("src", help="the framework's checkpoint (folder or URL)")
        p.add_argument("dst", help="URL of the reshard checkpoint to write")
        p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
        p.set_defaults(func=func)
        return p

    add("dcp", _dcp, "torch.distributed.checkpoint folder (.metadata + *.distcp)")
    add("orbax", _orbax, "Orbax checkpoint folder (StandardCheckpointer / PyTreeCheckpointer)")
    p = add("mindspore", _mindspore, "MindSpore per-rank rank_N/*.ckpt files plus the training strategy file")
    p.add_argument("--strategy", required=True, help="strategy file (protobuf or JSON, pipeline-merged too)")
    p = add("oneflow", _oneflow, "a OneFlow state dict saved as per-rank numpy .npz files (one per placement rank)")
    p.add_argument("--placement", required=True, help="placement ranks as JSON, e.g. '[0, 1]' or '[[0,1],[2,3]]'")
    p.add_argument("--sbp", required=True, help="SBP for every tensor: 'S(0)', 'B', or a JSON list for N-d")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from ..cli import storage_options

    return {"storage_options": storage_options(args.storage_option), "overwrite": args.overwrite}


def _report(what: str, args: argparse.Namespace, t0: float, result: Any) -> int:
    seconds = time.perf_counter() - t0
    detail = json.dumps(result) if isinstance(result, dict) else ""
    print(f"imported {what} {args.src} -> {args.dst} in {seconds:.2f} s {detail}".rstrip())
    return 0


def _dcp(args: argparse.Namespace) -> int:
    from .torch import import_dcp

    t0 = time.perf_counter()
    return _report("DCP checkpoint", args, t0, import_dcp(args.src, args.dst, **_options(args)))


def _orbax(args: argparse.Namespace) -> int:
    from .jax import import_orbax

    t0 = time.perf_counter()
    return _report("Orbax checkpoint", args, t0, import_orbax(args.src, args.dst, **_options(args)))


def _mindspore(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .mindspore import import_mindspore

    t0 = time.perf_counter()
    ckpt = import_mindspore(args.src, args.dst, Path(args.strategy).read_bytes(), **_options(args))
    return _report("MindSpore checkpoint", args, t0, {"tensors": len(ckpt), "bytes": ckpt.nbytes})


def _oneflow(args: argparse.Namespace) -> int:
    import glob

    import numpy as np

    from .oneflow import save_oneflow

    ranks = json.loads(args.placement)
    spec = json.loads(args.sbp) if args.sbp.lstrip().startswith("[") else args.sbp
    files = sorted(glob.glob(f"{args.src.rstrip('/')}/rank_*.npz"), key=lambda p: int(p.rsplit("_", 1)[1][:-4]))
    if not files:
        raise FileNotFoundError(f"no rank_N.npz files under {args.src}")
    t0 = time.perf_counter()
    for path in files:
        rank = int(path.rsplit("_", 1)[1][:-4])
        with np.load(path, allow_pickle=False) as f:
            save_oneflow(dict(f), args.dst, ranks, spec, rank=rank, commit=False, **_options(args))
    from ..writer import commit

    commit(args.dst, storage_options=_options(args)["storage_options"])
    return _report("OneFlow state", args, t0, {"ranks": len(files)})

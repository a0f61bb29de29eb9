"""Where MindSpore's inputs are: strategy files and per-rank checkpoint files.

* :func:`load_strategy`: a strategy file (protobuf or JSON, pipeline-merged or
  not; path, bytes or parsed) as ``{param: Layout}``; :func:`infer_shapes` gives
  a protobuf file without shapes its global shapes from the rank files.
* :func:`rank_files`: ``rank_N/*.ckpt`` / ``rank_N/*.safetensors``, a
  single-device ``ModelCheckpoint`` folder (its :func:`latest_file`), or one file.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reshard.layouts import OPTIMIZER_PREFIXES, Layout, parse_strategy
from reshard.layouts import _protowire as pw
from reshard.layouts.errors import CheckpointNotFoundError, FormatError

from .ckpt import SUFFIXES, Header

# ------------------------------------------------------------ strategies
StrategyLike = str | os.PathLike[str] | bytes | Mapping[str, Any] | None


def load_strategy(strategy: StrategyLike, shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Layout]:
    """``{param: Layout}`` of a strategy file path, its bytes, its parsed JSON, or layouts already.

    ``None`` gives ``{}`` (every tensor a whole copy). A file's errors name it.
    """
    if strategy is None:
        return {}
    if isinstance(strategy, Mapping) and all(isinstance(v, Layout) for v in strategy.values()):
        return dict(strategy)
    if not isinstance(strategy, (str, os.PathLike)):
        return parse_strategy(strategy, shapes)
    try:
        return parse_strategy(Path(strategy).read_bytes(), shapes)
    except FormatError as e:
        raise FormatError(f"{strategy}: {e}") from None


def _raw_entries(data: bytes) -> dict[str, tuple[list[int], list[int], int]]:
    """``{key: (dev_matrix, tensor_map, opt_weight_shard_size)}`` of a protobuf strategy."""
    out = {}
    for wire, item in pw.fields(data).get(3, []):
        if wire != pw.LEN or isinstance(item, int):
            continue
        f = pw.fields(item)
        lay = pw.fields(f[2][-1][1]) if 2 in f and not isinstance(f[2][-1][1], int) else {}
        dims = [pw.ints(pw.fields(v).get(1, []), signed) for signed, n in ((False, 1), (True, 2))
                for _, v in lay.get(n, [])[:1] if not isinstance(v, int)]
        opt = pw.ints(lay.get(7, []))
        if len(dims) == 2:
            out[pw.text(f.get(1, []), "param_name")] = (dims[0], dims[1], opt[-1] if opt else 0)
    return out


def infer_shapes(data: bytes, headers: Mapping[int, Mapping[str, Header]]) -> dict[str, list[int]]:
    """Global shapes for a protobuf strategy that holds none: local shape x split counts.

    The local shape comes from the stage's first rank file holding the tensor,
    else its optimizer state (with optimizer sharding, dim 0 is also
    multiplied by the shard size).
    Entries no file holds get a placeholder shape that any split divides.
    """
    shapes = {}
    for key, (dev, tmap, opt) in _raw_entries(data).items():
        m = re.match(r"^(\d+)-(.+)$", key)
        stage, name = (int(m.group(1)), m.group(2)) if m else (0, key)
        first = stage * math.prod(dev)
        tags = [name, *(p + name for p in OPTIMIZER_PREFIXES)]  # the parameter, else its optimizer state
        local = next((h[t][0] for t in tags for r, h in sorted(headers.items())
                      if r >= first and t in h and len(h[t][0]) == len(tmap)), (1,) * len(tmap))
        shape = [n * (dev[len(dev) - 1 - t] if t >= 0 else 1) for n, t in zip(local, tmap, strict=True)]
        if opt > 0 and shape:
            shape[0] *= opt
        shapes[key] = shape
    return shapes


# ------------------------------------------------------------ rank files
_STEP = re.compile(r"-(\d+)_(\d+)\.[a-z]+$")


def latest_file(files: Sequence[Path]) -> Path:
    """The newest of several ``ModelCheckpoint`` files.

    ``ModelCheckpoint`` names files ``{prefix}-{epoch}_{step}.ckpt`` (``.safetensors``);
    the latest is the one with the highest (epoch, step), then the newest
    modification time, then the last name.
    """
    def key(p: Path) -> tuple[int, int, float, str]:
        m = _STEP.search(p.name)
        epoch, step = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
        return epoch, step, p.stat().st_mtime, p.name

    return max(files, key=key)


def _matching(folder: Path, file_name: str | None, rank: int) -> list[Path]:
    if file_name:
        return sorted(p for p in folder.glob(file_name.replace("{rank}", str(rank))) if p.is_file())
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def rank_files(src: str | os.PathLike[str] | Mapping[int, Any], file_name: str | None = None) -> dict[int, Path]:
    """``{rank: rank file}`` found in ``src/rank_N/`` folders, or the file of a single-device save.

    Parameters
    ----------
    src : path or mapping
        The folder holding ``rank_0``, ``rank_1``...; a single-device folder
        (``.ckpt`` / ``.safetensors`` files and no ``rank_N``: its latest file,
        see :func:`latest_file`, as rank 0); one file (rank 0); or
        ``{rank: path}`` already.
    file_name : str, optional
        File name or glob inside each folder; ``{rank}`` is replaced by the
        rank. Without it each ``rank_N`` folder gives its latest file (every
        rank's at the same epoch and step, else an error; a warning says which),
        as a single-device folder does.
    """
    if isinstance(src, Mapping):
        return {int(r): Path(p) for r, p in src.items()}
    root = Path(src)
    if root.is_file():
        return {0: root}
    if not root.is_dir():
        raise CheckpointNotFoundError(f"MindSpore checkpoint folder {root.absolute()} does not exist")
    out, several = {}, {}
    for folder in sorted(root.iterdir()):
        m = re.fullmatch(r"rank_(\d+)", folder.name)
        if not m or not folder.is_dir():
            continue
        rank = int(m.group(1))
        found = _matching(folder, file_name, rank)
        if found:
            out[rank] = latest_file(found)
        if len(found) > 1:
            several[rank] = len(found)
    if several:  # each rank's latest, as in a single-device folder: the same epoch and step on every rank
        steps = {r: _STEP.search(p.name) for r, p in out.items()}
        keys = {r: (m.group(1), m.group(2)) if m else None for r, m in steps.items()}
        if None in keys.values() or len(set(keys.values())) > 1:
            raise FormatError(f"{root}: the rank_N folders hold several checkpoints whose latest differ by rank "
                              f"({', '.join(f'rank_{r}: {p.name}' for r, p in sorted(out.items()))}); pass "
                              "file_name= (reshard import mindspore --file NAME, {rank} for the rank)")
        warnings.warn(f"{root}: rank_N folders hold several checkpoints ({max(several.values())} in "
                      f"rank_{min(several)}); importing each rank's latest, {out[min(several)].name} in "
                      f"rank_{min(several)} (file_name= / --file picks another)", stacklevel=2)
    if out:
        return out
    found = _matching(root, file_name, 0)
    if found:
        return {0: latest_file(found)}
    raise CheckpointNotFoundError(f"no rank_N/{file_name or '*.ckpt / *.safetensors'} files and no "
                                  f"{file_name or '.ckpt / .safetensors'} file under {root.absolute()}: "
                                  "no tensors to import")


__all__ = ["StrategyLike", "infer_shapes", "latest_file", "load_strategy", "rank_files"]

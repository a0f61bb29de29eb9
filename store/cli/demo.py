"""``reshard demo``: save from 8 ranks, redivide to 7 and to 1, check every byte.

The demo builds a small transformer-like training state (bfloat16 weights,
float32 Adam moments ``exp_avg``/``exp_avg_sq`` in parameter shape, a step
counter) and then, timing each phase:

1. saves it from ``ranks`` simulated ranks (tensor-parallel ``ranks/2`` x
   data-parallel 2, MindSpore layouts; moments optimizer-sharded over the
   data-parallel replicas): every rank calls ``create`` and ``write`` with its
   own pieces only, one ``commit`` at the end;
2. loads each of ``ranks - 1`` new ranks (``torch.chunk``-style ``ceil`` splits
   for matrices, OneFlow-style ``balanced`` splits for vectors);
3. redivides the checkpoint to a new one for those ``ranks - 1`` ranks;
4. integrates it onto one host, exported to a safetensors file;
5. compares every byte of every result with the original state.

Everything lives under ``out`` (default ``./reshard-demo``).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from reshard.layouts import Layout

from ..commit.gc import gc
from ..format.tree import unflatten
from ..ops.redivide import redivide
from ..read.open import open as open_checkpoint
from ..write.writer import create

MOMENTS = ("exp_avg", "exp_avg_sq")
#: Model sizes: (vocab, hidden, ffn, layers).
FULL = (4096, 256, 1024, 4)
QUICK = (256, 64, 256, 2)


@dataclass(frozen=True)
class Phase:
    """One timed row of the demo's table."""

    phase: str
    tensors: int
    nbytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")


def model_state(step: int = 100, *, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """A transformer-like training state as a nested dict of numpy arrays.

    ``model.*`` holds bfloat16 weights (embedding, per layer: attention ``qkv``
    and ``out``, MLP ``up`` and ``down``, two norms), ``optimizer.exp_avg.*``
    and ``optimizer.exp_avg_sq.*`` float32 moments of the same shapes, and
    ``step`` the counter. Values depend on ``seed`` and ``step``.
    """
    vocab, hidden, ffn, layers = QUICK if quick else FULL
    rng = np.random.default_rng([seed, step])
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {
            f"layers.{i}.attn.qkv.weight": (3 * hidden, hidden),
            f"layers.{i}.attn.out.weight": (hidden, hidden),
            f"layers.{i}.mlp.up.weight": (ffn, hidden),
            f"layers.{i}.mlp.down.weight": (hidden, ffn),
            f"layers.{i}.norm1.weight": (hidden,),
            f"layers.{i}.norm2.weight": (hidden,),
        }
    flat: dict[str, Any] = {"step": step}
    for name, shape in shapes.items():
        scale = 1.0 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.1
        base = 1.0 if len(shape) == 1 else 0.0
        w = rng.standard_normal(shape, dtype=np.float32) * scale + base
        flat[f"model.{name}"] = w.astype(ml_dtypes.bfloat16)
        flat[f"optimizer.exp_avg.{name}"] = rng.standard_normal(shape, dtype=np.float32) * 1e-3
        flat[f"optimizer.exp_avg_sq.{name}"] = np.abs(rng.standard_normal(shape, dtype=np.float32)) * 1e-6
    return unflatten(flat)


def training_layouts(state: dict[str, Any], tp: int = 4, dp: int = 2) -> dict[str, Layout]:
    """MindSpore layouts on ``dev_matrix [dp, tp]`` for :func:`model_state`.

    Embedding, ``qkv`` and ``up`` split dim 0 over tp (``tmap [0,-1]``), ``out``
    and ``down`` split dim 1 (``tmap [-1,0]``), norms are replicated. Moments
    take the weight's layout plus optimizer sharding over the dp replicas
    (``opt_shard_size=-1``).
    """
    out = {}
    for name, arr in _flat(state).items():
        if not isinstance(arr, np.ndarray):
            continue
        if arr.ndim == 1:
            tmap: list[int] = [-1]
        elif name.endswith(("out.weight", "down.weight")):
            tmap = [-1, 0]
        else:
            tmap = [0, -1]
        opt = -1 if name.startswith("optimizer.") else None
        out[name] = Layout.from_mindspore([dp, tp], tmap, arr.shape, opt_shard_size=opt)
    return out


def target_layouts(state: dict[str, Any], ranks: int) -> dict[str, Layout]:
    """Layouts for a job of ``ranks`` ranks that need not divide anything.

    Matrices split dim 0 ``ceil`` (``torch.chunk``), vectors ``balanced`` (OneFlow).
    """
    out = {}
    for name, arr in _flat(state).items():
        if isinstance(arr, np.ndarray):
            dims = ((0,),) + ((),) * (arr.ndim - 1)
            out[name] = Layout(arr.shape, (ranks,), dims=dims, split="ceil" if arr.ndim > 1 else "balanced")
    return out


def save_from_ranks(state: dict[str, Any], url: str, layouts: dict[str, Layout], **options: Any) -> None:
    """Save as a real job does: per rank ``create`` + ``write`` (own pieces only), then one ``commit``.

    ``options`` go to :func:`reshard.store.create` (``storage_options``...).
    """
    flat = _flat(state)
    save_id = uuid.uuid4().hex  # a save of its own: an earlier run at the same URL is replaced whole
    ranks = sorted(set().union(*(lay.ranks for lay in layouts.values())))
    writer = None
    for rank in ranks:  # each iteration is what one rank's process does
        writer = create(url, layouts, overwrite=True, save_id=save_id, **options)
        local = {n: v for n, v in flat.items() if n not in layouts}
        for name, layout in layouts.items():
            if rank in layout.ranks:
                local[name] = np.ascontiguousarray(flat[name][layout.region(rank)])
        writer.write(rank, local)
    assert writer is not None
    writer.commit()
    gc(url, min_age=0, storage_options=options.get("storage_options"))  # an earlier run's save goes


def read_safetensors(path: str) -> Iterator[tuple[str, str, tuple[int, ...], memoryview]]:
    """Yield ``(name, dtype code, shape, raw bytes)`` of every tensor in a safetensors file.

    A small reader of its own because ``safetensors.numpy`` has no bfloat16.
    """
    with open(path, "rb") as f:
        raw = f.read()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    body = memoryview(raw)[8 + size :]
    for name, info in header.items():
        if name != "__metadata__":
            lo, hi = info["data_offsets"]
            yield name, info["dtype"], tuple(info["shape"]), body[lo:hi]


def _same(a: np.ndarray, b: Any) -> bool:
    """Byte equality (NaNs and signed zeros included)."""
    b = np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = np.dtype(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else None
    if bits is None:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a.view(bits), b.view(bits)))


def run_demo(out: str = "./reshard-demo", ranks: int = 8, quick: bool = False,
             echo: Callable[[str], None] | None = print) -> list[Phase]:
    """Run the whole demo; return the table rows (and print them through ``echo``).

    Parameters
    ----------
    out : str
        Folder or fsspec URL under which everything is written.
    ranks : int
        Saving ranks: a power of two up to 16 (tp = ranks/2, dp = 2; 1 rank: no split).
    quick : bool
        A tiny model (for tests).
    echo : callable or None
        Where lines go (``None``: silent).

    Raises
    ------
    AssertionError
        If any byte differs from the original (the demo's whole point).
    """
    if ranks not in (1, 2, 4, 8, 16):
        raise ValueError(f"--ranks must be 1, 2, 4, 8 or 16 (tp = ranks/2, dp = 2), got {ranks}")
    dp = 2 if ranks > 1 else 1
    tp, new = ranks // dp, max(1, ranks - 1)
    out = out.rstrip("/")
    src, dst, single = f"{out}/step-100", f"{out}/step-100-{new}ranks", f"{out}/model.safetensors"
    if "://" not in out:
        import os

        os.makedirs(out, exist_ok=True)
    state = model_state(100, quick=quick)
    flat = {n: v for n, v in _flat(state).items() if isinstance(v, np.ndarray)}
    total = sum(a.nbytes for a in flat.values())
    saving, target = training_layouts(state, tp, dp), target_layouts(state, new)
    rows: list[Phase] = []

    def timed(label: str, nbytes: int, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        rows.append(Phase(label, len(flat), nbytes, time.perf_counter() - t0))
        return result

    timed(f"save {ranks} ranks (tp{tp} x dp{dp})", total, lambda: save_from_ranks(state, src, saving))
    ckpt = open_checkpoint(src)
    loaded = timed(f"load {new} ranks (ceil/balanced)", total,
                   lambda: [ckpt.load(target, r) for r in range(new)])
    timed(f"redivide {ranks} -> {new} (new checkpoint)", total, lambda: redivide(ckpt, dst, target, overwrite=True))
    gc(dst, min_age=0)  # an earlier run's redivided save goes
    timed(f"integrate {ranks} -> 1 (safetensors)", total,
          lambda: ckpt.export(single, format="safetensors", overwrite=True))  # an earlier run's file is replaced

    def verify() -> int:
        checked = 0
        for r, local in enumerate(loaded):
            got = _flat(local)
            for name, arr in flat.items():
                _check(_same(got[name], arr[target[name].region(r)]), f"load rank {r}: {name} differs")
                checked += got[name].nbytes
        again = _flat(open_checkpoint(dst).read_all())
        for name, arr in flat.items():
            _check(_same(again[name], arr), f"redivided checkpoint: {name} differs")
            checked += arr.nbytes
        seen = set()
        for name, _, shape, data in read_safetensors(single):
            stored = np.frombuffer(data, flat[name].dtype).reshape(shape)
            _check(_same(flat[name], stored), f"safetensors: {name} differs")
            seen.add(name)
            checked += len(data)
        _check(seen == set(flat), f"safetensors lacks {sorted(set(flat) - seen)}")
        _check(ckpt.leaves == {"step": 100} == open_checkpoint(dst).leaves, "step counter lost")
        return checked

    checked = timed("verify every byte", 0, verify)
    rows[-1] = Phase(rows[-1].phase, len(flat), checked, rows[-1].seconds)
    if echo is not None:
        echo(format_table(rows))
        echo(f"VERIFIED: every byte of {len(flat)} tensors matches the original "
             f"({ranks} -> {new} ranks, {ranks} -> 1); files under {out}")
    return rows


def format_table(rows: list[Phase]) -> str:
    """The demo's table as aligned text."""
    head = ("phase", "tensors", "MB", "seconds", "MB/s")
    body = [(r.phase, str(r.tensors), f"{r.nbytes / 1e6:.1f}", f"{r.seconds:.3f}", f"{r.mb_per_s:.0f}")
            for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    lines = []
    for row in (head, *body):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"demo verification failed: {what}")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else k)
    return out

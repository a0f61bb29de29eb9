"""Workload definitions: which tensors, how they are divided, what they hold.

Every system (reshard, DCP, Orbax, plain numpy) builds the same tensors from
:func:`tensors` and fills each rank's piece with :func:`fill`, a deterministic,
incompressible function of the global index, so a loaded piece can be checked
exactly against what was saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Sizes of the full run; ``--smoke`` uses :data:`SMOKE`, ``--full`` adds the 4 GiB case.
FULL: dict[str, Any] = {
    "w1": {"rows": 4480, "cols": 3744, "count": 16},          # 16 x 64 MiB float32 = 1 GiB
    "w3": {"hidden": 1536, "layers": 5, "vocab": 12288},    # 160 M params: bf16 + 2 x fp32 = 1.5 GiB
    "w2": {"count": 5000, "max_side": 256, "max_len": 4096},
    "w4": {"rows": 4480, "cols": 936, "count": 16},          # 256 MiB on the S3 test server
    "w5": {"hidden": 320, "ffn": 832, "vocab": 2496, "layers": 32},  # 873 tensors, 484 MB (7B / ~170)
    "s3sim": {"rows": 4096, "cols": 64, "count": 16, "ranks": 1024, "procs": 8},  # 16 MiB, 1 KiB a piece
    "scale_ranks": [8, 64, 512],
    "scale_shape": [4096, 256], "scale_count": 16,             # 64 MiB, 8 rows per rank at 512
    "scale_meta": {"ranks": [64, 256, 1024], "tensors": 873},  # issue 26: metadata of N ranks x T tensors
    "sizes": {"256 MiB": 936, "1 GiB": 3744},                  # W1 columns for the size sweep
    "sizes_full": {"4 GiB": 14976},
    "gpt2": {"rows": 50257, "cols": 768},                      # GPT-2's token embedding, 147 MiB float32
}
SMOKE: dict[str, Any] = {
    "w1": {"rows": 112, "cols": 64, "count": 16},
    "w3": {"hidden": 48, "layers": 2, "vocab": 96},
    "w2": {"count": 200, "max_side": 24, "max_len": 256},
    "w4": {"rows": 112, "cols": 32, "count": 4},
    "w5": {"hidden": 64, "ffn": 128, "vocab": 192, "layers": 2},
    "s3sim": {"rows": 256, "cols": 8, "count": 4, "ranks": 64, "procs": 2},
    "scale_ranks": [8, 64],
    "scale_shape": [512, 16], "scale_count": 4,
    "scale_meta": {"ranks": [8], "tensors": 20},
    "sizes": {},  # no size sweep in smoke runs
    "sizes_full": {},
    "gpt2": {"rows": 1003, "cols": 24},
}


@dataclass(frozen=True)
class Spec:
    """One tensor of a workload.

    ``kind`` says how it is divided: ``shard0`` (rows over all ranks, ``ceil``
    pieces), ``balanced0`` (rows over all ranks, OneFlow's balanced pieces), ``col``
    / ``row`` (tensor-parallel column / row linear, optimizer-sharded), ``whole``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    index: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize


def np_dtype(name: str) -> np.dtype[Any]:
    """numpy dtype of a name (``bfloat16`` through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def tensors(workload: str, cfg: dict[str, Any]) -> list[Spec]:
    """The tensors of ``workload`` (``w1``, ``w2``, ``w3``, ``w4``, ``scale``) at sizes ``cfg``."""
    if workload in ("gpt2", "gpt2-balanced"):
        kind = "balanced0" if workload == "gpt2-balanced" else "shard0"
        return [Spec("wte", (int(cfg["rows"]), int(cfg["cols"])), "float32", kind, 0)]
    if workload == "w5":
        return _w5(cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"])
    if workload in ("w1", "w4", "scale", "s3sim"):
        rect = (int(cfg["rows"]), int(cfg["cols"]))
        return [Spec(f"layer{i:02d}.weight", rect, "float32", "shard0", i) for i in range(cfg["count"])]
    if workload == "w3":
        return _w3(cfg["hidden"], cfg["layers"], cfg["vocab"])
    if workload == "w2":
        rng = np.random.default_rng(0)
        out: list[Spec] = []
        for i in range(cfg["count"]):
            if i % 2:
                shape: tuple[int, ...] = (int(rng.integers(1, cfg["max_len"] + 1)),)
            else:
                shape = tuple(int(v) for v in rng.integers(4, cfg["max_side"] + 1, size=2))
            out.append(Spec(f"block{i // 10:03d}.p{i % 10}", shape, "float32", "whole", i))
        return out
    raise ValueError(f"unknown workload {workload!r}")


def _w5(h: int, ffn: int, vocab: int, layers: int) -> list[Spec]:
    """A Llama-7B-shaped state scaled down: 291 parameters, each with two Adam moments (873 tensors)."""
    weights: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"layers.{i}"
        weights += [(f"{p}.self_attn.{n}_proj.weight", (h, h)) for n in "qkvo"]
        weights += [(f"{p}.mlp.gate_proj.weight", (ffn, h)), (f"{p}.mlp.up_proj.weight", (ffn, h)),
                    (f"{p}.mlp.down_proj.weight", (h, ffn)),
                    (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    weights += [("norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    out: list[Spec] = []
    for group in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
        out += [Spec(f"{group}.{n}", s, "float32", "shard0", len(out) + j) for j, (n, s) in enumerate(weights)]
    return out


def _w3(h: int, layers: int, vocab: int) -> list[Spec]:
    weights = [("embedding", (vocab, h), "col")]
    for i in range(layers):
        weights += [(f"layer{i}.qkv", (3 * h, h), "col"), (f"layer{i}.proj", (h, h), "row"),
                    (f"layer{i}.fc1", (4 * h, h), "col"), (f"layer{i}.fc2", (h, 4 * h), "row")]
    out: list[Spec] = []
    for group, dtype in (("model", "bfloat16"), ("optim.exp_avg", "float32"), ("optim.exp_avg_sq", "float32")):
        out += [Spec(f"{group}.{n}", s, dtype, k, len(out) + j) for j, (n, s, k) in enumerate(weights)]
    return out


def fill(index: int, region: tuple[slice, ...], dtype: str) -> np.ndarray:
    """Contents of ``region`` of tensor number ``index``: a hash of the global position.

    Values are floats in [0, 1) with 24 random mantissa bits, so they do not
    compress (Orbax compresses with zstd by default; the others do not), and
    any piece can be rebuilt exactly from its region alone.
    """
    shape = tuple(r.stop - r.start for r in region)
    with np.errstate(over="ignore"):
        h = np.full(shape, np.uint32((index * 0xC2B2AE3D + 0x165667B1) & 0xFFFFFFFF), dtype=np.uint32)
        for d, (r, mult) in enumerate(zip(region, _MULTIPLIERS, strict=False)):
            ix = np.arange(r.start, r.stop, dtype=np.uint32) * np.uint32(mult)
            h ^= ix.reshape((-1,) + (1,) * (len(shape) - d - 1))
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x7FEB352D)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x846CA68B)
        h ^= h >> np.uint32(16)
    out = (h >> np.uint32(8)).astype(np.float32)
    out *= np.float32(2.0**-24)
    want = np_dtype(dtype)
    return out if want == out.dtype else out.astype(want)


_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0x27D4EB2F, 0x165667B1)


def reshard_layout(workload: str, spec: Spec, mesh: tuple[int, ...]) -> Any:
    """The reshard ``Layout`` of ``spec`` on ``mesh``.

    W1/W4/scale: ``mesh = (n,)``, DTensor ``Shard(0)``. W3: ``mesh = (dp, tp)``,
    MindSpore ``dev_matrix=[dp, tp]`` with optimizer sharding over the dp group.
    """
    from reshard.layouts import Layout

    if spec.kind == "whole":
        return Layout.single(spec.shape)
    if spec.kind == "shard0":
        return Layout.from_dtensor(mesh[0], ["Shard(0)"], spec.shape)
    if spec.kind == "balanced0":
        return Layout.from_oneflow(list(range(mesh[0])), "S(0)", spec.shape)
    tensor_map = [0, -1] if spec.kind == "col" else [-1, 0]
    return Layout.from_mindspore(list(mesh), tensor_map, spec.shape, opt_shard_size=-1)


def total_bytes(specs: list[Spec]) -> int:
    return sum(s.nbytes for s in specs)


def check(specs: list[Spec], regions: dict[str, tuple[slice, ...]], got: dict[str, Any]) -> int:
    """Compare every loaded piece with what was saved; return the bytes checked."""
    checked = 0
    for s in specs:
        if s.name not in got:
            continue
        want = fill(s.index, regions[s.name], s.dtype)
        have = np.ascontiguousarray(np.asarray(got[s.name]))
        if have.shape != want.shape or have.tobytes() != want.tobytes():
            raise AssertionError(f"{s.name}: loaded values differ from the saved ones")
        checked += want.nbytes
    return checked


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The region of a whole tensor."""
    return tuple(slice(0, n) for n in shape)

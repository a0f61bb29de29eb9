"""Model-parallel DeepSpeed saves: how a parameter's tensor-parallel slices join, and the layout of the whole.

With model parallelism (``mpu`` given to ``deepspeed.initialize``, as
Megatron-DeepSpeed does) every model-parallel rank ``m`` saves its own
``mp_rank_<m>_model_states.pt`` and ``zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt``:
ZeRO partitions of *its* (TP-local) parameters over its data-parallel group.
DeepSpeed's files do not say along which dim a parameter was cut. This module
takes that from

* the user (``tp_split={pattern: rule}``, the first pattern that matches the
  name at its start, :func:`re.match`, wins), else
* the save's ``universal_checkpoint_info`` (what Megatron-DeepSpeed stores for
  ``ds_to_universal``): ``tp_replicated_parameter_patterns`` -> replicated,
  ``parameter_to_average_patterns`` -> average,
  ``parameter_with_row_parallelism_patterns`` -> dim 1, any other parameter ->
  dim 0 (DeepSpeed's own rule),

where a rule is a dim (the slices are concatenated along it, in model-parallel
rank order), ``"replicated"`` (every TP rank holds the same values; checked) or
``"average"`` (they may differ; their mean is stored, as ``ds_to_universal``
does). Sub-parameter and affine-map patterns (fused QKV / SwiGLU slices) are
refused. A parameter no rule covers is refused, naming it; a module entry that
is no optimized parameter (a buffer) and no rule names is replicated if every
rank holds the same values, else refused.

A tensor is stored whole under a :class:`~reshard.layouts.FlatLayout` whose
blocks are the TP slices: global rank ``d * tp + m`` (DP rank ``d`` of
model-parallel rank ``m``, Megatron's order) holds its ZeRO range of block
``m``. Replicated (and averaged) tensors have one block held by every TP rank
as replicas (a replica's range is listed only where it equals model-parallel
rank 0's). The plain module weights get a block :class:`~reshard.layouts.Layout`
held by ranks ``0..tp-1``. Pure functions of shapes, names and arrays.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import FormatError, UnsupportedError

#: A rule: a dim to concatenate along, or one of these.
KINDS = ("replicated", "average")
#: ``universal_checkpoint_info`` keys whose parameters reshard does not join (sub-parameter layouts).
REFUSED = ("parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params", "affine_map")
MAX_PATTERN = 1000


def _safe_pattern(pattern: Any, where: str) -> re.Pattern[str]:
    """A checked regex: a string of at most MAX_PATTERN characters that compiles and repeats no repeat
    (``(a+)+``: exponential matching time on a hostile checkpoint's pattern)."""
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
        raise FormatError(f"{where}: pattern {str(pattern)[:80]!r} is not a string of at most {MAX_PATTERN} "
                          "characters")
    try:
        compiled = re.compile(pattern)
        parsed = importlib.import_module("re._parser").parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise FormatError(f"{where}: pattern {pattern!r} is not a regular expression: {e}") from None
    if _nested_repeat(parsed.data, False):
        raise FormatError(f"{where}: pattern {pattern!r} repeats a repeated group (matching time could explode); "
                          "reshard refuses it")
    return compiled


def _nested_repeat(items: Any, inside: bool) -> bool:
    for op, av in items:
        if str(op) in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            _, hi, sub = av
            many = hi != 1
            if (many and inside) or _nested_repeat(sub.data, inside or many):
                return True
            continue
        for value in av if isinstance(av, (tuple, list)) else (av,):
            subs = value if isinstance(value, list) else [value]
            for s in subs:
                if hasattr(s, "data") and _nested_repeat(s.data, inside):
                    return True
    return False


def _rule(value: Any, where: str) -> int | str:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not (value in KINDS or (isinstance(value, int) and value >= 0)):
        raise ValueError(f"{where}: rule {value!r} must be a dim (int >= 0), 'replicated' or 'average'")
    return value


class Rules:
    """How each parameter's TP slices join: the user's ``tp_split``, then ``universal_checkpoint_info``."""

    def __init__(self, tp_split: Mapping[str, Any] | None, info: Any) -> None:
        self.user = [(_safe_pattern(p, "tp_split"), _rule(v, f"tp_split[{p!r}]"), p)
                     for p, v in (tp_split or {}).items()]
        self.info: dict[str, list[re.Pattern[str]]] | None = None
        self.refused: list[tuple[str, re.Pattern[str]]] = []
        if info is None:
            return
        if not isinstance(info, Mapping):
            raise FormatError(f"universal_checkpoint_info is a {type(info).__name__}, not a mapping")
        self.info = {}
        for key in ("tp_replicated_parameter_patterns", "parameter_to_average_patterns",
                    "parameter_with_row_parallelism_patterns", "vocabulary_parameter_patterns"):
            self.info[key] = self._patterns(info.get(key), key)
        for key in REFUSED:
            value = info.get(key)
            if key == "affine_map" and isinstance(value, Mapping):
                value = list((value.get("params") or {}).keys())
            elif key == "parameter_with_sub_params" and isinstance(value, list):
                value = [p for s in value for p in self._sub_patterns(s)]
            self.refused += [(key, p) for p in self._patterns(value, key)]

    @staticmethod
    def _sub_patterns(entry: Any) -> list[Any]:
        """The patterns of a ``parameter_with_sub_params`` entry (a SubparamShape as a dict, or its stand-in's)."""
        if isinstance(entry, Mapping) and isinstance(entry.get("state"), Mapping) and "stub" in entry:
            entry = entry["state"]
        patterns = entry.get("patterns") if isinstance(entry, Mapping) else None
        if not isinstance(patterns, (list, tuple)):
            raise FormatError(f"universal_checkpoint_info['parameter_with_sub_params'] entry {str(entry)[:80]} "
                              "names no patterns")
        return list(patterns)

    @staticmethod
    def _patterns(value: Any, key: str) -> list[re.Pattern[str]]:
        if value is None:
            return []
        if not isinstance(value, (list, tuple)) or len(value) > 10_000:
            raise FormatError(f"universal_checkpoint_info[{key!r}] is not a list of patterns")
        return [_safe_pattern(p, f"universal_checkpoint_info[{key!r}]") for p in value]

    def of(self, name: str, optimized: bool) -> int | str | None:
        """The rule of ``name``; None for an entry no rule names that is not an optimized parameter (decide by
        its values). Raises UnsupportedError for a parameter no rule covers or a sub-parameter layout."""
        for pattern, rule, _ in self.user:
            if pattern.match(name):
                return rule
        if self.info is not None:  # DeepSpeed's order (ds_to_universal.merge_tp_slices)
            self._refuse(name, ("affine_map",))
            for key, rule in (("tp_replicated_parameter_patterns", "replicated"),
                              ("parameter_to_average_patterns", "average")):
                if any(p.match(name) for p in self.info[key]):
                    return rule
            self._refuse(name, REFUSED)
            if any(p.match(name) for p in self.info["parameter_with_row_parallelism_patterns"]):
                return 1
            if optimized:
                return 0  # DeepSpeed's rule: the rest is column-parallel, cut along dim 0
        if not optimized:
            return None
        raise UnsupportedError(f"{name}: the save is split over tensor-parallel ranks and nothing says along which "
                               "dim this parameter is (no universal_checkpoint_info in the model states, no "
                               "tp_split pattern for it): pass tp_split={pattern: dim | 'replicated' | 'average'} "
                               "(CLI: --tp-split PATTERN=DIM)")

    def _refuse(self, name: str, keys: tuple[str, ...]) -> None:
        for key, pattern in self.refused:
            if key in keys and pattern.match(name):
                raise UnsupportedError(f"{name}: universal_checkpoint_info's {key} pattern {pattern.pattern!r} "
                                       "names it (slices of several sub-parameters per TP rank); reshard does not "
                                       "join those; pass tp_split for it if it is a plain split")


def full_shape(name: str, rule: int | str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The whole tensor's shape from its TP slices' shapes, checked against the rule."""
    first = tuple(shapes[0])
    if isinstance(rule, str):
        if any(tuple(s) != first for s in shapes):
            raise FormatError(f"{name} is {rule} over the TP ranks but their shapes differ: "
                              f"{[list(s) for s in shapes]}")
        return first
    if rule >= len(first) or any(len(s) != len(first) or any(a != b for i, (a, b) in
                                                             enumerate(zip(s, first, strict=True)) if i != rule)
                                 for s in shapes):
        raise FormatError(f"{name}: TP slices of shapes {[list(s) for s in shapes]} do not join along dim {rule}")
    return tuple(sum(s[rule] for s in shapes) if i == rule else n for i, n in enumerate(first))


def offsets(rule: int | str, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Each TP slice's offset in the whole tensor."""
    out, at = [], 0
    for s in shapes:
        out.append(tuple(at if i == rule else 0 for i in range(len(s))))
        if isinstance(rule, int):
            at += s[rule]
    return out


def tp_layout(shape: tuple[int, ...], rule: int | str, shapes: Sequence[tuple[int, ...]],
              local: Sequence[FlatLayout], origin: dict[str, Any] | None = None, only: int | None = None
              ) -> FlatLayout:
    """The flat layout of a whole tensor from each model-parallel rank's flat layout of its slice.

    ``local[m]`` ranks are DP ranks; global rank ``d * tp + m``. A replicated tensor's model-parallel rank
    ``m > 0`` ranges are replicas of rank 0's, listed where they equal them; ``only=m`` gives the layout of
    model-parallel rank ``m``'s ranges alone (replica 0), for a replicated tensor.
    """
    tp = len(shapes)
    entries = []
    starts = offsets(rule, shapes)
    primary = {(a, b) for _, _, _, a, b, _ in local[0].ranges if a < b}
    for m, lay in enumerate(local):
        if isinstance(rule, str) and only is not None and m != only:
            continue
        for d, _, _, a, b, rid in lay.ranges:
            replica = rid
            if isinstance(rule, str) and only is None and m > 0:
                if (a, b) not in primary:
                    continue
                replica = rid * tp + m
            entries.append((d * tp + m, starts[m], tuple(shapes[m]), a, b, replica))
    return FlatLayout.from_ranges(shape, entries, origin)


def block_layout(shape: tuple[int, ...], rule: int | str, shapes: Sequence[tuple[int, ...]]) -> Layout:
    """The layout of a module weight: model-parallel rank ``m`` (DP rank 0: global rank ``m``) holds slice ``m``."""
    starts = offsets(rule, shapes)
    replicated = isinstance(rule, str)
    return Layout.from_blocks(shape, [(m, starts[m], tuple(s), m if replicated else 0) for m, s in enumerate(shapes)])


def join(name: str, rule: int | str, slices: Sequence[np.ndarray]) -> np.ndarray:
    """The whole tensor from its TP slices (in model-parallel rank order) under ``rule``."""
    if isinstance(rule, int):
        return np.concatenate(slices, axis=rule)
    first = slices[0]
    if rule == "replicated":
        for m, s in enumerate(slices[1:], 1):
            if s.dtype != first.dtype or s.shape != first.shape or s.tobytes() != first.tobytes():
                raise FormatError(f"{name}: model-parallel ranks 0 and {m} hold different values of a replicated "
                                  "tensor (give it tp_split={pattern: 'average'} to store their mean, as "
                                  "DeepSpeed's parameter_to_average_patterns do)")
        return first
    total = first
    for s in slices[1:]:
        total = total + s
    return np.asarray(total / len(slices)).astype(first.dtype)


def split_shapes(name: str, rule: int | str, shape: Sequence[int], tp: int) -> list[tuple[int, ...]]:
    """The slice shapes of a whole tensor over ``tp`` ranks (even splits only: Megatron's)."""
    shape = tuple(int(n) for n in shape)
    if isinstance(rule, str):
        return [shape] * tp
    if rule >= len(shape) or shape[rule] % tp:
        raise ValueError(f"{name}: dim {rule} of shape {list(shape)} does not split evenly over {tp} TP ranks")
    return [tuple(n // tp if i == rule else n for i, n in enumerate(shape))] * tp

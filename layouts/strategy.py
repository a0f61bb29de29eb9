"""MindSpore strategy files: bytes or dicts in, layouts out, and back.

Three forms are read (no file I/O; pass the file's bytes):

* protobuf ``ParallelStrategyMap`` (``node_strategy.proto``). It holds no
  tensor shapes: give them in `shapes`, or the single ``param_split_shape``
  entry is taken as the shape (what ``save_strategy_file`` writes, seed 002).
* JSON, ``{"parallel_layout_item": {name: {"dev_matrix", "tensor_map",
  "tensor_shape", "field", "opt_weight_shard_step", "opt_weight_shard_size"}}}``
  (a bare ``{name: {...}}`` mapping is accepted too).
* pipeline-merged files of either form, whose keys are ``"<stage>-<param>"``:
  global rank = stage * prod(dev_matrix) + local rank.

:func:`dump_strategy` writes JSON or protobuf that :func:`parse_strategy`
(and MindSpore) reads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from . import _protowire as pw
from .core import Layout
from .errors import FormatError, LayoutError, ShapeMismatchError

#: Name prefixes of optimizer state that shares its parameter's strategy entry
#: (MindSpore gives ``moments.X``, ``adam_m.X``, ``adam_v.X``... the layout of ``X``,
#: optimizer sharding included: its compiler's ``SetClonedTensorShapeForOptimizer``).
OPTIMIZER_PREFIXES = ("moments.", "adam_m.", "adam_v.", "accum.", "mean_grad.", "mean_square.", "moment1.",
                      "moment2.", "exp_avg.", "exp_avg_sq.", "lamb_m.", "lamb_v.", "vhat.", "max_exp_avg_sq.")
#: Gradient accumulation buffers (pipeline / ``GradAccumulationCell``): ``accu_grads.X``
#: takes ``X``'s model-parallel layout but not its optimizer sharding (MindSpore's
#: default, ``grad_accumulation_shard=False``).
ACCU_GRADS_PREFIX = "accu_grads."

_STAGED = re.compile(r"^(\d+)-(.+)$")
#: The most global ranks a strategy entry may name (its stage's and those before it), the format's limit on a
#: layout's mesh (docs/reliability.md). Checked before a layout lists its ranks: a damaged or hostile
#: ``dev_matrix`` (``[2, 2**40]``) is a :class:`FormatError`, not a ``MemoryError``.
MAX_DEVICES = 1 << 18


def _split_key(key: str) -> tuple[int, str]:
    m = _STAGED.match(key)
    return (int(m.group(1)), m.group(2)) if m else (0, key)


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _make(
    name: str,
    dev: Sequence[int],
    tmap: Sequence[Any],
    shape: Sequence[int],
    opt_size: int,
    stage: int,
    max_devices: int = MAX_DEVICES,
) -> Layout:
    if not all(_integer(d) and d >= 1 for d in dev) or not all(_integer(n) and n >= 0 for n in shape):
        raise FormatError(f"strategy entry {name!r}: dev_matrix {list(dev)} and tensor_shape {list(shape)} must be "
                          "positive (dev_matrix) and non-negative (shape) integers")
    if (stage + 1) * math.prod(dev) > max_devices:
        raise FormatError(f"strategy entry {name!r}: dev_matrix {list(dev)} (pipeline stage {stage}) names "
                          f"{(stage + 1) * math.prod(dev)} devices, more than max_devices={max_devices}: not a "
                          "strategy of a real job")
    try:
        layout = Layout.from_mindspore(dev, tmap, shape, None, None, stage)
        if opt_size > 0:
            used = {a for axes in layout.dims for a in axes}
            group = math.prod(k for a, k in enumerate(layout.mesh) if a not in used)
            return Layout.from_mindspore(dev, tmap, shape, -1 if opt_size >= group else opt_size, None, stage)
        return layout
    except LayoutError as e:
        raise FormatError(f"strategy entry {name!r}: {e}") from e


def _flat(value: Any) -> list[Any]:
    """Unwrap ``[[...]]`` (one repeated DevMatrix/TensorMap message) to ``[...]``."""
    if isinstance(value, list | tuple) and len(value) == 1 and isinstance(value[0], list | tuple):
        inner = value[0]
        if all(isinstance(v, int) for v in inner):
            return list(inner)
    return list(value) if isinstance(value, list | tuple) else []


def _parse_json(obj: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], max_devices: int) -> dict[str, Layout]:
    items = obj.get("parallel_layout_item", obj)
    if not isinstance(items, Mapping):
        raise FormatError("strategy JSON 'parallel_layout_item' must be an object")
    out: dict[str, Layout] = {}
    for key, item in items.items():
        if not isinstance(item, Mapping) or "dev_matrix" not in item or "tensor_map" not in item:
            if items is obj and key in ("current_stage", "parallel_strategy_item"):
                continue
            raise FormatError(f"strategy entry {key!r} lacks dev_matrix/tensor_map: {item!r}")
        stage, name = _split_key(str(key))
        shape = shapes.get(key, shapes.get(name, item.get("tensor_shape")))
        if shape is None:
            raise FormatError(f"strategy entry {key!r} has no tensor_shape; pass it in shapes")
        shape = _flat(shape)
        dev, tmap = _flat(item["dev_matrix"]), item["tensor_map"]
        if isinstance(tmap, list) and len(tmap) == 1 and isinstance(tmap[0], list) and len(shape) != 1:
            tmap = tmap[0]  # the protobuf-like wrapping [[...]]
        opt = int(item.get("opt_weight_shard_size", 0) or 0)
        if name not in out:  # a parameter shared by stages: keep its first stage
            out[name] = _make(key, dev, tmap, shape, opt, stage, max_devices)
    return out


def _dims(msg: dict[int, list[tuple[int, pw.Value]]], number: int, is_signed: bool) -> list[list[int]]:
    """The ``dim`` lists of a repeated ``{repeated int dim = 1}`` sub-message."""
    return [pw.ints(pw.fields(v).get(1, []), is_signed) for _, v in msg.get(number, []) if not isinstance(v, int)]


def _parse_proto(data: bytes, shapes: Mapping[str, Sequence[int]], max_devices: int) -> dict[str, Layout]:
    out: dict[str, Layout] = {}
    top = pw.fields(data)
    for wire, item in top.get(3, []):
        if wire != pw.LEN or isinstance(item, int):
            raise FormatError("strategy protobuf parallel_layout_item is not a message")
        f = pw.fields(item)
        key = pw.text(f.get(1, []), "param_name")
        payload = f.get(2, [(pw.VARINT, 0)])[-1][1]
        if isinstance(payload, int):
            raise FormatError(f"strategy entry {key!r} has no parallel_layouts message")
        lay = pw.fields(payload)
        devs, tmaps, splits = _dims(lay, 1, False), _dims(lay, 2, True), _dims(lay, 3, True)
        if not devs or not tmaps:
            raise FormatError(f"strategy entry {key!r} lacks dev_matrix or tensor_map")
        stage, name = _split_key(key)
        shape = shapes.get(key, shapes.get(name))
        if shape is None:
            if len(splits) != 1 or len(splits[0]) != len(tmaps[0]):
                raise FormatError(f"strategy entry {key!r}: the protobuf form holds no shape; pass it in shapes")
            shape = splits[0]
        opt = pw.ints(lay.get(7, []))
        if name not in out:
            out[name] = _make(key, devs[0], tmaps[0], shape, opt[-1] if opt else 0, stage, max_devices)
    return out


def parse_strategy(
    data: bytes | bytearray | str | Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    max_devices: int = MAX_DEVICES,
) -> dict[str, Layout]:
    """Layouts of every parameter of a MindSpore strategy file.

    Parameters
    ----------
    data : bytes, str or dict
        The file's bytes (protobuf or JSON), JSON text, or the parsed JSON.
    shapes : mapping of str to tuple of int, optional
        Global shapes by parameter name (or ``"<stage>-<name>"`` key); needed
        for protobuf files unless ``param_split_shape`` holds the shape.
    max_devices : int
        The most global ranks an entry may name (:data:`MAX_DEVICES`), checked
        before its layout is built.

    Returns
    -------
    dict of str to Layout
        Keyed by parameter name (the stage prefix removed).

    Raises
    ------
    FormatError
        Bytes that are neither form, entries that are incomplete, or that name
        more than ``max_devices`` devices.
    """
    shapes = shapes or {}
    if isinstance(data, Mapping):
        return _parse_json(data, shapes, max_devices)
    if isinstance(data, (bytes, bytearray)) and not bytes(data[:64]).lstrip().startswith(b"{"):
        return _parse_proto(bytes(data), shapes, max_devices)
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise FormatError(f"strategy JSON does not parse: {e}") from None
    if not isinstance(obj, Mapping):
        raise FormatError(f"strategy JSON must be an object, got {type(obj).__name__}")
    return _parse_json(obj, shapes, max_devices)


def layout_for(name: str, layouts: Mapping[str, Layout],
               prefixes: Sequence[str] = OPTIMIZER_PREFIXES) -> Layout | None:
    """The strategy layout of a tensor: its own entry, else its parameter's (``adam_m.X`` -> ``X``).

    MindSpore's compiler lays an optimizer's state (a clone of the parameter)
    out like the parameter, optimizer sharding included; ``accu_grads.X`` gets
    ``X``'s layout without the optimizer sharding. A strategy file saved with
    ``only_trainable_params=True`` (the default) names only the parameters; one
    saved with ``False`` names the clones too, and their own entries win.
    """
    if name in layouts:
        return layouts[name]
    for prefix in prefixes:
        if name.startswith(prefix) and name[len(prefix):] in layouts:
            return layouts[name[len(prefix):]]
    param = name[len(ACCU_GRADS_PREFIX):]
    if name.startswith(ACCU_GRADS_PREFIX) and param in layouts:
        layout = layouts[param]
        if layout.opt_shard is None:
            return layout
        origin = {**(layout.origin or {}), "opt_shard_size": 0}
        return dataclasses.replace(layout, opt_shard=None, origin=origin)
    return None


def strategy_layouts(layouts: Mapping[str, Layout], shapes: Mapping[str, Sequence[int]],
                     prefixes: Sequence[str] = OPTIMIZER_PREFIXES) -> dict[str, Layout]:
    """The layouts a strategy gives the tensors of a checkpoint, optimizer state included.

    Parameters
    ----------
    layouts : mapping of str to Layout
        The strategy's layouts by parameter name (:func:`parse_strategy`).
    shapes : mapping of str to tuple of int
        Every tensor of the checkpoint by name, with its global shape.
    prefixes : sequence of str
        Optimizer-state name prefixes (see :func:`layout_for`).

    Returns
    -------
    dict of str to Layout
        The strategy's own entries (also those naming no tensor of ``shapes``)
        plus one entry per tensor of ``shapes`` that takes its parameter's
        layout (``adam_m.X`` -> ``X``'s). Tensors the strategy does not cover
        are left out.

    Raises
    ------
    ShapeMismatchError
        A tensor whose shape is not the one its layout is for.
    """
    out = dict(layouts)
    for name, shape in shapes.items():
        layout = layout_for(name, layouts, prefixes)
        if layout is None:
            continue
        if tuple(layout.shape) != tuple(shape):
            whose = "its" if name in layouts else "its parameter's"
            raise ShapeMismatchError(f"{name!r}: {whose} strategy entry is for shape {list(layout.shape)}, "
                                     f"the tensor is {list(shape)}")
        out[name] = layout
    return out


def to_mindspore(layout: Layout) -> tuple[list[int], list[Any], int]:
    """``(dev_matrix, tensor_map, stage)`` of a layout MindSpore can express.

    Raises
    ------
    LayoutError
        Explicit blocks, splits that do not divide, or ranks that are not
        ``stage * prod(mesh) + range(prod(mesh))``.
    """
    if layout.explicit is not None:
        raise LayoutError(f"explicit layout {layout.describe()} has no MindSpore strategy")
    try:  # ceil/balanced/nested splits that divide evenly are the same as MindSpore's
        Layout(layout.shape, layout.mesh, layout.ranks, layout.dims, "even")
    except LayoutError as e:
        raise LayoutError(f"{layout.describe()} cannot be a MindSpore strategy: {e}") from None
    n = len(layout.ranks)
    stage = layout.ranks[0] // n
    if layout.ranks != tuple(range(stage * n, stage * n + n)):
        raise LayoutError(f"ranks {list(layout.ranks)} are not one pipeline stage of {n} consecutive ranks")
    m = len(layout.mesh)
    tmap: list[Any] = [
        -1 if not axes else m - 1 - axes[0] if len(axes) == 1 else [m - 1 - a for a in axes]
        for axes in layout.dims
    ]
    return list(layout.mesh), tmap, stage


def _opt_fields(layout: Layout) -> tuple[int, int]:
    if not layout.opt_sharded:
        return 0, 0
    used = {a for axes in layout.dims for a in axes}
    c0 = layout.coords(layout.ranks[0])
    group = sorted(
        r for r in layout.ranks if all(layout.coords(r)[a] == c0[a] for a in used)
    )
    step = (group[-1] - group[0]) // (len(group) - 1)
    return step, layout.opt_group_size


def dump_strategy(layouts: Mapping[str, Layout], format: str = "json") -> bytes:
    """Write layouts as a MindSpore strategy file (``"json"`` or ``"protobuf"``).

    Keys become ``"<stage>-<name>"`` when any layout lies beyond stage 0.
    The protobuf form records each shape as the single ``param_split_shape``.
    """
    if format not in ("json", "protobuf"):
        raise ValueError(f"format {format!r} must be 'json' or 'protobuf'")
    entries = []
    for name, layout in layouts.items():
        dev, tmap, stage = to_mindspore(layout)
        entries.append((name, stage, dev, tmap, layout, *_opt_fields(layout)))
    staged = any(e[1] for e in entries)
    if format == "json":
        items = {}
        for name, stage, dev, tmap, layout, step, size in entries:
            items[f"{stage}-{name}" if staged else name] = {
                "dev_matrix": dev,
                "tensor_map": tmap,
                "tensor_shape": list(layout.shape),
                "field": 0,
                "opt_weight_shard_step": step,
                "opt_weight_shard_size": size,
            }
        doc = {"current_stage": 0, "parallel_strategy_item": {}, "parallel_layout_item": items}
        return json.dumps(doc).encode()
    out: list[tuple[int, int | bytes | str]] = [(1, 0)]
    for name, stage, dev, tmap, layout, step, size in entries:
        if any(isinstance(t, list) for t in tmap):
            raise LayoutError(f"{name!r}: a dim split over several mesh axes has no protobuf tensor_map")
        layouts_msg = pw.encode(
            [
                (1, pw.encode([(1, d) for d in dev])),
                (2, pw.encode([(1, t) for t in tmap])),
                (3, pw.encode([(1, s) for s in layout.shape])),
                (5, 0),
                (6, step),
                (7, size),
            ]
        )
        key = f"{stage}-{name}" if staged else name
        out.append((3, pw.encode([(1, key), (2, layouts_msg)])))
    return pw.encode(out)

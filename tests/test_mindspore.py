"""MindSpore front end: .ckpt files and strategy files, checked against the real protobuf runtime.

MindSpore is not installed. Its ``checkpoint.proto`` and ``node_strategy.proto``
are rebuilt here from their published definitions with ``descriptor_pb2`` and
parsed/serialised by the ``google.protobuf`` package, independently of
reshard's own wire codec: files reshard writes must parse there, files
written there must import here.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from reshard.layouts import Layout, dump_strategy
from reshard.store.frontends import mindspore as ms

F = descriptor_pb2.FieldDescriptorProto


# ----------------------------------------------------------- real protobuf
def _message(file: Any, name: str, fields: list[tuple[str, int, int, int, str]]) -> Any:
    msg = file.message_type.add(name=name)
    for fname, number, label, ftype, type_name in fields:
        msg.field.add(name=fname, number=number, label=label, type=ftype, type_name=type_name or None)
    return msg


def _classes() -> dict[str, Any]:
    """Message classes for MindSpore's checkpoint.proto and node_strategy.proto (proto2)."""
    pool = descriptor_pool.DescriptorPool()
    ck = descriptor_pb2.FileDescriptorProto(name="checkpoint.proto", package="", syntax="proto2")
    _message(ck, "TensorProto", [("dims", 1, F.LABEL_REPEATED, F.TYPE_INT64, ""),
                                 ("tensor_type", 2, F.LABEL_REQUIRED, F.TYPE_STRING, ""),
                                 ("tensor_content", 3, F.LABEL_REQUIRED, F.TYPE_BYTES, "")])
    cp = _message(ck, "Checkpoint", [("value", 1, F.LABEL_REPEATED, F.TYPE_MESSAGE, ".Checkpoint.Value")])
    value = cp.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    value.field.add(name="tag", number=1, label=F.LABEL_REQUIRED, type=F.TYPE_STRING)
    value.field.add(name="tensor", number=2, label=F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE,
                    type_name=".TensorProto", oneof_index=0)
    pool.Add(ck)
    st = descriptor_pb2.FileDescriptorProto(name="node_strategy.proto", package="mindspore.straspb",
                                            syntax="proto2")
    p = ".mindspore.straspb."
    rep, req = F.LABEL_REPEATED, F.LABEL_REQUIRED
    _message(st, "DevMatrix", [("dim", 1, rep, F.TYPE_UINT32, "")])
    _message(st, "TensorMap", [("dim", 1, rep, F.TYPE_INT32, "")])
    _message(st, "ParamSplitShape", [("dim", 1, rep, F.TYPE_INT64, "")])
    _message(st, "IndicesOffset", [("dim", 1, rep, F.TYPE_INT64, "")])
    _message(st, "ParallelLayouts", [
        ("dev_matrix", 1, rep, F.TYPE_MESSAGE, p + "DevMatrix"),
        ("tensor_map", 2, rep, F.TYPE_MESSAGE, p + "TensorMap"),
        ("param_split_shape", 3, rep, F.TYPE_MESSAGE, p + "ParamSplitShape"),
        ("indices_offset", 4, rep, F.TYPE_MESSAGE, p + "IndicesOffset"),
        ("field", 5, req, F.TYPE_INT32, ""),
        ("opt_weight_shard_step", 6, req, F.TYPE_INT32, ""),
        ("opt_weight_shard_size", 7, req, F.TYPE_INT32, "")])
    _message(st, "ParallelLayoutItem", [("param_name", 1, req, F.TYPE_STRING, ""),
                                        ("parallel_layouts", 2, req, F.TYPE_MESSAGE, p + "ParallelLayouts")])
    _message(st, "ParallelStrategyMap", [("current_stage", 1, req, F.TYPE_UINT32, ""),
                                         ("parallel_layout_item", 3, rep, F.TYPE_MESSAGE,
                                          p + "ParallelLayoutItem")])
    pool.Add(st)
    get = message_factory.GetMessageClass
    return {"Checkpoint": get(pool.FindMessageTypeByName("Checkpoint")),
            "Strategy": get(pool.FindMessageTypeByName("mindspore.straspb.ParallelStrategyMap"))}


PB = _classes()
NP_TYPES = {"Float32": np.float32, "Float16": np.float16, "Int32": np.int32, "Int64": np.int64,
            "BFloat16": ml_dtypes.bfloat16, "Bool": np.bool_, "UInt8": np.uint8, "Float64": np.float64}


def pb_write(path: Path, values: dict[str, Any], crc: bool = False, slice_bytes: int = 512 << 20) -> None:
    """What mindspore.save_checkpoint writes, with google.protobuf."""
    names = {np.dtype(v): k for k, v in NP_TYPES.items()}
    body = b""
    for tag, value in values.items():
        arr = np.asarray(value)
        parts = np.array_split(arr, -(-arr.nbytes // slice_bytes)) if arr.nbytes > slice_bytes else [arr]
        for part in parts:
            msg = PB["Checkpoint"]()
            v = msg.value.add()
            v.tag = tag
            v.tensor.dims.extend(list(arr.shape) or [0])
            v.tensor.tensor_type = names[arr.dtype]
            v.tensor.tensor_content = part.tobytes()
            body += msg.SerializeToString()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body + (b"crc_num" + zlib.crc32(body).to_bytes(10, "big") if crc else b""))


def pb_read(path: Path) -> dict[str, Any]:
    """What mindspore.load_checkpoint reads, with google.protobuf."""
    data = path.read_bytes()
    if data[-17:-10] == b"crc_num":
        assert zlib.crc32(data[:-17]) == int.from_bytes(data[-10:], "big")
        data = data[:-17]
    msg = PB["Checkpoint"]()
    msg.ParseFromString(data)
    joined: dict[str, tuple[list[int], str, bytes]] = {}
    for v in msg.value:
        dims, ttype, raw = joined.get(v.tag, (list(v.tensor.dims), v.tensor.tensor_type, b""))
        joined[v.tag] = (dims, ttype, raw + v.tensor.tensor_content)
    out: dict[str, Any] = {}
    for tag, (dims, ttype, raw) in joined.items():
        if ttype == "str":
            out[tag] = str(np.frombuffer(raw, f"U{len(raw) // 4}")[0])
            continue
        arr = np.frombuffer(raw, NP_TYPES[ttype])
        out[tag] = arr.reshape(() if dims == [0] else dims)
    return out


def pb_strategy(entries: dict[str, tuple[list[int], list[int], int]], with_shapes: dict[str, list[int]] | None = None,
                steps: dict[str, int] | None = None) -> bytes:
    """A node_strategy.proto file as MindSpore writes it (no param_split_shape unless given)."""
    msg = PB["Strategy"]()
    msg.current_stage = 0
    for name, (dev, tmap, opt) in entries.items():
        item = msg.parallel_layout_item.add()
        item.param_name = name
        lay = item.parallel_layouts
        lay.dev_matrix.add().dim.extend(dev)
        lay.tensor_map.add().dim.extend(tmap)
        if with_shapes and name in with_shapes:
            lay.param_split_shape.add().dim.extend(with_shapes[name])
        lay.field = 0
        lay.opt_weight_shard_size = opt
        lay.opt_weight_shard_step = (steps or {}).get(name, 0)
    return msg.SerializeToString()


# ----------------------------------------------------------- the codec
def test_ckpt_codec_matches_protobuf_both_ways(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    values = {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "h": rng.standard_normal((3,)).astype(np.float16),
        "bf": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "step": np.array(7, np.int64),
        "flag": np.array([True, False]),
        "big": np.arange(300, dtype=np.int32).reshape(30, 10),
    }
    ours = tmp_path / "ours.ckpt"
    ms.write_ckpt(ours, {**values, "note": "héllo"}, crc=True, slice_bytes=256)
    theirs = pb_read(ours)  # the real protobuf parses it, crc trailer checked
    assert theirs["note"] == "héllo"
    for k, v in values.items():
        assert theirs[k].dtype == v.dtype and theirs[k].shape == v.shape
        np.testing.assert_array_equal(theirs[k], v)
    msg = PB["Checkpoint"]()
    msg.ParseFromString(ours.read_bytes()[:-17])
    assert [v.tag for v in msg.value].count("big") == 5  # 1200 bytes in 256-byte slices, full dims each
    assert all(list(v.tensor.dims) == [30, 10] for v in msg.value if v.tag == "big")
    assert [list(v.tensor.dims) for v in msg.value if v.tag == "step"] == [[0]]

    written = tmp_path / "theirs.ckpt"
    pb_write(written, values, crc=True, slice_bytes=256)
    back = ms.read_ckpt(written)
    for k, v in values.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    assert ms.ckpt_headers(written)["big"] == ((30, 10), "int32")

    broken = bytearray(written.read_bytes())
    broken[40] ^= 0xFF
    written.write_bytes(bytes(broken))
    with pytest.raises(rs.ChecksumError, match="crc32"):
        ms.read_ckpt(written)


# ----------------------------------------------------------- seed 000
SEED_DEVICES = {  # seed 000: the [2, 8] slices of an [8, 8] weight and its moments on 4 devices
    "model_parallel_weight": [
        [[0.87537426, 1.0448935, 0.86736983, 0.8836905, 0.77354026, 0.69588304, 0.9183654, 0.7792076],
         [0.87224025, 0.8726848, 0.771446, 0.81967723, 0.88974726, 0.7988162, 0.72919345, 0.7677011]],
        [[0.9210751, 0.9050457, 0.9827775, 0.920396, 0.9240526, 0.9750359, 1.0275179, 1.0819869],
         [0.73605865, 0.84631145, 0.9746683, 0.9386582, 0.82902765, 0.83565056, 0.9702136, 1.0514659]],
        [[1.0108461, 0.8689414, 0.91719437, 0.8805056, 0.7994629, 0.8999671, 0.7585804, 1.0287056],
         [0.90653455, 0.60146594, 0.7206475, 0.8306303, 0.8364681, 0.89625114, 0.7354735, 0.8447268]],
        [[0.7147005, 0.9168278, 0.80178416, 0.6258351, 0.8413766, 0.5909515, 0.696347, 0.71359116],
         [0.20506378, 0.03691584, 0.2454556, 0.12978578, 0.19065076, 0.23904312, 0.27509746, 0.34614682]],
    ],
    "moments.model_parallel_weight": [
        [[0.2567724, -0.07485991, 0.282002, 0.2456022, 0.454939, 0.619168, 0.18964815, 0.45714882],
         [0.25946522, 0.24344791, 0.45677605, 0.3611395, 0.23378398, 0.41439137, 0.5312468, 0.4696194]],
        [[0.2417504, 0.28193963, 0.06713893, 0.21510397, 0.23380603, 0.11424308, 0.0218009, -0.11969765],
         [0.45955992, 0.22664294, 0.01990281, 0.0731914, 0.27125207, 0.27298513, -0.01716102, -0.15327111]],
        [[0.03440702, 0.41419312, 0.24817684, 0.30765256, 0.48516113, 0.24904746, 0.57791173, 0.00955463],
         [0.13458519, 0.6690533, 0.49259356, 0.28319967, 0.25951773, 0.16777472, 0.45696738, 0.24933104]],
        [[0.14152306, 0.5040985, 0.24455397, 0.10907605, 0.11319532, 0.19538902, 0.01208619, 0.40430856],
         [-0.7773164, -0.47611716, -0.6041424, -0.6144473, -0.2651842, -0.31909415, -0.4510405, -0.12860501]],
    ],
}
# seed 000, "after the script is executed": the integrated moments, and what the two
# devices of stage 2 load. (The seed's integrated *weight* went through a training
# step in between, so only its last two rows, untouched, can be compared.)
SEED_INTEGRATED_MOMENTS = [row for dev in SEED_DEVICES["moments.model_parallel_weight"] for row in dev]
SEED_STAGE2_WEIGHT_DEVICE1_TAIL = [
    [0.7147005, 0.9168278, 0.80178416, 0.6258351, 0.8413766, 0.5909515, 0.696347, 0.71359116],
    [0.20506378, 0.03691584, 0.2454556, 0.12978578, 0.19065076, 0.23904312, 0.27509746, 0.34614682]]


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def test_seed000_matrix_2x2_integrate_then_2x1(tmp_path: Path) -> None:
    """[[1,2,3,4],[5,6,7,8]] on 4 devices with [2,2] -> one tensor -> 2 devices with [2,1]."""
    device = {0: [[1, 2]], 1: [[3, 4]], 2: [[5, 6]], 3: [[7, 8]]}  # the seed's table
    for rank, piece in device.items():
        pb_write(tmp_path / "src" / f"rank_{rank}" / f"CKP_{rank}-4_32.ckpt", {
            "model_parallel_weight": _f32(piece),
            "moments.model_parallel_weight": _f32(piece) / 10,
            "learning_rate": _f32([0.01]),
            "momentum": _f32([0.9]),
        }, crc=True)
    # shard [2, 2] = dev_matrix [2, 2], tensor_map [1, 0]; real strategy files hold no shapes
    strategy = tmp_path / "src_strategy.ckpt"
    strategy.write_bytes(pb_strategy({"model_parallel_weight": ([2, 2], [1, 0], 0)}))

    ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / "ckpt"), strategy)
    whole = ckpt.read_all()
    np.testing.assert_array_equal(whole["model_parallel_weight"], _f32([[1, 2, 3, 4], [5, 6, 7, 8]]))
    np.testing.assert_array_equal(whole["moments"]["model_parallel_weight"], _f32([[1, 2, 3, 4], [5, 6, 7, 8]]) / 10)
    np.testing.assert_array_equal(whole["learning_rate"], _f32([0.01]))
    assert ckpt["model_parallel_weight"].layout.describe().startswith("dev[2,2] tmap[1,0]")

    target = tmp_path / "dst_strategy.json"
    target.write_bytes(dump_strategy({"model_parallel_weight": Layout.from_mindspore([2, 1], [1, 0], [2, 4])}))
    files = ms.export_mindspore(str(tmp_path / "ckpt"), tmp_path / "dst", target)
    assert sorted(files) == [0, 1]
    dev0, dev1 = pb_read(files[0]), pb_read(files[1])
    np.testing.assert_array_equal(dev0["model_parallel_weight"], _f32([[1, 2, 3, 4]]))
    np.testing.assert_array_equal(dev1["model_parallel_weight"], _f32([[5, 6, 7, 8]]))
    np.testing.assert_array_equal(dev1["moments.model_parallel_weight"], _f32([[5, 6, 7, 8]]) / 10)
    np.testing.assert_array_equal(dev0["momentum"], _f32([0.9]))


def test_seed000_numbers_4_devices_to_2(tmp_path: Path) -> None:
    """The seed's own numbers: [8, 8] weight and moments, [2, 8] per device on 4 -> [4, 8] on 2."""
    for rank in range(4):
        pb_write(tmp_path / "stage1" / f"rank_{rank}" / "CKP_1-4_32.ckpt", {
            **{name: _f32(slices[rank]) for name, slices in SEED_DEVICES.items()},
            "learning_rate": _f32([0.01]), "momentum": _f32([0.9])})
    stage1 = {"model_parallel_weight": Layout.from_mindspore([4], [0, -1], [8, 8])}
    ms.import_mindspore(tmp_path / "stage1", str(tmp_path / "ckpt"), dump_strategy(stage1))
    ckpt = rs.open(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(ckpt["moments.model_parallel_weight"].read(), _f32(SEED_INTEGRATED_MOMENTS))
    np.testing.assert_array_equal(ckpt["model_parallel_weight"][6:].read(), _f32(SEED_STAGE2_WEIGHT_DEVICE1_TAIL))

    # the integrated single file, then stage 2's two devices
    one = ms.export_mindspore(ckpt, tmp_path / "integrated")
    np.testing.assert_array_equal(pb_read(one[0])["moments.model_parallel_weight"], _f32(SEED_INTEGRATED_MOMENTS))
    stage2 = {"model_parallel_weight": Layout.from_mindspore([2], [0, -1], [8, 8])}
    files = ms.export_mindspore(ckpt, tmp_path / "stage2", dump_strategy(stage2, "protobuf"), crc=True)
    dev0, dev1 = pb_read(files[0]), pb_read(files[1])
    np.testing.assert_array_equal(dev0["moments.model_parallel_weight"], _f32(SEED_INTEGRATED_MOMENTS[:4]))
    np.testing.assert_array_equal(dev1["moments.model_parallel_weight"], _f32(SEED_INTEGRATED_MOMENTS[4:]))
    np.testing.assert_array_equal(dev1["model_parallel_weight"][2:], _f32(SEED_STAGE2_WEIGHT_DEVICE1_TAIL))
    assert dev0["model_parallel_weight"].shape == (4, 8)
    np.testing.assert_array_equal(dev0["learning_rate"], _f32([0.01]))


# ----------------------------------------------------------- 64 -> 56 and 64 -> 1
def _expected_64(rank: int, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rank r's slices on dev_matrix [8, 8], by MindSpore's rules written out by hand.

    w [56, 64], tensor_map [1, 0]: rows by coordinate c0 = r // 8, columns by c1 = r % 8.
    b [448], tensor_map [0], opt_weight_shard_size 8: model-parallel part c1 (56 long),
    optimizer group = the 8 ranks with the same c1, ordered by c0: piece c0 of 7.
    """
    c0, c1 = divmod(rank, 8)
    b = slice(c1 * 56 + c0 * 7, c1 * 56 + c0 * 7 + 7)
    return {"w": full["w"][c0 * 7:(c0 + 1) * 7, c1 * 8:(c1 + 1) * 8], "b": full["b"][b],
            "adam_m.b": full["adam_m.b"][b], "emb": full["emb"], "global_step": full["global_step"]}


def _expected_56(rank: int, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """dev_matrix [7, 8]: w rows by c0 = r // 8 (8 each), columns by c1; b opt group of 7."""
    c0, c1 = divmod(rank, 8)
    b = slice(c1 * 56 + c0 * 8, c1 * 56 + c0 * 8 + 8)
    return {"w": full["w"][c0 * 8:(c0 + 1) * 8, c1 * 8:(c1 + 1) * 8], "b": full["b"][b],
            "adam_m.b": full["adam_m.b"][b], "emb": full["emb"], "global_step": full["global_step"]}


def test_64_devices_to_56_and_to_1(tmp_path: Path) -> None:
    rng = np.random.default_rng(64)
    full = {"w": rng.standard_normal((56, 64)).astype(np.float32),
            "b": rng.standard_normal(448).astype(np.float32),
            "adam_m.b": rng.standard_normal(448).astype(np.float32),
            "emb": rng.standard_normal((64, 8)).astype(ml_dtypes.bfloat16),
            "global_step": np.array(1000, np.int32)}
    for rank in range(64):
        values = _expected_64(rank, full)
        if rank == 37:  # a replica that differs: refused, naming both copies, before anything is written
            values["emb"] = np.full((64, 8), -1, ml_dtypes.bfloat16)
        ms.write_ckpt(tmp_path / "src" / f"rank_{rank}" / f"net_rank{rank}.ckpt", values, crc=rank % 2 == 0)
    sample = pb_read(tmp_path / "src" / "rank_9" / "net_rank9.ckpt")
    np.testing.assert_array_equal(sample["b"], _expected_64(9, full)["b"])
    src_strategy = pb_strategy({"w": ([8, 8], [1, 0], 0), "b": ([8, 8], [0], 8), "emb": ([8, 8], [-1, -1], 0)})
    with pytest.raises(rs.FormatError, match=r"'emb': its copies of the block \[\[0, 64\], \[0, 8\]\] differ: "
                       r"rank 0's .*rank_0/net_rank0.ckpt and rank 37's .*rank_37/net_rank37.ckpt"):
        ms.import_mindspore(tmp_path / "src", str(tmp_path / "ckpt"), src_strategy)
    assert not (tmp_path / "ckpt").exists()
    ms.write_ckpt(tmp_path / "src" / "rank_37" / "net_rank37.ckpt", _expected_64(37, full))

    ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / "ckpt"), src_strategy)
    assert ckpt["b"].layout.opt_sharded and ckpt["adam_m.b"].layout.opt_group_size == 8
    assert ckpt["w"].layout == Layout.from_mindspore([8, 8], [1, 0], [56, 64])
    for name, value in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), value)

    # 64 -> 56: MindSpore's transform_checkpoints refuses ("Cannot transform device_num from 64 to 56")
    dst = {"w": Layout.from_mindspore([7, 8], [1, 0], [56, 64]),
           "b": Layout.from_mindspore([7, 8], [0], [448], opt_shard_size=-1),
           "emb": Layout.from_mindspore([7, 8], [-1, -1], [64, 8])}
    target = pb_strategy({"w": ([7, 8], [1, 0], 0), "b": ([7, 8], [0], 7), "emb": ([7, 8], [-1, -1], 0)})
    assert ms.load_strategy(target, {n: lay.shape for n, lay in dst.items()}) == dst
    before = ckpt.stats.snapshot()
    ms.export_mindspore(ckpt, tmp_path / "one_rank", target, ranks=[9])
    delivered = (ckpt.stats - before).bytes_delivered
    assert delivered == sum(v.nbytes for v in _expected_56(9, full).values())  # its own region, nothing more
    files = ms.export_mindspore(ckpt, tmp_path / "dst", target)
    assert sorted(files) == list(range(56))
    for rank in (0, 9, 55):
        got, want = pb_read(files[rank]), _expected_56(rank, full)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)

    # and the 56 files import again (opt-sharded b included), and 64 -> 1
    again = ms.import_mindspore(tmp_path / "dst", str(tmp_path / "ckpt56"), target)
    np.testing.assert_array_equal(again["adam_m.b"].read(), full["adam_m.b"])
    one = pb_read(ms.export_mindspore(again, tmp_path / "one")[0])
    for name, value in full.items():
        np.testing.assert_array_equal(one[name], value)


# ----------------------------------------------------------- other shapes of input
def test_pipeline_merged_json_and_replica_files(tmp_path: Path) -> None:
    """Two pipeline stages of 2 devices; replica ranks' files are absent (remove_redundancy)."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    layouts = {"enc.w": Layout.from_mindspore([2], [-1, 0], [4, 6], stage=0),
               "dec.w": Layout.from_mindspore([2], [-1, -1], [6, 2], stage=1)}
    strategy = dump_strategy(layouts)
    assert b'"1-dec.w"' in strategy
    ms.write_ckpt(tmp_path / "rank_0" / "a.ckpt", {"enc.w": a[:, :3], "moments.enc.w": a[:, :3] * 2, "lr": "0.1"})
    ms.write_ckpt(tmp_path / "rank_1" / "a.ckpt", {"enc.w": a[:, 3:], "moments.enc.w": a[:, 3:] * 2})
    ms.write_ckpt(tmp_path / "rank_2" / "a.ckpt", {"dec.w": b})  # rank 3 holds only a copy of dec.w
    ckpt = ms.import_mindspore(tmp_path, str(tmp_path / "out"), strategy)
    assert ckpt.leaves == {"lr": "0.1"}
    np.testing.assert_array_equal(ckpt["moments.enc.w"].read(), a * 2)
    np.testing.assert_array_equal(ckpt["dec.w"].read(), b)
    assert ckpt["dec.w"].layout.ranks == (2, 3)

    files = ms.export_mindspore(ckpt, tmp_path / "again", strategy, ranks=[1, 3])
    assert sorted(files) == [1, 3]
    assert sorted(pb_read(files[3])) == ["dec.w", "lr"]  # only its stage's tensors, plus the leaf
    np.testing.assert_array_equal(pb_read(files[1])["moments.enc.w"], a[:, 3:] * 2)
    # an export split over hosts: another host's ranks replace only their own folders
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "again").rglob("*") if p.is_file()}
    with pytest.raises(rs.CheckpointExistsError, match="rank_1"):
        ms.export_mindspore(ckpt, tmp_path / "again", strategy, ranks=[0, 1])
    ms.export_mindspore(ckpt, tmp_path / "again", strategy, ranks=[0, 1], overwrite=True)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "again").rglob("*") if p.is_file()}
    assert sorted(str(p) for p in after) == ["again/rank_0/checkpoint_0.ckpt", "again/rank_1/checkpoint_1.ckpt",
                                             "again/rank_3/checkpoint_3.ckpt"]
    assert after[Path("again/rank_3/checkpoint_3.ckpt")] == before[Path("again/rank_3/checkpoint_3.ckpt")]
    np.testing.assert_array_equal(pb_read(tmp_path / "again/rank_0/checkpoint_0.ckpt")["enc.w"], a[:, :3])


def test_integrated_save_and_clear_errors(tmp_path: Path) -> None:
    """Files holding whole tensors import whatever the strategy says; mistakes are named."""
    w = np.arange(8, dtype=np.float32).reshape(2, 4)
    for rank in range(2):
        ms.write_ckpt(tmp_path / "whole" / f"rank_{rank}" / "x.ckpt", {"w": w})
    strategy = {"w": Layout.from_mindspore([2], [-1, 0], [2, 4])}
    ckpt = ms.import_mindspore(tmp_path / "whole", str(tmp_path / "a"), strategy)
    np.testing.assert_array_equal(ckpt["w"].read(), w)

    ms.write_ckpt(tmp_path / "bad" / "rank_0" / "x.ckpt", {"w": w[:, :3]})
    ms.write_ckpt(tmp_path / "bad" / "rank_1" / "x.ckpt", {"w": w[:, 2:]})
    with pytest.raises(rs.ShapeMismatchError, match=r"'w': rank 0's file holds shape \[2, 3\]"):
        ms.import_mindspore(tmp_path / "bad", str(tmp_path / "b"), strategy)
    assert not (tmp_path / "b").exists()  # nothing written before every header agreed

    ms.write_ckpt(tmp_path / "bad" / "rank_1" / "y.ckpt", {"w": w[:, 2:]})
    with pytest.raises(rs.FormatError, match="several checkpoints"):
        ms.import_mindspore(tmp_path / "bad", str(tmp_path / "c"), strategy)
    (tmp_path / "bad" / "rank_1" / "y.ckpt").unlink()
    (tmp_path / "bad" / "rank_1" / "x.ckpt").unlink()
    ms.write_ckpt(tmp_path / "bad" / "rank_0" / "x.ckpt", {"w": w[:, :2]})
    with pytest.raises(rs.FormatError, match=r"'w': no file of the replicas \[1\] holds its block"):
        ms.import_mindspore(tmp_path / "bad", str(tmp_path / "c"), strategy)
    with pytest.raises(FileNotFoundError, match="rank_N"):
        ms.import_mindspore(tmp_path / "a", str(tmp_path / "d"), strategy)


def test_optimizer_shard_size_smaller_than_the_group(tmp_path: Path) -> None:
    """opt_weight_shard_size 2 of a replica group of 4 (step 2), weight and adam_v alike (REFERENCE 1).

    dev [4, 2], tensor_map [-1, 0] on an [8, 4] weight: columns by c1 = r % 2; the
    replicas of a column block are {0, 2, 4, 6} or {1, 3, 5, 7} (step 2), cut into
    chunks of 2: {0, 2}, {4, 6}; rows 8 -> 2 pieces by position in the chunk.
    """
    rng = np.random.default_rng(3)
    w, v = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 4)).astype(np.float32)

    def piece(rank: int) -> tuple[slice, slice]:
        return slice((rank // 2) % 2 * 4, (rank // 2) % 2 * 4 + 4), slice(rank % 2 * 2, rank % 2 * 2 + 2)

    for rank in range(8):
        pb_write(tmp_path / "src" / f"rank_{rank}" / "net.ckpt", {"w": w[piece(rank)], "adam_v.w": v[piece(rank)]},
                 crc=True)
    as_json = json.dumps({"current_stage": 0, "parallel_layout_item": {"w": {
        "dev_matrix": [4, 2], "tensor_map": [-1, 0], "tensor_shape": [8, 4], "field": 0,
        "opt_weight_shard_step": 2, "opt_weight_shard_size": 2}}}).encode()
    as_pb = pb_strategy({"w": ([4, 2], [-1, 0], 2)}, steps={"w": 2})
    for i, strategy in enumerate((as_json, as_pb)):
        ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / f"ck{i}"), strategy)
        assert ckpt["adam_v.w"].layout == Layout.from_mindspore([4, 2], [-1, 0], [8, 4], 2)
        np.testing.assert_array_equal(ckpt["w"].read(), w)
        np.testing.assert_array_equal(ckpt["adam_v.w"].read(), v)
    assert json.loads(dump_strategy({"w": ckpt["w"].layout}))["parallel_layout_item"]["w"][
        "opt_weight_shard_step"] == 2  # what MindSpore records for this group

    # the same state on 2 devices, optimizer-sharded over both (rows 4 + 4), 8 -> 2
    target = json.dumps({"current_stage": 0, "parallel_layout_item": {"w": {
        "dev_matrix": [2], "tensor_map": [-1, -1], "tensor_shape": [8, 4], "field": 0,
        "opt_weight_shard_step": 1, "opt_weight_shard_size": 2}}}).encode()
    files = ms.export_mindspore(ckpt, tmp_path / "dst", target)
    for rank in (0, 1):
        got = pb_read(files[rank])
        np.testing.assert_array_equal(got["w"], w[rank * 4:rank * 4 + 4])
        np.testing.assert_array_equal(got["adam_v.w"], v[rank * 4:rank * 4 + 4])


def test_split_values_through_import_and_export(tmp_path: Path) -> None:
    """Values split along axis 0 (MindSpore does it over 512 MiB; here over 64 bytes) join on import."""
    w = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    for rank in range(2):
        pb_write(tmp_path / "src" / f"rank_{rank}" / "a.ckpt", {"w": w[rank * 6:rank * 6 + 6]}, slice_bytes=64)
    msg = PB["Checkpoint"]()
    msg.ParseFromString((tmp_path / "src" / "rank_0" / "a.ckpt").read_bytes())
    assert [v.tag for v in msg.value] == ["w"] * 2  # 96 bytes in two Values
    strategy = {"w": Layout.from_mindspore([2], [0, -1], [12, 4])}
    ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / "ck"), strategy)
    np.testing.assert_array_equal(ckpt["w"].read(), w)
    (path,) = ms.export_mindspore(ckpt, tmp_path / "one").values()
    ms.write_ckpt(tmp_path / "split.ckpt", {"w": w}, slice_bytes=64)
    msg.ParseFromString((tmp_path / "split.ckpt").read_bytes())
    assert len(msg.value) == 3 and list(msg.value[2].tensor.dims) == [12, 4]
    np.testing.assert_array_equal(pb_read(tmp_path / "split.ckpt")["w"], w)
    np.testing.assert_array_equal(pb_read(path)["w"], w)


# ----------------------------------------------------------- optimizer state follows its parameter
def test_redivide_with_a_strategy_file_moves_the_moments_too(tmp_path: Path) -> None:
    """Issue 14 item 6: a strategy names parameters; adam_m.X / adam_v.X take X's layout (64 -> 56)."""
    from reshard.store.cli import main

    rng = np.random.default_rng(6)
    full = {"w": rng.standard_normal((56, 64)).astype(np.float32),
            "adam_m.w": rng.standard_normal((56, 64)).astype(np.float32),
            "adam_v.w": rng.standard_normal((56, 64)).astype(np.float32),
            "b": rng.standard_normal(448).astype(np.float32),
            "adam_m.b": rng.standard_normal(448).astype(np.float32),
            "step": np.array(3, np.int32)}
    src = {"w": Layout.from_mindspore([8, 8], [1, 0], [56, 64]),
           "b": Layout.from_mindspore([8, 8], [0], [448], opt_shard_size=-1)}
    layouts = {n: src.get(n.split(".", 1)[-1], Layout.single(v.shape)) for n, v in full.items()}
    rs.save(full, str(tmp_path / "ck64"), layouts)
    dst = {"w": Layout.from_mindspore([7, 8], [1, 0], [56, 64]),
           "b": Layout.from_mindspore([7, 8], [0], [448], opt_shard_size=-1)}
    for form in ("json", "protobuf"):
        spec = tmp_path / f"s56.{form}"
        spec.write_bytes(dump_strategy(dst, form))
        out = str(tmp_path / f"ck56-{form}")
        assert main(["redivide", str(tmp_path / "ck64"), out, "--layout", str(spec)]) == 0
        got = rs.open(out)
        for name in ("w", "adam_m.w", "adam_v.w"):
            assert got[name].layout == dst["w"], name
        assert got["adam_m.b"].layout == dst["b"] and got["adam_m.b"].layout.opt_sharded
        assert got["step"].layout == Layout.single(())
        for name, value in full.items():
            np.testing.assert_array_equal(got[name].read(), value)
    # export mindspore maps them the same way (the same helper)
    files = ms.export_mindspore(str(tmp_path / "ck64"), tmp_path / "ms56", dst)
    np.testing.assert_array_equal(ms.read_ckpt(files[9])["adam_v.w"], full["adam_v.w"][dst["w"].region(9)])


def test_strategy_layouts_is_pure_and_checks_shapes() -> None:
    from reshard.layouts import ShapeMismatchError, strategy_layouts

    w = Layout.from_mindspore([2, 2], [1, 0], [4, 4])
    got = strategy_layouts({"w": w}, {"w": (4, 4), "moments.w": (4, 4), "exp_avg_sq.w": (4, 4), "v": (3,),
                                      "adam_m.v": (3,)})
    assert got == {"w": w, "moments.w": w, "exp_avg_sq.w": w}
    with pytest.raises(ShapeMismatchError, match=r"adam_m\.w"):
        strategy_layouts({"w": w}, {"adam_m.w": (2, 4)})


# ----------------------------------------------------------- files MindSpore wrote (issue 24)
DATA = Path(__file__).parent / "data" / "mindspore"  # written by make_samples.py with MindSpore (expected.json)


def _expected() -> dict[str, np.ndarray]:
    doc = json.loads((DATA / "expected.json").read_text())
    return {k: np.asarray(v, np.float32) for k, v in doc.items() if k not in ("mindspore", "dedup_keeps")}


def test_remove_redundancy_takes_each_block_from_the_replica_that_saved_it(tmp_path: Path) -> None:
    """Item 10: MindSpore's remove_param_redundancy put some blocks in a replica-1 file only."""
    keeps = json.loads((DATA / "expected.json").read_text())["dedup_keeps"]
    assert "w3" in keeps["1"] and "w3" not in keeps["0"]  # w3 is replicated on 4 ranks; rank 1 saved it
    assert "w3" not in ms.ckpt_headers(DATA / "dedup" / "rank_0" / "net.ckpt")
    ckpt = ms.import_mindspore(DATA / "dedup", str(tmp_path / "ck"), DATA / "strategy.ckpt")
    for name, value in _expected().items():
        np.testing.assert_array_equal(ckpt[name].read(), value, err_msg=name)
    assert ckpt["w4"].layout == Layout.from_mindspore([2, 2], [1, -1], [4, 2])
    # the same state saved with redundancy imports identically
    full = ms.import_mindspore(DATA / "redundant", str(tmp_path / "full"), DATA / "strategy.ckpt")
    assert sorted(full.arrays) == sorted(ckpt.arrays)
    # a block no replica saved is named
    for rank in range(4):  # rank 1 alone saved w4's first block (rank 3 its second)
        values = dict(ms.read_ckpt(DATA / "dedup" / f"rank_{rank}" / "net.ckpt"))
        if rank == 1:
            values.pop("w4")
        ms.write_ckpt(tmp_path / "lost" / f"rank_{rank}" / "net.ckpt", values)
    with pytest.raises(rs.FormatError, match=r"'w4': no file of the replicas \[0, 1\] holds its block \[\(0, 2\)"):
        ms.import_mindspore(tmp_path / "lost", str(tmp_path / "no"), DATA / "strategy.ckpt")


def test_per_rank_safetensors_import_and_export(tmp_path: Path) -> None:
    """Item 11: save_checkpoint(format="safetensors") rank files import like .ckpt ones and are written back."""
    from reshard.store.cli import main

    ckpt = ms.import_mindspore(DATA / "safetensors", str(tmp_path / "ck"), DATA / "strategy.ckpt")
    for name, value in _expected().items():
        np.testing.assert_array_equal(ckpt[name].read(), value, err_msg=name)
    files = ms.export_mindspore(ckpt, tmp_path / "st", DATA / "strategy.ckpt", format="safetensors")
    assert files[3].name == "checkpoint_3.safetensors"
    for rank in range(4):  # byte for byte the values MindSpore saved for that rank
        ours = ms.read_file(files[rank])
        theirs = ms.read_file(DATA / "safetensors" / f"rank_{rank}" / "net.safetensors")
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=f"rank {rank} {name}")
    from reshard.store.frontends.huggingface import read_header

    assert read_header(files[0]).metadata["format"] == "ms"
    assert main(["export", "mindspore", str(tmp_path / "ck"), str(tmp_path / "cli"), "--strategy",
                 str(DATA / "strategy.ckpt"), "--ms-format", "safetensors"]) == 0
    assert (tmp_path / "cli" / "rank_2" / "checkpoint_2.safetensors").is_file()
    again = ms.import_mindspore(tmp_path / "cli", str(tmp_path / "again"), DATA / "strategy.ckpt")
    np.testing.assert_array_equal(again["adam_m.w1"].read(), _expected()["adam_m.w1"])


def test_safetensors_rank_files_keep_their_string_values(tmp_path: Path) -> None:
    """A str value goes into a safetensors rank file's __metadata__ (write_safetensors, export_mindspore); the
    import dropped it silently (issue 35): it is a leaf again, as from a .ckpt file."""
    from reshard.store.frontends.mindspore.ckpt import write_safetensors

    for rank in range(4):
        values = ms.read_file(DATA / "safetensors" / f"rank_{rank}" / "net.safetensors")
        write_safetensors(tmp_path / "src" / f"rank_{rank}" / "net.safetensors", {**values, "note": "run 7"})
    assert ms.file_headers(tmp_path / "src" / "rank_0" / "net.safetensors")["note"] == ((), "str")
    ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / "ck"), DATA / "strategy.ckpt")
    assert ckpt.leaves["note"] == "run 7"
    files = ms.export_mindspore(ckpt, tmp_path / "st", DATA / "strategy.ckpt", format="safetensors")
    assert ms.read_file(files[1])["note"] == "run 7"


def test_exported_safetensors_load_in_mindspore(tmp_path: Path) -> None:
    mindspore = pytest.importorskip("mindspore", reason="MindSpore is not installed (optional; CI has none)")
    ckpt = ms.import_mindspore(DATA / "safetensors", str(tmp_path / "ck"), DATA / "strategy.ckpt")
    files = ms.export_mindspore(ckpt, tmp_path / "st", DATA / "strategy.ckpt", format="safetensors")
    loaded = mindspore.load_checkpoint(str(files[3]), format="safetensors")
    np.testing.assert_array_equal(loaded["w4"].asnumpy(), _expected()["w4"][2:])


def test_single_device_modelcheckpoint_folder_from_the_cli(tmp_path: Path) -> None:
    """Item 12: no strategy; the latest of several ModelCheckpoint files, --file, or a bare file."""
    from reshard.store.cli import main

    files = {p.name: ms.read_ckpt(p) for p in sorted((DATA / "single").glob("*.ckpt"))}
    assert sorted(files) == ["lenet-1_2.ckpt", "lenet-2_2.ckpt", "lenet-3_2.ckpt"]
    assert not np.array_equal(files["lenet-1_2.ckpt"]["fc1.weight"], files["lenet-3_2.ckpt"]["fc1.weight"])
    assert main(["import", "mindspore", str(DATA / "single"), str(tmp_path / "latest")]) == 0
    assert main(["import", "mindspore", str(DATA / "single"), str(tmp_path / "first"), "--file", "lenet-1_2.ckpt"]) == 0
    assert main(["import", "mindspore", str(DATA / "single" / "lenet-2_2.ckpt"), str(tmp_path / "bare")]) == 0
    for dst, name in (("latest", "lenet-3_2.ckpt"), ("first", "lenet-1_2.ckpt"), ("bare", "lenet-2_2.ckpt")):
        got = rs.open(str(tmp_path / dst))
        assert sorted(got.arrays) == sorted(files[name])
        for tag, value in files[name].items():
            np.testing.assert_array_equal(got[tag].read(), value, err_msg=f"{dst}: {tag}")
    with pytest.raises(FileNotFoundError, match="no rank_N"):
        ms.rank_files(tmp_path / "latest")


def test_inspect_names_the_pipeline_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 13: stage 1's tensors show their stage (their ranks are 2 and 3), stage 0's none."""
    from reshard.store.cli import main

    b = np.ones((6, 2), np.float32)
    layouts = {"enc.w": Layout.from_mindspore([2], [-1, -1], [6, 2], stage=0),
               "dec.w": Layout.from_mindspore([2], [-1, -1], [6, 2], stage=1)}
    for rank in range(4):
        ms.write_ckpt(tmp_path / "src" / f"rank_{rank}" / "a.ckpt", {("enc.w" if rank < 2 else "dec.w"): b})
    ms.import_mindspore(tmp_path / "src", str(tmp_path / "ck"), dump_strategy(layouts))
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "dev[2] tmap[-1,-1] stage1" in lines["dec.w"]
    assert "stage" not in lines["enc.w"]


def test_accu_grads_take_the_model_parallel_layout_without_optimizer_sharding(tmp_path: Path) -> None:
    """Item 14 (MindSpore's SetClonedTensorShapeForOptimizer): adam_m.w is sliced like w, optimizer
    sharding included; accu_grads.w like w but not optimizer-sharded. dev [2, 2], w [8, 4] tmap [-1, 0]
    (columns by r % 2), optimizer-sharded over its 2 replicas (rows by r // 2)."""
    rng = np.random.default_rng(14)
    full = {n: rng.standard_normal((8, 4)).astype(np.float32) for n in ("w", "adam_m.w", "accu_grads.w")}
    strategy = pb_strategy({"w": ([2, 2], [-1, 0], 2)})
    w = ms.load_strategy(strategy, {"w": (8, 4)})["w"]
    assert w.opt_sharded
    for rank in range(4):
        cols = slice(rank % 2 * 2, rank % 2 * 2 + 2)
        rows = slice(rank // 2 * 4, rank // 2 * 4 + 4)
        pb_write(tmp_path / "src" / f"rank_{rank}" / "n.ckpt", {
            "w": full["w"][rows, cols], "adam_m.w": full["adam_m.w"][rows, cols],
            "accu_grads.w": full["accu_grads.w"][:, cols]})
    ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / "ck"), strategy)
    for name, value in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), value, err_msg=name)
    assert ckpt["adam_m.w"].layout.opt_sharded and not ckpt["accu_grads.w"].layout.opt_sharded
    files = ms.export_mindspore(ckpt, tmp_path / "dst", strategy)
    got = pb_read(files[3])
    assert got["adam_m.w"].shape == (4, 2) and got["accu_grads.w"].shape == (8, 2)
    np.testing.assert_array_equal(got["accu_grads.w"], full["accu_grads.w"][:, 2:])


# ----------------------------------------------------------- strategies and files that disagree (issue 35)


def _copy_ranks(src: Path, dst: Path, change: dict[int, dict[str, Any]] | None = None) -> Path:
    """The real redundant save's rank files under ``dst``, rank r's values updated with ``change[r]``."""
    for rank in range(4):
        values = dict(ms.read_ckpt(src / f"rank_{rank}" / "net.ckpt"))
        values.update((change or {}).get(rank, {}))
        ms.write_ckpt(dst / f"rank_{rank}" / "net.ckpt", values)
    return dst


def test_a_strategy_naming_absurd_device_counts_is_refused_before_allocating(tmp_path: Path) -> None:
    """dev_matrix [2, 2**40] once listed 2**41 ranks (MemoryError); now it is named, nothing allocated."""
    from reshard.layouts import parse_strategy

    doc = {"parallel_layout_item": {"w1": {"dev_matrix": [2, 2**40], "tensor_map": [1, -1], "tensor_shape": [8, 4]}}}
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(rs.FormatError, match=r"strategy\.json: strategy entry 'w1': dev_matrix \[2, 1099511627776\] "
                       r"\(pipeline stage 0\) names 2199023255552 devices, more than max_devices=262144"):
        ms.import_mindspore(DATA / "redundant", str(tmp_path / "x"), path)
    assert not (tmp_path / "x").exists()
    with pytest.raises(rs.FormatError, match="strategy entry 'w1'"):
        parse_strategy(pb_strategy({"w1": ([2**16, 2**16], [1, -1], 0)}, {"w1": [8, 4]}))  # uint32 dims
    doc["parallel_layout_item"]["w1"]["dev_matrix"] = [2, 4]
    assert parse_strategy(json.dumps(doc))["w1"].mesh == (2, 4)
    with pytest.raises(rs.FormatError, match="names 8 devices, more than max_devices=4"):
        parse_strategy(json.dumps(doc), max_devices=4)


def test_a_strategy_whose_shape_contradicts_the_files_is_refused(tmp_path: Path) -> None:
    """w1 is [8, 4] cut in two row blocks; a strategy saying [4, 4] made each file's [4, 4] piece look like a whole
    copy, and rank 0's became the tensor (ranks 2 and 3's rows dropped). The copies are compared now."""
    layouts = ms.load_strategy(DATA / "strategy.ckpt", {n: v.shape for n, v in _expected().items()})
    layouts["w1"] = Layout.from_mindspore([2, 2], [1, -1], [4, 4])
    path = tmp_path / "wrong.json"
    path.write_bytes(dump_strategy(layouts))
    with pytest.raises(rs.FormatError, match=r"'w1': its copies of the block \[\[0, 4\], \[0, 4\]\] differ: rank 0's "
                       r".*redundant/rank_0/net\.ckpt and rank 2's .*redundant/rank_2/net\.ckpt .*wrong\.json's "
                       r".* of shape \[4, 4\] does not give them"):
        ms.import_mindspore(DATA / "redundant", str(tmp_path / "x"), path)
    assert not (tmp_path / "x").exists()
    layouts["w1"] = Layout.from_mindspore([2, 2], [1, -1], [16, 4])  # pieces smaller than it gives: by shape
    path.write_bytes(dump_strategy(layouts))
    with pytest.raises(rs.ShapeMismatchError, match=r"'w1': rank 0's file holds shape \[4, 4\] \(.*rank_0/net\.ckpt\), "
                       r"strategy .* of shape \[16, 4\] gives it \[8, 4\]"):
        ms.import_mindspore(DATA / "redundant", str(tmp_path / "x"), path)


def test_replicas_that_differ_are_refused_naming_both_ranks(tmp_path: Path) -> None:
    """global_step is in no strategy entry: one copy per rank file, compared now, not taken from rank 0 alone;
    w2 is replicated by the strategy: the same."""
    src = _copy_ranks(DATA / "redundant", tmp_path / "src", {3: {"global_step": np.array([7], np.int32)}})
    with pytest.raises(rs.FormatError, match=r"'global_step': its copies of the block \[\[0, 1\]\] differ: rank 0's "
                       r".*rank_0/net\.ckpt and rank 3's .*rank_3/net\.ckpt \(copies of a block must be equal\); "
                       r"not in .*strategy\.ckpt: each file's copy is taken for the whole tensor$"):
        ms.import_mindspore(src, str(tmp_path / "x"), DATA / "strategy.ckpt")
    w2 = ms.read_ckpt(DATA / "redundant" / "rank_1" / "net.ckpt")["w2"]
    src = _copy_ranks(DATA / "redundant", tmp_path / "src2", {1: {"w2": w2 + 1}})
    with pytest.raises(rs.FormatError, match=r"'w2': its copies .* rank 0's .* and rank 1's"):
        ms.import_mindspore(src, str(tmp_path / "x"), DATA / "strategy.ckpt")
    assert not (tmp_path / "x").exists()
    ok = ms.import_mindspore(_copy_ranks(DATA / "redundant", tmp_path / "same"), str(tmp_path / "ok"),
                             DATA / "strategy.ckpt")
    np.testing.assert_array_equal(ok["w1"].read(), _expected()["w1"])


def _with_map_tensor(path: Path, tag: str) -> None:
    """Append a MapParameter Value (``maptensor``, field 3 of checkpoint.proto's Value) to a .ckpt file."""
    from reshard.layouts import _protowire as pw

    value = pw.encode([(1, tag), (3, pw.encode([(1, 2), (2, b"\x00" * 8)]))])
    path.write_bytes(path.read_bytes() + pw.encode([(1, value)]))


def test_map_tensors_are_refused_unless_skipped_and_then_recorded(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.store.cli import main

    src = _copy_ranks(DATA / "redundant", tmp_path / "src")
    for rank in (0, 2):
        _with_map_tensor(src / f"rank_{rank}" / "net.ckpt", "emb.table")
    with pytest.raises(rs.FormatError, match=r"map tensor 'emb\.table' \(a MapParameter\) in .*rank_0/net\.ckpt, "
                       r".*rank_2/net\.ckpt: reshard does not decode map tensors"):
        ms.import_mindspore(src, str(tmp_path / "x"), DATA / "strategy.ckpt")
    assert not (tmp_path / "x").exists()
    with pytest.raises(rs.FormatError, match=r"rank_0/net\.ckpt: 'emb\.table' is a map tensor"):
        ms.read_ckpt(src / "rank_0" / "net.ckpt")
    assert "emb.table" not in ms.read_ckpt(src / "rank_0" / "net.ckpt", skip_maps=True)

    ckpt = ms.import_mindspore(src, str(tmp_path / "x"), DATA / "strategy.ckpt", skip=["emb.*"])
    assert "emb.table" not in ckpt.arrays
    assert [r["name"] for r in ckpt.leaves["reshard.skipped"]] == ["emb.table"]
    np.testing.assert_array_equal(ckpt["w1"].read(), _expected()["w1"])
    assert main(["import", "mindspore", str(src), str(tmp_path / "cli"), "--strategy",
                 str(DATA / "strategy.ckpt"), "--skip", "emb.table"]) == 0
    assert '"skipped": ["emb.table"]' in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "cli")]) == 0
    assert "skipped at import: emb.table: map tensor 'emb.table'" in capsys.readouterr().out


def test_damaged_protobuf_errors_name_the_file(tmp_path: Path) -> None:
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes((DATA / "redundant" / "rank_0" / "net.ckpt").read_bytes()[:100])
    with pytest.raises(rs.FormatError, match=r"^.*cut\.ckpt: protobuf"):
        ms.ckpt_headers(cut)
    with pytest.raises(rs.FormatError, match=r"^.*cut\.ckpt: protobuf"):
        ms.read_ckpt(cut, check_crc=False)
    strategy = tmp_path / "cut_strategy.ckpt"
    strategy.write_bytes((DATA / "strategy.ckpt").read_bytes()[:40])
    with pytest.raises(rs.FormatError, match=r"^.*cut_strategy\.ckpt: "):
        ms.load_strategy(strategy, {n: v.shape for n, v in _expected().items()})


def test_rank_folders_of_several_checkpoints_take_each_ranks_latest(tmp_path: Path) -> None:
    """As a single-device folder does: each rank_N's latest, the same epoch and step on every rank, said."""
    from reshard.store.cli import main

    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    strategy = dump_strategy({"w": Layout.from_mindspore([2], [0, -1], [4, 2])})
    (tmp_path / "strategy.json").write_bytes(strategy)
    for epoch in (1, 2):
        for r in (0, 1):
            ms.write_ckpt(tmp_path / "src" / f"rank_{r}" / f"net-{epoch}_5.ckpt", {"w": w[2 * r: 2 * r + 2] * epoch})
    with pytest.warns(UserWarning, match=r"importing each rank's latest, net-2_5\.ckpt in rank_0"):
        ckpt = ms.import_mindspore(tmp_path / "src", str(tmp_path / "a"), strategy)
    np.testing.assert_array_equal(ckpt["w"].read(), w * 2)
    assert main(["import", "mindspore", str(tmp_path / "src"), str(tmp_path / "b"), "--strategy",
                 str(tmp_path / "strategy.json"), "--file", "net-1_5.ckpt"]) == 0
    np.testing.assert_array_equal(rs.open(str(tmp_path / "b"))["w"].read(), w)
    (tmp_path / "src" / "rank_1" / "net-2_5.ckpt").unlink()  # rank 1's latest is an older step: refused
    with pytest.raises(rs.FormatError, match=r"latest differ by rank \(rank_0: net-2_5\.ckpt, rank_1: net-1_5\.ckpt\)"):
        ms.import_mindspore(tmp_path / "src", str(tmp_path / "c"), strategy)
    assert not (tmp_path / "c").exists()


def test_export_with_a_strategy_of_another_model_names_the_entry(tmp_path: Path, capsys) -> None:
    from reshard.store.cli import main

    rs.save({"w": np.ones((4, 2), np.float32)}, str(tmp_path / "ck"))
    (tmp_path / "other.json").write_text(json.dumps({"v": {"dev_matrix": [2], "tensor_map": [0, -1]}}))  # no shape
    assert main(["export", "mindspore", str(tmp_path / "ck"), str(tmp_path / "out"), "--strategy",
                 str(tmp_path / "other.json")]) == 1
    err = capsys.readouterr().err
    assert "strategy entry 'v'" in err and "holds no tensor of that name: is the strategy this checkpoint's?" in err
    assert "shapes" not in err and not (tmp_path / "out").exists()
    assert main(["export", "mindspore", str(tmp_path / "ck"), str(tmp_path / "out")]) == 2
    assert "export mindspore needs --strategy FILE" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "x.npz"), "--strategy", "s.json"]) == 2
    assert "--strategy applies to the mindspore format only (this export writes npz)" in capsys.readouterr().err

"""MindSpore strategy files and the pure-Python protobuf codec, checked against google.protobuf."""

from __future__ import annotations

import json

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from reshard.layouts import FormatError, Layout, LayoutError, dump_strategy, parse_strategy
from reshard.layouts import _protowire as pw

# node_strategy.proto (proto2, package mindspore.straspb), per REFERENCE.md
SCHEMA = {
    "ParallelStrategy": [("dim", 1, "uint32", "repeated")],
    "ParallelStrategys": [("stage", 1, "uint32", "required"),
                          ("parallel_strategy", 2, ".mindspore.straspb.ParallelStrategy", "repeated")],
    "ParallelStrategyItem": [("node_name", 1, "string", "required"),
                             ("parallel_strategys", 2, ".mindspore.straspb.ParallelStrategys", "required")],
    "DevMatrix": [("dim", 1, "uint32", "repeated")],
    "TensorMap": [("dim", 1, "int32", "repeated")],
    "ParamSplitShape": [("dim", 1, "int64", "repeated")],
    "IndicesOffset": [("dim", 1, "int64", "repeated")],
    "ParallelLayouts": [("dev_matrix", 1, ".mindspore.straspb.DevMatrix", "repeated"),
                        ("tensor_map", 2, ".mindspore.straspb.TensorMap", "repeated"),
                        ("param_split_shape", 3, ".mindspore.straspb.ParamSplitShape", "repeated"),
                        ("indices_offset", 4, ".mindspore.straspb.IndicesOffset", "repeated"),
                        ("field", 5, "int32", "required"),
                        ("opt_weight_shard_step", 6, "int32", "required"),
                        ("opt_weight_shard_size", 7, "int32", "required")],
    "ParallelLayoutItem": [("param_name", 1, "string", "required"),
                           ("parallel_layouts", 2, ".mindspore.straspb.ParallelLayouts", "required")],
    "ParallelStrategyMap": [("current_stage", 1, "uint32", "required"),
                            ("parallel_strategy_item", 2, ".mindspore.straspb.ParallelStrategyItem", "repeated"),
                            ("parallel_layout_item", 3, ".mindspore.straspb.ParallelLayoutItem", "repeated")],
}
F = descriptor_pb2.FieldDescriptorProto


@pytest.fixture(scope="module")
def proto():
    fd = descriptor_pb2.FileDescriptorProto(name="node_strategy.proto", package="mindspore.straspb", syntax="proto2")
    for name, fields in SCHEMA.items():
        msg = fd.message_type.add(name=name)
        for fname, number, ftype, label in fields:
            f = msg.field.add(name=fname, number=number, label=getattr(F, "LABEL_" + label.upper()))
            if ftype.startswith("."):
                f.type, f.type_name = F.TYPE_MESSAGE, ftype
            else:
                f.type = getattr(F, "TYPE_" + ftype.upper())
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"mindspore.straspb.{n}")) for n in SCHEMA}


def add_layout(smap, name, dev, tmap, split_shape=None, step=0, size=0):
    item = smap.parallel_layout_item.add(param_name=name)
    lay = item.parallel_layouts
    lay.dev_matrix.add().dim.extend(dev)
    lay.tensor_map.add().dim.extend(tmap)
    if split_shape is not None:
        lay.param_split_shape.add().dim.extend(split_shape)
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, step, size


def test_parse_google_protobuf_message(proto):
    smap = proto["ParallelStrategyMap"](current_stage=0)
    s = smap.parallel_strategy_item.add(node_name="MatMul-op0")
    s.parallel_strategys.stage = 0
    s.parallel_strategys.parallel_strategy.add().dim.extend([2, 2])
    add_layout(smap, "model_parallel_weight", [2, 2], [1, 0])
    add_layout(smap, "embedding_table", [8], [-1, -1], step=1, size=8)
    add_layout(smap, "bias", [2, 4], [0], split_shape=[12])
    shapes = {"model_parallel_weight": (2, 4), "embedding_table": (80, 200)}
    got = parse_strategy(smap.SerializeToString(), shapes=shapes)
    w = got["model_parallel_weight"]
    assert [w.region(r) for r in range(4)] == [
        (slice(0, 1), slice(0, 2)), (slice(0, 1), slice(2, 4)), (slice(1, 2), slice(0, 2)), (slice(1, 2), slice(2, 4))
    ]
    emb = got["embedding_table"]
    assert emb.opt_sharded and emb.opt_shard == -1 and emb.local_shape(5) == (10, 200)
    assert got["bias"].shape == (12,) and got["bias"].region(1) == (slice(3, 6),)


def test_missing_shape_is_a_format_error(proto):
    smap = proto["ParallelStrategyMap"](current_stage=0)
    add_layout(smap, "w", [2], [0, -1])
    with pytest.raises(FormatError, match=r"'w'.*shapes"):
        parse_strategy(smap.SerializeToString())


def test_dump_protobuf_is_read_by_google_protobuf(proto):
    layouts = {
        "w": Layout.from_mindspore([2, 4], [1, -1], (8, 6), opt_shard_size=2),
        "e": Layout.from_mindspore([4, 2], [-1, 0], (8, 8), opt_shard_size=-1),
        "b": Layout.from_mindspore([8], [-1], (5,)),
    }
    data = dump_strategy(layouts, format="protobuf")
    smap = proto["ParallelStrategyMap"]()
    smap.ParseFromString(data)
    assert smap.IsInitialized()
    items = {i.param_name: i.parallel_layouts for i in smap.parallel_layout_item}
    assert list(items["w"].dev_matrix[0].dim) == [2, 4] and list(items["w"].tensor_map[0].dim) == [1, -1]
    # w: group of rank 0 = {0, 1, 2, 3}: step 1; shard size 2
    assert (items["w"].opt_weight_shard_step, items["w"].opt_weight_shard_size) == (1, 2)
    # e: dim 1 split by mesh axis 1: group of rank 0 = {0, 2, 4, 6}: step 2, size 4
    assert (items["e"].opt_weight_shard_step, items["e"].opt_weight_shard_size) == (2, 4)
    assert (items["b"].opt_weight_shard_step, items["b"].opt_weight_shard_size) == (0, 0)
    assert list(items["b"].param_split_shape[0].dim) == [5]
    # byte-compatible: google.protobuf re-serialises our bytes identically
    assert smap.SerializeToString() == data
    back = parse_strategy(data)
    for name, lay in layouts.items():
        assert back[name].blocks() == lay.blocks()
        assert [back[name].replica_id(r) for r in range(8)] == [lay.replica_id(r) for r in range(8)]


def test_json_round_trip_and_form():
    layouts = {
        "w": Layout.from_mindspore([2, 4], [1, -1], (8, 6), opt_shard_size=2),
        "x": Layout.from_mindspore([2, 2], [(1, 0), -1], (8, 3)),
        "j": Layout.from_jax({"a": 2, "b": 2}, [None, "a"], (3, 4)),
    }
    data = dump_strategy(layouts)
    doc = json.loads(data)
    item = doc["parallel_layout_item"]["w"]
    assert item == {"dev_matrix": [2, 4], "tensor_map": [1, -1], "tensor_shape": [8, 6], "field": 0,
                    "opt_weight_shard_step": 1, "opt_weight_shard_size": 2}
    assert doc["parallel_layout_item"]["j"]["tensor_map"] == [-1, 1]
    for form in (data, data.decode(), doc):
        back = parse_strategy(form)
        assert back["w"] == layouts["w"] and back["x"] == layouts["x"]
        assert back["j"].blocks() == layouts["j"].blocks()


def test_pipeline_merged_keys():
    doc = {"parallel_layout_item": {
        "0-embedding": {"dev_matrix": [2, 2], "tensor_map": [1, -1], "tensor_shape": [8, 4]},
        "1-head": {"dev_matrix": [2, 2], "tensor_map": [-1, 0], "tensor_shape": [4, 8],
                   "opt_weight_shard_step": 0, "opt_weight_shard_size": 0},
    }}
    got = parse_strategy(doc)
    assert got["embedding"].ranks == (0, 1, 2, 3)
    head = got["head"]
    assert head.ranks == (4, 5, 6, 7) and head.region(5) == (slice(0, 4), slice(4, 8))
    again = parse_strategy(dump_strategy(got))
    assert set(json.loads(dump_strategy(got))["parallel_layout_item"]) == {"0-embedding", "1-head"}
    assert again == got
    proto_again = parse_strategy(dump_strategy(got, format="protobuf"))
    assert proto_again == got


def test_wrapped_json_lists():
    doc = {"w": {"dev_matrix": [[2, 2]], "tensor_map": [[1, 0]], "tensor_shape": [2, 4]}}
    assert parse_strategy(doc)["w"].region(1) == (slice(0, 1), slice(2, 4))


def test_dump_refuses_what_mindspore_cannot_express():
    with pytest.raises(LayoutError, match="cannot be a MindSpore strategy"):
        dump_strategy({"b": Layout.from_oneflow([0, 1, 2], "S(0)", (20,))})
    with pytest.raises(LayoutError, match="not one pipeline stage"):
        dump_strategy({"r": Layout((4,), (2,), ranks=(1, 0), dims=((0,),))})
    with pytest.raises(LayoutError, match="several mesh axes"):
        dump_strategy({"x": Layout.from_mindspore([2, 2], [(1, 0)], (8,))}, format="protobuf")
    # a ceil split that divides evenly is a MindSpore split
    ok = parse_strategy(dump_strategy({"d": Layout.from_dtensor(2, ["S(0)"], (4,))}))
    assert ok["d"].region(1) == (slice(2, 4),)


@pytest.mark.parametrize("bad", [b"\x1a\x05\x0a\x01", b"{not json", b"\x0f", "[1, 2]"])
def test_garbage_is_a_format_error(bad):
    with pytest.raises(FormatError):
        parse_strategy(bad)


# ------------------------------------------------------------ protowire


def test_protowire_matches_google_protobuf(proto):
    tm = proto["TensorMap"]()
    tm.dim.extend([-1, 0, 2**31 - 1, -(2**31)])
    assert pw.encode([(1, v) for v in tm.dim]) == tm.SerializeToString()
    assert len(pw.encode_varint(-1)) == 10
    assert pw.ints(pw.fields(tm.SerializeToString())[1]) == [-1, 0, 2**31 - 1, -(2**31)]
    ps = proto["ParamSplitShape"]()
    ps.dim.extend([0, 1, 300, 2**40])
    assert pw.encode([(1, v) for v in ps.dim]) == ps.SerializeToString()
    # packed input is read too
    assert pw.ints([(pw.LEN, pw.packed([1, -2, 300]))]) == [1, -2, 300]
    item = proto["ParallelStrategyItem"](node_name="ü-op")
    item.parallel_strategys.stage = 3
    ours = pw.encode([(1, "ü-op"), (2, pw.encode([(1, 3)]))])
    assert ours == item.SerializeToString()
    triples = pw.decode(ours)
    assert triples[0] == (1, pw.LEN, "ü-op".encode())
    view = pw.decode(ours, copy=False)[1][2]
    assert isinstance(view, memoryview) and pw.decode(view) == [(1, pw.VARINT, 3)]
    assert pw.signed(2**32 - 1, bits=32) == -1


def test_protowire_fixed_and_errors():
    assert pw.decode(b"\x0d\x01\x00\x00\x00\x11" + (5).to_bytes(8, "little")) == [(1, pw.I32, 1), (2, pw.I64, 5)]
    for bad in (b"\x08", b"\x0a\x05ab", b"\x00\x01", b"\x0b", b"\x08" + b"\xff" * 11):
        with pytest.raises(FormatError):
            pw.decode(bad)


def test_shapes_may_be_tuples():
    from reshard.layouts import Layout, dump_strategy, parse_strategy

    lay = {"w": Layout.from_mindspore([2, 2], [1, 0], (8, 4))}
    data = dump_strategy(lay, format="protobuf")
    assert parse_strategy(data, shapes={"w": (8, 4)}) == lay

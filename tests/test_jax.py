"""JAX front end: save on a (4, 2) mesh, restore on (2,) and (8,), Orbax import.

JAX runs in a subprocess with 8 fake CPU devices (``XLA_FLAGS`` must be set
before jax is first imported, which this pytest process cannot promise).
Each scenario below is a function of this file, run as
``python tests/test_jax.py <scenario> <tmp dir>``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.jax


def _run(scenario: str, tmp_path: Path) -> None:
    pytest.importorskip("jax")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, scenario, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_save_on_4x2_restore_on_2_and_8(tmp_path: Path) -> None:
    _run("save_restore", tmp_path)


def test_restore_onto_replicated_devices_reads_each_byte_once(tmp_path: Path) -> None:
    """Issue 25 item 2 for JAX: one process reads each distinct region once (``_distinct``), so 8 devices
    holding replicas (DDP-like, HSDP-like, TP x DP-like) cost one read of the checkpoint."""
    _run("read_once", tmp_path)


def test_orbax_import_and_restore_elsewhere(tmp_path: Path) -> None:
    _run("orbax", tmp_path)


def test_orbax_import_resolves_paths_and_refuses_empty_imports(tmp_path: Path) -> None:
    """Issue 11 defect 9: relative, missing and CheckpointManager paths committed an empty checkpoint."""
    _run("orbax_paths", tmp_path)


def test_orbax_scalars_that_are_not_json_are_refused_unless_skipped(tmp_path: Path) -> None:
    """Issue 35: a complex scalar ended the import in a bare TypeError naming no file; now it is named, or skipped
    on request and recorded."""
    _run("orbax_skip", tmp_path)


# ------------------------------------------------------------ in the subprocess
def _values() -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(0)
    return {
        "params.w": rng.standard_normal((16, 8), dtype=np.float32),
        "params.b": rng.standard_normal(8, dtype=np.float32),
        "params.emb": rng.standard_normal((8, 6), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "opt.0.mu": rng.standard_normal((32, 4), dtype=np.float32),
        "opt.1.count": np.arange(12, dtype=np.int32).reshape(4, 3),
    }


def _tree(mesh: Any, specs: dict[str, Any]) -> dict[str, Any]:
    """The nested pytree of jax arrays placed with ``specs`` on ``mesh`` (numpy where spec is None)."""
    import jax
    from jax.sharding import NamedSharding
    from reshard.store.format.tree import unflatten

    flat = {}
    for name, value in _values().items():
        spec = specs[name]
        flat[name] = value if spec is None else jax.device_put(value, NamedSharding(mesh, spec))
    tree = unflatten(flat)
    tree["opt"] = [tree["opt"]["0"], tree["opt"]["1"]]  # a list, named by index
    return tree


def _check(tree: Any, shardings: dict[str, Any]) -> None:
    import jax
    from reshard.store.frontends.jax import key_name

    want = _values()
    flat = {key_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    for name, sharding in shardings.items():
        array = flat[name]
        assert array.sharding == sharding, (name, array.sharding)
        assert array.dtype == want[name].dtype, name
        np.testing.assert_array_equal(np.asarray(array), want[name], err_msg=name)
        for shard in array.addressable_shards:  # every device holds exactly its region
            np.testing.assert_array_equal(np.asarray(shard.data), want[name][shard.index])


def scenario_save_restore(tmp: Path) -> None:
    import jax
    import reshard.store as rs
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from reshard.layouts import Layout
    from reshard.store.frontends import jax as rj

    devices = np.array(jax.devices())
    assert devices.size == 8
    # a mesh whose device order is not the id order: ranks are device ids in mesh order
    mesh = Mesh(devices[[1, 0, 3, 2, 5, 4, 7, 6]].reshape(4, 2), ("data", "model"))
    specs = {"params.w": P("data", "model"), "params.b": P("model"), "params.emb": P(None, "model"),
             "opt.0.mu": P(("data", "model")), "opt.1.count": None}
    tree = _tree(mesh, specs)
    tree["step"], tree["name"] = 7, "run-1"
    rj.save(tree, str(tmp / "ck"))

    ckpt = rs.open(str(tmp / "ck"))
    want = _values()
    assert set(ckpt.arrays) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(ckpt.read(name), value, err_msg=name)
    ids = [1, 0, 3, 2, 5, 4, 7, 6]
    axes = [("data", 4), ("model", 2)]
    assert ckpt["params.w"].layout == Layout.from_jax(axes, ("data", "model"), (16, 8), ranks=ids)
    assert ckpt["params.w"].layout.region(0) == (slice(0, 4), slice(4, 8))  # device 0 sits at mesh (0, 1)
    assert ckpt["params.b"].meta.shard == (4,)  # replicated over "data": one writer per block
    assert ckpt["params.emb"].meta.dtype == "bfloat16"
    assert ckpt["opt.1.count"].layout.ranks == (0,)
    assert ckpt.leaves == {"step": 7, "name": "run-1"}

    # onto a (2,) mesh of devices 6 and 3: each reads only its half
    two = Mesh(devices[[6, 3]], ("x",))
    target2: dict[str, Any] = {"params": {"w": NamedSharding(two, P("x")), "b": NamedSharding(two, P()),
                          "emb": NamedSharding(two, P(None, "x"))},
               "opt": [{"mu": NamedSharding(two, P("x"))}, {"count": NamedSharding(two, P("x"))}],
               "step": None}
    opened = rs.open(str(tmp / "ck"))
    out = rj.restore(opened, target2)
    _check(out, {"params.w": target2["params"]["w"], "params.b": target2["params"]["b"],
                 "params.emb": target2["params"]["emb"], "opt.0.mu": target2["opt"][0]["mu"],
                 "opt.1.count": target2["opt"][1]["count"]})
    assert out["step"] == 7
    # replicated "b" is read once although two devices hold it: every region once
    assert opened.stats.bytes_delivered == sum(v.nbytes for v in want.values())

    # onto all 8 devices in a (8,) mesh, with ShapeDtypeStruct targets (one casts)
    eight = Mesh(devices, ("x",))
    sds = jax.ShapeDtypeStruct
    target8 = {"params": {"w": sds((16, 8), np.float32, sharding=NamedSharding(eight, P("x"))),
                          "b": sds((8,), np.float32, sharding=NamedSharding(eight, P("x"))),
                          "emb": sds((8, 6), np.float32, sharding=NamedSharding(eight, P("x")))}}
    out8 = rj.restore(str(tmp / "ck"), target8)
    assert out8["params"]["emb"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out8["params"]["emb"]), want["params.emb"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(out8["params"]["w"]), want["params.w"])
    assert [s.data.shape for s in out8["params"]["w"].addressable_shards] == [(2, 8)] * 8

    # one Sharding for everything: a nested dict back, leaves included
    whole = rj.restore(str(tmp / "ck"), NamedSharding(two, P()))
    np.testing.assert_array_equal(np.asarray(whole["opt"]["0"]["mu"]), want["opt.0.mu"])
    assert whole["name"] == "run-1"


def scenario_read_once(tmp: Path) -> None:
    import jax
    import reshard.store as rs
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from reshard.store.frontends import jax as rj

    devices = np.array(jax.devices())
    rng = np.random.default_rng(25)
    values = {"a": rng.standard_normal((256, 512), dtype=np.float32),
              "b": rng.standard_normal((1000, 64), dtype=np.float32)}
    fsdp = Mesh(devices, ("x",))
    rj.save({n: jax.device_put(v, NamedSharding(fsdp, P("x"))) for n, v in values.items()}, str(tmp / "ck"))
    size = sum(f.stat().st_size for f in (tmp / "ck").rglob("*") if f.is_file())
    grid = Mesh(devices.reshape(4, 2), ("dp", "mp"))
    for spec in (P(), P("mp"), P(None, "mp")):  # 8 replicas; 2 shards x 4 replicas; columns x 4 replicas
        ckpt = rs.open(str(tmp / "ck"))
        out = rj.restore(ckpt, {n: NamedSharding(grid, spec) for n in values})
        for n, v in values.items():
            np.testing.assert_array_equal(np.asarray(out[n]), v)
        assert sum(v.nbytes for v in values.values()) <= ckpt.stats.bytes_fetched <= 1.1 * size, (spec, size)


def scenario_orbax(tmp: Path) -> None:
    import jax
    import orbax.checkpoint as ocp
    import reshard.store as rs
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from reshard.layouts import Layout
    from reshard.store.frontends import jax as rj

    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    specs = {"params.w": P("data", "model"), "params.b": P("model"), "params.emb": P(None, "model"),
             "opt.0.mu": P(("data", "model")), "opt.1.count": P("data")}
    tree = _tree(mesh, specs)
    tree["step"] = 7
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp / "orbax", tree)
    checkpointer.wait_until_finished()
    assert (tmp / "orbax" / "manifest.ocdbt").exists()  # the default: OCDBT, readable only via TensorStore

    report = rj.import_orbax(str(tmp / "orbax"), str(tmp / "ck"), chunk_bytes=1 << 16)
    assert report["tensors"] == 5 and report["skipped"] == []
    ckpt = rs.open(str(tmp / "ck"))
    want = _values()
    for name, value in want.items():
        got = ckpt.read(name)
        assert got.dtype == value.dtype, name
        np.testing.assert_array_equal(got, value, err_msg=name)
    assert ckpt.leaves == {"step": 7}
    # Orbax's saving sharding is kept as the saving layout
    assert ckpt["params.w"].layout == Layout.from_jax([("data", 4), ("model", 2)], ("data", "model"), (16, 8))
    assert ckpt["params.w"].meta.shard == (4, 4)

    # and restores on another device count (Orbax itself ties it to the saving mesh)
    three = Mesh(devices[:4].reshape(2, 2), ("a", "b"))
    target = jax.tree_util.tree_map(lambda _: NamedSharding(three, P("a")), {k: v for k, v in tree.items()
                                                                               if k != "step"})
    target["params"]["b"] = NamedSharding(three, P("b"))
    out = rj.restore(str(tmp / "ck"), target)
    _check(out, {"params.w": target["params"]["w"], "params.b": target["params"]["b"],
                 "opt.0.mu": target["opt"][0]["mu"]})

    # the older per-array layout (no OCDBT), with a host array, a scalar and a string
    legacy = {"a": np.arange(6.0).reshape(2, 3), "f": 1.5, "s": "hello", "j": tree["params"]["w"]}
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(tmp / "legacy", legacy)
    assert not (tmp / "legacy" / "manifest.ocdbt").exists()
    rj.import_orbax(str(tmp / "legacy"), str(tmp / "legacy-ck"))
    ckpt = rs.open(str(tmp / "legacy-ck"))
    assert ckpt.leaves == {"f": 1.5, "s": "hello"}
    np.testing.assert_array_equal(ckpt.read("a"), legacy["a"])
    np.testing.assert_array_equal(ckpt.read("j"), want["params.w"])


def scenario_orbax_paths(tmp: Path) -> None:
    import contextlib
    import io

    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import reshard.store as rs
    from reshard.store.cli import main
    from reshard.store.frontends import jax as rj

    os.chdir(tmp)
    manager = ocp.CheckpointManager(tmp / "runs")
    for step in (1, 5):
        manager.save(step, args=ocp.args.StandardSave({"w": jnp.arange(6.0) * step, "n": step}))
    manager.wait_until_finished()
    # a relative CheckpointManager root: the latest step, said so
    report = rj.import_orbax("runs", "ck")
    assert report["step"] == 5 and report["source"] == str(tmp / "runs" / "5" / "default"), report
    np.testing.assert_array_equal(rs.open(str(tmp / "ck")).read("w"), np.arange(6.0) * 5)
    assert rj.import_orbax("runs", "ck1", step=1)["step"] == 1
    np.testing.assert_array_equal(rs.open(str(tmp / "ck1")).read("w"), np.arange(6.0))
    for bad, match in [("nowhere", "no such Orbax checkpoint"), ("ck", "neither an Orbax checkpoint")]:
        try:
            rj.import_orbax(bad, "never")
        except rs.CheckpointNotFoundError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"{bad}: imported")
    try:
        rj.import_orbax("runs", "never", step=3)
    except rs.CheckpointNotFoundError as e:
        assert "steps found: [1, 5]" in str(e), e
    else:
        raise AssertionError("step 3 imported")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp / "scalars", {"n": 3, "lr": 0.5})
    checkpointer.wait_until_finished()
    try:
        rj.import_orbax("scalars", "never")
    except rs.CheckpointNotFoundError as e:
        assert "holds no tensors" in str(e), e
    else:
        raise AssertionError("a checkpoint without arrays imported")
    assert not (tmp / "never").exists()
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["import", "orbax", "nowhere", "never"]) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["import", "orbax", "runs", "ck2"]) == 0
    assert '"step": 5' in out.getvalue(), out.getvalue()


def scenario_orbax_skip(tmp: Path) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import reshard.store as rs
    from reshard.store.frontends import jax as rj

    ocp.PyTreeCheckpointer().save(tmp / "src", {"w": jnp.arange(4.0), "phase": np.complex64(1 + 2j), "step": 3})
    try:
        rj.import_orbax(str(tmp / "src"), str(tmp / "ck"))
    except rs.FormatError as e:
        assert f"{tmp / 'src'}: scalar 'phase': it is a complex64, which is not JSON" in str(e), e
    else:
        raise AssertionError("a complex scalar was imported or dropped")
    assert not (tmp / "ck").exists()
    report = rj.import_orbax(str(tmp / "src"), str(tmp / "ck"), skip=["phase"])
    assert report["skipped"] == ["phase"], report
    ckpt = rs.open(str(tmp / "ck"))
    assert ckpt.leaves["step"] == 3 and ckpt.leaves["reshard.skipped"][0]["name"] == "phase"
    np.testing.assert_array_equal(ckpt.read("w"), np.arange(4.0))
    checkpointer = ocp.StandardCheckpointer()  # saves the complex number as a 0-d array: refused, named, unwritten
    checkpointer.save(tmp / "array", {"w": jnp.arange(4.0), "phase": np.complex64(1 + 2j)})
    checkpointer.wait_until_finished()
    try:
        rj.import_orbax(str(tmp / "array"), str(tmp / "ck2"))
    except rs.DTypeMismatchError as e:
        assert f"{tmp / 'array'}: array 'phase': dtype complex64 is not supported" in str(e), e
    else:
        raise AssertionError("a complex array was imported")
    assert not (tmp / "ck2").exists()


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](Path(sys.argv[2]))

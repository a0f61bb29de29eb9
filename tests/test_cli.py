"""The ``reshard`` command line: every command on real checkpoints, in-process and as a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from paths import zarr_root
from reshard.layouts import Layout, dump_strategy
from reshard.store.cli import demo
from reshard.store.cli.app import main, parse_region, short_layouts, storage_options
from reshard.store.read.display import human_bytes as display_size


def run(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture(scope="module")
def ckpt_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo's state (tiny), saved from 8 ranks, tp 4 x dp 2, moments optimizer-sharded."""
    url = str(tmp_path_factory.mktemp("cli") / "step-100")
    state = demo.model_state(100, quick=True)
    demo.save_from_ranks(state, url, demo.training_layouts(state))
    return url


@pytest.fixture
def copy(ckpt_url: str, tmp_path: Path) -> str:
    """A private copy of the checkpoint in the directory form (a file per shard), free to damage."""
    dst = tmp_path / "copy"
    rs.convert(ckpt_url, str(dst), form="directory")
    return str(dst)


def cli_subprocess(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.store.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})


# ------------------------------------------------------------- subprocess
def test_subprocess_inspect_and_version(ckpt_url):
    p = cli_subprocess("inspect", ckpt_url, "model.layers.0")
    assert p.returncode == 0, p.stderr
    assert "dev[2,4] tmap[0,-1]" in p.stdout and "qkv.weight" in p.stdout
    assert "total: 6 tensors" in p.stdout and "step=100" not in p.stdout  # the pattern filters the leaves too
    v = cli_subprocess("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"reshard {rs.__version__}"


def test_subprocess_verify_names_the_corrupted_tensor(copy):
    shard = Path(zarr_root(copy), "model", "layers", "1", "mlp", "up", "weight", "c", "2", "0")
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    p = cli_subprocess("verify", copy)
    assert p.returncode == 1
    assert "FAILED" in p.stdout and "'model.layers.1.mlp.up.weight'" in p.stdout and "crc32c" in p.stdout
    assert "Traceback" not in p.stderr


def test_subprocess_missing_url_is_one_line(tmp_path):
    p = cli_subprocess("inspect", str(tmp_path / "nothing"))
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"reshard: error: no checkpoint at {tmp_path / 'nothing'}"]


# --------------------------------------------------------------- inspect
def test_inspect_tree_and_totals(ckpt_url, capsys):
    assert run("inspect", ckpt_url) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{ckpt_url}  (committed, saved by 8 ranks)"
    assert out.splitlines()[1] == ("packed form; zarr-python, xarray, dask: rs.open(url).zarr_store(), or fsspec "
                                   f"reference:// over {zarr_root(ckpt_url)}/refs.json (docs/format.md)")
    assert "\n  embed.weight " in out and "\n    0\n" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("embed.weight"))
    assert "bfloat16" in line and "[256, 64]" in line and "dev[2,4] tmap[0,-1]" in line and line.endswith(" 4")
    assert "total: 39 tensors, " in out


def test_inspect_json_pattern(ckpt_url, capsys):
    assert run("inspect", ckpt_url, "optimizer.exp_avg.*.norm1.weight", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(data["tensors"]) == ["optimizer.exp_avg.layers.0.norm1.weight",
                                       "optimizer.exp_avg.layers.1.norm1.weight"]
    t = data["tensors"]["optimizer.exp_avg.layers.0.norm1.weight"]
    assert t["layout"] == "dev[2,4] tmap[-1] opt8" and t["shards"] == 8 and t["nbytes"] == 64 * 4
    assert Layout.from_json(t["layout_json"]).opt_group_size == 8
    assert data["committed"] is True and data["leaves"] == {"step": 100}
    assert data["form"] == "packed" and data["zarr_url"] is None  # no folder of a packed save is a zarr hierarchy
    assert data["references_url"] == f"{zarr_root(ckpt_url)}/refs.json"
    assert data["references_url"].endswith(f"/gen-{data['save_id']}/refs.json")
    assert data["totals"] == {"tensors": 2, "nbytes": 512, "shards": 16, "ranks": 8}


def test_inspect_unknown_pattern_fails(ckpt_url, capsys):
    assert run("inspect", ckpt_url, "nope.*") == 1
    assert "no tensor matches 'nope.*'" in capsys.readouterr().err


def test_inspect_s3_reads_no_data(ckpt_url, s3_proxy, s3_bucket, capsys):
    url = f"s3://{s3_bucket}/step-100"
    rs.redivide(ckpt_url, url, {}, storage_options=s3_proxy.storage_options())
    s3_proxy.reset_counters()
    opts = ["-S", "key=testing", "-S", "secret=testing", "-S", f"endpoint_url={s3_proxy.endpoint_url}",
            "-S", "client_kwargs.region_name=us-east-1", "-S", "skip_instance_cache=true"]
    assert run("inspect", url, *opts) == 0
    assert "total: 39 tensors" in capsys.readouterr().out
    paths = [r.path for r in s3_proxy.records("GET")]
    assert paths and not [p for p in paths if "/c/" in p], paths  # metadata only, no shard touched


@pytest.mark.parametrize("source", ["env", "profile"])
def test_inspect_s3_takes_credentials_from_the_usual_places(ckpt_url, s3_proxy, s3_bucket, tmp_path, source):
    """No -S options: key and endpoint come from AWS_* variables or a named profile, as boto does."""
    url = f"s3://{s3_bucket}/step-100"
    rs.redivide(ckpt_url, url, {}, storage_options=s3_proxy.storage_options())
    s3_proxy.reset_counters()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ENDPOINT_URL=s3_proxy.endpoint_url, AWS_DEFAULT_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true")
    if source == "env":
        env.update(AWS_ACCESS_KEY_ID="fromenv", AWS_SECRET_ACCESS_KEY="x")
    else:
        creds = tmp_path / "credentials"
        creds.write_text("[ckpt]\naws_access_key_id = fromprofile\naws_secret_access_key = x\n")
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_PROFILE="ckpt")
    proc = subprocess.run([sys.executable, "-m", "reshard.store.cli", "inspect", url, "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["totals"]["tensors"] == 39
    assert {_signing_key(r) for r in s3_proxy.records("GET")} == {f"from{source}"}


def _signing_key(record) -> str:
    """The access key a request was signed with: its Authorization header's, or a presigned URL's query's."""
    auth = record.headers.get("authorization", "")
    if "Credential=" in auth:
        return auth.split("Credential=")[-1].split("/")[0]
    query = urllib.parse.parse_qs(record.query)
    if "X-Amz-Credential" in query:
        return query["X-Amz-Credential"][0].split("/")[0]
    return query.get("AWSAccessKeyId", [""])[0]


def test_uncommitted_is_refused_in_one_line(copy, capsys):
    os.remove(Path(copy, ".reshard", "commit.json"))
    assert run("inspect", copy) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("reshard: error: ") and "never committed" in err
    assert run("inspect", copy, "--uncommitted") == 0
    assert "UNCOMMITTED" in capsys.readouterr().out
    assert run("verify", copy) == 1
    assert "never committed" in capsys.readouterr().out


# ------------------------------------------------------------------ show
def test_show_values_region(ckpt_url, capsys):
    want = rs.open(ckpt_url)["model.embed.weight"].read()
    assert run("show", ckpt_url, "model.embed.weight", "--region", "2:4,5:8", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["region"] == "[2:4, 5:8]" and data["dtype"] == "bfloat16"
    np.testing.assert_array_equal(np.array(data["values"]), want[2:4, 5:8].astype(np.float64))
    assert run("show", ckpt_url, "model.embed.weight") == 0
    out = capsys.readouterr().out
    assert "region [0:8, 0:8] (a corner" in out and out.count("\n") == 9


def test_show_stats_match_numpy(tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((300, 17)).astype(np.float32)
    x[3, 4], x[7, 1], x[9, 9] = np.nan, np.inf, -np.inf
    url = str(tmp_path / "c")
    rs.save({"w": x, "b": x.astype(ml_dtypes.bfloat16)}, url, lambda n, s: Layout(s, (3,), dims=((0,), ())))
    assert run("show", url, "w", "--stats", "--json") == 0
    s = json.loads(capsys.readouterr().out)["stats"]
    fin = x[np.isfinite(x)].astype(np.float64)
    assert (s["count"], s["finite"], s["nan"], s["inf"]) == (x.size, x.size - 3, 1, 2)
    for key, value in {"min": fin.min(), "max": fin.max(), "mean": fin.mean(), "std": fin.std(),
                       "norm": math.sqrt((fin * fin).sum())}.items():
        assert s[key] == pytest.approx(value, rel=1e-9), key
    assert run("show", url, "b", "--stats", "--region", "100:200,:") == 0
    out = capsys.readouterr().out
    assert "region [100:200, 0:17]" in out and "count   1700" in out


def test_show_leaf(ckpt_url, capsys):
    assert run("show", ckpt_url, "step") == 0
    assert capsys.readouterr().out == "step = 100\n"


def test_show_errors(ckpt_url, capsys):
    assert run("show", ckpt_url, "model.nope") == 1
    assert "no tensor named 'model.nope'" in capsys.readouterr().err
    assert run("show", ckpt_url, "model.embed.weight", "--region", "0:a") == 2
    assert run("show", ckpt_url, "model.embed.weight", "--region", "0:1:2") == 2
    assert parse_region("1, 0:4, ...,:") == (1, slice(0, 4), Ellipsis, slice(None))


# ------------------------------------------------------------------ diff
def test_diff_same_and_changed(ckpt_url, tmp_path, capsys):
    assert run("diff", ckpt_url, ckpt_url) == 0
    assert capsys.readouterr().out.startswith("same: 39 tensors compared")
    state = demo.model_state(100, quick=True)
    state["model"]["embed"]["weight"][5, 6] += ml_dtypes.bfloat16(0.5)
    state["model"]["extra"] = np.ones(3, np.float32)
    del state["optimizer"]["exp_avg"]["layers"]["1"]
    state["step"] = 101
    other = str(tmp_path / "other")
    rs.save(state, other)
    assert run("diff", ckpt_url, other) == 1
    out = capsys.readouterr().out
    assert "+ model.extra  float32[3]" in out
    assert "- optimizer.exp_avg.layers.1.attn.qkv.weight" in out
    assert "~ model.embed.weight  max abs 0.5" in out and "leaf step: 100 -> 101" in out
    assert sum(x.startswith("~ ") for x in out.splitlines()) == 1  # only the edited tensor differs
    assert run("diff", ckpt_url, other, "--json") == 1
    data = json.loads(capsys.readouterr().out)
    assert data["tensors"]["model.embed.weight"]["max_abs"] == 0.5
    assert data["tensors"]["model.layers.0.mlp.up.weight"]["bitwise_equal"] is True


def test_diff_tolerance_and_nan(tmp_path, capsys):
    a = np.array([[1.0, np.nan], [np.inf, 4.0]], np.float32)
    rs.save({"w": a}, str(tmp_path / "a"))
    rs.save({"w": a + np.float32(1e-3)}, str(tmp_path / "b"))
    rs.save({"w": np.where(np.isnan(a), 0, a)}, str(tmp_path / "c"))
    assert run("diff", str(tmp_path / "a"), str(tmp_path / "b")) == 1
    capsys.readouterr()
    assert run("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "2e-3") == 0
    assert run("diff", str(tmp_path / "a"), str(tmp_path / "a")) == 0  # NaN == NaN
    capsys.readouterr()
    assert run("diff", str(tmp_path / "a"), str(tmp_path / "c"), "--atol", "1", "--json") == 1
    w = json.loads(capsys.readouterr().out)["tensors"]["w"]  # NaN against 0: never within tolerance
    assert w["max_abs"] == math.inf and w["same"] is False


# ---------------------------------------------------------------- verify
def test_verify_ok(ckpt_url, capsys):
    assert run("verify", ckpt_url, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["committed"] and data["tensors"] == 39
    assert data["bytes_checked"] == rs.open(ckpt_url).nbytes


def test_verify_missing_shard_names_tensor(copy, capsys):
    os.remove(Path(zarr_root(copy), "optimizer", "exp_avg_sq", "embed", "weight", "c", "5", "0"))
    assert run("verify", copy) == 1
    out = capsys.readouterr().out
    assert "1 problem(s)" in out and "'optimizer.exp_avg_sq.embed.weight'" in out and "missing" in out


# -------------------------------------------------------------- redivide
def test_redivide_short_form(ckpt_url, tmp_path, capsys):
    dst = str(tmp_path / "tp3")
    assert run("redivide", ckpt_url, dst, "--tp", "3", "--dp", "2", "--opt-shard") == 0
    assert "redivided 39 tensors" in capsys.readouterr().out
    src, new = rs.open(ckpt_url), rs.open(dst)
    lay = new.arrays["optimizer.exp_avg.layers.0.attn.qkv.weight"].layout
    assert lay.mesh == (2, 3) and lay.dims == ((1,), ()) and lay.opt_sharded  # 192 rows: 64 per tp, 32 per dp
    assert lay.local_shape(0) == (32, 64)
    assert not new.arrays["optimizer.exp_avg.embed.weight"].layout.opt_sharded  # 86 / 2 but 85 not: none
    assert new.arrays["model.embed.weight"].layout.opt_sharded is False
    assert new.arrays["model.layers.0.norm1.weight"].layout.blocks()[0].ranks == tuple(range(6))
    for name in src:
        np.testing.assert_array_equal(new[name].read(), src[name].read())
    assert run("redivide", ckpt_url, dst, "--tp", "2") == 1
    assert "--overwrite" in capsys.readouterr().err
    assert run("redivide", ckpt_url, dst, "--tp", "2", "--overwrite") == 0


def test_short_layouts_rule():
    metas = {"w": type("M", (), {"shape": (10, 4)})(), "optimizer.exp_avg.w": type("M", (), {"shape": (12, 4)})(),
             "b": type("M", (), {"shape": (5,)})()}
    lay = short_layouts(metas, tp=2, dp=3, opt_shard=True)  # type: ignore[arg-type]
    assert lay["w"].region(1) == (slice(5, 10), slice(0, 4)) and lay["w"].region(2) == lay["w"].region(0)
    assert lay["optimizer.exp_avg.w"].local_shape(0) == (2, 4)  # 12/2 rows per tp piece, /3 dp
    assert lay["b"].blocks()[0].ranks == tuple(range(6))


def test_redivide_layout_files(ckpt_url, tmp_path, capsys):
    src = rs.open(ckpt_url)
    target = {n: Layout.from_mindspore([2, 1], [1, 0] if len(m.shape) == 2 else [-1], m.shape)
              for n, m in src.arrays.items()}
    strategy = tmp_path / "strategy.json"
    strategy.write_bytes(dump_strategy(target, "json"))
    proto = tmp_path / "strategy.ckpt"
    proto.write_bytes(dump_strategy(target, "protobuf"))
    plain = tmp_path / "layouts.json"
    plain.write_text(json.dumps({"model.embed.weight": Layout.single((256, 64), rank=3).to_json()}))
    for spec in (strategy, proto):
        dst = str(tmp_path / spec.suffix[1:])
        assert run("redivide", ckpt_url, dst, "--layout", str(spec)) == 0
        got = rs.open(dst)
        assert {n: m.layout for n, m in got.arrays.items()} == target
        np.testing.assert_array_equal(got["model.embed.weight"].read(), src["model.embed.weight"].read())
    assert run("redivide", ckpt_url, str(tmp_path / "plain"), "--layout", str(plain)) == 0
    got = rs.open(str(tmp_path / "plain"))
    assert got.arrays["model.embed.weight"].layout.ranks == (3,)
    assert got.arrays["model.layers.0.mlp.up.weight"].layout == src.arrays["model.layers.0.mlp.up.weight"].layout
    assert run("redivide", ckpt_url, str(tmp_path / "x"), "--layout", str(plain), "--dp", "2") == 2
    capsys.readouterr()


# ------------------------------------------------------ export, demo, misc
def test_export_npz_and_torch(ckpt_url, tmp_path, capsys):
    pytest.importorskip("reshard.store.read.export")
    src = rs.open(ckpt_url)
    path = tmp_path / "model.npz"
    assert run("export", ckpt_url, str(path)) == 0
    assert f"exported {display_size(src.nbytes)} of tensors to {path} (npz)" in capsys.readouterr().out
    with np.load(path) as z:
        want = src["optimizer.exp_avg.embed.weight"].read()
        np.testing.assert_array_equal(z["optimizer.exp_avg.embed.weight"], want)
    assert run("export", ckpt_url, str(tmp_path / "m.npz"), "--prefix", "model.") == 2
    torch = pytest.importorskip("torch")
    assert run("export", ckpt_url, str(tmp_path / "m.pt"), "--prefix", "model.") == 0
    sd = torch.load(tmp_path / "m.pt")
    assert len(sd) == 13 and sd["embed.weight"].dtype == torch.bfloat16
    assert sd["embed.weight"].view(torch.int16).numpy().tobytes() == src["model.embed.weight"].read().tobytes()


def test_demo_quick(tmp_path, capsys):
    pytest.importorskip("reshard.store.read.export")
    assert run("demo", "--out", str(tmp_path / "d"), "--quick") == 0
    out = capsys.readouterr().out
    assert "save 8 ranks (tp4 x dp2)" in out and "redivide 8 -> 7" in out and "VERIFIED" in out
    assert (tmp_path / "d" / "model.safetensors").stat().st_size > 0
    assert run("demo", "--out", str(tmp_path / "d"), "--quick") == 0  # again: the demo replaces its own files


def test_usage_errors_exit_2(ckpt_url, capsys):
    assert run() == 2
    assert run("frobnicate") == 2
    assert run("inspect") == 2
    assert run("inspect", ckpt_url, "-S", "novalue") == 2
    assert run("demo", "--ranks", "6") == 2
    assert run("--help") == 0
    for cmd in ("inspect", "show", "diff", "verify", "redivide", "export", "demo"):
        assert run(cmd, "--help") == 0
        assert "usage: reshard " + cmd in capsys.readouterr().out


def test_debug_shows_the_exception(tmp_path):
    with pytest.raises(rs.CheckpointNotFoundError):
        run("--debug", "inspect", str(tmp_path / "none"))
    with pytest.raises(rs.CheckpointNotFoundError):
        run("inspect", str(tmp_path / "none"), "--debug")


def test_storage_options_parsing():
    assert storage_options([]) is None
    assert storage_options(["anon=true", "client_kwargs.region_name=eu-west-1", "n=3", "s=a=b"]) == {
        "anon": True, "client_kwargs": {"region_name": "eu-west-1"}, "n": 3, "s": "a=b"}


def test_command_names_stay_importable_from_cli_app():
    # the commands live in cli.commands and cli.write; cli.app re-exports them for callers of 0.1
    from reshard.store.cli import app as cli
    from reshard.store.cli import commands as cli_commands
    from reshard.store.cli import write as cli_write

    assert cli.storage_options is cli_commands.storage_options
    assert cli.compare is cli_commands.compare and cli.tensor_stats is cli_commands.tensor_stats
    assert cli.short_layouts is cli_write.short_layouts and cli.load_layout_spec is cli_write.load_layout_spec


def test_inspect_with_a_pattern_shows_only_the_leaves_it_matches(ckpt_url, capsys):
    assert run("inspect", ckpt_url) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("; leaves: step=100")
    assert run("inspect", ckpt_url, "model.embed.weight") == 0
    footer = capsys.readouterr().out.splitlines()[-1]
    assert footer.startswith("total: 1 tensors, ") and "leaves" not in footer
    assert run("inspect", ckpt_url, "step") == 1  # a leaf alone is not a tensor: reshard show URL step prints it


def test_help_and_import_load_neither_zarr_nor_numpy():
    # the command line starts quickly (issue 37 item 7; timed by python -m bench.cli_start): the parser and
    # `import reshard.store` leave zarr and numpy to the commands and functions that use them
    probe = ("import sys\nfrom reshard.store.cli import main\nassert main(['--help']) == 0\n"
             "import reshard.store\nprint(sorted(m for m in ('zarr', 'numpy', 'dask', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[-1] == "[]"


def test_zarr_imported_after_reshard_store_knows_reshards_dtypes():
    # zarr-python < 3.4.1 never loads the zarr.data_type entry points: importing zarr after reshard.store registers them
    probe = ("import reshard.store\nimport zarr\nfrom zarr.core.dtype import data_type_registry\n"
             "import reshard.store as rs\nprint(sorted(n for n in ('bfloat16', 'float8_e4m3fn', 'float8_e5m2') "
             "if n in data_type_registry.contents), callable(rs.commit), rs.commit.__module__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["['bfloat16',", "'float8_e4m3fn',", "'float8_e5m2']", "True",
                                  "reshard.store.commit.protocol"]


@pytest.mark.parametrize("source, shown", [
    ({"format": "Megatron-Core torch_dist", "ranks": 4}, "imported from the files of 4 ranks of a Megatron-Core "
                                                           "torch_dist save; its layouts number 8 saved pieces"),
    ({"format": "DCP", "ranks": 8}, "imported from the files of 8 ranks of a DCP save"),
    ({"format": "DCP", "ranks": "8"}, "saved by 8 ranks"),  # the leaf is the file's, not trusted
    ({"ranks": True}, "saved by 8 ranks"),
    ("8 ranks", "saved by 8 ranks"),
])
def test_inspect_shows_the_job_ranks_an_import_recorded(tmp_path, source, shown, capsys):
    state = demo.model_state(1, quick=True)
    layouts = demo.training_layouts(state)
    url = str(tmp_path / "ck")
    rs.save({**state, "reshard": {"source": source}}, url, layouts)
    assert run("inspect", url) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f"(committed, {shown})")


def test_a_redivision_drops_the_import_record_a_conversion_keeps(tmp_path, capsys):
    state = demo.model_state(1, quick=True)
    url = str(tmp_path / "ck")
    rs.save({**state, "reshard": {"source": {"format": "DCP", "ranks": 4}}}, url, demo.training_layouts(state))
    assert run("convert", url, str(tmp_path / "dir"), "--form", "directory", "-q") == 0
    assert run("redivide", url, str(tmp_path / "tp2"), "--tp", "2", "-q") == 0
    capsys.readouterr()
    kept = "imported from the files of 4 ranks of a DCP save; its layouts number 8 saved pieces"
    for dst, shown in (("dir", kept), ("tp2", "saved by 2 ranks")):
        assert run("inspect", str(tmp_path / dst)) == 0
        assert capsys.readouterr().out.splitlines()[0].endswith(f"(committed, {shown})"), dst

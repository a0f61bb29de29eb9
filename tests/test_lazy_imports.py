"""What a command or a load imports (issue 37 items 7 and 8): the public names of ``reshard.store``
are kept in two places by hand, and reshard's own reads and writes of local files need neither
zarr-python nor fsspec."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.format import dtypes, zarr_dtypes

STORE_INIT = Path(rs.__file__)


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """``{bound name: (module under reshard.store, name there)}`` of ``if TYPE_CHECKING:`` in store/__init__.py."""
    tree = ast.parse(STORE_INIT.read_text())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
              and n.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1
    out: dict[str, tuple[str, str]] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1 and node.module, ast.dump(node)
        for alias in node.names:
            out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def test_homes_and_type_checking_imports_list_the_same_names():
    homes = dict(rs._HOMES)
    assert _type_checking_imports() == homes
    for name, (module, attr) in homes.items():  # and each resolves to what its home holds
        assert name in rs.__all__
        assert getattr(rs, name) is getattr(__import__(f"reshard.store.{module}", fromlist=[attr]), attr)


def test_zarr_dtypes_agree_with_dtypes_and_are_found_there_too():
    assert set(zarr_dtypes.ZARR_DTYPES) == {"bfloat16", "float8_e4m3fn", "float8_e5m2"}
    for name, cls in zarr_dtypes.ZARR_DTYPES.items():
        assert cls._native == dtypes.numpy_dtype(name) and cls._zarr_v3_name == name
    for name in ("register_zarr_dtypes", "ZARR_DTYPES", "BFloat16", "Float8E4M3FN", "Float8E5M2"):
        assert getattr(dtypes, name) is getattr(zarr_dtypes, name)  # earlier installs' entry points name dtypes
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        dtypes.nothing  # noqa: B018


PROBE = """
import json, sys
def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] in ("zarr", "numcodecs", "fsspec"))
from reshard.store.cli import main
assert main(["import", "safetensors", sys.argv[1], sys.argv[2]]) == 0
after_import = heavy()
import numpy as np
import reshard.store as rs
from reshard.layouts import Layout
ckpt = rs.open(sys.argv[2])
layouts = {n: Layout(ckpt[n].shape, mesh=(3,), dims=((0,), ())) for n in ckpt}
out = {n: np.zeros(lay.local_shape(1), np.float32) for n, lay in layouts.items()}
ckpt.load(layouts, 1, out=out)
np.save(sys.argv[3], np.stack([out[n] for n in sorted(out)]))
np.save(sys.argv[4], np.stack([np.asarray(ckpt[n][...]) for n in sorted(ckpt)]))
print(json.dumps([after_import, heavy()]))
"""


def test_importing_safetensors_and_loading_a_rank_import_neither_zarr_nor_fsspec(tmp_path):
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    save_file({f"layer{i}.weight": rng.standard_normal((12, 8), dtype=np.float32) for i in range(3)},
              str(tmp_path / "small.safetensors"))
    want = load_file(str(tmp_path / "small.safetensors"))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "small.safetensors"), str(tmp_path / "ckpt"),
                           str(tmp_path / "rank1.npy"), str(tmp_path / "whole.npy")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [[], []]
    names = sorted(want)
    np.testing.assert_array_equal(np.load(tmp_path / "rank1.npy"), np.stack([want[n][4:8] for n in names]))
    np.testing.assert_array_equal(np.load(tmp_path / "whole.npy"), np.stack([want[n] for n in names]))


def test_plain_files_answer_as_fsspecs_local_file_system(tmp_path):
    from fsspec.implementations.local import LocalFileSystem
    from reshard.store.io.localfs import PlainFiles, plain_root

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "w.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    ours, theirs = PlainFiles(), LocalFileSystem()
    keys = ("name", "size", "type", "islink")
    for path in (str(tmp_path), f"{tmp_path}/", str(tmp_path / "a.json")):
        assert sorted(ours.ls(path)) == sorted(theirs.ls(path))
        assert sorted(tuple(i[k] for k in keys) for i in ours.ls(path, detail=True)) == \
            sorted(tuple(i[k] for k in keys) for i in theirs.ls(path, detail=True))
    for name in ("a.json", "w.safetensors", "link.json", "dangling", "sub", "nothing"):
        path = str(tmp_path / name)
        assert ours.exists(path) == theirs.exists(path) and ours.isdir(path) == theirs.isdir(path), name
    assert ours.size(str(tmp_path / "w.safetensors")) == theirs.size(str(tmp_path / "w.safetensors")) == 100
    with ours.open(str(tmp_path / "link.json")) as f:
        assert f.read() == b"{}"
    for call in (ours.ls, ours.size, ours.open):
        with pytest.raises(FileNotFoundError):
            call(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="reading only"):
        ours.open(str(tmp_path / "a.json"), "wb")
    assert plain_root("s3://bucket/x") is None and plain_root("memory://x") is None
    assert plain_root("simplecache::/tmp/x") is None

"""Progress bars (issue 37 item 6): on a terminal for every long command, never in a pipe or with --quiet.

The commands run in a real pseudo-terminal (``pty``), as a user's shell runs them; the bars are tqdm's,
so the test reads what tqdm drew: the command's label, the bytes and the tensors done.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
MEGATRON = ROOT / "tests" / "data" / "megatron" / "forms" / "dp_reshardable"


def on_terminal(*args: str, timeout: float = 300) -> tuple[int, str]:
    """Run ``reshard ARGS`` with stdout and stderr on a pseudo-terminal; (exit code, what it drew)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal's size: 40 x 160
    proc = subprocess.Popen([sys.executable, "-m", "reshard.store.cli", *args], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")


def in_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.store.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def safetensors_file(tmp_path: Path) -> Path:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    path = tmp_path / "model.safetensors"
    save_file({f"layer{i}.weight": rng.standard_normal((512, 512), dtype=np.float32) for i in range(6)}, str(path))
    return path


def test_import_and_export_draw_a_bar_of_bytes_and_tensors_on_a_terminal(tmp_path, safetensors_file):
    code, drawn = on_terminal("import", "safetensors", str(safetensors_file), str(tmp_path / "ck"))
    assert code == 0, drawn
    # the bar's total is the 6 tensors' 6.29 MB, its postfix counts tensors (tqdm redraws at most every 0.1 s)
    assert "import safetensors" in drawn and "/6.29M" in drawn and "/6 tensors" in drawn and "B/s" in drawn, drawn
    code, drawn = on_terminal("export", "torch", str(tmp_path / "ck"), str(tmp_path / "model.pt"))
    assert code == 0, drawn
    assert "export torch" in drawn and "/6.29M" in drawn and "/6 tensors" in drawn, drawn


def test_megatron_import_draws_its_bar(tmp_path):
    pytest.importorskip("torch")
    code, drawn = on_terminal("import", "megatron", str(MEGATRON), str(tmp_path / "ck"))
    assert code == 0, drawn
    assert "import megatron" in drawn and "tensors" in drawn and "B/s" in drawn, drawn


def test_quiet_and_pipes_draw_nothing(tmp_path, safetensors_file):
    code, drawn = on_terminal("--quiet", "import", "safetensors", str(safetensors_file), str(tmp_path / "a"))
    assert code == 0 and "B/s" not in drawn and "\r" not in drawn.replace("\r\n", ""), drawn
    code, drawn = on_terminal("redivide", str(tmp_path / "a"), str(tmp_path / "b"), "--tp", "2", "-q")
    assert code == 0 and "task/s" not in drawn and "\r" not in drawn.replace("\r\n", ""), drawn
    run = in_pipe("import", "safetensors", str(safetensors_file), str(tmp_path / "c"))
    assert run.returncode == 0 and run.stderr == "", run.stderr
    code, drawn = on_terminal("redivide", str(tmp_path / "a"), str(tmp_path / "d"), "--tp", "2")
    assert code == 0 and "redivide" in drawn and "task" in drawn, drawn  # the same command, not quiet


def test_a_notebook_shows_the_bars_of_redivide_load_many_export_and_verify(tmp_path, safetensors_file):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    in_pipe("import", "safetensors", str(safetensors_file), str(tmp_path / "ck"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import reshard.store as rs\nfrom reshard.layouts import Layout\n"
        f"rs.redivide({str(tmp_path / 'ck')!r}, {str(tmp_path / 'nb')!r}, "
        "lambda name, shape: Layout.from_dtensor((2,), ['S(0)'], shape))\n"
        f"ckpt = rs.open({str(tmp_path / 'nb')!r})\n"
        "pieces = rs.load_many(ckpt, lambda name, shape: Layout.from_dtensor((4,), ['S(1)'], shape), [0, 1, 2, 3])\n"
        "assert sorted(pieces) == [0, 1, 2, 3]\n"
        f"rs.export(ckpt, {str(tmp_path / 'nb.safetensors')!r})\n"
        f"assert rs.verify({str(tmp_path / 'nb')!r}).ok\n")])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    text = "".join(o.get("text", "") + str(o.get("data", "")) for o in nb.cells[0].outputs)
    assert all(bar in text for bar in ("redivide", "load", "export", "verify")), nb.cells[0].outputs

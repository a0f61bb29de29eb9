"""Build the interpreters the real-framework tests run DeepSpeed and Megatron-Core in (tox ``commands_pre``).

``python tests/frameworks.py DIR`` makes, once, a virtual environment per framework under ``DIR``
(each with torch's CPU wheel): ``ds`` (DeepSpeed 0.19.8 and megatron-core 0.12.1, for
tests/test_deepspeed*.py and tests/test_megatron.py) and ``mc16`` (megatron-core 0.16.1, for
tests/test_megatron_forms.py). tox points ``RESHARD_DEEPSPEED_PYTHON``, ``RESHARD_MEGATRON_PYTHON``
and ``RESHARD_MEGATRON16_PYTHON`` at them unless they are set. One that does not install is left
out with a line saying so, and its tests skip (they check the interpreter imports the framework);
the rest of the suite never needs them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

TORCH = "torch==2.13.0"  # the CPU wheel (tox.ini)
FRAMEWORKS = {"ds": ["deepspeed==0.19.8", "megatron-core==0.12.1"], "mc16": ["megatron-core==0.16.1"]}
#: Seconds one pip install may take.
TIMEOUT = 900


def build(root: Path, name: str, packages: list[str]) -> bool:
    """The environment ``root/name`` with ``packages`` (kept if built before); whether it is there."""
    where = root / name
    done = where / ".installed"
    if done.exists():
        return True
    shutil.rmtree(where, ignore_errors=True)
    venv.create(where, with_pip=True)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q"]
    for step in ([TORCH], packages):
        try:
            run = subprocess.run([*pip, *step], capture_output=True, text=True, timeout=TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            print(f"frameworks: {name}: pip install {' '.join(step)} took over {TIMEOUT} s; its tests skip")
            shutil.rmtree(where, ignore_errors=True)
            return False
        if run.returncode != 0:
            print(f"frameworks: {name}: pip install {' '.join(step)} failed; its tests skip\n{run.stderr[-2000:]}")
            shutil.rmtree(where, ignore_errors=True)
            return False
    done.write_text(" ".join([TORCH, *packages]) + "\n")
    return True


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".tox/frameworks").resolve()
    root.mkdir(parents=True, exist_ok=True)
    for name, packages in FRAMEWORKS.items():
        print(f"frameworks: {name}: {'ready' if build(root, name, packages) else 'not available'} ({root / name})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

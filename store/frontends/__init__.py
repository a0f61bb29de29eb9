"""Framework front ends: torch (DTensor, DCP), JAX (Orbax), MindSpore, OneFlow.

Each module imports its framework lazily, inside the functions that need it,
so ``import reshard.store`` never pulls torch or jax in.
"""

from __future__ import annotations

import argparse
from typing import Any


def register_import(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add ``reshard import ...`` to the command line (called by ``reshard.store.cli``)."""
    from .commands import register_import as register

    register(subparsers, common)

"""Checks every importer makes on its source: it exists, and it holds tensors.

An import that found nothing must not commit an empty checkpoint and report
success (issue 11, defect 9): each importer calls :func:`refuse_empty` before
it creates the destination.
"""

from __future__ import annotations

import os
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError


def local_path(src: Any) -> str:
    """``src`` as an absolute local path (``~`` expanded); URLs (``scheme://``) are returned as they are."""
    text = os.fspath(src)
    return text if "://" in text else os.path.abspath(os.path.expanduser(text))


def refuse_empty(kind: str, src: Any, tensors: int, detail: str = "") -> None:
    """Raise :class:`CheckpointNotFoundError` when an import found no tensors (nothing is written)."""
    if tensors == 0:
        raise CheckpointNotFoundError(f"{src}: the {kind} checkpoint holds no tensors{detail}; nothing was imported "
                                      "(is it the right folder?)")

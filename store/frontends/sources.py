"""Checks every importer makes on its source: it exists, and it holds tensors.

An import that found nothing must not commit an empty checkpoint and report
success (issue 11, defect 9): each importer calls :func:`refuse_empty` before
it creates the destination.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError

from ..io.replace import set_aside


def local_path(src: Any) -> str:
    """``src`` as an absolute local path (``~`` expanded); URLs (``scheme://``) are returned as they are."""
    text = os.fspath(src)
    return text if "://" in text else os.path.abspath(os.path.expanduser(text))


def source_path(src: Any) -> str:
    """:func:`local_path` of an import's source; where a killed export left the source missing (its swap
    cut between two renames, docs/reliability.md "Exports"), the old export it set aside, with a warning.

    Nothing is renamed or removed: the next export of that target puts the old one back.
    """
    path = local_path(src)
    old = None if "://" in path else set_aside(path)
    if old is None:
        return path
    warnings.warn(f"{path} is missing: an export over it was killed and set the previous one aside; reading "
                  f"that ({old})", stacklevel=3)
    return old


def refuse_empty(kind: str, src: Any, tensors: int, detail: str = "") -> None:
    """Raise :class:`CheckpointNotFoundError` when an import found no tensors (nothing is written)."""
    if tensors == 0:
        raise CheckpointNotFoundError(f"{src}: the {kind} checkpoint holds no tensors{detail}; nothing was imported "
                                      "(is it the right folder?)")

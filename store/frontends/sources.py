"""Checks every importer makes on its source: it exists, it holds tensors, and nothing is skipped unasked.

An import that found nothing must not commit an empty checkpoint and report
success (issue 11, defect 9): each importer calls :func:`refuse_empty` before
it creates the destination. Nor may it report success having left state out
(issue 35): what an importer does not decode goes through :class:`Skips`.
"""

from __future__ import annotations

import os
import re
import shlex
import warnings
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError, FormatError

from ..format.tree import SKIPPED_LEAF, SOURCE_LEAF
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


class Skips:
    """What an import found and did not decode: an error naming it, unless the caller allowed it.

    No import exits 0 having skipped state silently (docs/reliability.md): every
    importer calls :meth:`add` for each key, key family or object it leaves out,
    then :meth:`check` before it creates the destination. :meth:`check` raises
    :class:`FormatError` naming everything that matches none of ``skip``; what
    matches is recorded, and :meth:`leaves` gives the record the checkpoint keeps
    under :data:`SKIPPED_LEAF` (``reshard inspect`` shows it).

    Parameters
    ----------
    skip : sequence of str
        Names the caller lets the import leave out (``skip=`` of every
        importer, ``reshard import --skip PATTERN``): a glob (``"chained_*"``,
        ``"*"``) or a dotted prefix (``"optimizer"`` covers ``optimizer.x.y``).
    """

    def __init__(self, skip: Sequence[str] | str = ()) -> None:
        self.patterns = (skip,) if isinstance(skip, str) else tuple(skip)
        self.records: list[dict[str, str]] = []

    def allowed(self, name: str) -> bool:
        """Whether ``name`` matches one of the patterns."""
        return any(fnmatchcase(name, p) or name.startswith(p + ".") for p in self.patterns)

    def add(self, name: str, what: str, why: str) -> None:
        """Note that ``name`` is left out (``what``: what it is and its file; ``why``: why it is not decoded)."""
        self.records.append({"name": name, "what": what, "why": why})

    def check(self) -> None:
        """Refuse what was left out unasked.

        Raises
        ------
        FormatError
            Naming every record whose name matches none of the patterns (call it before writing anything).
        """
        refused = [r for r in self.records if not self.allowed(r["name"])]
        if refused:
            lines = "; ".join(f"{r['what']}: {r['why']}" for r in refused)
            names = [r["name"] for r in refused]
            flags = " ".join(f"--skip {shlex.quote(n)}" for n in names)
            raise FormatError(f"not decoded, so the import would leave it out: {lines}. Nothing was written; "
                              f"pass skip={names!r} (reshard import ... {flags}) to import the rest and record "
                              f"what was skipped in the leaf {SKIPPED_LEAF!r}")

    def leaves(self) -> dict[str, Any]:
        """``{SKIPPED_LEAF: records}`` when anything was skipped, else ``{}`` (after :meth:`check`)."""
        return {SKIPPED_LEAF: list(self.records)} if self.records else {}

    def names(self) -> list[str]:
        """The names skipped, in order."""
        return [r["name"] for r in self.records]


#: A torch DCP data file, ``__<rank>_<n>.distcp`` (DCP and Megatron-Core ``torch_dist`` saves).
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def dcp_source(fmt: str, files: Iterable[str]) -> dict[str, Any]:
    """The leaf :data:`~reshard.store.format.tree.SOURCE_LEAF` of a DCP-style save: the ranks that wrote its files.

    Rank ``r`` writes ``__<r>_<n>.distcp``. A rank with nothing to write (its pieces all replicas
    that another rank saved) writes no file, so this counts the ranks that wrote data, at most the
    job's. ``{}`` when no file is named that way.
    """
    ranks = {int(m.group(1)) for f in files if (m := _DCP_FILE.fullmatch(os.path.basename(str(f))))}
    return {SOURCE_LEAF: {"format": fmt, "ranks": len(ranks)}} if ranks else {}

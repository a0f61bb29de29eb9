"""Other frameworks' checkpoints, told apart by their file names: what to run instead of opening them.

A folder that holds no reshard checkpoint may hold another framework's: DCP's
``.metadata`` and ``*.distcp`` files, a Megatron-Core ``torch_dist`` save (the
same plus ``metadata.json``), a DeepSpeed save (``latest`` and the tag's
``*_model_states.pt``), an Orbax checkpoint (``_METADATA``,
``_CHECKPOINT_METADATA``, or a manager's numbered steps), a Hugging Face folder
(``*.safetensors``, ``model.safetensors.index.json``), MindSpore rank files
(``rank_N/*.ckpt``, ``*.ckpt``) or a OneFlow ``flow.save`` folder
(``pickled_data``). :func:`foreign_hint` names the format and the exact
``reshard import`` command; ``rs.open``, the DCP plugin's reader and every
command that opens a checkpoint add it to their "no checkpoint" error. Only
names are read: one listing of the folder, and one of a numbered step or of
``rank_0`` where the folder holds those.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..io.storage import Storage


@dataclass(frozen=True)
class Foreign:
    """A framework's checkpoint format and the ``reshard import`` command word that reads it."""

    name: str
    command: str
    args: str = ""


DCP = Foreign("PyTorch DCP", "dcp")
MEGATRON = Foreign("Megatron-Core torch_dist", "megatron")
DEEPSPEED = Foreign("DeepSpeed", "deepspeed")
ORBAX = Foreign("Orbax", "orbax")
HUGGINGFACE = Foreign("Hugging Face safetensors", "safetensors")
MINDSPORE = Foreign("MindSpore", "mindspore")
MINDSPORE_RANKS = Foreign("MindSpore per-rank", "mindspore", " --strategy STRATEGY_FILE")
ONEFLOW = Foreign("OneFlow flow.save", "oneflow")

_DEEPSPEED_FILE = re.compile(r"^(zero_pp_rank_\d+_)?(bf16_)?(zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt$")
_ORBAX_FILES = {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "_sharding"}


def _kind(names: set[str]) -> Foreign | None:
    """The format a folder's file names show, or None."""
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return MEGATRON if "metadata.json" in names else DCP
    if "latest" in names or any(_DEEPSPEED_FILE.match(n) for n in names):
        return DEEPSPEED
    if names & _ORBAX_FILES or any(n.startswith("ocdbt.process_") for n in names):
        return ORBAX
    if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return HUGGINGFACE
    if any(n.endswith(".ckpt") for n in names):
        return MINDSPORE
    if "pickled_data" in names:
        return ONEFLOW
    return None


def detect(root: Storage) -> Foreign | None:
    """The foreign format of the folder at ``root`` (a local path or URL), or None; never raises."""
    try:
        names = set(root.list(""))
        found = _kind(names)
        if found is None and (steps := sorted(n for n in names if n.isdigit())):
            found = ORBAX if _kind(set(root.list(steps[-1]))) is ORBAX else None  # a CheckpointManager's steps
        if found is None and "rank_0" in names and _kind(set(root.list("rank_0"))) is MINDSPORE:
            found = MINDSPORE_RANKS
        return found
    except Exception:  # a hint must never hide the error it decorates
        return None


def foreign_hint(root: Storage) -> str:
    """``"; it holds a X checkpoint, which `reshard import ...` reads"`` for a foreign folder, else ``""``."""
    found = detect(root)
    if found is None:
        return ""
    command = f"reshard import {found.command} {root.url} DST{found.args}"
    return f"; it holds a {found.name} checkpoint, which `{command}` reads"

"""The training loop's checkpoints: :class:`CheckpointManager` (steps, async save, retention, resume).

``index`` (the committed steps, ``root/manager.json``), ``retention`` (what is
kept), ``staging`` (host copies for async saves), ``committer`` (the designated
rank's background commit), ``manager`` (the user-facing class);
``torch_manager.TorchCheckpointManager`` and ``jax_manager.JaxCheckpointManager``
build one from a state dict or a pytree (importable from here too, lazily).
"""

from typing import Any

from .index import INDEX_KEY, Index, StepRecord, read_index, step_dir
from .manager import CheckpointManager
from .retention import Retention

__all__ = ["INDEX_KEY", "CheckpointManager", "Index", "JaxCheckpointManager", "Retention", "StepRecord",
           "TorchCheckpointManager", "read_index", "step_dir"]


def __getattr__(name: str) -> Any:
    if name == "TorchCheckpointManager":
        from .torch_manager import TorchCheckpointManager

        return TorchCheckpointManager
    if name == "JaxCheckpointManager":
        from .jax_manager import JaxCheckpointManager

        return JaxCheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The training loop's checkpoints: :class:`CheckpointManager` (steps, async save, retention, resume).

``index`` (the committed steps, ``root/manager.json``), ``retention`` (what is
kept), ``staging`` (host copies for async saves), ``committer`` (the designated
rank's background commit), ``manager`` (the user-facing class).
"""

from .index import INDEX_KEY, Index, StepRecord, read_index, step_dir
from .manager import CheckpointManager
from .retention import Retention

__all__ = ["INDEX_KEY", "CheckpointManager", "Index", "Retention", "StepRecord", "read_index", "step_dir"]

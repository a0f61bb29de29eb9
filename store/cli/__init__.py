"""The ``reshard`` command: ``app`` parses (``main``), ``commands`` reads (inspect, show, diff,
verify), ``write`` writes (redivide, export, demo), ``demo`` is the main job."""

from .app import main

__all__ = ["main"]

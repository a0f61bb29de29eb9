"""Pure layout math: meshes, per-dim splits, rank -> region, replicas, read plans.

No I/O and no framework imports. The public names::

    from reshard.layouts import Layout, Block, Piece, plan, intersect
    from reshard.layouts import parse_strategy, dump_strategy, strategy_layouts
"""

from .core import Layout, all_ranks
from .errors import (
    FormatError,
    LayoutError,
    RankError,
    ReshardError,
    ShapeMismatchError,
    UnsupportedError,
)
from .plan import plan
from .records import Block, Piece, intersect
from .strategy import OPTIMIZER_PREFIXES, dump_strategy, layout_for, parse_strategy, strategy_layouts

__all__ = [
    "OPTIMIZER_PREFIXES",
    "Block",
    "FormatError",
    "Layout",
    "LayoutError",
    "Piece",
    "RankError",
    "ReshardError",
    "ShapeMismatchError",
    "UnsupportedError",
    "all_ranks",
    "dump_strategy",
    "intersect",
    "layout_for",
    "parse_strategy",
    "plan",
    "strategy_layouts",
]

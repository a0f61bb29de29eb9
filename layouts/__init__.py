"""Pure layout math: meshes, per-dim splits, rank -> region, replicas, read plans.

No I/O and no framework imports. The public names::

    from reshard.layouts import Layout, Block, Piece, plan, intersect
    from reshard.layouts import FlatLayout, FlatBuffer, range_boxes      # flattened ranges
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
from .flat import FlatLayout, range_boxes
from .flatbuf import FlatBuffer, FlatPart
from .plan import plan
from .records import Block, Piece, intersect
from .strategy import OPTIMIZER_PREFIXES, dump_strategy, layout_for, parse_strategy, strategy_layouts

__all__ = [
    "OPTIMIZER_PREFIXES",
    "Block",
    "FlatBuffer",
    "FlatLayout",
    "FlatPart",
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
    "range_boxes",
    "strategy_layouts",
]

"""Where a local checkpoint's files are, for tests that look at or damage them."""

from __future__ import annotations

from pathlib import Path

import reshard.store as rs


def zarr_root(url: str | Path) -> Path:
    """The folder of the committed save's zarr hierarchy (``url/gen-<save_id>``)."""
    return Path(rs.open(str(url)).zarr_url)

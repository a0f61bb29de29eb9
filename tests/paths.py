"""Where a local checkpoint's files are, for tests that look at or damage them."""

from __future__ import annotations

import json
from pathlib import Path

import reshard.store as rs


def zarr_root(url: str | Path) -> Path:
    """The folder of the committed save (``url/gen-<save_id>``), in either storage form."""
    return Path(rs.open(str(url)).storage.url)


def shard_keys(url: str | Path) -> list[str]:
    """The shard keys (``model/w/c/0/1``) the committed save stored, in either storage form."""
    root = zarr_root(url)
    refs = root / "refs.json"
    if refs.exists():  # packed: the references name every key
        return sorted(k for k in json.loads(refs.read_text())["refs"] if "/c/" in f"/{k}")
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and "/c/" in f"/{p.relative_to(root).as_posix()}")

"""What :func:`~.verify.verify` reports: the kinds of damage, one :class:`Damage` each, and the
:class:`VerifyReport` that gathers them (a module of its own so that the checks in :mod:`.verify`,
:mod:`.verify_data` and :mod:`.verify_parquet` share it without importing one another)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Every kind of damage :func:`verify` reports (docs/cli.md describes each).
KINDS = {
    "marker": "the commit marker .reshard/commit.json is unreadable or malformed",
    "uncommitted": "no commit marker: the save was never committed (ranks missing, or commit not called)",
    "metadata": "the root zarr.json (consolidated metadata) is missing, malformed, or does not match the marker",
    "array-json": "an array's zarr.json is missing, malformed, or differs from the consolidated metadata",
    "group-json": "a group's zarr.json is missing, malformed, or differs from the consolidated metadata",
    "manifest": "a rank's manifest is missing, malformed, or disagrees with the committed metadata",
    "references": "packed form: refs.json or refs.parq (what zarr-python reads) is missing, does not match the "
                  "marker, or disagrees with the root zarr.json or with where the ranks' manifests say the shards are",
    "shard": "a shard object is missing, truncated, or its index is damaged",
    "checksum": "a chunk's bytes fail their crc32c",
    "replaced": "the checkpoint was committed anew while it was verified",
}

@dataclass(frozen=True)
class Damage:
    """One problem: its ``kind`` (a key of :data:`KINDS`), where (a file or tensor) and the message."""

    kind: str
    where: str
    message: str


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` is true when nothing is damaged."""

    url: str
    committed: bool = False
    tensors: int = 0
    bytes_checked: int = 0
    chunks_checked: int = 0
    files_checked: int = 0
    without_checksums: list[str] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def problems(self) -> list[str]:
        """One line per damage."""
        return [d.message for d in self.damage]

    def kinds(self) -> set[str]:
        return {d.kind for d in self.damage}

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ok=self.ok, problems=self.problems)
        return out

    def add(self, kind: str, where: str, error: BaseException | str) -> None:
        text = " ".join(str(error).split())
        self.damage.append(Damage(kind, where, text if where in text else f"{where}: {text}"))

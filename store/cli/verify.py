"""``reshard verify URL``: every metadata document, every shard, every chunk.

The checks are in :mod:`reshard.store.ops.verify`.
"""

from __future__ import annotations

import argparse

from ..read.display import human_bytes
from .commands import emit, storage_options


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when sound, 1 on any damage; each line names its kind and the file or tensor."""
    from ..ops.verify import verify

    try:
        opts = storage_options(args.storage_option)
    except ValueError as e:
        args.parser.error(str(e))
    report = verify(args.url, storage_options=opts)
    if report.damage:
        lines = [f"FAILED: {report.url}: {len(report.damage)} problem(s)"]
        lines += [f"  [{d.kind}] {d.message}" for d in report.damage]
        text = "\n".join(lines)
    else:
        unchecked = report.without_checksums
        text = (f"VERIFIED: {report.url}: committed, {report.tensors} tensors, {human_bytes(report.bytes_checked)}, "
                f"{report.chunks_checked} chunks read and crc32c-checked, {report.files_checked} metadata files "
                f"checked in {report.seconds:.2f} s"
                + (f"; {len(unchecked)} tensors stored without checksums" if unchecked else ""))
    emit(args, report.as_dict(), text)
    return 0 if report.ok else 1

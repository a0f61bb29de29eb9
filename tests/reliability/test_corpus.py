"""Issue 35 item 5: a hostile corpus for every parser added since test_hostile.py was written.

Each case copies a real valid sample of one parser (:data:`corpus.PARSERS`: parquet
references, third-form trailers, summary records, DCP ``.metadata``, Megatron
``.metadata``/``common.pt`` and flat ranges, DeepSpeed flat ranges, MindSpore ``.ckpt``
and strategy files, OneFlow ``pickled_data``, safetensors headers, Hugging Face index
files), edits it as an attacker would (truncations, bit flips, sizes and counts of
2**40, negative and overlapping offsets, wrong types, deep nesting, names escaping
the root, a pickle calling ``os.system``; digests recomputed where the format records
them), and runs the parser's reader in a child under a 1 GiB ``RLIMIT_AS`` and a
timeout (:func:`corpus.run`). Every outcome must be the sample's exact data, or a
``ReshardError`` (or, for ``verify``, reported damage) whose message names the file:
never a crash (MemoryError, a raw KeyError, UnpicklingError or struct.error), a hang,
other data, or the pickle's command run. The peak RSS of each case and the maximum per
parser are printed and recorded (``RESHARD_RELIABILITY_REPORT``). A few cases per parser
run by default; all of them with ``RESHARD_SOAK=1``.

"""

from __future__ import annotations

import io
import json
import pickle
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus import PARSERS, build, copy, run, safetensors_bytes
from harness import SOAK, Tally, generation, reseal

CASE_TIMEOUT = 120 if SOAK else 60
#: A command a hostile pickle runs if it is ever unpickled: it leaves this file in the case's folder.
CANARY = "OWNED"


# ------------------------------------------------------------------ edits
def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip(path: Path, at: float | int, bit: int = 0) -> None:
    """Flip one bit of the byte at ``at`` (a fraction of the length, or an offset; negative from the end)."""
    data = bytearray(path.read_bytes())
    i = int(len(data) * at) if isinstance(at, float) else at
    data[i] ^= 1 << bit
    path.write_bytes(bytes(data))


def sparse(path: Path, size: int = 8 << 30) -> None:
    """Replace ``path`` with a sparse file of ``size`` zero bytes (no disk used)."""
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(size)


def evil_pickle(case: Path) -> bytes:
    """A pickle that runs ``touch <case>/OWNED`` when unpickled (protocol 0: GLOBAL os.system, REDUCE)."""
    return f"cos\nsystem\n(S'touch {case / CANARY}'\ntR.".encode()


def deep_pickle(depth: int = 200_000) -> bytes:
    """A pickle of lists nested ``depth`` deep (EMPTY_LIST, then APPENDs)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def deep_json(depth: int = 200_000) -> bytes:
    return b"[" * depth + b"]" * depth


def evil_pt(path: Path, case: Path) -> None:
    """A ``torch.save`` archive whose pickle calls ``os.system`` (as a real attacker would write one)."""
    import torch

    from tests.test_deepspeed import PICKLE, stub

    torch.save({"optimizer_state_dict": {"x": stub("os.system", (f"touch {case / CANARY}",))}}, path,
               pickle_module=PICKLE)


class _FakeModules(pickle.Unpickler):
    """The test's own reader of a sample's pickle: classes of modules not installed (megatron) become plain
    classes registered under their own module name, so that the edited object pickles as the original did."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("megatron."):
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
            if not hasattr(sys.modules[module], name):
                setattr(sys.modules[module], name, type(name, (), {"__module__": module}))
            return getattr(sys.modules[module], name)
        return super().find_class(module, name)


def repickle(path: Path, change: Callable[[Any], None]) -> None:
    """Edit a sample's pickled metadata: unpickle it (the test's own trusted sample), ``change`` it, pickle it."""
    md = _FakeModules(io.BytesIO(path.read_bytes())).load()
    change(md)
    path.write_bytes(pickle.dumps(md))


def edit_json(path: Path, change: Callable[[Any], None]) -> None:
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_bytes(json.dumps(doc).encode())


# ------------------------------------------------------------------ DCP and Megatron metadata
def _storage(md: Any, fqn: str) -> Any:
    return next(i for i in md.storage_data if i.fqn == fqn)


def _set_storage(fqn: str, **fields: Any) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        index = _storage(md, fqn)
        for k, v in fields.items():
            setattr(md.storage_data[index], k, v)
    return change


def _chunk_of(md: Any, fqn: str, i: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md.state_dict_metadata[fqn].chunks[i] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _dcp_huge(md: Any) -> None:
    import torch

    item = md.state_dict_metadata["model.w"]
    item.size = torch.Size([2**40, 2**40])
    _chunk_of(md, "model.w", 0, (0, 0), (2**40, 2**40))


FLAT = "optimizer.state.exp_avg.embedding.word_embeddings.weight"  # Megatron: blocks of 36, ranges 17 + 19


def _flat(i: int, start: int, n: int) -> Callable[[Any], None]:
    """Megatron flat range ``i`` of :data:`FLAT` (block 0: ranges 0 and 2) made ``[start, start + n)``."""
    return lambda md: _chunk_of(md, FLAT, i, (*tuple(md.state_dict_metadata[FLAT].chunks[i].offsets)[:2], start),
                                (1, 1, n))


def _orig_shape(md: Any) -> None:
    md.mcore_data[FLAT]["nd_reformulated_orig_global_shape"] = (2**20, 2**20)


def _bucket(md: Any) -> tuple[str, Any]:
    key = next(k for k, v in md.state_dict_metadata.items() if k.startswith("optimizer.distributed.")
               and k.endswith(".param") and hasattr(v, "chunks"))
    return key, md.state_dict_metadata[key]


def _bucket_overlap(md: Any) -> None:
    key, item = _bucket(md)
    c = item.chunks[1]
    _chunk_of(md, key, 1, (int(c.offsets[0]) - 4,), (int(c.sizes[0]),))


# ------------------------------------------------------------------ DeepSpeed
def _optim(case: Path, rank: int = 0) -> Path:
    return case / "s" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _torch_edit(path: Path, change: Callable[[Any], None]) -> None:
    """Edit a sample ``.pt`` (the test's own, loaded with its DeepSpeed stand-ins) and save it the same way."""
    import torch
    from reshard.store.frontends.torch.pt_files import load_pt

    from tests.test_deepspeed import PICKLE

    obj = load_pt(str(path))  # memory-mapped: written anew beside it, then renamed over it
    change(obj)
    torch.save(_unstub(obj), path.with_suffix(".new"), pickle_module=PICKLE)
    path.with_suffix(".new").replace(path)


def _unstub(value: Any) -> Any:
    """reshard's inert stand-ins back to the test's foreign objects (which pickle under DeepSpeed's names)."""
    from reshard.store.frontends.torch.pt_files import Stub

    from tests.test_deepspeed import stub

    if isinstance(value, Stub):
        return stub(value.qualname, tuple(_unstub(a) for a in value.args), _unstub(value.state))
    if isinstance(value, dict):
        return {k: _unstub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unstub(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_unstub(v) for v in value)
    return value


def _every_optim(case: Path, change: Callable[[Any], None]) -> None:
    for rank in (0, 1):
        _torch_edit(_optim(case, rank), change)


def _paddings(value: int) -> Callable[[Any], None]:
    def change(o: Any) -> None:
        o["optimizer_state_dict"]["param_alignment_paddings"][0][0] = value
    return change


def _mapping_numel(o: Any) -> None:
    mapping = o["optimizer_state_dict"]["param_slice_mappings"][0]
    first = next(iter(mapping.values()))
    first.state["numel"] += 3


def _short_partition(o: Any) -> None:
    groups = o["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    groups[0] = groups[0][:-5]


def _huge_shape(case: Path) -> None:
    import torch

    def change(model: Any) -> None:
        model["param_shapes"][0]["embed.weight"] = torch.Size([2**40, 12])
    _torch_edit(case / "s" / "mp_rank_00_model_states.pt", change)


# ------------------------------------------------------------------ MindSpore, OneFlow, safetensors
def _ckpt(case: Path, rank: int = 0) -> Path:
    return case / "ranks" / f"rank_{rank}" / "net.ckpt"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _ms_huge_length(case: Path) -> None:
    """The first value's length-delimited field (tag 1, wire type 2) made to claim 2**40 bytes."""
    path = _ckpt(case)
    data = path.read_bytes()
    assert data[0] == 0x0A  # field 1, length-delimited: the first Value
    n = 1
    while data[n] & 0x80:
        n += 1
    path.write_bytes(data[:1] + _varint(2**40) + data[n + 1:])


def _strategy_json(change: Callable[[Any], None]) -> Callable[[Path], None]:
    return lambda case: edit_json(case / "strategy.json", change)


def _first_entry(doc: Any) -> Any:
    """The first parameter's layout in a strategy JSON (``parallel_layout_item``: ``{name: {dev_matrix, ...}}``)."""
    return doc["parallel_layout_item"]["w1"]


def _of_meta(case: Path, text: str, out: bytes | None = None) -> None:
    """The first tensor folder's ``meta`` replaced by ``text`` (and its ``out`` by ``out``)."""
    folder = next(p for p in sorted(case.iterdir()) if p.is_dir())
    (folder / "meta").write_text(text)
    if out is not None:
        (folder / "out").write_bytes(out)


def _of_tensor_path(name: str) -> Callable[[Path], None]:
    """``pickled_data`` with its first tensor folder name replaced by ``name`` (same length or not)."""
    def edit(case: Path) -> None:
        data = (case / "pickled_data").read_bytes()
        first = next(p.name for p in sorted(case.iterdir()) if p.is_dir()).encode()
        old = bytes([0x8C, len(first)]) + first  # SHORT_BINUNICODE
        assert old in data
        (case / "pickled_data").write_bytes(data.replace(old, bytes([0x8C, len(name)]) + name.encode(), 1))
    return edit


def _of_deep_data(case: Path, depth: int = 100_000) -> None:
    """A valid flow.save header whose ``data`` dict holds lists nested ``depth`` deep."""
    def text(s: str) -> bytes:
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    deep = b"]" * depth + b"a" * (depth - 1)
    (case / "pickled_data").write_bytes(b"\x80\x02}(" + text("protocol_version") + b"K\x01" + text("data")
                                        + b"}(" + text("a") + deep + b"uu.")


def _of_bytes8(case: Path) -> None:
    """A BINBYTES8 claiming 2**40 bytes right after the protocol header."""
    data = (case / "pickled_data").read_bytes()
    (case / "pickled_data").write_bytes(data[:2] + b"\x8e" + (2**40).to_bytes(8, "little") + data[2:])


def _st_header(header: dict[str, Any]) -> Callable[[Path], None]:
    from corpus import hf_tensors

    return lambda case: (case / "model.safetensors").write_bytes(safetensors_bytes(hf_tensors(), header))


def _st_length(case: Path) -> None:
    path = case / "model.safetensors"
    path.write_bytes((2**40).to_bytes(8, "little") + path.read_bytes()[8:])


INDEX = "model.safetensors.index.json"


def _index(change: Callable[[Any], None]) -> Callable[[Path], None]:
    return lambda case: edit_json(case / INDEX, change)


def _weight_map(name: str) -> Callable[[Any], None]:
    return lambda doc: doc["weight_map"].update({"embed.weight": name})


# ------------------------------------------------------------------ reshard's own: trailers, summary, parquet
def _trailer_part(case: Path, rank: int = 1) -> Path:
    return case / "gen-0" / "packed" / f"{rank}.bin"


def _footer(field: int, value: int) -> Callable[[Path], None]:
    """A third-form footer's length ``field`` (0 records, 1 table, 2 manifest) set to ``value``."""
    def edit(case: Path) -> None:
        path = _trailer_part(case)
        data = bytearray(path.read_bytes())
        at = len(data) - 32 + 8 * field
        data[at : at + 8] = value.to_bytes(8, "little", signed=False)
        path.write_bytes(bytes(data))
    return edit


def _table_column(column: str, change: Callable[[np.ndarray], None]) -> Callable[[Path], None]:
    """Rewrite one column of a rank's shard table, then its ``table_sha256`` and the manifest's own digest
    (an attacker who can write the object)."""
    def edit(case: Path) -> None:
        import base64
        import hashlib

        from reshard.store.format.schema import with_digest
        from reshard.store.format.table import trailer_parts

        path = _trailer_part(case)
        raw = path.read_bytes()
        footer, n_records, n_table, n_manifest = trailer_parts(str(path), raw)
        end = len(raw) - footer
        table = json.loads(raw[end - n_manifest - n_table : end - n_manifest])
        manifest = json.loads(raw[end - n_manifest : end])
        values = np.frombuffer(base64.b64decode(table[column]), "<i8" if column in ("index", "offset", "length")
                               else "<i4").copy()
        change(values)
        table[column] = base64.b64encode(values.tobytes()).decode()
        new_table = json.dumps(table, separators=(",", ":")).encode()
        manifest.pop("sha256", None)
        manifest["table_sha256"] = hashlib.sha256(new_table).hexdigest()
        new_manifest = with_digest(manifest)
        head = raw[: end - n_manifest - n_table]
        path.write_bytes(head + new_table + new_manifest + n_records.to_bytes(8, "little")
                         + len(new_table).to_bytes(8, "little") + len(new_manifest).to_bytes(8, "little")
                         + raw[-8:])
    return edit


def _summary(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Edit the root document's summary (``attributes.reshard``), then re-seal the marker."""
    def edit(case: Path) -> None:
        gen, _ = generation(case)
        path = Path(gen.root) / "zarr.json"
        doc = json.loads(path.read_bytes())
        change(doc["attributes"]["reshard"])
        path.write_bytes(json.dumps(doc).encode())  # key order kept: the summary prefix stays first
        reseal(case)
    return edit


def _parquet(case: Path) -> Path:
    return case / "gen-0" / "refs.parq" / "all" / "t3" / "refs.0.parq"


def _parquet_rows(change: Callable[[dict[str, list[Any]], int], None]) -> Callable[[Path], None]:
    """Rewrite ``all/t3``'s parquet rows, then re-seal the marker's ``parquet_sha256`` (tests/test_parquet_refs)."""
    def edit(case: Path) -> None:
        from tests.test_parquet_refs import _edit_parquet

        _edit_parquet(case, change)
    return edit


def _parquet_resealed(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    """``edit`` a file of refs.parq, then re-seal the marker's ``parquet_sha256``."""
    def both(case: Path) -> None:
        from tests.test_parquet_refs import _reseal_parquet

        edit(case)
        _reseal_parquet(case)
    return both


def _raw_column(case: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(_parquet(case))
    table = table.set_column(3, "raw", pa.array([b"\x00" * 72] * table.num_rows, pa.binary()))
    pq.write_table(table, _parquet(case))


# ------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """One hostile edit of a parser's sample. ``names``: what the error must name (default: ``target``'s
    file name); ``ci``: run by default (else with RESHARD_SOAK=1 only)."""

    parser: str
    edit: Callable[[Path], None]
    target: str
    ci: bool = False
    names: str | None = None



CASES: dict[str, Case] = {
    # parquet references, read by verify (reshard's own reads never use them)
    "parquet-truncated": Case("parquet references", lambda c: truncate(_parquet(c)), "refs.0.parq", ci=True),
    "parquet-bit-flip": Case("parquet references", lambda c: flip(_parquet(c), 0.5), "refs.0.parq"),
    "parquet-rows-swapped-resealed": Case("parquet references", _parquet_rows(
        lambda rows, size: [col.insert(0, col.pop(1)) for col in rows.values()]), "refs.0.parq", ci=True),
    "parquet-offset-2**40-resealed": Case("parquet references", _parquet_rows(
        lambda rows, size: rows["offset"].__setitem__(0, 2**40)), "refs.0.parq"),
    "parquet-object-../x-resealed": Case("parquet references", _parquet_rows(
        lambda rows, size: rows["path"].__setitem__(0, "../outside/packed/0.bin")), "refs.0.parq", ci=True),
    "parquet-inline-bytes-resealed": Case("parquet references", _parquet_resealed(_raw_column), "refs.0.parq"),
    "parquet-zmetadata-deep-resealed": Case("parquet references", _parquet_resealed(
        lambda c: (c / "gen-0" / "refs.parq" / ".zmetadata").write_bytes(deep_json())), ".zmetadata", ci=True),
    "parquet-sparse-8GiB": Case("parquet references", lambda c: sparse(_parquet(c)), "refs.0.parq"),
    # the third trailer form, merged by a commit
    "trailer-table-length-2**40": Case("third trailer form", _footer(1, 2**40), "1.bin", ci=True),
    "trailer-manifest-length-2**64-1": Case("third trailer form", _footer(2, 2**64 - 1), "1.bin"),
    "trailer-truncated": Case("third trailer form", lambda c: truncate(_trailer_part(c), 0.7), "1.bin", ci=True),
    "trailer-table-bit-flip": Case("third trailer form", lambda c: flip(_trailer_part(c), -200), "1.bin"),
    "trailer-offset-past-object-resealed": Case("third trailer form", _table_column(
        "offset", lambda v: v.__setitem__(0, 2**40)), "1.bin", ci=True),
    "trailer-offset-negative-resealed": Case("third trailer form", _table_column(
        "offset", lambda v: v.__setitem__(0, -64)), "1.bin"),
    "trailer-index-2**40-resealed": Case("third trailer form", _table_column(
        "index", lambda v: v.__setitem__(0, 2**40)), "1.bin"),
    "trailer-shards-swapped-resealed": Case("third trailer form", _table_column(
        "offset", lambda v: v.__setitem__(slice(0, 2), v[1::-1])), "1.bin", ci=True),
    # the root document's summary records
    "summary-record_of-2**40": Case("summary records", _summary(
        lambda a: a["record_of"].__setitem__(0, 2**40)), "zarr.json", ci=True),
    "summary-record_of-negative": Case("summary records", _summary(
        lambda a: a["record_of"].__setitem__(0, -1)), "zarr.json"),
    "summary-record_of-wrong-type": Case("summary records", _summary(
        lambda a: a.__setitem__("record_of", {"0": "x"})), "zarr.json"),
    "summary-record-shape-2**40": Case("summary records", _summary(
        lambda a: a["records"][0].__setitem__("shape", [2**40, 2**40])), "zarr.json", ci=True),
    "summary-records-deep": Case("summary records", _summary(
        lambda a: a["records"].__setitem__(0, json.loads(deep_json(900)))), "zarr.json"),
    "summary-shape-2**40": Case("summary records", _summary(
        lambda a: a["arrays"]["layer0.w"].__setitem__(0, [2**40, 4])), "zarr.json"),
    # DCP .metadata
    "dcp-truncated": Case("DCP .metadata", lambda c: truncate(c / ".metadata"), ".metadata", ci=True),
    "dcp-bit-flip": Case("DCP .metadata", lambda c: flip(c / ".metadata", 2, 3), ".metadata"),
    "dcp-os.system": Case("DCP .metadata", lambda c: (c / ".metadata").write_bytes(evil_pickle(c)), ".metadata",
                          ci=True),
    "dcp-deep-nesting": Case("DCP .metadata", lambda c: (c / ".metadata").write_bytes(deep_pickle()), ".metadata"),
    "dcp-wrong-type": Case("DCP .metadata", lambda c: (c / ".metadata").write_bytes(pickle.dumps([1, 2])),
                           ".metadata"),
    "dcp-length-2**40": Case("DCP .metadata", lambda c: repickle(c / ".metadata", _set_storage(
        "model.w", length=2**40)), ".distcp", ci=True),
    "dcp-offset-negative": Case("DCP .metadata", lambda c: repickle(c / ".metadata", _set_storage(
        "model.w", offset=-64)), ".metadata"),
    "dcp-path-../x": Case("DCP .metadata", lambda c: repickle(c / ".metadata", _set_storage(
        "model.w", relative_path="../outside/packed/secret.distcp")), ".metadata", ci=True),
    "dcp-storage-missing": Case("DCP .metadata", lambda c: repickle(c / ".metadata", lambda md: md.storage_data.pop(
        _storage(md, "model.b"))), ".metadata"),
    "dcp-size-2**80": Case("DCP .metadata", lambda c: repickle(c / ".metadata", _dcp_huge), ".metadata"),
    "dcp-chunk-past-tensor": Case("DCP .metadata", lambda c: repickle(c / ".metadata", lambda md: _chunk_of(
        md, "model.w", 0, (2, 0), (6, 4))), ".metadata"),
    # Megatron .metadata, common.pt, flat ranges
    "megatron-metadata-truncated": Case("Megatron .metadata, common.pt", lambda c: truncate(c / ".metadata"),
                                        ".metadata", ci=True),
    "megatron-common-os.system": Case("Megatron .metadata, common.pt", lambda c: evil_pt(c / "common.pt", c),
                                      "common.pt", ci=True),
    "megatron-common-truncated": Case("Megatron .metadata, common.pt", lambda c: truncate(c / "common.pt"),
                                      "common.pt"),
    "megatron-length-2**40": Case("Megatron .metadata, common.pt", lambda c: repickle(c / ".metadata", _set_storage(
        FLAT, length=2**40)), ".distcp"),
    "megatron-flat-overlap": Case("Megatron flat ranges", lambda c: repickle(c / ".metadata", _flat(2, 16, 19)),
                                  ".metadata", ci=True),
    "megatron-flat-hole": Case("Megatron flat ranges", lambda c: repickle(c / ".metadata", _flat(2, 18, 18)),
                               ".metadata"),
    "megatron-flat-past-block": Case("Megatron flat ranges", lambda c: repickle(c / ".metadata", _flat(2, 17, 40)),
                                     ".metadata"),
    "megatron-flat-numel": Case("Megatron flat ranges", lambda c: repickle(c / ".metadata", _flat(0, 0, 16)),
                                ".metadata", ci=True),
    "megatron-flat-shape-2**40": Case("Megatron flat ranges", lambda c: repickle(c / ".metadata", _orig_shape),
                                      ".metadata"),
    "megatron-bucket-overlap": Case("Megatron buckets", lambda c: repickle(c / ".metadata", _bucket_overlap),
                                    ".metadata", ci=True),
    # DeepSpeed flat ranges (.pt files)
    "deepspeed-overlap": Case("DeepSpeed flat ranges", lambda c: _every_optim(c, _paddings(-5)), "optim_states.pt",
                              ci=True, names="s"),
    "deepspeed-padding-2**40": Case("DeepSpeed flat ranges", lambda c: _every_optim(c, _paddings(2**40)),
                                    "optim_states.pt", names="s"),
    "deepspeed-hole": Case("DeepSpeed flat ranges", lambda c: _torch_edit(_optim(c), _short_partition),
                           "optim_states.pt", ci=True, names="s"),
    "deepspeed-numel": Case("DeepSpeed flat ranges", lambda c: _torch_edit(_optim(c), _mapping_numel),
                            "optim_states.pt", names="s"),
    "deepspeed-shape-2**40": Case("DeepSpeed flat ranges", _huge_shape, "model_states.pt", ci=True, names="s"),
    "deepspeed-os.system": Case("DeepSpeed flat ranges", lambda c: evil_pt(_optim(c, 1), c),
                                "zero_pp_rank_1_mp_rank_00_optim_states.pt", ci=True),
    "deepspeed-truncated": Case("DeepSpeed flat ranges", lambda c: truncate(c / "s" / "mp_rank_00_model_states.pt"),
                                "mp_rank_00_model_states.pt"),
    # MindSpore .ckpt and strategy files
    "mindspore-ckpt-truncated": Case("MindSpore .ckpt", lambda c: truncate(_ckpt(c)), "net.ckpt", ci=True),
    "mindspore-ckpt-length-2**40": Case("MindSpore .ckpt", _ms_huge_length, "net.ckpt", ci=True),
    "mindspore-ckpt-bit-flip": Case("MindSpore .ckpt", lambda c: flip(_ckpt(c), 1, 6), "net.ckpt"),
    "mindspore-strategy-truncated": Case("MindSpore strategy (protobuf)", lambda c: truncate(
        c / "strategy.ckpt", 0.6), "strategy.ckpt", ci=True),
    "mindspore-strategy-bit-flip": Case("MindSpore strategy (protobuf)", lambda c: flip(
        c / "strategy.ckpt", 1, 7), "strategy.ckpt"),
    "mindspore-strategy-json-deep": Case("MindSpore strategy (JSON)", lambda c: (c / "strategy.json").write_bytes(
        deep_json()), "strategy.json", ci=True),
    "mindspore-strategy-json-wrong-type": Case("MindSpore strategy (JSON)", _strategy_json(
        lambda d: _first_entry(d).__setitem__("dev_matrix", "x")), "strategy.json"),
    "mindspore-strategy-json-2**40": Case("MindSpore strategy (JSON)", _strategy_json(
        lambda d: _first_entry(d).__setitem__("dev_matrix", [2**40, 2**40])), "strategy.json", ci=True),
    # OneFlow pickled_data and tensor folders
    "oneflow-truncated": Case("OneFlow pickled_data", lambda c: truncate(c / "pickled_data"), "pickled_data",
                              ci=True),
    "oneflow-bit-flip": Case("OneFlow pickled_data", lambda c: flip(c / "pickled_data", 2, 3), "pickled_data"),
    "oneflow-os.system": Case("OneFlow pickled_data", lambda c: (c / "pickled_data").write_bytes(evil_pickle(c)),
                              "pickled_data", ci=True),
    "oneflow-deep-nesting": Case("OneFlow pickled_data", lambda c: (c / "pickled_data").write_bytes(deep_pickle()),
                                 "pickled_data", ci=True),
    "oneflow-bytes-2**40": Case("OneFlow pickled_data", _of_bytes8, "pickled_data"),
    "oneflow-tensor-..": Case("OneFlow pickled_data", _of_tensor_path(".."), "pickled_data", ci=True),
    "oneflow-tensor-../x": Case("OneFlow pickled_data", _of_tensor_path("../local"), "pickled_data"),
    "oneflow-sparse-8GiB": Case("OneFlow pickled_data", lambda c: sparse(c / "pickled_data"), "pickled_data"),
    "oneflow-meta-2**64-elements": Case("OneFlow pickled_data", lambda c: _of_meta(
        c, "shape { dim: 4294967296 dim: 4294967296 } data_type: kFloat", b""), "meta", ci=True, names="tensor_"),
    "oneflow-meta-negative": Case("OneFlow pickled_data", lambda c: _of_meta(
        c, "shape { dim: -5 dim: 4 } data_type: kFloat"), "meta", names="tensor_"),
    "oneflow-deep-in-data": Case("OneFlow pickled_data", _of_deep_data, "pickled_data"),
    # safetensors headers
    "safetensors-header-length-2**40": Case("safetensors header", _st_length, "model.safetensors", ci=True),
    "safetensors-truncated": Case("safetensors header", lambda c: truncate(c / "model.safetensors", 0.9),
                                  "model.safetensors"),
    "safetensors-overlap": Case("safetensors header", _st_header(
        {"layers.0.step": {"dtype": "I64", "shape": [3], "data_offsets": [0, 24]}}), "model.safetensors", ci=True),
    "safetensors-shape-2**40": Case("safetensors header", _st_header(
        {"layers.0.step": {"dtype": "I64", "shape": [2**40, 2**40], "data_offsets": [0, 24]}}), "model.safetensors"),
    "safetensors-offsets-negative": Case("safetensors header", _st_header(
        {"layers.0.step": {"dtype": "I64", "shape": [3], "data_offsets": [-24, 0]}}), "model.safetensors"),
    "safetensors-dtype-wrong-type": Case("safetensors header", _st_header(
        {"layers.0.step": {"dtype": ["I64"], "shape": [3], "data_offsets": [96, 120]}}), "model.safetensors",
        ci=True),
    "safetensors-deep-nesting": Case("safetensors header", lambda c: (c / "model.safetensors").write_bytes(
        len(deep_json(50_000)).to_bytes(8, "little") + deep_json(50_000)), "model.safetensors"),
    # Hugging Face index files
    "hf-index-../x": Case("Hugging Face index", _index(_weight_map("../outside/model.safetensors")), INDEX,
                          ci=True),
    "hf-index-absolute": Case("Hugging Face index", _index(_weight_map("/etc/passwd")), INDEX),
    "hf-index-missing-file": Case("Hugging Face index", _index(_weight_map("model-00009-of-00009.safetensors")),
                                  INDEX, ci=True),
    "hf-index-wrong-file": Case("Hugging Face index", _index(_weight_map("model-00002-of-00002.safetensors")),
                                INDEX),
    "hf-index-wrong-type": Case("Hugging Face index", _index(lambda d: d.__setitem__("weight_map", [1, 2])),
                                INDEX),
    "hf-index-deep-nesting": Case("Hugging Face index", lambda c: (c / INDEX).write_bytes(deep_json()), INDEX,
                                  ci=True),
    "hf-index-sparse-8GiB": Case("Hugging Face index", lambda c: sparse(c / INDEX), INDEX, ci=True),
}


# ------------------------------------------------------------------ running and judging
#: The sample's own outcome per parser (its digest), and the figures of every case run.
PRISTINE: dict[str, dict[str, Any]] = {}
FIGURES: dict[str, list[tuple[str, str, int, int]]] = {}


def _run(parser: str, case: Path, tmp: Path) -> dict[str, Any]:
    work = tmp / "work"
    work.mkdir()
    return run(PARSERS[parser][1], case, work, CASE_TIMEOUT)


def pristine(parser: str, base: Path) -> dict[str, Any]:
    """The reader's outcome on an unedited copy of the sample (it must read; its digest is what exact means)."""
    if parser not in PRISTINE:
        tmp = base / f"pristine-{len(PRISTINE)}"
        tmp.mkdir()
        case = copy(build(parser, base / "samples"), tmp / "case")
        PRISTINE[parser] = _run(parser, case, tmp)
    return PRISTINE[parser]


def judge(spec: Case, got: dict[str, Any], want: dict[str, Any], case: Path) -> tuple[str, str]:
    """``(outcome, detail)``: ``exact``, ``refused``/``reported`` (naming the file), or a failure."""
    outcome, detail = got["outcome"], got.get("detail", "")
    if (case / CANARY).exists():
        return "code ran", f"the pickle's command ran ({case / CANARY} exists)"
    if outcome == "ok":
        if got["digest"] != want["digest"]:
            return "wrong data", "the reader returned other data than the sample's, without an error"
        if PARSERS[spec.parser][1] == "verify":  # what it checks is read by others (plain zarr): report it
            return "silent", "read exactly, but verify does not report the edit"
        return "exact", ""
    if outcome in ("refused", "reported"):
        names = f"{case}/{spec.names}" if spec.names else spec.target
        if names in detail and str(case) in detail:
            return outcome, detail
        return "unclear error", f"does not name {names!r} in {case}: {detail}"
    return outcome, detail


CI_CASES = sorted(n for n, c in CASES.items() if c.ci or SOAK)


@pytest.mark.parametrize("name", CI_CASES)
def test_a_hostile_file_is_refused_naming_it_or_read_exactly(tmp_path_factory: pytest.TempPathFactory,
                                                              tmp_path: Path, name: str) -> None:
    spec = CASES[name]
    base = tmp_path_factory.getbasetemp()
    want = pristine(spec.parser, base)
    assert want["outcome"] == "ok", f"{spec.parser}: the unedited sample does not read: {want}"
    case = copy(build(spec.parser, base / "samples"), tmp_path / "case")
    (tmp_path / "outside" / "packed").mkdir(parents=True)  # what the names escaping the root would reach
    for secret in ("packed/0.bin", "packed/secret.distcp", "model.safetensors"):
        (tmp_path / "outside" / secret).write_bytes(b"SECRET" * 100)
    spec.edit(case)
    got = _run(spec.parser, case, tmp_path)
    outcome, detail = judge(spec, got, want, case)
    grew = got["rss_kib"] - got.get("start_kib", got["rss_kib"])
    FIGURES.setdefault(spec.parser, []).append((name, outcome, got["rss_kib"], grew))
    print(f"\n{name:40s} {outcome:10s} peak RSS {got['rss_kib'] / 1024:7.1f} MiB (+{grew / 1024:.1f})  "
          f"{detail[:200]}")
    tally = Tally(f"corpus[{name}]")
    tally.add(outcome, kind=spec.parser, bad=None if outcome in ("exact", "refused", "reported")
              else f"{name}: {outcome}: {detail}")
    tally.check()


def test_every_parser_has_cases_in_the_default_run() -> None:
    """The corpus covers every parser, each with at least one case in the default run."""
    assert {c.parser for c in CASES.values()} == set(PARSERS)
    assert {c.parser for c in CASES.values() if c.ci} == set(PARSERS)


@pytest.fixture(scope="module", autouse=True)
def _report() -> Any:
    """Print the peak RSS per parser (the maximum over its cases) once the cases ran."""
    yield
    for parser, rows in sorted(FIGURES.items()):
        outcomes = Counter(o for _, o, _, _ in rows)
        print(f"\n{parser:32s} cases {len(rows):3d}  max peak RSS {max(r[2] for r in rows) / 1024:7.1f} MiB "
              f"(+{max(r[3] for r in rows) / 1024:.1f} over the child's start)  {dict(outcomes)}")
    if FIGURES:
        Tally("corpus[peak RSS KiB by parser]", counts=Counter(
            {p: max(r[2] for r in rows) for p, rows in FIGURES.items()})).record()

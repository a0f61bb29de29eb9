"""Byte flips and truncation in every kind of file: refused or exact, and ``verify`` reports it.

For each kind of file a committed checkpoint holds (shards, manifests, the
marker, the root ``zarr.json``, array and group ``zarr.json``), seeded random
injections flip one byte (xor a random non-zero value) or truncate the file.
After each: ``open`` + reading everything must give the saved data bit for bit
or raise a ReshardError (never other data, never another exception), and
``verify`` must report damage, unless the damaged JSON parses to the very same
document (a whitespace byte turned into another whitespace byte: nothing is
damaged). The file is restored before the next injection.
"""

from __future__ import annotations

import json

import reshard.store as rs
from harness import UNREAD_KINDS, Backend, Tally, attempt, kind_of, make_state, read_back, rng_for, same, save, trials
from reshard.store.ops.verify import verify


def _same_json(a: bytes, b: bytes) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def test_flips_and_truncation_in_every_kind_of_file(backend: Backend, form: str) -> None:
    rng = rng_for("corrupt", backend.name, form)
    tally = Tally(f"corrupt[{backend.name}-{form}]")
    state = make_state(rng)
    save(state, backend, form, "base")
    by_kind: dict[str, list[str]] = {}
    for key in backend.files():
        by_kind.setdefault(kind_of(key, backend), []).append(key)
    kinds = {"directory": {"marker", "head", "manifest", "root-json", "array-json", "group-json", "shard"},
             "packed": {"marker", "head", "references", "data-object"}}[form]
    assert kinds <= set(by_kind), by_kind
    # moto answers in tens of ms: an injection there (read everything, then verify) takes a second or more
    per_kind = trials(ci={"file": 6, "memory": 3}.get(backend.name, 1), soak=10 if backend.name == "s3" else 60)
    for kind, keys in sorted(by_kind.items()):
        if kind in UNREAD_KINDS:
            continue
        for i in range(per_kind):
            key = rng.choice(keys)
            original = backend.read(key)
            damaged = bytearray(original)
            if i % 3 == 2 or not original:  # a third of them truncate
                how = f"truncated to {(n := rng.randrange(len(original)) if original else 0)} bytes"
                damaged = damaged[:n]
            else:
                at = rng.randrange(len(original))
                damaged[at] ^= rng.randrange(1, 256)
                how = f"byte {at} flipped"
            backend.write(key, bytes(damaged))
            try:
                case = f"{kind} {key}: {how}"
                outcome, got = attempt(lambda: read_back(backend))
                if outcome == "crash":
                    tally.add("unclear error", kind, f"{case}: {type(got).__name__}: {got}")
                    continue
                if outcome == "ok" and not same(got, state):
                    tally.add("wrong data", kind, f"{case}: read other data without an error")
                    continue
                report = verify(backend.url, storage_options=backend.storage_options)
                harmless = kind != "shard" and _same_json(bytes(damaged), original)
                copy = kind == "head" and outcome == "ok"  # a copy checked by digest: harmless when the read was exact
                if not report.ok:
                    tally.add("detected", kind)
                elif harmless:
                    tally.add("harmless (same JSON)", kind)
                elif copy:
                    tally.add("harmless (a copy checked by digest)", kind)
                else:
                    tally.add("undetected", kind, f"{case}: verify says OK ({outcome} at read)")
                if outcome == "refused" and not any(s in str(got) for s in (backend.url, "tensor")):
                    tally.add("unnamed", kind, f"{case}: the error names no file or tensor: {got}")
            finally:
                backend.write(key, original)
        assert same(read_back(backend), state)  # restored
    assert rs.open(backend.url, storage_options=backend.storage_options)
    tally.check()

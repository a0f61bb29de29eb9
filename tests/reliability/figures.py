"""Sum a ``RESHARD_RELIABILITY_REPORT`` file into the tables of docs/reliability.md.

``python tests/reliability/figures.py report.jsonl`` prints markdown.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    kills: Counter[str] = Counter()
    corrupt: dict[str, Counter[str]] = defaultdict(Counter)
    fuzz: dict[str, Counter[str]] = defaultdict(Counter)
    flaky: Counter[str] = Counter()
    lifecycle: Counter[str] = Counter()
    failures = sum(len(r["failures"]) for r in rows)
    for r in rows:
        group = r["test"].split("[")[0]
        where = r["test"].split("[")[1].rstrip("]")
        if group == "kill":
            kills.update({f"{where}: {k}": v for k, v in r["counts"].items()})
        elif group == "corrupt":
            for kind, counts in r["by_kind"].items():
                corrupt[kind].update(counts)
        elif group == "fuzz":
            doc = where.split("-")[2:]  # backend, form, document..., mode
            fuzz["-".join(doc)].update(r["counts"])
        elif group.startswith("lifecycle"):
            lifecycle.update({f"{group}[{where}]: {k}": v for k, v in r["counts"].items()})
        else:
            flaky.update({f"{group}: {k}": v for k, v in r["counts"].items()})
    seeds = sorted({r["seed"] for r in rows})
    print(f"seed {', '.join(map(str, seeds))}; soak: {any(r['soak'] for r in rows)}; bad cases: {failures}\n")
    print("| kill -9 trials | count |\n|---|---|")
    for k, v in sorted(kills.items()):
        print(f"| {k} | {v} |")
    print("\n| file kind | injections | detected (refused or reported by verify) | harmless (same JSON) | "
          "undetected | wrong data |\n|---|---|---|---|---|---|")
    for kind, c in sorted(corrupt.items()):
        total = sum(c.values())
        print(f"| {kind} | {total} | {c['detected']} | {c['harmless (same JSON)']} | {c['undetected']} | "
              f"{c['wrong data'] + c['unclear error']} |")
    print("\n| document, mode | cases | refused (clear error) | read exactly | reported by verify | silent |\n"
          "|---|---|---|---|---|---|")
    for doc, c in sorted(fuzz.items()):
        total = sum(c.values())
        exact = c["correct"] + c["correct; verify reports it"]
        reported = c["caught by verify"] + c["correct; verify reports it"]
        print(f"| {doc} | {total} | {c['refused']} | {exact} | {reported} | {c['silent'] + c['unnamed']} |")
    print("\n| lifecycle (gc, retention, jobs) | count |\n|---|---|")
    for k, v in sorted(lifecycle.items()):
        print(f"| {k} | {v} |")
    print("\n| flaky S3 | count |\n|---|---|")
    for k, v in sorted(flaky.items()):
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main(sys.argv[1])

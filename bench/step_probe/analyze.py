"""Plain decode steps of two runs' engines set side by side at the same rows and longest context (buckets: rows
up to a power of two, contexts in 64-token bands), from `bench/step_probe/sitecustomize.py`'s files: run B's
steps over run A's median in the same bucket, by what the step followed (a plain step or a speculative round);
the proposer's share of B's plain steps. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def bucket(rows: int, context: int) -> tuple[int, int]:
    return 1 << max(0, rows - 1).bit_length(), context // 64 * 64


def runs(directory: str) -> list[list[list]]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).rglob("*.json"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--a", nargs="+", required=True, help="probe directories of the reference runs (e.g. (a))")
    p.add_argument("--b", nargs="+", required=True, help="probe directories of the runs compared (e.g. (b))")
    p.add_argument("--min-steps", type=int, default=5, help="steps a bucket needs in A to be a reference")
    args = p.parse_args()
    reference: dict[tuple[int, int], list[float]] = defaultdict(list)
    for steps in (s for d in args.a for s in runs(d)):
        for kind, rows, context, seconds, _ in steps:
            if kind == "plain":
                reference[bucket(rows, context)].append(seconds)
    medians = {k: statistics.median(v) for k, v in reference.items() if len(v) >= args.min_steps}
    ratios: dict[str, list[float]] = defaultdict(list)
    plain = observed = 0.0
    for steps in (s for d in args.b for s in runs(d)):
        previous = None
        for kind, rows, context, seconds, observe in steps:
            if kind == "plain":
                plain, observed = plain + seconds, observed + observe
                if bucket(rows, context) in medians:
                    after = "start" if previous is None else "plain" if previous == "plain" else "round"
                    ratios[after].append(seconds / medians[bucket(rows, context)])
            previous = kind
    out = {
        f"b_plain_after_{k}_over_a": {"median": round(statistics.median(v), 3), "steps": len(v)}
        for k, v in sorted(ratios.items())
    }
    out["b_proposer_share_of_plain"] = round(observed / plain, 4) if plain else None
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

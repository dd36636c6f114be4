"""A few seconds of this machine's speed, for `bench/plan_check.py --probes`: plain decode steps of the tiny
world's policy at 1, 16 and 64 rows, at 2 torch threads and at 1 (the thread counts the e2e runs give a process),
in a fresh process. A microbenchmark, not a run: `bench/e2e.py --probe-dir` makes one before each run and one
after the last (no service running), and `bench/plan_hold.sh` one before and one after each fit; the check then
scales each run's model by how much slower or faster the machine was beside that run than beside the fits
(the shared machine's speed drifts by tens of percent within an hour: docs/notes/h44h.md).

    python bench/plan_probe.py --out artifacts/plan/r13/probes/fit-t2-pre-before.json

Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ROWS = (1, 16, 64)
STEPS = 48


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="", help="what the probe stands beside (a run's key, a fit)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torch
    from plan_fit import RAGGED_SPREAD, engine_steps

    from tlt_stream.model import load_model

    world = Path(args.world)
    if not (world / "policy").is_dir():
        sys.exit(f"{world}: no policy; run `tlt-stream bootstrap --out {world}` first")
    policy = load_model(world / "policy")
    started = time.time()
    ms: dict[str, dict[str, float]] = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        ms[f"t{threads}"] = {
            str(rows): round(
                1e3
                * statistics.median(
                    engine_steps(policy, rows, skip=4, steps=STEPS, spread=RAGGED_SPREAD)[0]
                    for _ in range(args.repeats)
                ),
                4,
            )
            for rows in ROWS
        }
    result = {"bench": "plan_probe", "label": args.label, "at": started, "ms": ms}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

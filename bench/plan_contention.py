"""What other processes on the cores cost an engine step: plain decode steps of the tiny world's policy at 1 and
2 torch threads, alone and beside a process that wakes every millisecond for 0.2 ms (as the run's services and
Redis wake), wall clock, the fastest of 3 repeats. A microbenchmark for the planner's CPU model, which so far
counts only the worker's and learner's threads.

    flock /tmp/tlt-heavy.lock python bench/plan_contention.py --world artifacts/world
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

WAKER = (
    "import time\nwhile True:\n    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < {busy}: pass\n    time.sleep({idle})\n"
)


def step_ms(policy, threads: int, batch: int, steps: int = 30) -> float:
    import torch
    from plan_fit import prompts_of

    from tlt_stream.rollout.engine import GenerationEngine

    torch.set_num_threads(threads)
    engine = GenerationEngine(policy, batch, 600)
    for i, p in enumerate(prompts_of(batch)):
        engine.add_request(p, 400, 1.0, seed=i, eos_ids=())
    for _ in range(4):
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - started) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--busy", type=float, default=0.0002, help="seconds the waker computes each wake-up")
    p.add_argument("--idle", type=float, default=0.001, help="seconds it sleeps between wake-ups")
    args = p.parse_args()
    from tlt_stream.model import load_model

    policy = load_model(Path(args.world) / "policy")
    rows = []
    for waker in (False, True):
        code = WAKER.format(busy=args.busy, idle=args.idle)
        proc = subprocess.Popen([sys.executable, "-c", code]) if waker else None
        try:
            for batch in (1, 32):
                for threads in (1, 2):
                    ms = min(step_ms(policy, threads, batch) for _ in range(3))
                    rows.append({"waker": waker, "batch": batch, "threads": threads, "ms_per_step": round(ms, 3)})
                    print(f"[plan_contention] {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    print(json.dumps({"bench": "plan_contention", "busy_s": args.busy, "idle_s": args.idle, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""A rollout engine's decode steps on the compute thread while an idle executor thread of the same process has
run one torch operator: with its own full OpenMP team (as every executor thread of the services had until
`tlt_stream/model/threads.py`), with one torch thread (`off_compute_thread`), and with no side thread at all.

Each setting runs in a fresh process (a team, once made, lives as long as its thread), the three interleaved
`--rounds` times; each process times plain decode steps of the tiny world's policy at 1, 16 and 128 rows
(median of 3 engines of `--steps` steps each) with `--threads` torch threads on the compute thread.

    python bench/side_threads.py [--world artifacts/world] [--rounds 3] [--threads 2]

Prints one JSON object: per setting and batch, the median milliseconds per step over the rounds, and each
setting's ratio to no side thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("none", "side_team", "side_one_thread")
BATCHES = (1, 16, 128)


def child(world: Path, setting: str, threads: int, steps: int) -> dict[str, float]:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from plan_fit import engine_steps

    from tlt_stream.model import load_model
    from tlt_stream.model.threads import off_compute_thread

    torch.set_num_threads(threads)
    policy = load_model(world / "policy")

    def matmul() -> None:
        a = torch.randn(512, 512)
        (a @ a).sum()

    side = ThreadPoolExecutor(1)  # alive until the process ends, as a service's default executor is
    if setting == "side_team":
        side.submit(matmul).result()
    elif setting == "side_one_thread":
        side.submit(off_compute_thread(matmul)).result()

    def per_step(batch: int) -> float:
        return 1e3 * engine_steps(policy, batch, skip=4, steps=steps)[0]

    out = {str(b): statistics.median(per_step(b) for _ in range(3)) for b in BATCHES}
    side.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the compute thread")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = p.parse_args()
    world = Path(args.world)
    if args.child:
        print(json.dumps(child(world, args.child, args.threads, args.steps)))
        return
    if not (world / "policy").is_dir():
        sys.exit(f"{world}: no policy; run `tlt-stream bootstrap --out {world}` first")
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    for r in range(args.rounds):
        for setting in SETTINGS:
            command = [sys.executable, __file__, "--child", setting, "--world", str(world)]
            command += ["--threads", str(args.threads), "--steps", str(args.steps)]
            done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"[side_threads] round {r + 1}/{args.rounds} {setting}: {runs[setting][-1]}", file=sys.stderr)
    ms = {s: {str(b): round(statistics.median(x[str(b)] for x in runs[s]), 3) for b in BATCHES} for s in SETTINGS}
    ratio = {s: {b: round(ms[s][b] / ms["none"][b], 3) for b in ms[s]} for s in SETTINGS if s != "none"}
    out = {"bench": "side_threads", "threads": args.threads, "rounds": args.rounds, "ms_per_step": ms}
    print(json.dumps({**out, "vs_none": ratio, "cpus": os.cpu_count()}, indent=2))


if __name__ == "__main__":
    main()

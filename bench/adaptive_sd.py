"""Adaptive speculative decoding against every fixed strategy, on real long-tailed rollouts.

One run of the bootstrapped policy (T = 1, EOS stops, as RL rollouts) over a batch of task prompts that
starts full (64) and drains to 1 as responses finish, under: no SD, SD always on with each fixed arm, and
adaptive SD (`rollout/adaptive.py`; its tuner is warmed up on one rollout of the workload, reported as
`adaptive_cold`, and keeps its statistics from rep to rep, as a worker's tuner does across RL steps).
Two workloads:

- tail-heavy: prompts drawn from the task's own distribution (max/median response length ~10x);
- tail-light: prompts whose solutions all have 3-5 steps (similar lengths; little tail).

Strategies run in alternation, rep by rep, on the same prompts and seeds, and every figure is the median
over reps. Per strategy: total rollout time, tail-phase time (the steps run once fewer than 32 requests
remain, TLT's definition, and once at most 8 remain), tokens/s per phase, the rollout's time per token of
its longest response (each strategy samples its own responses, and a drained rollout lasts as long as its
longest one), and for adaptive the arms chosen per batch bucket. Prints progress to stderr and one JSON
object to stdout.

    python bench/adaptive_sd.py [--quick]        # --quick: 16 prompts, 3 strategies, 1 rep (< 1 minute)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED = [(2, 1, 2), (4, 1, 4), (6, 1, 6), (4, 2, 8)]


def log(message: str) -> None:
    print(f"[adaptive_sd] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--crossover", type=int, default=16, help="measured SD crossover batch (bench/sd_speedup.py)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.reps, args.batch = 1, 16
    return args


def run_once(engine: Any, adaptive: Any, prompts: list[list[int]], budget: int, eos: int, seed: int) -> dict:
    """One drained rollout; per-step (running batch, seconds, tokens) folded into phase totals."""
    for i, p in enumerate(prompts):
        engine.add_request(p, budget, 1.0, seed + i, [eos], request_id=i)
    phases = {"total": [0.0, 0], "tail_lt32": [0.0, 0], "tail_le8": [0.0, 0]}
    finished = 0
    lengths: list[int] = []
    while engine.has_unfinished:
        remaining = len(prompts) - finished
        tokens = engine.tokens_generated
        started = time.perf_counter()
        results = adaptive.step() if adaptive is not None else engine.step()
        seconds, emitted = time.perf_counter() - started, engine.tokens_generated - tokens
        finished += len(results)
        lengths += [len(r.token_ids) for r in results]
        for name, inside in (("total", True), ("tail_lt32", remaining < 32), ("tail_le8", remaining <= 8)):
            if inside:
                phases[name][0] += seconds
                phases[name][1] += emitted
    return {
        **{f"{name}_s": s for name, (s, _) in phases.items()},
        **{f"{name}_tok_s": (t / s if s else 0.0) for name, (s, t) in phases.items()},
        "tokens": phases["total"][1],
        "max_over_median_length": max(lengths) / max(1.0, statistics.median(lengths)),
        # A drained rollout lasts as long as its longest response, and each strategy samples its own
        # responses (SD arms consume random numbers differently): time per token of the longest one compares
        # strategies without the luck of which tail each drew.
        "ms_per_longest_token": 1000 * phases["total"][0] / max(lengths),
    }


def main() -> None:
    args = parse_args()
    import torch

    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.adaptive import AdaptiveSd, AdaptiveSettings
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    world = Path(args.world)
    if not (world / "drafter").is_dir():
        sys.exit(f"{world}: no bootstrapped world (run `tlt-stream bootstrap --out {world}`)")
    policy = load_model(world / "policy")
    tokenizer = build_tokenizer()
    task = RepeatedAddTask()
    pool = task.problems(4000, args.seed + 5, heldout=False)
    workloads = {
        "tail_heavy": pool[: args.batch],
        "tail_light": [p for p in pool if 3 <= p.steps <= 5][: args.batch],
    }
    max_len = policy.spec.max_position_embeddings
    eos = tokenizer.eos_token_id
    fixed = FIXED[1:3] if args.quick else FIXED
    strategies = ["plain", *(Arm.drafter(*a).label for a in fixed), "adaptive"]
    result: dict[str, Any] = {
        "benchmark": "adaptive_sd",
        "quick": args.quick,
        "batch": args.batch,
        "reps": args.reps,
        "crossover": args.crossover,
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__},
        "workloads": {},
    }
    for name, problems in workloads.items():
        prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
        budget = max_len - max(len(p) for p in prompts)
        runs: dict[str, list[dict]] = {s: [] for s in strategies}
        chosen: dict[str, Any] = {}
        # The tuner lives as long as the worker (across RL steps): warm it up on one rollout of the workload
        # (reported as adaptive_cold), then measure it warm, carrying its statistics from rep to rep.
        tuner: Any = None

        def engine_for(strategy: str, rows: int = len(prompts)) -> Any:
            drafter = load_drafter(world / "drafter", policy)
            fixed_arm = next((Arm.drafter(*a) for a in fixed if Arm.drafter(*a).label == strategy), None)
            return GenerationEngine(
                policy,
                rows,
                max_len,
                proposer=None if strategy == "plain" else EagleProposer(drafter),
                arm=fixed_arm,
                max_draft_nodes=32,
            )

        engine = engine_for("adaptive")
        tuner = AdaptiveSd(engine, AdaptiveSettings(crossover=args.crossover, seed=args.seed), drafter_version=0)
        cold = run_once(engine, tuner, prompts, budget, eos, seed=999_999)
        log(f"{name} warm-up: adaptive (cold) {cold['total_s']:.2f}s")
        for rep in range(args.reps):
            for strategy in strategies:
                engine = engine_for(strategy)
                adaptive = None
                if strategy == "adaptive":  # the warm tuner, driving this rep's engine
                    adaptive = tuner
                    adaptive.engine = engine
                runs[strategy].append(run_once(engine, adaptive, prompts, budget, eos, seed=1000 * rep))
                if adaptive is not None:
                    chosen = adaptive.summary()
                log(f"{name} rep {rep}: {strategy} {runs[strategy][-1]['total_s']:.2f}s")
        summary = {s: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for s, rs in runs.items()}
        fixed_best = min((s for s in strategies if s != "adaptive"), key=lambda s: summary[s]["total_s"])
        adaptive_total = summary["adaptive"]["total_s"]
        per_token = {s: summary[s]["ms_per_longest_token"] for s in strategies}
        fixed_best_per_token = min((s for s in strategies if s != "adaptive"), key=per_token.__getitem__)
        result["workloads"][name] = {
            "strategies": summary,
            "best_fixed": fixed_best,
            "adaptive_over_best_fixed": round(adaptive_total / summary[fixed_best]["total_s"], 3),
            "adaptive_beats_every_fixed": all(
                adaptive_total < summary[s]["total_s"] for s in strategies if s != "adaptive"
            ),
            "best_fixed_per_longest_token": fixed_best_per_token,
            "adaptive_over_best_fixed_per_longest_token": round(
                per_token["adaptive"] / per_token[fixed_best_per_token], 3
            ),
            "tail_lt32_speedup_vs_plain": round(
                summary["plain"]["tail_lt32_s"] / summary["adaptive"]["tail_lt32_s"], 3
            ),
            "tail_le8_speedup_vs_plain": round(summary["plain"]["tail_le8_s"] / summary["adaptive"]["tail_le8_s"], 3),
            "adaptive_cold": {k: round(v, 3) for k, v in cold.items()},
            "adaptive_arms_chosen": chosen,
        }
    result["goals"] = {
        "adaptive_over_best_fixed_max": 1.05,
        "adaptive_strictly_best_on_one_workload": True,
        "tail_speedup_vs_plain_min": 2.0,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

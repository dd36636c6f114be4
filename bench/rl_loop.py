"""The RL loop over the streams, measured: per-step time breakdown on- and off-policy, and how much the
policy learns in a fixed number of steps (160: about 15 minutes on 2 cores). Runs are reproducible: two runs
with the same seed produced bit-identical rewards and losses at every step.

Every figure comes from a real run: the policy service, rollout worker(s) and learner as separate processes
(`tlt_stream.commands.run.launch`, the same path as `tlt-stream run`), every sample through Redis, every policy version
through MQTT. Per-step figures are what the learner wrote to `metrics.jsonl` (rollout span and tail phase
from the samples' own timestamps, learn/checkpoint/wait times from the learner); step wall time is the gap
between consecutive policy versions. Medians over the steps after the first (which includes start-up).

    python bench/rl_loop.py --quick          # < 2 minutes: 4 steps each at max_staleness 0 and 1, 10 learning steps
    python bench/rl_loop.py                  # breakdown (12 steps each) + the 160-step learning run
    python bench/rl_loop.py --skip-breakdown --learn-steps 160

Prints one JSON object; run directories (with reward curves) stay under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", default=str(ROOT / "artifacts" / "bench-rl"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=12, help="steps per breakdown run")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="learner lr (default: tlt-stream run's)")
    p.add_argument(
        "--final-norm-lr-scale", type=float, default=None, help="learner final-norm lr scale (default: run's)"
    )
    p.add_argument("--learn-steps", type=int, default=160, help="policy updates of the learning run (0: skip)")
    p.add_argument(
        "--learn-minutes", type=float, default=25.0, help="wall-clock cap of the learning run (stops it early)"
    )
    p.add_argument("--learn-staleness", type=int, default=0)
    p.add_argument("--eval", type=int, default=512, help="held-out prompts per evaluation")
    p.add_argument("--skip-breakdown", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def log(message: str) -> None:
    print(f"[rl_loop] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def breakdown(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per-step figures over `rows` (learner steps), skipping the first (start-up)."""
    steady = rows[1:] if len(rows) > 1 else rows
    walls = [b["time"] - a["time"] for a, b in itertools.pairwise(rows)]
    histogram: dict[str, int] = {}
    for row in rows:
        for lag, count in row.get("staleness_hist", {}).items():
            histogram[lag] = histogram.get(lag, 0) + count
    return {
        "steps": len(rows),
        "step_wall_s": median(walls),
        "rollout_span_s": median([r["rollout_seconds"] for r in steady]),
        "tail_phase_s": median([r["tail_seconds"] for r in steady]),
        "tail_share_of_rollout": median([r["tail_share"] for r in steady]),
        "learn_s": median([r["learn_seconds"] for r in steady]),
        "checkpoint_s": median([r["checkpoint_seconds"] for r in steady]),
        "learner_wait_s": median([r["wait_seconds"] for r in steady]),
        "rollout_tokens_per_s": median([r["rollout_tokens_per_s"] for r in steady]),
        "response_len_p50": median([r["response_len_p50"] for r in steady]),
        "response_len_max_over_median": median([r["response_len_max_over_median"] for r in steady]),
        "reward_mean": median([r["reward_mean"] for r in rows]),
        "staleness_histogram": histogram,
    }


async def one_run(plan, *, budget_s: float | None = None) -> tuple[int, float]:
    from tlt_stream.commands.run.launch import run_plan

    stop = asyncio.Event()
    timer = asyncio.get_running_loop().call_later(budget_s, stop.set) if budget_s else None
    started = time.perf_counter()
    try:
        code = await run_plan(
            plan,
            stop=stop,
            purge=True,
            on_step=lambda rows: log(f"  step {rows[-1]['version']}: reward {rows[-1]['reward_mean']:.3f}"),
        )
    finally:
        if timer is not None:
            timer.cancel()
    return code, time.perf_counter() - started


def main() -> None:
    args = parse_args()
    import torch

    from tlt_stream.basics.config import load_config, override
    from tlt_stream.commands.report import write_report
    from tlt_stream.commands.run.launch import RunPlan, evaluate_version
    from tlt_stream.rl.checkpoint import latest_checkpoint
    from tlt_stream.rl.records import load_metrics

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    world, out = Path(args.world), Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    if not (world / "policy").is_dir():
        sys.exit(f"{world}/policy not found: run `tlt-stream bootstrap --out {world}` first")
    config = override(load_config(None, environ=os.environ), {"preset": "tiny-world", "launch.sd": "off"})
    stamp = time.strftime("%H%M%S")

    def named(part: str, values: dict[str, Any]):  # every run its own namespace: runs must not share state
        return override(config, {"run": f"{config.run}-{part}-{stamp}", **values, **extra})

    steps = 4 if args.quick else args.steps
    shape = {"policy.prompts_per_step": args.prompts_per_step, "policy.group_size": args.group_size}
    shape["policy.seed"] = args.seed
    extra: dict[str, Any] = {"learner.lr": args.lr} if args.lr is not None else {}
    if args.final_norm_lr_scale is not None:
        extra["learner.final_norm_lr_scale"] = args.final_norm_lr_scale
    result: dict[str, Any] = {
        "bench": "rl_loop",
        "quick": args.quick,
        "cores": cores,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "redis": "configured" if config.bus.redis_url else "embedded",
    }

    if not args.skip_breakdown:
        result["breakdown"] = {}
        for staleness in (0, 1):
            run_dir = out / f"staleness{staleness}"
            log(f"breakdown run, max_staleness={staleness}, {steps} steps -> {run_dir}")
            values = {"policy.steps": steps, "policy.max_staleness": staleness, **shape}
            plan = RunPlan(world=world, run_dir=run_dir, config=named(f"s{staleness}", values), cores=cores)
            code, seconds = asyncio.run(one_run(plan))
            assert code == 0
            figures = breakdown(load_metrics(run_dir))
            figures["run_wall_s"] = round(seconds, 1)
            result["breakdown"][f"max_staleness_{staleness}"] = figures
            write_report(run_dir)
        on, off = (result["breakdown"][f"max_staleness_{k}"]["step_wall_s"] for k in (0, 1))
        result["breakdown"]["step_time_ratio_staleness1_over_0"] = round(off / on, 3)

    learn_steps = min(args.learn_steps, 10) if args.quick else args.learn_steps
    minutes = args.learn_minutes
    if learn_steps > 0:
        run_dir = out / "learn"
        n = 64 if args.quick else args.eval
        values = {"policy.steps": learn_steps, "policy.max_staleness": args.learn_staleness, **shape}
        plan = RunPlan(world=world, run_dir=run_dir, config=named("learn", values), cores=cores)
        before = evaluate_version(run_dir, 0, world / "policy", n=n, seed=args.seed + 1, threads=cores)
        log(f"learning run, {learn_steps} steps -> {run_dir} (held-out accuracy before: {before['accuracy']:.3f})")
        code, seconds = asyncio.run(one_run(plan, budget_s=minutes * 60))
        final = latest_checkpoint(run_dir / "checkpoints")
        assert final is not None
        after = evaluate_version(run_dir, final.step, final.policy_dir, n=n, seed=args.seed + 1, threads=cores)
        rows = load_metrics(run_dir)
        page = write_report(run_dir)
        result["learning"] = {
            "planned_steps": learn_steps,
            "cap_minutes": minutes,
            "wall_s": round(seconds, 1),
            "steps": final.step,
            "lr": plan.lr,
            "final_norm_lr_scale": plan.final_norm_lr_scale,
            "max_staleness": plan.max_staleness,
            "heldout_prompts": n,
            "heldout_accuracy_before": before["accuracy"],
            "heldout_accuracy_after": after["accuracy"],
            "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
            "goal_points": 15.0,
            "train_reward_first10": median([r["reward_mean"] for r in rows[:10]]),
            "train_reward_last10": median([r["reward_mean"] for r in rows[-10:]]),
            "reward_curve": str(page.parent / "reward.png"),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

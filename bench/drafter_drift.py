"""Does the online drafter keep up with a policy that RL keeps changing, and what does it cost?

Part A, drift (in one process, deterministic): K GRPO updates of the bootstrapped policy on the tiny task
(on-policy, the learner's own `LearnerCore.step`). After each update, on fresh held-out rollouts of the new
policy (T = 1, SD chain d4k1v4), the mean acceptance length (tokens per target forward in SD rounds) of:

- the static warm-up drafter (bound to the current policy's embedding and LM head, never trained again);
- the online drafter: `OnlineDrafterTrainer` fed with each step's hidden-state windows and given a short
  slice after each update (what an idle worker does while the learner updates);
- an oracle: a drafter trained from scratch to convergence (1600 steps) on the current policy's own samples (at the
  first and last update only: it is the expensive reference).

Part B, cost (the real pipeline, `tlt_stream.commands.run.launch`): the same RL run with SD (a fixed d4 chain by
default), with and without online drafter training, alternating (`--repeats` runs each); the median step
wall time over every step of each mode (training adds time only if it steals it from generation) and the
share of workers' idle seconds
that became drafter-training seconds (optimizer steps only: restoring, saving and judging are not counted),
from the runs' saved `stats` timelines (WorkerState transitions and one DrafterStats per slice).

A step's rollout is mostly its longest response, decoded at a small batch, so the comparison needs both
modes to sample the same responses. With a fixed SD arm they do (per-sample seeds, the same drafter, the
same batches) until the online run publishes a drafter; with adaptive SD (`--pipeline-adaptive-sd`) the arms
are chosen by measured speed, consume random numbers differently, and the two modes draw different tails:
11% longer longest responses in one mode was measured, which swamps a cost of a few percent.

    python bench/drafter_drift.py [--quick]      # --quick: K=3, small oracle, 4-step pipeline runs (< 2 min)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tlt_stream.basics.config import PRESETS, override  # noqa: E402  (light: no torch)

TINY = PRESETS["tiny-world"]["learner"]
"""The RL run's learner recipe (`tlt-stream run` on the tiny world)."""


def log(message: str) -> None:
    print(f"[drafter_drift] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--lr", type=float, default=TINY["lr"], help="policy learning rate (the RL run's)")
    p.add_argument(
        "--final-norm-lr-scale",
        type=float,
        default=TINY["final_norm_lr_scale"],
        help="policy final-norm lr scale (the RL run's, tlt-stream run's default)",
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--slice-steps", type=int, default=20, help="online drafter steps after each update")
    p.add_argument("--online-lr", type=float, default=None, help="the online drafter's lr (default: the worker's)")
    p.add_argument("--online-warmup", type=int, default=None, help="its warmup steps (default: the worker's)")
    p.add_argument(
        "--oracle-steps", type=int, default=1600, help="the oracle's training (400 was far from converged: 3.8 vs 4.45)"
    )
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--pipeline-steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="pipeline runs per mode, alternating on/off")
    p.add_argument(
        "--hidden-share", type=float, default=None, help="share of samples streamed to `hidden` (default: run's)"
    )
    p.add_argument(
        "--pipeline-adaptive-sd", action="store_true", help="adaptive SD in the pipeline runs (samples then differ)"
    )
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument("--skip-drift", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.updates, args.oracle_steps, args.eval_prompts, args.pipeline_steps = 3, 60, 12, 4
        args.prompts, args.slice_steps, args.repeats = 8, 10, 1
    return args


def acceptance(policy: Any, drafter: Any, prompts: list[list[int]], eos: int, seed: int) -> float:
    """Mean tokens per SD round (chain d4k1v4, T = 1) over fresh rollouts of `policy`."""
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer

    drafter.bind(policy)
    engine = GenerationEngine(
        policy,
        len(prompts),
        policy.spec.max_position_embeddings,
        proposer=EagleProposer(drafter),
        arm=Arm.drafter(4, 1, 4),
    )
    budget = policy.spec.max_position_embeddings - max(len(p) for p in prompts)
    results = engine.generate(prompts, budget, 1.0, seed=seed, eos_ids=[eos])
    rounds = [a for r in results for a in r.accept_lengths]
    return statistics.fmean(rounds) if rounds else 1.0


def oracle_drafter(policy: Any, prompts: list[list[int]], eos: int, steps: int, seed: int) -> Any:
    """A drafter trained from scratch on `policy`'s own samples (as the bootstrap trains its drafter)."""
    import torch

    from tlt_stream.drafter.model import Drafter
    from tlt_stream.drafter.train import DrafterTrainer, batches
    from tlt_stream.rl.samples import hidden_window
    from tlt_stream.rollout.engine import GenerationEngine

    engine = GenerationEngine(policy, 32, policy.spec.max_position_embeddings)
    budget = policy.spec.max_position_embeddings - max(len(p) for p in prompts)
    results = engine.generate(prompts, budget, 1.0, seed=seed, eos_ids=[eos], return_hidden=True)
    windows = [_window(hidden_window(r, f"o/{i}", 0, dtype="float32")) for i, r in enumerate(results) if r.token_ids]
    torch.manual_seed(seed)
    drafter = Drafter(policy.spec).bind(policy)
    trainer = DrafterTrainer(drafter, lr=2e-3, total_steps=steps, unroll=3)
    stream = batches(windows, row_tokens=512, rows_per_batch=4, seed=seed)
    for _ in range(steps):
        trainer.step(next(stream))
    return drafter.eval()


def _window(message: Any) -> Any:
    from tlt_stream.drafter.buffer import window_from_message

    return window_from_message(message)


def drift(args: argparse.Namespace, world: Path) -> dict[str, Any]:
    import msgspec
    from _grpo import update_groups  # bench/, on the path as the script's directory
    from transformers import AutoModelForCausalLM

    from tlt_stream.basics.config import DEFAULTS
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.drafter.online import OnlineDrafterTrainer, WindowBuffer
    from tlt_stream.model import load_model
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings
    from tlt_stream.rl.samples import hidden_window
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    task = RepeatedAddTask()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    held_out = [encode(p.prompt) for p in task.problems(args.eval_prompts, args.seed + 99, heldout=True)]
    oracle_prompts = [encode(p.prompt) for p in task.problems(64 if args.quick else 256, args.seed + 7, heldout=False)]
    hf = AutoModelForCausalLM.from_pretrained(world / "policy")
    settings = LearnerSettings(
        lr=args.lr, warmup_steps=min(20, args.updates), final_norm_lr_scale=args.final_norm_lr_scale
    )
    core = LearnerCore(hf, settings)
    policy = load_model(world / "policy")
    static = load_drafter(world / "drafter", policy)
    online_drafter = copy.deepcopy(static).bind(policy)
    buffer = WindowBuffer(recent_tokens=60_000, reservoir_tokens=60_000, seed=args.seed)
    online = OnlineDrafterTrainer(
        online_drafter,
        buffer,
        msgspec.structs.replace(
            DEFAULTS.drafter,
            lr=DEFAULTS.drafter.lr if args.online_lr is None else args.online_lr,
            lr_warmup_steps=DEFAULTS.drafter.lr_warmup_steps if args.online_warmup is None else args.online_warmup,
            batch_pairs=1024,
        ),
        policy_version=0,
    )
    scratch = Path(tempfile.mkdtemp(prefix="drafter-drift-"))
    rows = []
    started = time.perf_counter()
    for update in range(1, args.updates + 1):
        problems = task.problems(args.prompts, args.seed * 7919 + update, heldout=False)
        groups, results = update_groups(
            policy, problems, tokenizer, group=args.group, update=update, return_hidden=True
        )
        windows = [
            hidden_window(result, f"u{update}-{i}/{g}", update - 1)
            for (i, g), result in sorted(results.items())
            if result.token_ids
        ]
        metrics = core.step(groups)
        hf.save_pretrained(scratch)
        policy = load_model(scratch)
        for message in windows:  # the step's hidden states reach the drafter while the learner updates
            buffer.add(_window(message), message.policy_version)
        online.rebind(policy, update)
        online.train_slice(max_steps=args.slice_steps)
        row = {
            "update": update,
            "reward": round(metrics["reward_mean"], 3),
            "static": round(acceptance(policy, static, held_out, eos, seed=update), 3),
            "online": round(acceptance(policy, online.drafter, held_out, eos, seed=update), 3),
        }
        if update in (1, args.updates):
            log(f"update {update}: training the oracle drafter ({args.oracle_steps} steps)")
            oracle = oracle_drafter(policy, oracle_prompts, eos, args.oracle_steps, seed=args.seed + update)
            row["oracle"] = round(acceptance(policy, oracle, held_out, eos, seed=update), 3)
            row["online_over_oracle"] = round(row["online"] / row["oracle"], 3)
        rows.append(row)
        log(f"update {update}: {row}")
    first, last = rows[0], rows[-1]
    k = min(5, len(rows))  # one update's figure moves by ~0.1 with the 24 prompts' sampled responses

    def mean(key: str, part: list[dict[str, Any]]) -> float:
        return round(statistics.fmean(r[key] for r in part), 3)

    return {
        "updates": rows,
        "seconds": round(time.perf_counter() - started, 1),
        "static_change": round(last["static"] - first["static"], 3),
        "static_first_last_mean": [mean("static", rows[:k]), mean("static", rows[-k:])],
        "online_first_last_mean": [mean("online", rows[:k]), mean("online", rows[-k:])],
        "static_over_oracle_first_last": [round(r["static"] / r["oracle"], 3) for r in (first, last)],
        "online_minus_static_last": round(last["online"] - last["static"], 3),
        "online_over_oracle_min": min(r["online_over_oracle"] for r in rows if "online_over_oracle" in r),
    }


def pipeline(args: argparse.Namespace, world: Path) -> dict[str, Any]:

    from tlt_stream.basics.config import load_config
    from tlt_stream.commands.report import state_intervals
    from tlt_stream.commands.run.launch import RunPlan, run_plan
    from tlt_stream.rl.records import load_metrics, read_jsonl

    base = load_config(None, environ=os.environ)
    out = Path(tempfile.mkdtemp(prefix="drafter-drift-runs-"))
    runs: dict[str, list[dict[str, Any]]] = {"online": [], "static": []}
    for repeat, train in itertools.product(range(args.repeats), (True, False)):
        name = "online" if train else "static"
        config = override(base, {
            "run": f"drift-{name}-{repeat}-{os.getpid()}-{int(time.time())}", "preset": "tiny-world",
            "policy.steps": args.pipeline_steps, "launch.sd": "eagle", "drafter.train": train,
            "policy.prompts_per_step": args.prompts, "policy.group_size": args.group, "learner.lr": args.lr,
            "learner.final_norm_lr_scale": args.final_norm_lr_scale, "sd.adaptive": args.pipeline_adaptive_sd,
            **({} if args.hidden_share is None else {"rollout.hidden_share": args.hidden_share}),
        })  # fmt: skip
        plan = RunPlan(world=world, run_dir=out / f"{name}-{repeat}", config=config)
        log(f"pipeline run {repeat + 1}/{args.repeats} with drafter training {'on' if train else 'off'}")
        assert asyncio.run(run_plan(plan, purge=True)) == 0
        rows = load_metrics(plan.run_dir)
        timeline = read_jsonl(plan.run_dir / "timeline.jsonl")  # the run's stats, saved by run_plan
        seconds = {"IDLE": 0.0, "TRAINING_DRAFTER": 0.0}
        for spans in state_intervals(timeline, end=rows[-1]["time"]).values():
            for start, stop, state in spans:
                if state in seconds:
                    seconds[state] += stop - start
        runs[name].append(
            {
                "walls": [b["time"] - a["time"] for a, b in itertools.pairwise(rows)],
                "state_s": seconds,
                "slices": [e for e in timeline if e["kind"] == "drafter_train"],
                "accept": [r["accept_length_mean"] for r in rows],
                # steps 2.. (the first includes start-up): what each phase took and the tail it decoded
                "rollout_s": [r["rollout_seconds"] for r in rows[1:]],
                "longest": [r["response_len_max"] for r in rows[1:]],
                "learn_s": [r["learn_seconds"] for r in rows[1:]],
            }
        )
    results: dict[str, Any] = {
        "repeats": args.repeats,
        "adaptive_sd": args.pipeline_adaptive_sd,
        "hidden_share": args.hidden_share or RunPlan.hidden_share,
    }
    for name, done in runs.items():
        walls = [w for run in done for w in run["walls"]]
        slices = [s for run in done for s in run["slices"]]
        idle = sum(run["state_s"]["IDLE"] + run["state_s"]["TRAINING_DRAFTER"] for run in done)
        training = sum(s["seconds"] for s in slices)
        judged = [s for s in slices if s["judged"]]
        latencies = [s["preempt_latency_s"] for s in slices if s["end"] == "preempted"]
        results[name] = {
            "step_wall_s": round(statistics.median(walls), 3) if walls else None,
            "step_wall_s_per_run": [round(statistics.median(r["walls"]), 3) for r in done if r["walls"]],
            "idle_s": round(idle, 2),
            "holding_lease_s": round(sum(run["state_s"]["TRAINING_DRAFTER"] for run in done), 2),
            "drafter_training_s": round(training, 2),
            "judging_s": round(sum(s["judge_s"] for s in judged), 2),
            "idle_to_training_share": round(training / idle, 3) if idle else None,
            "slices": len(slices),
            "steps": sum(s["steps"] for s in slices),
            "judged": len(judged),
            "published_drafters": len({s["drafter_version"] for s in judged if s["adopted"]}),
            "preempt_latency_s_median": round(statistics.median(latencies), 3) if latencies else None,
            "accept_length_mean": round(statistics.fmean(a for r in done for a in r["accept"]), 3),
            "rollout_s_median": round(statistics.median(x for r in done for x in r["rollout_s"]), 3),
            "longest_response_median": statistics.median(x for r in done for x in r["longest"]),
            # A step's rollout is mostly its longest response decoded at a small batch, and the two modes
            # sample different responses (the SD arms chosen by timing consume random numbers differently),
            # so the rollout cost per token of the longest response separates cost from the tail's luck.
            "rollout_ms_per_longest_token": round(
                1000 * sum(x for r in done for x in r["rollout_s"]) / sum(x for r in done for x in r["longest"]), 3
            ),
            "learn_s_median": round(statistics.median(x for r in done for x in r["learn_s"]), 3),
        }
    on, off = results["online"]["step_wall_s"], results["static"]["step_wall_s"]
    results["step_time_overhead"] = round(on / off - 1, 3) if on and off else None
    for key in ("rollout_ms_per_longest_token", "learn_s_median", "longest_response_median"):
        results[f"{key}_ratio"] = round(results["online"][key] / results["static"][key], 3)
    return results


def main() -> None:
    args = parse_args()
    import torch
    import transformers

    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()  # a checkpoint is saved and loaded every update
    world = Path(args.world)
    if not (world / "drafter").is_dir():
        sys.exit(f"{world}: no bootstrapped world (run `tlt-stream bootstrap --out {world}`)")
    result: dict[str, Any] = {
        "benchmark": "drafter_drift",
        "quick": args.quick,
        "lr": args.lr,
        "final_norm_lr_scale": args.final_norm_lr_scale,
    }
    if not args.skip_drift:
        result["drift"] = drift(args, world)
    if not args.skip_pipeline:
        result["pipeline"] = pipeline(args, world)
    result["goals"] = {
        "online_over_oracle_min": 0.95,
        "static_falls": "measurably",
        "step_time_overhead_max": 0.02,
        "idle_to_training_share_min": 0.70,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

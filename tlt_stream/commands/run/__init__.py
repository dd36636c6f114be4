"""`tlt-stream run`: the main job, the whole pipeline as processes on the embedded defaults, with progress
bars and a report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tlt_stream.basics.config.tree import DEFAULTS
from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, load, setting

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="the whole system on this machine: policy service, rollout workers and learner as processes",
        description="Bootstraps the tiny world if needed, starts (embedded or configured) Redis and MQTT, the "
        "policy service, N rollout workers and the learner as separate processes, shows progress, evaluates "
        "held-out accuracy before and after, and leaves metrics, checkpoints, logs and plots in --out. Every "
        "setting is in the configuration (`tlt-stream config describe`); the services read it from "
        "OUT/config.toml. On the tiny world the learner follows preset tiny-world unless another is set.",
    )
    setting(run, "--steps", keys="policy.steps")
    setting(run, "--workers", keys="launch.workers")
    setting(run, "--learner-gpus", keys="launch.learner_gpus")
    run.add_argument("--out", help="run directory (default runs/RUN-TIMESTAMP)")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run where it stopped (its checkpoints, dispatch position, dataset position and "
        "drafter states), with its own settings (RUN_DIR/config.toml) and the flags given now (e.g. --steps)",
    )
    setting(run, "--world", keys="launch.world")
    setting(run, "--policy", keys="launch.policy")
    setting(run, "--drafter", keys="launch.drafter")
    setting(run, "--dataset", keys="data.dataset")
    setting(run, "--eval-dataset", keys="data.eval_dataset")
    setting(run, "--reward", keys="rollout.reward")
    setting(run, "--prompts-per-step", keys="policy.prompts_per_step")
    setting(run, "--group-size", keys="policy.group_size")
    setting(run, "--max-staleness", keys="policy.max_staleness")
    setting(run, "--lr", keys="learner.lr")
    setting(run, "--warmup-steps", keys="learner.warmup_steps")
    setting(run, "--final-norm-lr-scale", keys="learner.final_norm_lr_scale")
    setting(run, "--sd", keys="launch.sd", choices=["off", "eagle", "ngram"])
    setting(
        run,
        "--no-drafter-training",
        keys="drafter.train",
        const=False,
        help="with --sd eagle: keep the warm-up drafter",
    )
    setting(run, "--hidden-share", keys="rollout.hidden_share")
    setting(run, "--fixed-sd", keys="sd.adaptive", const=False, help="always speculate with sd.arm (no adaptive SD)")
    setting(
        run,
        "--group-drafts",
        keys="sd.group",
        const=True,
        help="draft also from the prompt's own responses and history (siblings, earlier steps)",
    )
    setting(
        run,
        "--partial-rollouts",
        keys="policy.partial_rollouts",
        const=True,
        help="start each step early as drafts of the version before and re-verify them losslessly on arrival",
    )
    setting(run, "--max-len", keys="rollout.max_len")
    setting(run, "--eval", keys="launch.eval")
    setting(run, "--seed", keys="policy.seed")
    setting(run, "--device", keys=("rollout.device", "learner.device"))
    setting(run, "--log-to", keys="learner.log_to", type=_names, metavar="tensorboard,wandb")
    add_config_args(run)
    run.set_defaults(handler=handle)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (`--log-to tensorboard,wandb`); the configuration checks each."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def handle(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import time
    from pathlib import Path

    import msgspec
    import torch

    from tlt_stream.basics.aio import install_stop_signals
    from tlt_stream.basics.config import redact_text
    from tlt_stream.basics.progress import PhaseProgress
    from tlt_stream.commands.placement import describe
    from tlt_stream.commands.report import write_report
    from tlt_stream.commands.run.launch import (
        TINY_WORLD,
        RunPlan,
        ensure_new_run,
        evaluate_version,
        placement,
        run_plan,
    )
    from tlt_stream.model import resolve_device
    from tlt_stream.rl.datasets import DatasetError
    from tlt_stream.rl.tracking import require_trackers
    from tlt_stream.tasks.bootstrap import SIZES, bootstrap, unfinished

    resume = Path(args.resume) if args.resume else None
    if resume is not None:  # the stopped run's own settings, as its services read them; flags still apply
        if not (resume / "config.toml").is_file():
            print(f"tlt-stream run: {resume} holds no config.toml: not a run directory to resume", file=sys.stderr)
            return EXIT_CONFIG
        args.config = args.config or str(resume / "config.toml")
        args.out = str(resume)
    config = load(args)
    own = config.launch.policy is not None  # a policy of one's own: no world, no tiny-world recipe
    if not own:
        config = load(args, default_preset=TINY_WORLD)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if resume is None and args.run is None and "TLT_RUN" not in os.environ:  # a fresh namespace per new run
        config = msgspec.structs.replace(config, run=f"{config.run}-{stamp}")
    out = Path(args.out or f"runs/{config.run}")
    world = Path(config.launch.world)
    if resume is not None:
        from tlt_stream.basics.config import override
        from tlt_stream.rl.checkpoint import latest_checkpoint

        newest = latest_checkpoint(out / "checkpoints")
        at = newest.step if newest is not None else 0
        config = override(config, {"policy.start_step": at})  # on fresh servers, dispatch continues from there
        print(f"tlt-stream run: resuming {out} at policy version {at} (run {config.run})", file=sys.stderr)
    elif (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        print(f"tlt-stream run: {out} already holds checkpoints; choose a new --out", file=sys.stderr)
        return EXIT_CONFIG
    if resume is None and config.bus.redis_url is not None:  # a configured server may hold this run's state
        try:
            asyncio.run(ensure_new_run(config))
        except RuntimeError as exc:
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return 1
    sd, evals, seed = config.launch.sd, config.launch.eval, config.policy.seed
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    with PhaseProgress() as progress:
        if not own and (why := _world_to_build(world, sd)) is not None:
            pending = unfinished(world) or {}
            print(f"tlt-stream run: {why}; bootstrapping the tiny world (a few minutes)", file=sys.stderr)
            size = pending.get("size") if pending.get("size") in SIZES else "default"
            bootstrap(world, seed=pending.get("seed", 0), size=size, progress=progress)
        try:
            resolve_device(config.rollout.device)  # a bad --device fails here, not in every service after start-up
            resolve_device(config.learner.device)
            require_trackers(config.learner.log_to)  # a missing tracker package: one line now, not in the learner
            plan = RunPlan(world=world, run_dir=out, config=config, cores=cores)
            if config.data.dataset is not None:  # a bad row stops the run here, in one line, not a service later
                from tlt_stream.commands.run.launch import service_config
                from tlt_stream.roles.policy import task_source

                pool = task_source(service_config(plan, config))
                print(
                    f"tlt-stream run: {config.data.dataset}: {len(pool)} prompts, {pool.skipped} over the prompt "
                    "limit skipped (data.max_prompt_len)",
                    file=sys.stderr,
                )
        except (FileNotFoundError, ValueError, DatasetError) as exc:
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"tlt-stream run: {plan.steps} steps, {plan.workers} worker(s), run dir {out}", file=sys.stderr)
        if placed := placement(plan, config):  # a ConfigError (too few GPUs) stops the run here, exit code 2
            print(f"tlt-stream run: GPUs (CUDA_VISIBLE_DEVICES): {describe(placed)}", file=sys.stderr)
        if own and plan.sd != sd:
            print(f"tlt-stream run: no drafter for {plan.policy_dir} (--drafter): drafting n-grams", file=sys.stderr)
        if evals and own and config.data.eval_dataset is None:
            print("tlt-stream run: no --eval-dataset for this policy: no held-out evaluation", file=sys.stderr)
            evals = 0
        if evals and not (out / "eval.jsonl").exists():
            row = evaluate_version(out, 0, plan.policy_dir, n=evals, seed=seed, threads=cores, config=config)
            shown = row["prompts"]
            print(f"held-out accuracy before training: {row['accuracy']:.3f} ({shown} prompts)", file=sys.stderr)
        started = time.perf_counter()

        def on_step(rows: list[dict]) -> None:
            for row in rows:
                figures = {
                    "reward": row["reward_mean"],
                    "len_p50": row.get("response_len_p50", 0.0),
                    "rollout_tok/s": row.get("rollout_tokens_per_s", 0.0),
                    "learn_s": row["learn_seconds"],
                    "wait_s": row.get("wait_seconds", 0.0),
                }
                drafters = [int(k.rsplit("_", 1)[1]) for k in row if k.startswith("accept_length_drafter_")]
                if sd != "off":  # tokens per target forward and the newest drafter version in the step
                    figures["accept"] = row.get("accept_length_mean", 1.0)
                    figures["drafter_v"] = float(max(drafters, default=-1))
                progress("train", row["version"], plan.steps, figures)
                every = config.launch.eval_every
                if evals and every and row["version"] % every == 0 and row["version"] < plan.steps:
                    _evaluate_during(out, row["version"], evals, seed, config)

        async def main() -> int:
            stop = asyncio.Event()
            install_stop_signals(stop)
            code = await run_plan(plan, on_step=on_step, stop=stop)
            if code == 130:
                print("tlt-stream run: stopped; every service was shut down, checkpoints are intact", file=sys.stderr)
            return code

        try:
            code = asyncio.run(main())
        except (RuntimeError, FileNotFoundError, ValueError) as exc:  # a service's log tail among them
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return 1
    seconds = time.perf_counter() - started
    if code == 0 and evals:
        from tlt_stream.rl.checkpoint import latest_checkpoint

        final = latest_checkpoint(out / "checkpoints")
        assert final is not None
        row = evaluate_version(out, final.step, final.policy_dir, n=evals, seed=seed, threads=cores, config=config)
        print(f"held-out accuracy after {final.step} steps: {row['accuracy']:.3f}", file=sys.stderr)
    try:
        where = f"report: {write_report(out)}"
    except FileNotFoundError:  # stopped before the first update
        where = "no step finished, so no report"
    print(f"tlt-stream run: {'finished' if code == 0 else 'stopped'} in {seconds:.0f}s; {where}", file=sys.stderr)
    return code


DEFAULT_WORLD = DEFAULTS.launch.world


def _evaluate_during(out: Path, version: int, n: int, seed: int, config: Any) -> None:
    """Held-out evaluation of the checkpoint of `version` while the run goes on (one thread: the services
    have the cores); a checkpoint already pruned is skipped."""
    from tlt_stream.basics.errors import CheckpointError
    from tlt_stream.commands.run.launch import evaluate_version
    from tlt_stream.rl.checkpoint import complete_checkpoints

    found = next((c for c in complete_checkpoints(out / "checkpoints") if c.step == version), None)
    if found is None:
        return
    try:
        row = evaluate_version(out, version, found.policy_dir, n=n, seed=seed, threads=1, config=config)
    except (OSError, ValueError, CheckpointError) as exc:  # pruned while read: the next evaluation will do
        print(f"tlt-stream run: evaluation of version {version} skipped ({exc})", file=sys.stderr)
        return
    print(f"held-out accuracy at version {version}: {row['accuracy']:.3f}", file=sys.stderr)


def _world_to_build(world: Path, sd: str) -> str | None:
    """Why `tlt-stream run` must bootstrap `world` first (None: it holds what the run needs). The default world
    is the command's own, built until it has a drafter; one given with --world is used as it is (a bootstrap
    left unfinished in it is finished), so a world of one's own without a drafter is refused, not replaced."""
    from pathlib import Path

    from tlt_stream.tasks.bootstrap import unfinished

    if unfinished(world) is not None:
        return f"{world} holds an unfinished bootstrap"
    if not (world / "policy").is_dir():
        return f"no policy in {world}"
    if sd == "eagle" and not (world / "drafter").is_dir() and world.resolve() == Path(DEFAULT_WORLD).resolve():
        return f"no drafter in {world}"
    return None

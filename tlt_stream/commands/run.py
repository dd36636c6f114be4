"""`tlt-stream run`: the main job, the whole pipeline as processes on the embedded defaults, with progress
bars and a report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, add_device_arg, load, positive, share

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    from tlt_stream.launch import TINY_WORLD_FINAL_NORM_LR_SCALE, TINY_WORLD_LR  # light: dataclasses, config

    run = commands.add_parser(
        "run",
        help="the whole system on this machine: policy service, rollout workers and learner as processes",
        description="Bootstraps the tiny world if needed, starts (embedded or configured) Redis and MQTT, the "
        "policy service, N rollout workers and the learner as separate processes, shows progress, evaluates "
        "held-out accuracy before and after, and leaves metrics, checkpoints, logs and plots in --out.",
    )
    run.add_argument("--steps", type=positive, default=60, help="policy updates to run")
    run.add_argument("--workers", type=positive, default=1, help="rollout worker processes")
    run.add_argument("--out", help="run directory (default runs/RUN-TIMESTAMP)")
    run.add_argument(
        "--world",
        default=DEFAULT_WORLD,
        help=f"tiny world directory (built or finished when missing or unfinished; {DEFAULT_WORLD}, the default, "
        "also when it lacks the drafter --sd eagle needs)",
    )
    run.add_argument("--prompts-per-step", type=positive, default=16)
    run.add_argument("--group-size", type=positive, default=8)
    run.add_argument("--max-staleness", type=int, default=0, help="0: on-policy")
    run.add_argument(
        "--lr", type=float, default=TINY_WORLD_LR, help=f"learner AdamW learning rate (default {TINY_WORLD_LR:g})"
    )
    run.add_argument("--warmup-steps", type=int, default=20, help="learner learning-rate warmup (updates)")
    run.add_argument(
        "--final-norm-lr-scale",
        type=float,
        default=TINY_WORLD_FINAL_NORM_LR_SCALE,
        help="learner: the final norm's gain trains at lr x this "
        f"(default {TINY_WORLD_FINAL_NORM_LR_SCALE:g}: the tiny world's recipe, docs/benchmarks.md issue 5)",
    )
    run.add_argument(
        "--sd",
        choices=["off", "eagle", "ngram"],
        default="eagle",
        help="rollout speculative decoding (default eagle: adaptive SD with the drafter trained online)",
    )
    run.add_argument(
        "--no-drafter-training",
        action="store_true",
        help="with --sd eagle: keep the warm-up drafter (no online training)",
    )
    run.add_argument(
        "--hidden-share",
        type=share,
        default=0.25,
        help="share of samples whose hidden states feed drafter training (default 0.25: on a CPU the trainer "
        "uses a fraction of them, and streaming all of them slowed rollouts ~8%%; docs/benchmarks.md issue 6)",
    )
    run.add_argument(
        "--fixed-sd", action="store_true", help="with --sd: always speculate with the default arm (no adaptive SD)"
    )
    run.add_argument("--max-len", type=positive, default=1408, help="prompt + response tokens per rollout row")
    run.add_argument("--eval", type=int, default=256, help="held-out prompts evaluated before and after (0: skip)")
    run.add_argument("--seed", type=int, default=0)
    add_device_arg(run)
    add_config_args(run)
    run.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import time
    from pathlib import Path

    import msgspec
    import torch

    from tlt_stream.aio import install_stop_signals
    from tlt_stream.config import redact_text
    from tlt_stream.launch import RunPlan, ensure_new_run, evaluate_version, run_plan
    from tlt_stream.model import resolve_device
    from tlt_stream.progress import PhaseProgress
    from tlt_stream.report import write_report
    from tlt_stream.tasks.bootstrap import SIZES, bootstrap, unfinished

    config = load(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.run is None and "TLT_RUN" not in os.environ:  # a fresh namespace per run unless one is named
        config = msgspec.structs.replace(config, run=f"{config.run}-{stamp}")
    out = Path(args.out or f"runs/{config.run}")
    world = Path(args.world)
    if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        print(f"tlt-stream run: {out} already holds checkpoints; choose a new --out", file=sys.stderr)
        return EXIT_CONFIG
    if config.bus.redis_url is not None:  # a configured server may hold this run's state already
        try:
            asyncio.run(ensure_new_run(config))
        except RuntimeError as exc:
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return 1
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    with PhaseProgress() as progress:
        if (why := _world_to_build(world, args.sd)) is not None:
            pending = unfinished(world) or {}
            print(f"tlt-stream run: {why}; bootstrapping the tiny world (a few minutes)", file=sys.stderr)
            size = pending.get("size") if pending.get("size") in SIZES else "default"
            bootstrap(world, seed=pending.get("seed", 0), size=size, progress=progress)
        try:
            resolve_device(args.device)  # a bad --device fails here, not in every service after start-up
            plan = RunPlan(
                world=world,
                run_dir=out,
                steps=args.steps,
                workers=args.workers,
                prompts_per_step=args.prompts_per_step,
                group_size=args.group_size,
                max_staleness=args.max_staleness,
                lr=args.lr,
                warmup_steps=args.warmup_steps,
                final_norm_lr_scale=args.final_norm_lr_scale,
                seed=args.seed,
                sd=args.sd,
                train_drafter=not args.no_drafter_training,
                adaptive_sd=not args.fixed_sd,
                hidden_share=args.hidden_share,
                max_len=args.max_len,
                device=args.device,
                cores=cores,
            )
        except (FileNotFoundError, ValueError) as exc:
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"tlt-stream run: {plan.steps} steps, {plan.workers} worker(s), run dir {out}", file=sys.stderr)
        if args.eval and not (out / "eval.jsonl").exists():
            row = evaluate_version(out, 0, world / "policy", n=args.eval, seed=args.seed, threads=cores)
            print(f"held-out accuracy before training: {row['accuracy']:.3f} ({args.eval} prompts)", file=sys.stderr)
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
                if plan.sd != "off":  # tokens per target forward and the newest drafter version in the step
                    figures["accept"] = row.get("accept_length_mean", 1.0)
                    figures["drafter_v"] = float(max(drafters, default=-1))
                progress("train", row["version"], plan.steps, figures)

        async def main() -> int:
            stop = asyncio.Event()
            install_stop_signals(stop)
            code = await run_plan(plan, config, on_step=on_step, stop=stop)
            if code == 130:
                print("tlt-stream run: stopped; every service was shut down, checkpoints are intact", file=sys.stderr)
            return code

        try:
            code = asyncio.run(main())
        except (RuntimeError, FileNotFoundError, ValueError) as exc:  # a service's log tail among them
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return 1
    seconds = time.perf_counter() - started
    if code == 0 and args.eval:
        from tlt_stream.rl.checkpoint import latest_checkpoint

        final = latest_checkpoint(out / "checkpoints")
        assert final is not None
        row = evaluate_version(out, final.step, final.policy_dir, n=args.eval, seed=args.seed, threads=cores)
        print(f"held-out accuracy after {final.step} steps: {row['accuracy']:.3f}", file=sys.stderr)
    try:
        where = f"report: {write_report(out)}"
    except FileNotFoundError:  # stopped before the first update
        where = "no step finished, so no report"
    print(f"tlt-stream run: {'finished' if code == 0 else 'stopped'} in {seconds:.0f}s; {where}", file=sys.stderr)
    return code


DEFAULT_WORLD = "artifacts/world"


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

"""`tlt-stream run`: the main job, the whole pipeline as processes on the embedded defaults, with progress
bars and a report."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tlt_stream.commands.args import add_config_args, setting

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
    import time

    import torch

    from tlt_stream.basics.interrupts import noting_sigint, sigint_received
    from tlt_stream.basics.progress import PhaseProgress
    from tlt_stream.commands.run.setup import (
        RunRefused,
        check_plan,
        evaluate_before,
        finish,
        run_services,
        settings_of,
        world_ready,
    )

    try:
        config, out, own = settings_of(args)
        torch.set_num_threads(cores := _cores())
        with PhaseProgress() as progress:
            with noting_sigint():  # the services' own event loop handles a Ctrl-C while they run
                world_ready(config, own, progress)
                plan = check_plan(config, out, own, cores)
                evals = evaluate_before(plan, config, own)
            started = time.perf_counter()
            code = run_services(plan, config, evals, progress, resume=args.resume is not None)
    except RunRefused as refused:
        if sigint_received():  # a Ctrl-C that torch turned into the error refused: an interruption all the same
            raise KeyboardInterrupt from None
        print(f"tlt-stream run: {refused}", file=sys.stderr)
        return refused.code
    with noting_sigint():
        return finish(plan, config, code, evals, time.perf_counter() - started)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))

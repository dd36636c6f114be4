"""`tlt-stream learner`: the learner service (one per run)."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, add_device_arg, load, positive

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    learn = commands.add_parser(
        "learner",
        help="the GRPO learner service: consume samples, update, checkpoint, publish policy versions",
        description="Consumes the run's `samples` stream, assembles complete groups, applies one GRPO update "
        "per --groups-per-step groups, checkpoints to RUN_DIR/checkpoints (resuming from there after a "
        "restart) and publishes each new policy version on MQTT and in the Redis mirror.",
    )
    learn.add_argument("--run-dir", required=True, help="checkpoints, metrics.jsonl")
    learn.add_argument("--policy", required=True, help="initial policy checkpoint (used when RUN_DIR has none)")
    learn.add_argument("--groups-per-step", type=positive, default=8)
    learn.add_argument("--max-staleness", type=int, default=0, help="0: on-policy (synchronous semantics)")
    learn.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate")
    learn.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warmup (updates)")
    learn.add_argument(
        "--final-norm-lr-scale",
        type=float,
        default=1.0,
        help="the final norm's gain (the policy's inverse temperature) trains at lr x this (default 1)",
    )
    learn.add_argument("--max-updates", type=positive, help="stop after this many updates (default: run on)")
    learn.add_argument(
        "--until-version",
        type=positive,
        help="stop once the policy reaches this version, counting what a resumed checkpoint already holds",
    )
    learn.add_argument(
        "--keep-checkpoints", type=positive, default=3, help="complete checkpoints kept on disk (the newest)"
    )
    learn.add_argument("--threads", type=positive, default=1, help="torch threads")
    add_device_arg(learn)
    add_config_args(learn)
    learn.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import torch

    from tlt_stream.roles.learner import serve_learner

    torch.set_num_threads(args.threads)
    return serve_learner(load(args), args)

"""`tlt-stream learner`: the learner service (one per run)."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, load, setting

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    learn = commands.add_parser(
        "learner",
        help="the GRPO learner service: consume samples, update, checkpoint, publish policy versions",
        description="Consumes the run's `samples` stream, assembles complete groups, applies one GRPO update "
        "per learner.groups_per_step groups, checkpoints to RUN_DIR/checkpoints (resuming from there after a "
        "restart) and publishes each new policy version on MQTT and in the Redis mirror. Under `torchrun "
        "--nproc-per-node N` the policy is sharded over the N ranks (FSDP2) and rank 0 alone talks to the bus "
        "(give the run name as TLT_RUN there: torchrun's own parser takes --run). Every setting is in "
        "the configuration (`tlt-stream config describe`); the flags below set the common ones.",
    )
    setting(learn, "--run-dir", keys="learner.run_dir")
    setting(learn, "--policy", keys="learner.policy")
    setting(learn, "--groups-per-step", keys="learner.groups_per_step")
    setting(learn, "--max-staleness", keys="policy.max_staleness")
    setting(learn, "--lr", keys="learner.lr")
    setting(learn, "--warmup-steps", keys="learner.warmup_steps")
    setting(learn, "--final-norm-lr-scale", keys="learner.final_norm_lr_scale")
    setting(learn, "--max-updates", keys="learner.max_updates")
    setting(learn, "--until-version", keys="learner.until_version")
    setting(learn, "--keep-checkpoints", keys="learner.keep_checkpoints")
    setting(learn, "--threads", keys="learner.threads")
    setting(learn, "--device", keys="learner.device")
    add_config_args(learn)
    learn.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.roles.learner import serve_learner

    return serve_learner(load(args))

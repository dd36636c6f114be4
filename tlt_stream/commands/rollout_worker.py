"""`tlt-stream rollout-worker`: a rollout worker service."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, load, setting

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    worker = commands.add_parser(
        "rollout-worker",
        help="a rollout worker: generate prompt groups on the newest verified policy, stream scored samples",
        description="Every setting is in the configuration (`tlt-stream config describe`: sections rollout, sd "
        "and drafter); the flags below set the common ones.",
    )
    setting(worker, "--worker-id", keys="rollout.worker_id")
    setting(worker, "--max-batch", keys="rollout.max_batch")
    setting(worker, "--max-len", keys="rollout.max_len")
    setting(worker, "--temperature", keys="rollout.temperature")
    setting(worker, "--reward", keys="rollout.reward")
    setting(worker, "--drafter", keys="sd.drafter")
    setting(worker, "--sd-arm", keys="sd.arm")
    setting(worker, "--adaptive-sd", keys="sd.adaptive", const=True, help="decide SD per step (with --drafter)")
    setting(worker, "--fixed-sd", keys="sd.adaptive", const=False, help="always speculate with --sd-arm")
    setting(worker, "--sd-crossover", keys="sd.crossover")
    setting(worker, "--no-hidden", keys="rollout.stream_hidden", const=False, help="stream no hidden states")
    setting(worker, "--hidden-share", keys="rollout.hidden_share")
    setting(
        worker,
        "--train-drafter",
        keys="drafter.state_dir",
        metavar="STATE_DIR",
        help="train the drafter online in idle time, keeping training states in STATE_DIR (shared by the run's "
        "workers); needs --drafter DIR",
    )
    setting(worker, "--backend", keys="rollout.backend")
    setting(worker, "--max-tasks", keys="rollout.max_tasks")
    setting(worker, "--threads", keys="rollout.threads")
    setting(worker, "--device", keys="rollout.device")
    add_config_args(worker)
    worker.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.roles.rollout_worker import serve_rollout_worker

    return serve_rollout_worker(load(args))

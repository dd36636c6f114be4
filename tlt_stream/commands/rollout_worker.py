"""`tlt-stream rollout-worker`: a rollout worker service."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, add_device_arg, load, positive, sd_arm, share

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    worker = commands.add_parser(
        "rollout-worker",
        help="a rollout worker: generate prompt groups on the newest verified policy, stream scored samples",
    )
    worker.add_argument("--worker-id", help="default: rollout-HOST-PID")
    worker.add_argument("--max-batch", type=positive, default=64, help="rows decoded together")
    worker.add_argument("--max-len", type=positive, default=1408, help="prompt + response tokens per row")
    worker.add_argument("--temperature", type=float, default=1.0)
    worker.add_argument("--reward", default="repeated_add", help="reward function (repeated_add, math)")
    worker.add_argument(
        "--drafter", help='speculative decoding: a drafter checkpoint directory or "ngram" (default: off)'
    )
    worker.add_argument(
        "--sd-arm", type=sd_arm, default=(4, 1, 4), help="DEPTH,TOPK,VERIFY of the SD arm (default 4,1,4)"
    )
    worker.add_argument(
        "--no-hidden", action="store_true", help="do not stream hidden-state windows (no drafter training data)"
    )
    worker.add_argument(
        "--hidden-share",
        type=share,
        default=1.0,
        help="share of samples whose hidden-state windows are streamed, by a stable hash of the id (default 1)",
    )
    worker.add_argument(
        "--adaptive-sd",
        action="store_true",
        help="with --drafter: decide SD per step (on/off by running batch, arm per batch bucket) instead of --sd-arm",
    )
    worker.add_argument(
        "--sd-crossover", type=positive, default=16, help="batch size above which SD loses (measured; default 16)"
    )
    worker.add_argument(
        "--train-drafter",
        metavar="STATE_DIR",
        help="train the drafter online in idle time, keeping training states in STATE_DIR (shared by the "
        "run's workers); needs --drafter DIR",
    )
    worker.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="rollout engine: this project's (default) or vLLM (GPU, `pip install 'tlt-stream[vllm]'`, fixed "
        "--sd-arm only; UNVERIFIED, docs/vllm.md)",
    )
    worker.add_argument("--max-tasks", type=positive, help="stop after this many tasks (default: run on)")
    worker.add_argument("--threads", type=positive, default=1, help="torch threads")
    add_device_arg(worker)
    add_config_args(worker)
    worker.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import torch

    from tlt_stream.roles.rollout_worker import serve_rollout_worker

    torch.set_num_threads(args.threads)
    return serve_rollout_worker(load(args), args)

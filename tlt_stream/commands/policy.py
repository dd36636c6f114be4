"""`tlt-stream policy`: the policy service (one per run)."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, load, positive

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    policy = commands.add_parser(
        "policy", help="the policy service: dispatch prompt groups step by step inside the staleness window"
    )
    policy.add_argument("--prompts-per-step", type=positive, default=8)
    policy.add_argument("--group-size", type=positive, default=8, help="samples per prompt (GRPO's G)")
    policy.add_argument("--max-staleness", type=int, default=0)
    policy.add_argument("--steps", type=positive, help="dispatch this many steps in all (default: run on)")
    policy.add_argument("--seed", type=int, default=0)
    add_config_args(policy)
    policy.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.roles.policy import serve_policy

    return serve_policy(load(args), args)

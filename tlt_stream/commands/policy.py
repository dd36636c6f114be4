"""`tlt-stream policy`: the policy service (one per run)."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, load, setting

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    policy = commands.add_parser(
        "policy", help="the policy service: dispatch prompt groups step by step inside the staleness window"
    )
    setting(policy, "--prompts-per-step", keys="policy.prompts_per_step")
    setting(policy, "--group-size", keys="policy.group_size")
    setting(policy, "--max-staleness", keys="policy.max_staleness")
    setting(policy, "--steps", keys="policy.steps")
    setting(policy, "--seed", keys="policy.seed")
    add_config_args(policy)
    policy.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.roles.policy import serve_policy

    return serve_policy(load(args))

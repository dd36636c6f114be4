"""`tlt-stream bootstrap`: build the tiny default world: a small policy trained in code, and its drafter."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import positive

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    boot = commands.add_parser(
        "bootstrap",
        help="build the tiny world: a warmed-up policy (DIR/policy) and drafter (DIR/drafter)",
        description="Supervised warm-up of a small policy on the repeated-addition task, then an offline warm-up of "
        "the drafter on the policy's own generations. Deterministic for a seed; skipped when DIR already "
        "holds a matching result; the defaults' world ships with the package and is copied (--rebuild trains it).",
    )
    boot.add_argument("--out", required=True, help="directory to build in")
    boot.add_argument("--seed", type=int, default=0)
    boot.add_argument("--size", choices=["small", "default"], default="default")
    boot.add_argument("--threads", type=positive, default=2, help="torch threads")
    boot.add_argument(
        "--rebuild", action="store_true", help="train even when the world shipped with the package is the one asked for"
    )
    boot.add_argument("-v", "--verbose", action="count", default=0)
    boot.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    import torch

    from tlt_stream.basics.progress import PhaseProgress
    from tlt_stream.tasks.bootstrap import bootstrap

    torch.set_num_threads(args.threads)
    with PhaseProgress() as progress:
        record = bootstrap(args.out, seed=args.seed, size=args.size, progress=progress, rebuild=args.rebuild)
    print(json.dumps(record, indent=2))
    return 0

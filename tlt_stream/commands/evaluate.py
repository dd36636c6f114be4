"""`tlt-stream eval`: held-out accuracy and response lengths of a policy on the tiny task."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, positive

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    ev = commands.add_parser(
        "eval",
        help="accuracy and response lengths on held-out prompts (and acceptance length with a drafter)",
    )
    ev.add_argument("--model", required=True, help="policy checkpoint directory")
    ev.add_argument("--drafter", help="drafter checkpoint directory, or 'ngram'")
    ev.add_argument("--n", type=positive, default=200, help="held-out prompts")
    ev.add_argument(
        "--temperature", type=temperature, default=1.0, help="sampling temperature (0: greedy; default 1.0)"
    )
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--batch-size", type=positive, default=32)
    ev.add_argument("--depth", type=positive, default=4)
    ev.add_argument("--topk", type=positive, default=1)
    ev.add_argument("--threads", type=positive, default=2)
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument("-v", "--verbose", action="count", default=0)
    ev.set_defaults(handler=handle)


def temperature(text: str) -> float:
    """An argparse type: a finite float >= 0, what the engine samples at (0 is greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def handle(args: argparse.Namespace) -> int:
    import json

    import torch
    from safetensors import SafetensorError

    from tlt_stream.basics.progress import PhaseProgress
    from tlt_stream.model import CheckpointError
    from tlt_stream.tasks.evaluate import evaluate

    torch.set_num_threads(args.threads)
    try:
        with PhaseProgress() as progress:
            report = evaluate(
                args.model,
                drafter=args.drafter,
                n=args.n,
                temperature=args.temperature,
                seed=args.seed,
                batch_size=args.batch_size,
                depth=args.depth,
                topk=args.topk,
                progress=lambda done, total: progress("eval", done, total, {}),
            )
    except CheckpointError as exc:
        print(f"tlt-stream eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except SafetensorError as exc:  # the drafter's are checked where it loads: these are the policy's
        print(
            f"tlt-stream eval: {args.model}: unreadable safetensors weights ({exc}); copy or export the checkpoint "
            "again",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(report))
    else:
        length = report["length"]
        print(f"accuracy {report['accuracy']:.1%} on {report['prompts']} held-out prompts (T={report['temperature']})")
        print(
            f"response length p50 {length['p50']:.0f}  p90 {length['p90']:.0f}  p99 {length['p99']:.0f}  "
            f"max {length['max']}  (max/median {length['max_over_median']:.1f}x)"
        )
        if "mean_accept_length" in report:
            print(f"mean acceptance length {report['mean_accept_length']:.2f} ({report['arm']})")
    return 0

"""`tlt-stream eval`: held-out accuracy and response lengths of a policy: on the tiny task (a tiny-world
policy), or on held-out prompts of your own (`--dataset`, scored with `--reward`)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, load, positive, setting

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
    setting(
        ev,
        "--dataset",
        keys="data.eval_dataset",
        help="held-out prompts of your own (JSONL, JSON, CSV, TSV or Parquet, read as `run` reads them; data.* "
        "settings): pass@1 and mean reward of the model on them, instead of the tiny task",
    )
    setting(ev, "--reward", keys="rollout.reward")
    add_config_args(ev, bus=False)
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
    config = load(args)
    if config.data.eval_dataset is not None:
        return _on_dataset(args, config)
    try:
        _check_tiny_world(args.model)
    except CheckpointError as exc:
        print(f"tlt-stream eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
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


def _check_tiny_world(model: str) -> None:
    """The tiny task is written in the character tokenizer: a policy whose own tokenizer is another is refused
    (it would be scored on prompts it cannot read), with the way to evaluate it."""
    from pathlib import Path

    from tlt_stream.model import CheckpointError, load_tokenizer
    from tlt_stream.model.loader import TOKENIZER_FILES, checkpoint_vocab
    from tlt_stream.tasks.tokenizer import vocab

    path = Path(model)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        tiny = load_tokenizer(path).get_vocab() == vocab()
    else:
        tiny = checkpoint_vocab(path) == len(vocab())
    if not tiny:
        raise CheckpointError(
            f"{path}: not a tiny-world policy (its tokenizer is not the tiny task's): evaluate it on held-out "
            "prompts of your own with --dataset FILE [--reward math|exact|module:function]"
        )


def _on_dataset(args: argparse.Namespace, config: Any) -> int:
    """pass@1 and mean reward of `--model` on `data.eval_dataset` at `--temperature` and `--seed`."""
    import json

    from tlt_stream.basics.config import override
    from tlt_stream.basics.interrupts import noting_sigint, sigint_received
    from tlt_stream.commands.run.setup import EVAL_ERRORS, warn_tiny_reward
    from tlt_stream.rl.evaluate import evaluate_dataset
    from tlt_stream.rl.rewards import resolve_reward

    if args.drafter is not None:
        print("tlt-stream eval: --drafter measures acceptance on the tiny task; leave it out with --dataset",
              file=sys.stderr)  # fmt: skip
        return EXIT_CONFIG
    config = override(config, {"policy.seed": args.seed})
    warn_tiny_reward(config.rollout.reward, "eval")
    try:
        with noting_sigint():
            resolve_reward(config.rollout.reward)  # a missing module or function: before the model loads
            report = evaluate_dataset(
                args.model, config, n=args.n, batch_size=args.batch_size, temperature=args.temperature
            )
    except EVAL_ERRORS as exc:
        if sigint_received():  # a Ctrl-C that torch turned into this error (`basics.interrupts`)
            raise KeyboardInterrupt from None
        print(f"tlt-stream eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    report = {"model": str(args.model), "temperature": args.temperature, **report}
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"pass@1 {report['accuracy']:.1%}, mean reward {report['mean_reward']:.3f} on {report['prompts']} held-out "
        f"prompts of {report['dataset']} (T={args.temperature}, reward {config.rollout.reward})"
    )
    print(
        f"response length mean {report['length_mean']:.0f}, {report['truncated']:.0%} cut at the length limit; "
        f"{report['skipped_long_prompts']} prompts over the prompt limit skipped"
    )
    return 0

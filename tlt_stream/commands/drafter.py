"""`tlt-stream drafter init`: an EAGLE drafter warmed up for a policy of one's own, from its own responses."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, load, positive, setting
from tlt_stream.commands.generate import SEED_RANGE, seed

__all__ = ["handle", "register"]


def learning_rate(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class OutError(Exception):
    """`--out` cannot take the drafter (the message says why and what to do, in one line)."""


def _check_out(out: Path, force: bool) -> None:
    """Refuse, before any work, an `--out` the drafter cannot be written to: a file, a folder under a file, a
    non-empty folder without `--force`, a folder that cannot be written to."""
    from tlt_stream.drafter.export import file_in_the_way

    if out.exists() and not out.is_dir():
        raise OutError(f"--out {out}: exists and is not a directory; name a directory")
    if (blocker := file_in_the_way(out)) is not None:
        raise OutError(f"--out {out}: {blocker} is a file, not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutError(f"--out {out}: directory is not empty (pass --force to replace the drafter in it)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = _staging(out)
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise OutError(f"--out {out}: cannot write there ({exc.strerror or exc}); choose another --out") from None


def _staging(out: Path) -> Path:
    """Where the drafter is written before it is moved into `out` whole."""
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


def _publish(staged: Path, out: Path) -> None:
    """Move the drafter at `staged` into `out` (its weights first: a config never names missing ones)."""
    from tlt_stream.drafter.model import CONFIG, WEIGHTS

    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in (WEIGHTS, CONFIG):
            os.replace(staged / name, out / name)
    except OSError as exc:
        raise OutError(f"--out {out}: cannot write the drafter ({exc.strerror or exc})") from None


def register(commands: Any) -> None:
    drafter = commands.add_parser("drafter", help="drafters for a policy of your own (init)")
    actions = drafter.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = actions.add_parser(
        "init",
        help="warm an EAGLE drafter up on the policy's own responses to a dataset's prompts",
        description="Samples the policy's responses to the first --samples prompts of --dataset (chat template, "
        "prompt limit and fields as for training: data.*), then trains a fresh one-layer drafter on the policy's "
        "hidden states over them, with progress bars. `tlt-stream run --policy DIR --drafter OUT` starts from it "
        "and keeps training it online.",
    )
    init.add_argument("--out", required=True, help="directory for the drafter")
    setting(init, "--policy", keys="learner.policy")
    setting(init, "--dataset", keys="data.dataset")
    setting(init, "--max-len", keys="rollout.max_len")
    init.add_argument("--samples", type=positive, default=256, help="prompts sampled (default 256)")
    init.add_argument("--steps", type=positive, default=1600, help="drafter training steps (default 1600)")
    init.add_argument("--lr", type=learning_rate, default=2e-3, help="drafter learning rate (default 2e-3)")
    init.add_argument("--seed", type=seed, default=0, help="prompt i samples with seed + i")
    init.add_argument("--force", action="store_true", help="replace the drafter in a non-empty --out")
    init.add_argument("--threads", type=positive, default=2, help="torch threads")
    add_config_args(init, bus=False)
    init.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:

    import torch

    from tlt_stream.basics.config import redact_text
    from tlt_stream.basics.errors import ConfigError
    from tlt_stream.model import CheckpointError, load_spec, load_tokenizer
    from tlt_stream.model.sizing import context_len
    from tlt_stream.rl.datasets import DatasetError, pool_from_config

    config = load(args)
    data = config.data
    if config.learner.policy is None or data.dataset is None:
        print("tlt-stream drafter init: --policy DIR and --dataset FILE are required", file=sys.stderr)
        return EXIT_CONFIG
    out = Path(args.out)
    try:
        _check_out(out, args.force)
    except OutError as exc:
        print(f"tlt-stream drafter init: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    torch.set_num_threads(args.threads)
    try:
        tokenizer = load_tokenizer(data.tokenizer or config.learner.policy)
        positions = load_spec(config.learner.policy).max_position_embeddings
        max_len = context_len(config.rollout.max_len, positions, config.learner.policy)
        pool = pool_from_config(data.dataset, config, tokenizer, seed=args.seed, max_len=max_len)
    except (CheckpointError, ConfigError, DatasetError, OSError, ValueError) as exc:
        print(f"tlt-stream drafter init: {redact_text(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    prompts = [ids for _, _, ids, _ in pool.prompts(0, min(args.samples, len(pool)))]
    if args.seed + len(prompts) - 1 > SEED_RANGE[1]:
        print(
            f"tlt-stream drafter init: --seed {args.seed}: prompt i samples with seed + i, which passes 2**63 - 1 "
            f"for {len(prompts)} prompts; use a smaller --seed",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    staged = _staging(out)
    shutil.rmtree(staged, ignore_errors=True)
    try:
        code = _warm_up(args, config, tokenizer, prompts, max_len, staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return code


def _warm_up(
    args: argparse.Namespace, config: Any, tokenizer: Any, prompts: list, max_len: int, staged: Path, out: Path
) -> int:
    """Sample the windows, train the drafter into `staged`, and move it into `out` when training held."""
    import json

    from tlt_stream.basics.progress import PhaseProgress
    from tlt_stream.drafter.model import read_drafter
    from tlt_stream.model import CheckpointError, stop_token_ids
    from tlt_stream.rollout.warmup import policy_windows, warm_up_drafter

    with PhaseProgress() as progress:
        windows = policy_windows(
            config.learner.policy,
            prompts,
            max_len=max_len,
            stops=stop_token_ids(config.learner.policy, tokenizer),
            seed=args.seed,
            temperature=config.rollout.temperature,
            progress=progress,
        )
        stats = warm_up_drafter(
            config.learner.policy,
            windows,
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            out=staged,
            progress=progress,
        )
    try:
        read_drafter(staged)  # refuses weights that are not all finite
        finite = all(math.isfinite(v) for v in stats.values())
    except CheckpointError:
        finite = False
    if not finite:
        loss = stats.get("loss", float("nan"))
        print(
            f"tlt-stream drafter init: training diverged at --lr {args.lr} (loss {loss}); nothing was written "
            f"to {out}: lower --lr",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        _publish(staged, out)
    except OutError as exc:
        print(f"tlt-stream drafter init: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    tokens = sum(len(w.tokens) - w.prompt_len for w in windows)
    print(json.dumps({"out": args.out, "prompts": len(prompts), "response_tokens": tokens, **stats}, indent=2))
    return 0

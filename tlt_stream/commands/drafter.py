"""`tlt-stream drafter init`: an EAGLE drafter warmed up for a policy of one's own, from its own responses."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, load, positive, setting

__all__ = ["handle", "register"]


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
    init.add_argument("--lr", type=float, default=2e-3, help="drafter learning rate (default 2e-3)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--threads", type=positive, default=2, help="torch threads")
    add_config_args(init, bus=False)
    init.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    import torch

    from tlt_stream.basics.config import redact_text
    from tlt_stream.basics.errors import ConfigError
    from tlt_stream.basics.progress import PhaseProgress
    from tlt_stream.model import CheckpointError, load_spec, load_tokenizer, stop_token_ids
    from tlt_stream.model.sizing import context_len
    from tlt_stream.rl.datasets import DatasetError, pool_from_config
    from tlt_stream.rollout.warmup import policy_windows, warm_up_drafter

    config = load(args)
    data = config.data
    if config.learner.policy is None or data.dataset is None:
        print("tlt-stream drafter init: --policy DIR and --dataset FILE are required", file=sys.stderr)
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
            out=args.out,
            progress=progress,
        )
    tokens = sum(len(w.tokens) - w.prompt_len for w in windows)
    print(json.dumps({"out": args.out, "prompts": len(prompts), "response_tokens": tokens, **stats}, indent=2))
    return 0

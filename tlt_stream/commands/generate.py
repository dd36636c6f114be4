"""`tlt-stream generate`: generate from a JSONL file of prompts with the rollout engine (plain or speculative)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, positive

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate from a JSONL file of prompts with the rollout engine (plain or speculative)",
        description='Rows {"prompt_ids": [...]} or {"prompt": "..."} in; rows {token_ids, logprobs, '
        "finish_reason, accept_lengths} out, in input order.",
    )
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint directory (Llama/Qwen2)")
    gen.add_argument("--drafter", help="drafter checkpoint directory, or 'ngram' for prompt lookup")
    gen.add_argument("--sd", choices=["off", "on"], help="speculative decoding (default: on with --drafter)")
    gen.add_argument("--depth", type=positive, default=4, help="draft depth (levels)")
    gen.add_argument("--topk", type=positive, default=1, help="children per drafted node (1: a chain)")
    gen.add_argument("--verify", type=positive, help="nodes verified per round (default depth x topk)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    gen.add_argument("--max-new-tokens", type=positive, default=256)
    gen.add_argument("--seed", type=int, default=0, help="row i samples with seed + i")
    gen.add_argument("--batch-size", type=positive, default=32, help="rows decoded together at most")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="torch: this project's engine; vllm: vLLM on a GPU (pip install 'tlt-stream[vllm]'; EAGLE chains)",
    )
    gen.add_argument("--input", required=True, help="JSONL prompts")
    gen.add_argument("--output", required=True, help="JSONL results")
    gen.add_argument("-v", "--verbose", action="count", default=0)
    gen.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:

    from tlt_stream.generate import GenerateOptions, InputError, run_generate
    from tlt_stream.model import CheckpointError
    from tlt_stream.rollout.vllm.backend import BackendUnavailable

    sd = args.sd or ("on" if args.drafter else "off")
    if sd == "on" and not args.drafter:
        print("tlt-stream generate: --sd on needs --drafter DIR or --drafter ngram", file=sys.stderr)
        return EXIT_CONFIG
    options = GenerateOptions(
        model=Path(args.model),
        input=Path(args.input),
        output=Path(args.output),
        drafter=args.drafter if sd == "on" else None,
        depth=args.depth,
        topk=args.topk,
        verify=args.verify,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        dtype=args.dtype,
        backend=args.backend,
    )
    try:
        run_generate(options)
    except (InputError, CheckpointError, ValueError, BackendUnavailable) as exc:
        print(f"tlt-stream generate: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0

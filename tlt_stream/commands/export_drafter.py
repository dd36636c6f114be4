"""`tlt-stream export-drafter`: export a drafter in a serving engine's EAGLE layout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    export = commands.add_parser(
        "export-drafter",
        help="write a drafter checkpoint in the layout vLLM's EAGLE loader reads (config.json + safetensors)",
        description="Export CHECKPOINT (a drafter directory, or an online-training state holding drafter/) for "
        "serving: --format eagle writes vLLM's EAGLE-1 Llama draft layout, loaded with "
        'speculative_config={"method": "eagle", "model": OUT}. The embedding and LM head are shared from the '
        "target by vLLM and are not written (see docs/vllm.md).",
    )
    export.add_argument("checkpoint", help="drafter checkpoint directory (or an online-training state directory)")
    export.add_argument("--format", choices=["eagle"], default="eagle", help="target layout (default eagle)")
    export.add_argument("--out", required=True, help="directory to write (created; must be empty unless --force)")
    export.add_argument(
        "--policy", help="also write this policy checkpoint's embedding (vLLM loads it only with pipeline parallelism)"
    )
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    export.add_argument("--force", action="store_true", help="replace an existing export in --out")
    export.add_argument("-v", "--verbose", action="count", default=0)
    export.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    from tlt_stream.drafter.export import export_drafter
    from tlt_stream.model import CheckpointError

    try:
        result = export_drafter(
            args.checkpoint, args.out, format=args.format, policy=args.policy, dtype=args.dtype, overwrite=args.force
        )
    except (CheckpointError, OSError) as exc:
        print(f"tlt-stream export-drafter: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(
        json.dumps(
            {
                "out": str(result.path),
                "format": args.format,
                "architecture": "EagleLlamaForCausalLM",
                "tensors": list(result.tensors),
                "with_embedding": result.with_embedding,
            }
        )
    )
    return 0

"""The model families on the torch runtime: decode speed against transformers, the cost of long contexts, and
long generations token-identical to transformers.

Three figures, each family a random checkpoint built from its transformers config class (`tests/families.py`):
- plain greedy decode tokens/s of `GenerationEngine` vs transformers' `generate` (fp32 both, EOS off,
  `min_new_tokens` forced) at batch 1 and 32, on a tiny model and a ~100M-parameter one; the two are
  interleaved per repetition so background load hits both alike, and the ratio is measured in one run;
- the cost of long contexts: decode tokens/s at batch 1 after 1k, 4k and 8k tokens of context, ours and
  transformers', for one model per RoPE type;
- long generations: greedy output to `--long-tokens` new tokens (8k by default) for one model per RoPE type
  (default, llama3, YaRN, linear), plain and with n-gram drafts, compared token for token with transformers.

Prints progress to stderr and one JSON object to stdout. `--quick` finishes in a few minutes on 2 cores.
Run from the repository root: `python -m bench.families [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.rollout import machine
from tests.families import FAMILIES, build_family

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2),
    "100m": dict(
        vocab=32_000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}
ROPE_FAMILIES = {"default": "qwen3", "llama3": "llama3", "yarn": "yarn", "linear": "linear"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "100m"])
    p.add_argument("--long-tokens", type=int, help="new tokens of the long generations (default 8192, quick 2048)")
    p.add_argument("--skip", nargs="*", choices=["decode", "context", "long"], default=[])
    args = p.parse_args()
    args.new_tokens = 16 if args.quick else 32
    args.reps = 2 if args.quick else 3
    args.contexts = [1024, 4096] if args.quick else [1024, 4096, 8192]
    args.long_tokens = args.long_tokens or (2048 if args.quick else 8192)
    return args


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build(root: Path, family: str, size: str, positions: int) -> tuple[Any, Any]:
    import torch

    from tlt_stream.model import load_model

    shape = dict(SIZES[size])
    vocab = shape.pop("vocab")
    if family == "qwen3":
        shape.setdefault("head_dim", 32 if size == "tiny" else 64)
    if family in ("mistral", "ministral") and size == "tiny":
        shape["head_dim"] = 16
    path = root / f"{family}-{size}-{positions}"
    hf = build_family(family, path, vocab=vocab, max_position_embeddings=positions, **shape)
    with torch.no_grad():
        hf.model.norm.weight.fill_(12.0)  # peaked next-token distributions: greedy ties are rare
    hf.save_pretrained(path)
    return hf.eval(), load_model(path)


def race(torch, hf, ours, prompts, n: int, reps: int) -> dict[str, Any]:
    """Median tokens/s of both at the same greedy work, interleaved; and whether the tokens agree."""
    from tlt_stream.rollout.engine import GenerationEngine

    b, p = prompts.shape
    engine = GenerationEngine(ours, max_batch=b, max_len=p + n)
    kwargs = dict(
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    out: dict[str, Any] = {}
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        out["ours"] = engine.generate(prompts.tolist(), n)
        t1 = time.perf_counter()
        with torch.inference_mode():
            out["hf"] = hf.generate(prompts, **kwargs)
        t2 = time.perf_counter()
        if rep:
            times["ours"].append(t1 - t0)
            times["hf"].append(t2 - t1)
    tps = {k: b * n / statistics.median(v) for k, v in times.items()}
    same = sum(r.token_ids == out["hf"][i, p:].tolist() for i, r in enumerate(out["ours"]))
    return {
        "ours_tok_s": round(tps["ours"], 1),
        "hf_tok_s": round(tps["hf"], 1),
        "ratio": round(tps["ours"] / tps["hf"], 3),
        "greedy_rows_identical": f"{same}/{b}",
    }


def bench_decode(torch, root: Path, args) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        for family in args.families:
            hf, ours = build(root, family, size, 256)
            vocab = ours.spec.vocab_size
            for b in (1, 32):
                prompts = torch.randint(1, vocab, (b, 16), generator=torch.Generator().manual_seed(b))
                row = {"family": family, "size": size, "params": ours.spec.num_parameters(), "batch": b}
                row |= race(torch, hf, ours, prompts, args.new_tokens, args.reps)
                log(json.dumps(row))
                rows.append(row)
    return rows


def bench_context(torch, root: Path, args) -> list[dict[str, Any]]:
    rows = []
    for rope, family in ROPE_FAMILIES.items():
        hf, ours = build(root, family, "tiny", max(args.contexts) + 64)
        for context in args.contexts:
            prompt = torch.randint(1, ours.spec.vocab_size, (1, context), generator=torch.Generator().manual_seed(7))
            row = {"rope": rope, "family": family, "context": context, "batch": 1}
            row |= race(torch, hf, ours, prompt, args.new_tokens, args.reps)
            log(json.dumps(row))
            rows.append(row)
    return rows


def bench_long(torch, root: Path, args) -> list[dict[str, Any]]:
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import NgramProposer

    n, rows = args.long_tokens, []
    for rope, family in ROPE_FAMILIES.items():
        hf, ours = build(root, family, "tiny", n + 64)
        prompt = torch.randint(1, ours.spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
        t0 = time.perf_counter()
        with torch.inference_mode():
            reference = hf.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, 16:].tolist()  # fmt: skip
        t1 = time.perf_counter()
        plain = GenerationEngine(ours, 1, 16 + n).generate(prompt.tolist(), n)[0].token_ids
        t2 = time.perf_counter()
        engine = GenerationEngine(ours, 1, 16 + n, proposer=NgramProposer(), arm=Arm.ngram(4))
        sd = engine.generate(prompt.tolist(), n)[0].token_ids
        t3 = time.perf_counter()
        first_diff = next((i for i, (a, b) in enumerate(zip(plain, reference, strict=True)) if a != b), None)
        row = {
            "rope": rope,
            "family": family,
            "new_tokens": n,
            "plain_identical": plain == reference,
            "ngram_identical": sd == reference,
            "first_difference": first_diff,
            "hf_s": round(t1 - t0, 1),
            "plain_s": round(t2 - t1, 1),
            "ngram_s": round(t3 - t2, 1),
            "ngram_rounds": engine.rounds,
        }
        log(json.dumps(row))
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result: dict[str, Any] = {"bench": "families", "machine": machine(torch, transformers, args.threads)}
    result["settings"] = {k: v for k, v in vars(args).items() if k != "skip"}
    with tempfile.TemporaryDirectory(prefix="tlt-families-") as tmp:
        root = Path(tmp)
        if "decode" not in args.skip:
            result["decode"] = bench_decode(torch, root, args)
        if "context" not in args.skip:
            result["context"] = bench_context(torch, root, args)
        if "long" not in args.skip:
            result["long"] = bench_long(torch, root, args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

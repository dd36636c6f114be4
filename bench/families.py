"""The model families on the torch runtime: decode speed against transformers, the cost of long contexts, and
long generations token-identical to transformers.

Three figures, each family a random checkpoint built from its transformers config class (`tests/families.py`):
- plain greedy decode tokens/s of `GenerationEngine` vs transformers' `generate` (fp32 both, EOS off,
  `min_new_tokens` forced) at batch 1 and 32, on a tiny model and a ~100M-parameter one; the two are
  interleaved per repetition so background load hits both alike, and the ratio is measured in one run;
- the cost of long contexts: decode tokens/s at batch 1 after 1k, 4k and 8k tokens of context, ours and
  transformers', for one model per RoPE type (the decode steps timed alone: transformers' through a streamer
  that notes each token's time, ours from the end of the first step);
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
    p.add_argument("--new-tokens", type=int, help="tokens decoded per timed run (default 32, quick 16)")
    p.add_argument("--reps", type=int, help="timed repetitions per figure (default 3, quick 2)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32], help="decode batch sizes (default 1 32)")
    p.add_argument("--contexts", nargs="+", type=int, help="context lengths (default 1024 4096 8192, quick 1024 4096)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both engines on it)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights of both engines")
    args = p.parse_args()
    args.new_tokens = args.new_tokens or (16 if args.quick else 32)
    args.reps = args.reps or (2 if args.quick else 3)
    args.contexts = args.contexts or ([1024, 4096] if args.quick else [1024, 4096, 8192])
    args.long_tokens = args.long_tokens or (2048 if args.quick else 8192)
    return args


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build(root: Path, family: str, size: str, positions: int, args: Any) -> tuple[Any, Any]:
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
    dtype = getattr(torch, args.dtype)
    return hf.to(args.device, dtype).eval(), load_model(path, dtype=dtype, device=args.device)


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
        if prompts.is_cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if rep:
            times["ours"].append(t1 - t0)
            times["hf"].append(t2 - t1)
    tps = {k: b * n / statistics.median(v) for k, v in times.items()}
    same = sum(r.token_ids == out["hf"][i, p:].tolist() for i, r in enumerate(out["ours"]))
    return {
        "ours_s": statistics.median(times["ours"]),
        "hf_s": statistics.median(times["hf"]),
        "ours_tok_s": round(tps["ours"], 1),
        "hf_tok_s": round(tps["hf"], 1),
        "ratio": round(tps["ours"] / tps["hf"], 3),
        "greedy_rows_identical": f"{same}/{b}",
    }


def bench_decode(torch, root: Path, args) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        for family in args.families:
            hf, ours = build(root, family, size, 256, args)
            vocab = ours.spec.vocab_size
            for b in args.batches:
                prompts = torch.randint(1, vocab, (b, 16), generator=torch.Generator().manual_seed(b)).to(args.device)
                row = {"family": family, "size": size, "params": ours.spec.num_parameters(), "batch": b}
                row |= race(torch, hf, ours, prompts, args.new_tokens, args.reps)
                log(json.dumps(row))
                rows.append(row)
    return rows


class _Stamps:
    """A transformers streamer that notes when each put came: the prompt first, then every new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode_rates(torch, hf, ours, prompt, n: int, reps: int) -> dict[str, Any]:
    """Decode tokens/s at batch 1 after `prompt`'s context, the prefill left out on both sides: ours from the
    end of the first step (the prefill and the first decode step) to the last token, transformers' `generate`
    from its second streamed token (the first decoded one) to the last. Interleaved, median of `reps`."""
    from tlt_stream.rollout.engine import GenerationEngine

    p = prompt.shape[1]
    engine = GenerationEngine(ours, max_batch=1, max_len=p + n)
    rates: dict[str, list[float]] = {"ours": [], "hf": []}
    prefill: dict[str, list[float]] = {"ours": [], "hf": []}
    out: dict[str, Any] = {}
    for rep in range(reps + 1):
        engine.add_request(prompt[0].tolist(), n, request_id="r")
        t0 = time.perf_counter()
        finished = engine.step()
        t1, first = time.perf_counter(), engine.tokens_generated
        while not finished:
            finished = engine.step()
        t2 = time.perf_counter()
        out["ours"] = finished[0].token_ids
        stamps = _Stamps()
        with torch.inference_mode():
            out["hf"] = hf.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0, streamer=stamps,
            )[0, p:].tolist()  # fmt: skip
        if rep:
            rates["ours"].append((engine.tokens_generated - first) / (t2 - t1))
            rates["hf"].append((n - 1) / (stamps.times[-1] - stamps.times[1]))
            prefill["ours"].append(t1 - t0)
            prefill["hf"].append(stamps.times[1] - stamps.times[0])
        engine.tokens_generated = 0
    ours_tps, hf_tps = statistics.median(rates["ours"]), statistics.median(rates["hf"])
    return {
        "decode_ours_tok_s": round(ours_tps, 1),
        "decode_hf_tok_s": round(hf_tps, 1),
        "decode_ratio": round(ours_tps / hf_tps, 3),
        "prefill_ours_s": round(statistics.median(prefill["ours"]), 3),
        "prefill_hf_s": round(statistics.median(prefill["hf"]), 3),
        "greedy_identical": out["ours"] == out["hf"],
    }


def bench_context(torch, root: Path, args) -> list[dict[str, Any]]:
    rows = []
    for rope, family in ROPE_FAMILIES.items():
        hf, ours = build(root, family, "tiny", max(args.contexts) + args.new_tokens + 64, args)
        for context in args.contexts:
            prompt = torch.randint(1, ours.spec.vocab_size, (1, context), generator=torch.Generator().manual_seed(7))
            row = {"rope": rope, "family": family, "context": context, "batch": 1, "new_tokens": args.new_tokens}
            row |= decode_rates(torch, hf, ours, prompt.to(args.device), args.new_tokens, args.reps)
            log(json.dumps(row))
            rows.append(row)
    return rows


def bench_long(torch, root: Path, args) -> list[dict[str, Any]]:
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import NgramProposer

    n, rows = args.long_tokens, []
    for rope, family in ROPE_FAMILIES.items():
        hf, ours = build(root, family, "tiny", n + 64, args)
        prompt = torch.randint(1, ours.spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
        prompt = prompt.to(args.device)
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
        if "long" not in args.skip:
            result["long"] = bench_long(torch, root, args)
        if "decode" not in args.skip:
            result["decode"] = bench_decode(torch, root, args)
        if "context" not in args.skip:
            result["context"] = bench_context(torch, root, args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

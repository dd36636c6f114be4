"""Rollout throughput of the torch runtime against transformers, and the verify-cost curve.

Two figures decide whether the runtime and speculative decoding pay on a machine:
- plain greedy decoding tokens/s of `GenerationEngine` vs transformers' `generate` at several batch sizes
  (same weights, same token count: EOS off, `min_new_tokens` forced), ratios measured in one run with the
  two interleaved per repetition so background load hits both alike;
- the verify-cost curve: time of one target forward (+ LM head) over k new tokens per row after a committed
  context, relative to k = 1; speculative decoding pays where verifying k tokens costs far less than k steps;
- the speculative path's own overhead: at batch 1 with an oracle drafter (it always proposes the target's
  greedy continuation, so every round accepts all d drafts plus the bonus token), decode tokens/s relative
  to the ideal (tokens per round / (measured propose time + measured verify forward over d+1 tokens)).
The full run also decodes with a long context (768-token prompts), where transformers' growing cache costs.

Models are randomly initialised Qwen2 configurations (~25M and ~3M parameters). Prints progress to stderr
and one JSON object to stdout. `--quick` finishes in under a minute on 2 cores. Run from the repository
root: `python -m bench.rollout [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    "25m": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1408
    ),
    "3m": dict(
        hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688
    ),
}
VOCAB = 4096


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sweep that finishes in under a minute")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["25m", "3m"])
    p.add_argument("--batches", nargs="+", type=int, help="decode batch sizes (default 1 8 32 64)")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], help="(default: float32 bfloat16)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, help="tokens generated per row (default 128, quick 16)")
    p.add_argument("--reps", type=int, help="timed repetitions per figure (default 5, quick 3)")
    p.add_argument("--hf-static", action="store_true", help="also time transformers with a StaticCache")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd decode forwards")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads < 1:
        p.error("--threads must be >= 1")
    quick = args.quick
    args.batches = args.batches or ([1, 8, 32] if quick else [1, 8, 32, 64])
    args.dtypes = args.dtypes or (["float32"] if quick else ["float32", "bfloat16"])
    args.new_tokens = args.new_tokens or (16 if quick else 128)
    args.reps = args.reps or (3 if quick else 5)
    args.verify_batches = [1, 4, 16] if quick else [1, 4, 16, 32]
    args.verify_k = [1, 2, 4, 8, 16, 32]
    args.verify_reps = 5 if quick else 15
    args.verify_context = 256
    args.long_prompt_len = None if quick else 768
    args.long_new_tokens = 256
    args.long_batches = [8, 32]
    args.sd_depths = [2, 4] if quick else [2, 4, 8]
    args.sd_new_tokens = 48 if quick else 160
    return args


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def machine(torch, transformers, threads: int) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "loadavg_start": list(os.getloadavg()),
    }


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench_decode(torch, hf, ours, size: str, dtype: str, args) -> list[dict[str, Any]]:
    rows = []
    for b in args.batches:
        row = {"model": size, "dtype": dtype, "batch": b, **decode_one(torch, hf, ours, b, args)}
        log(json.dumps(row))
        rows.append(row)
    return rows


def decode_one(torch, hf, ours, b: int, args, p: int | None = None, n: int | None = None) -> dict[str, Any]:
    """Greedy tokens/s of our engine and of transformers' generate at batch `b`, interleaved per rep."""
    from tlt_stream.rollout.engine import GenerationEngine

    p, n = p or args.prompt_len, n or args.new_tokens
    gen = torch.Generator().manual_seed(args.seed + b)
    prompts = torch.randint(0, VOCAB, (b, p), generator=gen)
    engine = GenerationEngine(ours, max_batch=b, max_len=p + n, cache_dtype=torch.float32)
    hf_kwargs = dict(
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    variants = {"hf_dynamic": {}}
    if args.hf_static:
        variants["hf_static"] = {"cache_implementation": "static"}
    outputs: dict[str, Any] = {}

    def run_ours() -> None:
        outputs["ours"] = engine.generate(prompts.tolist(), n)

    def run_hf(name: str) -> None:
        with torch.inference_mode():
            outputs[name] = hf.generate(prompts, **hf_kwargs, **variants[name])

    times: dict[str, list[float]] = {"ours": [], **{k: [] for k in variants}}
    for rep in range(args.reps + 1):
        t_ours = timed(run_ours)
        t_hf = {k: timed(run_hf, k) for k in variants}
        if rep == 0:
            continue
        times["ours"].append(t_ours)
        for k, t in t_hf.items():
            times[k].append(t)
    tps = {k: b * n / statistics.median(v) for k, v in times.items()}
    best_hf = max(variants, key=tps.__getitem__)
    match = sum(r.token_ids == outputs["hf_dynamic"][i, p:].tolist() for i, r in enumerate(outputs["ours"]))
    return {
        "new_tokens": n,
        "prompt_len": p,
        "ours_tok_s": round(tps["ours"], 1),
        **{f"{k}_tok_s": round(tps[k], 1) for k in variants},
        "ratio_vs_hf_dynamic": round(tps["ours"] / tps["hf_dynamic"], 3),
        "ratio_vs_best_hf": round(tps["ours"] / tps[best_hf], 3),
        "greedy_rows_identical": f"{match}/{b}",
    }


def verify_forward(model, ids, positions, cache, tree_mask) -> None:
    model.logits(model(ids, positions, cache, tree_mask=tree_mask))


def bench_verify(torch, ours, size: str, dtype: str, args) -> list[dict[str, Any]]:
    ctx, kmax = args.verify_context, max(args.verify_k)
    cache = ours.new_cache(max(args.verify_batches), ctx + kmax, dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.fill_(ctx)
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        for b in args.verify_batches:
            medians = {}
            for k in args.verify_k:
                call = (
                    ours,
                    torch.randint(0, VOCAB, (b, k), generator=gen),
                    ctx + torch.arange(k).expand(b, k),
                    cache,
                    torch.ones(k, k, dtype=torch.bool).tril().expand(b, k, k),
                )
                verify_forward(*call)
                medians[k] = statistics.median(timed(verify_forward, *call) for _ in range(args.verify_reps))
            row = {
                "model": size,
                "dtype": dtype,
                "batch": b,
                "context": ctx,
                "ms": {k: round(v * 1e3, 3) for k, v in medians.items()},
                "relative_to_k1": {k: round(v / medians[1], 3) for k, v in medians.items()},
            }
            log(json.dumps(row))
            rows.append(row)
    return rows


def bench_sd_overhead(torch, ours, size: str, args) -> list[dict[str, Any]]:
    """Batch-1 speculative decoding with an oracle drafter vs the ideal its measured costs imply."""
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import OracleProposer

    p, n = args.prompt_len, args.sd_new_tokens
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, VOCAB, (p,), generator=gen).tolist()
    plain = GenerationEngine(ours, 1, p + n, cache_dtype=torch.float32)
    reference = plain.generate([prompt], n)[0].token_ids
    prefill_s = statistics.median(timed(plain.generate, [prompt], 1) for _ in range(args.reps))
    plain_s = statistics.median(timed(plain.generate, [prompt], n) for _ in range(args.reps)) - prefill_s
    rows = []
    for depth in args.sd_depths:
        arm = Arm.drafter(depth, 1, depth)
        proposer = OracleProposer({tuple(prompt[1:]): reference}, VOCAB)
        engine = GenerationEngine(ours, 1, p + n, cache_dtype=torch.float32, proposer=proposer, arm=arm)
        walls, outputs = [], None
        for _ in range(args.reps + 1):
            rounds_before = engine.rounds
            t0 = time.perf_counter()
            outputs = engine.generate([prompt], n)
            walls.append(time.perf_counter() - t0)
            rounds = engine.rounds - rounds_before
        assert outputs is not None and outputs[0].token_ids == reference, "SD changed the greedy output"
        sd_s = statistics.median(walls[1:]) - prefill_s
        per_round = (n - 1) / rounds
        # Ideal: the measured propose and verify costs per round, nothing else.
        cache = ours.new_cache(1, p + n + depth + 2, dtype=torch.float32)
        cache.k.normal_()
        cache.v.normal_()
        cache.lengths.fill_(p + n // 2)
        call = (
            ours,
            torch.randint(0, VOCAB, (1, depth + 1), generator=gen),
            (p + n // 2 + torch.arange(depth + 1))[None],
            cache,
            torch.ones(depth + 1, depth + 1, dtype=torch.bool).tril()[None],
        )
        with torch.inference_mode():
            verify_forward(*call)
            verify_s = statistics.median(timed(verify_forward, *call) for _ in range(args.verify_reps))
        proposer.reset_slot(0)
        proposer.observe(0, prompt[1:] + reference[: n // 2])
        propose_s = statistics.median(
            timed(proposer.propose, 1, arm, torch.zeros(1), [None]) for _ in range(args.verify_reps)
        )
        ideal_tok_s = per_round / (propose_s + verify_s)
        actual_tok_s = (n - 1) / sd_s
        row = {
            "model": size,
            "depth": depth,
            "tokens_per_round": round(per_round, 2),
            "plain_decode_tok_s": round((n - 1) / plain_s, 1),
            "sd_decode_tok_s": round(actual_tok_s, 1),
            "speedup_vs_plain": round(actual_tok_s * plain_s / (n - 1), 3),
            "verify_ms": round(verify_s * 1e3, 3),
            "propose_ms": round(propose_s * 1e3, 3),
            "ideal_tok_s": round(ideal_tok_s, 1),
            "fraction_of_ideal": round(actual_tok_s / ideal_tok_s, 3),
        }
        log(json.dumps(row))
        rows.append(row)
    return rows


def decode_forward(fwd, ids, cache) -> None:
    fwd(ids, cache.lengths[: ids.shape[0], None].clone(), cache)


def bench_compile(torch, ours, size: str, args) -> dict[str, Any]:
    """Decode-forward time, eager vs torch.compile(dynamic=True), plus the first call's wall time."""
    compiled = torch.compile(ours, dynamic=True)
    out: dict[str, Any] = {"model": size, "batches": {}}
    with torch.inference_mode():
        for b in args.batches:
            cache = ours.new_cache(b, args.verify_context + 64, dtype=torch.float32)
            cache.k.normal_()
            cache.v.normal_()
            cache.lengths.fill_(args.verify_context)
            ids = torch.zeros(b, 1, dtype=torch.long)
            res = {}
            for name, fwd in (("eager", ours), ("compiled", compiled)):
                res[f"{name}_first_s"] = round(timed(decode_forward, fwd, ids, cache), 2)
                ts = [timed(decode_forward, fwd, ids, cache) for _ in range(10)]
                res[f"{name}_ms"] = round(statistics.median(ts) * 1e3, 3)
            out["batches"][b] = res
            log(f"compile {size} b={b}: {res}")
    return out


def main() -> None:
    args = parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tlt_stream.model import load_model

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    result: dict[str, Any] = {
        "bench": "rollout",
        "quick": args.quick,
        "machine": machine(torch, transformers, args.threads),
        "settings": {
            "batches": args.batches,
            "dtypes": args.dtypes,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "reps": args.reps,
            "statistic": "median",
            "ours": "GenerationEngine, weights in `dtype`, KV cache in float32",
            "hf_generate": "greedy, eos off, min_new_tokens=max_new_tokens, DynamicCache (default)"
            + (" and StaticCache" if args.hf_static else ""),
            "verify": {
                "context": args.verify_context,
                "batches": args.verify_batches,
                "k": args.verify_k,
                "reps": args.verify_reps,
                "what": "one forward over k chain-masked new tokens per row + LM head",
            },
        },
        "models": {},
        "decode": [],
        "verify": [],
        "sd_overhead": [],
        "decode_long": [],
    }
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            torch.manual_seed(args.seed)
            config = Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, **SIZES[size])
            hf32 = AutoModelForCausalLM.from_config(config).eval()
            path = Path(tmp) / size
            hf32.save_pretrained(path, safe_serialization=True)
            for dtype in args.dtypes:
                torch_dtype = getattr(torch, dtype)
                ours = load_model(path, dtype=torch_dtype)
                hf = hf32 if dtype == "float32" else AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
                hf.eval()
                result["models"][size] = {"parameters": ours.spec.num_parameters(), **SIZES[size]}
                log(f"{size} ({ours.spec.num_parameters() / 1e6:.1f}M params) {dtype}: decode")
                result["decode"] += bench_decode(torch, hf, ours, size, dtype, args)
                log(f"{size} {dtype}: verify-cost curve")
                result["verify"] += bench_verify(torch, ours, size, dtype, args)
                if dtype == "float32":
                    log(f"{size}: speculative-path overhead (oracle drafter, batch 1)")
                    result["sd_overhead"] += bench_sd_overhead(torch, ours, size, args)
                    if args.long_prompt_len:
                        for b in args.long_batches:
                            log(f"{size}: long-context decode b={b}")
                            row = decode_one(torch, hf, ours, b, args, args.long_prompt_len, args.long_new_tokens)
                            row = {"model": size, "dtype": dtype, "batch": b, **row}
                            log(json.dumps(row))
                            result["decode_long"].append(row)
                if args.compile and dtype == "float32":
                    result.setdefault("compile", []).append(bench_compile(torch, ours, size, args))
    ratios = [r["ratio_vs_best_hf"] for r in result["decode"]]
    hf_fp32 = {(r["model"], r["batch"]): r["hf_dynamic_tok_s"] for r in result["decode"] if r["dtype"] == "float32"}
    result["summary"] = {
        "min_ratio_vs_best_hf_same_dtype": min(ratios),
        "sd_fraction_of_ideal": {f"{r['model']}/d{r['depth']}": r["fraction_of_ideal"] for r in result["sd_overhead"]},
        "long_context_ratio_vs_best_hf": {
            f"{r['model']}/b{r['batch']}": r["ratio_vs_best_hf"] for r in result["decode_long"]
        },
        "ratio_vs_best_hf_same_dtype_at_batch_32": {
            f"{r['model']}/{r['dtype']}": r["ratio_vs_best_hf"] for r in result["decode"] if r["batch"] == 32
        },
        "ours_vs_hf_dynamic_float32": {
            f"{r['model']}/{r['dtype']}/b{r['batch']}": round(r["ours_tok_s"] / hf_fp32[r["model"], r["batch"]], 3)
            for r in result["decode"]
            if (r["model"], r["batch"]) in hf_fp32
        },
    }
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

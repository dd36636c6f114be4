"""`tlt-stream eval`: accuracy and response lengths of a policy on held-out prompts, and with a drafter,
the mean acceptance length of speculative decoding."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from tlt_stream.tasks.repeated_add import RepeatedAddTask, reward
from tlt_stream.tasks.tokenizer import build_tokenizer

__all__ = ["evaluate", "percentile"]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def evaluate(
    model_dir: str | Path,
    *,
    drafter: str | None = None,
    n: int = 200,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 32,
    depth: int = 4,
    topk: int = 1,
    progress: Any = None,
) -> dict[str, Any]:
    from tlt_stream.model import load_model
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import build_proposer

    model_dir = Path(model_dir)
    model = load_model(model_dir)
    tokenizer = build_tokenizer()
    problems = RepeatedAddTask().problems(n, seed, heldout=True)
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    max_len = model.spec.max_position_embeddings
    budget = min(max_len - max(len(p) for p in prompts), 1200)
    proposer = build_proposer(drafter, model) if drafter else None
    arm = Arm.drafter(depth, topk, depth * topk) if drafter else None
    engine = GenerationEngine(model, batch_size, max(len(p) for p in prompts) + budget, proposer=proposer, arm=arm)
    ids = [
        engine.add_request(p, budget, temperature, seed + i, [tokenizer.eos_token_id]) for i, p in enumerate(prompts)
    ]
    done: dict[Any, Any] = {}
    started = time.perf_counter()
    while engine.has_unfinished:
        for result in engine.step():
            done[result.request_id] = result
            if progress is not None:
                progress(len(done), len(ids))
    seconds = time.perf_counter() - started
    results = [done[i] for i in ids]
    rewards = [
        reward(tokenizer.decode(r.token_ids, skip_special_tokens=True), p.answer)
        for r, p in zip(results, problems, strict=True)
    ]
    lengths = [len(r.token_ids) for r in results]
    report: dict[str, Any] = {
        "model": str(model_dir),
        "prompts": n,
        "temperature": temperature,
        "accuracy": sum(rewards) / n,
        "length": {
            "p50": percentile(lengths, 0.5),
            "p90": percentile(lengths, 0.9),
            "p99": percentile(lengths, 0.99),
            "max": max(lengths),
            "max_over_median": max(lengths) / max(1.0, statistics.median(lengths)),
        },
        "truncated": sum(r.finish_reason == "length" for r in results),
        "tokens_per_s": sum(lengths) / seconds,
        "seconds": seconds,
    }
    if drafter:
        rounds = [a for r in results for a in r.accept_lengths]
        report["drafter"] = drafter
        report["arm"] = arm.label if arm else None
        report["mean_accept_length"] = sum(rounds) / len(rounds) if rounds else None
    return report

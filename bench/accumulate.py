"""The learner's compute, batch against accumulated group by group, on the tiny world's shapes (CPU).

One synchronous step of `--groups` groups of `--group-size` responses of the tiny world's task (the worked
solutions' lengths, 0.7-1.3x each, so a group's responses differ), on a random policy of the world's default
size (or `--size 25m`). The groups complete in order of their longest response, as a rollout finishes them.
Per repetition, in turn on copies of the same policy:

- **batch**: `LearnerCore.step` once the last group is in: all of it comes after the last sample;
- **accumulated**: `StepAccumulator.add` per group, then `finish`; what comes after the last sample is the
  last group's add plus `finish` (`after_last_s`); the rest overlaps the rollout's tail.

Compute only: no bus, no rollout beside it (whether accumulating slows a rollout sharing the cores is the
pipeline's measurement, `bench/e2e.py`). Medians over `--reps`.

    python bench/accumulate.py [--threads 1] [--reps 5] [--size tiny]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "tiny": {"hidden": 128, "layers": 4, "heads": 4, "kv": 2, "inter": 384},
    "25m": {"hidden": 512, "layers": 8, "heads": 8, "kv": 8, "inter": 1408},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the configuration's")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def workload(args: argparse.Namespace, vocab: int) -> list[Any]:
    """The step's groups in the order they complete (by their longest response)."""
    from _grpo import synthetic_group  # bench/, on the path as the script's directory

    from tlt_stream.tasks.repeated_add import RepeatedAddTask

    rng = random.Random(args.seed)
    groups = []
    for g, problem in enumerate(RepeatedAddTask().problems(args.groups, args.seed, heldout=False)):
        prompt = [rng.randrange(vocab) for _ in problem.prompt]
        size = len(problem.solution)
        length = lambda size=size: max(1, int(size * rng.uniform(0.7, 1.3)))  # noqa: E731
        groups.append(synthetic_group(rng, g, prompt, args.group_size, length, vocab))
    return sorted(groups, key=lambda group: max(s.response_len for s in group.samples))


def main() -> None:
    args = parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.basics.config import DEFAULTS
    from tlt_stream.rl.accumulate import StepAccumulator
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings
    from tlt_stream.tasks.bootstrap import WORLD_LEN
    from tlt_stream.tasks.tokenizer import vocab

    torch.set_num_threads(args.threads)
    m, vocab_size = SIZES[args.size], len(vocab())
    torch.manual_seed(args.seed)
    policy = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=m["hidden"],
            intermediate_size=m["inter"],
            num_hidden_layers=m["layers"],
            num_attention_heads=m["heads"],
            num_key_value_heads=m["kv"],
            tie_word_embeddings=True,
            max_position_embeddings=WORLD_LEN,
        )
    )
    groups = workload(args, vocab_size)
    tokens = args.micro_batch_tokens or DEFAULTS.learner.micro_batch_tokens
    settings = LearnerSettings(lr=1e-5, micro_batch_tokens=tokens)
    core = LearnerCore(copy.deepcopy(policy), settings)
    core.step(groups)  # warm-up: allocator, AdamW state
    accumulating = LearnerCore(copy.deepcopy(policy), settings)
    accumulating.step(groups)
    step = StepAccumulator(accumulating, len(groups))
    rows: dict[str, list[float]] = {"batch_s": [], "accumulated_s": [], "after_last_s": [], "last_add_s": []}
    for _ in range(args.reps):
        started = time.perf_counter()
        core.step(groups)
        rows["batch_s"].append(time.perf_counter() - started)
        for group in groups[:-1]:
            step.add(group)
        last = time.perf_counter()
        step.add(groups[-1])
        added = time.perf_counter()
        metrics = step.finish()
        rows["after_last_s"].append(time.perf_counter() - last)
        rows["last_add_s"].append(added - last)
        rows["accumulated_s"].append(metrics["learn_seconds"])
    medians = {key: round(statistics.median(values), 4) for key, values in rows.items()}
    lengths = [s.response_len for g in groups for s in g.samples]
    print(
        json.dumps(
            {
                "bench": "accumulate",
                "size": args.size,
                "groups": args.groups,
                "group_size": args.group_size,
                "micro_batch_tokens": tokens,
                "response_tokens": sum(lengths),
                "response_len_max": max(lengths),
                "reps": args.reps,
                "median": medians,
                "accumulated_over_batch": round(medians["accumulated_s"] / medians["batch_s"], 3),
                "after_last_over_batch": round(medians["after_last_s"] / medians["batch_s"], 3),
                "machine": {
                    "cpus": os.cpu_count(),
                    "threads": args.threads,
                    "torch": torch.__version__,
                    "platform": platform.platform(),
                },
            }
        )
    )


if __name__ == "__main__":
    main()

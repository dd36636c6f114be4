"""Where a speculative round's time goes at batch 1 (issue 23 point 4: the round's own cost is the ceiling
once drafting is nearly free): per round, milliseconds in drafting (`proposer.propose`), the target's verify
forward, acceptance (`speculative._accept`), and everything else (the rest of `verify_round`: ids, positions,
the ancestor mask, logits, log-probabilities, KV commit; and the engine's per-token bookkeeping: appends, stop
checks, observing the committed tokens, per-source counts), against one plain decode step.

Timers wrap the engine's pieces from outside (nothing in the engine is changed for measuring), on the tiny
world's policy and drafter, the last row of a group (7 siblings finished, remembered by the group source),
T = 1, EOS stops, 4 long held-out prompts per arm.

    python bench/round_costs.py [--world artifacts/world] [--prompts 4]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout import speculative
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer, GroupProposer
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    world = Path(args.world)
    policy = load_model(world / "policy")
    drafter = load_drafter(world / "drafter", policy)
    tokenizer = build_tokenizer()
    problems = [q for q in RepeatedAddTask().problems(500, 7, heldout=True) if q.steps >= 12][: args.prompts]
    prompts = [tokenizer(q.prompt, add_special_tokens=False)["input_ids"] for q in problems]
    eos = [tokenizer.eos_token_id]
    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - started

        return wrapper

    forward = policy.forward
    speculative._accept = timed("accept", speculative._accept)
    out = {}
    for name, arm in (("plain", None), ("eagle", Arm.drafter(6, 1, 6)), ("group", Arm.group_source(12, 12))):
        spent.clear()
        rounds = tokens = 0
        wall = 0.0
        for i, prompt in enumerate(prompts):
            proposer = None
            if name == "eagle":
                proposer = EagleProposer(drafter)
            elif name == "group":
                proposer = GroupProposer()
                siblings = GenerationEngine(policy, 7, len(prompt) + 300)
                for r in siblings.generate([prompt] * 7, 256, 1.0, seed=100 + i, eos_ids=eos):
                    proposer.remember(prompt, r.token_ids)
            engine = GenerationEngine(policy, 1, len(prompt) + 300, proposer=proposer, arm=arm, max_draft_nodes=32)
            if proposer is not None:
                proposer.propose = timed("drafting", proposer.propose)
            policy.forward = timed("target_forward", forward)  # instance attribute: this model only
            started = time.perf_counter()
            (result,) = engine.generate([prompt], 256, 1.0, seed=i, eos_ids=eos)
            wall += time.perf_counter() - started
            del policy.forward
            rounds += engine.rounds + engine.plain_steps
            tokens += len(result.token_ids)
        per_round = {k: round(1e3 * v / rounds, 3) for k, v in spent.items()}
        per_round["total"] = round(1e3 * wall / rounds, 3)
        per_round["other"] = round(per_round["total"] - sum(v for k, v in per_round.items() if k != "total"), 3)
        out[name] = {
            "ms_per_round": per_round,
            "tokens_per_round": round(tokens / rounds, 2),
            "tokens_per_s": round(tokens / wall, 1),
        }
        print(f"[round_costs] {name}: {out[name]}", file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "round_costs", "batch": 1, "temperature": 1.0, "arms": out}))


if __name__ == "__main__":
    main()

"""What a partial rollout keeps, and what it saves, against how many policy updates lie between the draft and
its re-verification (issue 24), on the tiny world's real RL updates.

Part 1: K GRPO updates of the bootstrapped policy (the learner's own `LearnerCore.step` on the tiny task,
on-policy, with the tiny-world preset's learner settings), each version saved. Part 2, for every gap g in 1..K
and every base version b with b + g <= K: held-out prompts x G samples start under version b as drafts (T = 1,
`ahead_limit` = --ahead tokens, one batch), run until every row has parked; version b + g is loaded with
`reverify=True`; the rows then run to the end. Against that, the same prompts and seeds from scratch under
version b + g. Per gap, medians over the base versions:

- `kept_share`: re-verified tokens kept / tokens generated ahead (the rest are discarded at the first
  rejection of each row);
- `reverify_s`: the re-verifying load minus a plain load of the same checkpoint (the price, on the critical
  path, of keeping the drafts);
- `kept_share_of_rollout`: kept tokens / the tokens the fresh rows generate (decode work already done);
- `saved_share`: (kept tokens per row - the re-verification's cost in decode steps) / the fresh run's decode
  steps: the share of the new version's rollout the drafts took off the critical path (the draft time itself
  is spent in the previous step's tail, on slots that were idle). Counted in decode work, not in seconds to
  the longest row: continued and fresh rows sample different continuations, whose lengths differ by chance.

    python bench/partial_rollouts.py [--world artifacts/world] [--updates 4] [--quick] [--past-warmup]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def log(message: str) -> None:
    print(f"[partial_rollouts] {message}", file=sys.stderr, flush=True)


def run_rows(engine: Any, prompts: list[list[int]], group: int, eos: int, *, ahead: int | None) -> float:
    """Queue every prompt's `group` rows (fixed seeds) and step until nothing is left to step; seconds."""
    for i, ids in enumerate(prompts):
        for g in range(group):
            budget = engine.max_len - len(ids)
            engine.add_request(ids, budget, 1.0, 1000 * i + g, [eos], request_id=(i, g), ahead_limit=ahead)
    return drain(engine)


def drain(engine: Any) -> float:
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--updates", type=int, default=4, help="RL updates K (gaps 1..K)")
    p.add_argument("--prompts", type=int, default=16, help="training prompts per update")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts drafted per measurement")
    p.add_argument("--eval-group", type=int, default=4)
    p.add_argument("--ahead", type=int, default=64, help="tokens a draft row runs ahead (ahead_limit)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats per measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 updates, small batches")
    p.add_argument(
        "--past-warmup",
        action="store_true",
        help="updates at the preset's full lr from the first (as later in a run), not the warm-up ramp's first",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate instead of the preset's (a faster policy)")
    args = p.parse_args()
    if args.quick:
        args.updates, args.prompts, args.eval_prompts, args.repeats = 2, 8, 4, 1

    import torch
    import transformers
    from _grpo import update_groups
    from transformers import AutoModelForCausalLM

    from tlt_stream.basics.config import Config, override
    from tlt_stream.model import load_model
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    world = Path(args.world)
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    task = RepeatedAddTask()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    held_out = [encode(q.prompt) for q in task.problems(args.eval_prompts, 4242, heldout=True)]

    scratch = Path(tempfile.mkdtemp(prefix="partial-rollouts-"))
    versions = [world / "policy"]
    hf = AutoModelForCausalLM.from_pretrained(world / "policy")
    tiny = override(Config(), {"preset": "tiny-world"})  # the tiny world's learner: lr, warm-up, final norm
    learner = LearnerSettings.from_config(tiny)
    if args.past_warmup:
        learner = dataclasses.replace(learner, warmup_steps=0)
    if args.lr is not None:
        learner = dataclasses.replace(learner, lr=args.lr)
    core = LearnerCore(hf, learner)
    policy = load_model(world / "policy")
    rewards = []
    started = time.perf_counter()
    for update in range(1, args.updates + 1):
        problems = task.problems(args.prompts, 7919 * update, heldout=False)
        groups, _ = update_groups(policy, problems, tokenizer, group=args.group, update=update)
        metrics = core.step(groups)
        rewards.append(round(metrics["reward_mean"], 3))
        out = scratch / f"v{update}"
        hf.save_pretrained(out)
        tokenizer.save_pretrained(out)
        versions.append(out)
        policy = load_model(out)
        log(f"update {update}: reward {rewards[-1]} ({time.perf_counter() - started:.0f} s)")

    rows = len(held_out) * args.eval_group
    max_len = policy.spec.max_position_embeddings
    by_gap: dict[int, list[dict[str, float]]] = {}
    for gap in range(1, args.updates + 1):
        for base in range(0, args.updates - gap + 1):
            new = versions[base + gap]
            timings: dict[str, list[float]] = {"reverify_s": [], "continue_s": [], "scratch_s": [], "draft_s": []}
            for _ in range(args.repeats):  # the two contenders interleaved, medians taken
                engine = GenerationEngine(load_model(versions[base]), rows, max_len)
                timings["draft_s"].append(run_rows(engine, held_out, args.eval_group, eos, ahead=args.ahead))
                assert engine.num_parked == rows, "every draft row parks before the new version"
                load_started = time.perf_counter()
                engine.load_policy(new, reverify=True)
                reverify_load_s = time.perf_counter() - load_started
                timings["continue_s"].append(drain(engine))
                kept, discarded = engine.tokens_kept, engine.tokens_discarded  # the same every repeat (seeds)

                fresh = GenerationEngine(load_model(versions[base]), rows, max_len)
                load_started = time.perf_counter()
                fresh.load_policy(new)
                plain_load_s = time.perf_counter() - load_started
                timings["scratch_s"].append(run_rows(fresh, held_out, args.eval_group, eos, ahead=None))
                timings["reverify_s"].append(max(0.0, reverify_load_s - plain_load_s))
            row = {k: statistics.median(v) for k, v in timings.items()}
            row["kept_share"] = kept / max(1, kept + discarded)
            row["ahead_tokens"] = kept + discarded
            # The continued rows and the fresh ones sample different continuations (one random stream went
            # on through the drafts), so their lengths, and the seconds to the longest, differ by chance:
            # what is saved is counted in decode work, the kept tokens against the fresh rows' tokens, and
            # the re-verification's cost in decode steps of the fresh run.
            row["kept_share_of_rollout"] = kept / max(1, fresh.tokens_generated)
            step_s = row["scratch_s"] / max(1, fresh.plain_steps)
            row["reverify_in_decode_steps"] = row["reverify_s"] / step_s
            row["saved_share"] = (kept / rows - row["reverify_in_decode_steps"]) / max(1, fresh.plain_steps)
            by_gap.setdefault(gap, []).append(row)
            log(f"gap {gap} base v{base}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))

    def med(part: list[dict[str, float]], key: str) -> float:
        return round(statistics.median(r[key] for r in part), 3)

    result = {
        "benchmark": "partial_rollouts",
        "updates": args.updates,
        "learner": {"lr": learner.lr, "warmup_steps": learner.warmup_steps},
        "update_rewards": rewards,
        "rows": rows,
        "ahead_limit": args.ahead,
        "temperature": 1.0,
        "threads": args.threads,
        "by_gap": {
            str(gap): {
                "measurements": len(part),
                **{
                    k: med(part, k)
                    for k in (
                        "kept_share",
                        "kept_share_of_rollout",
                        "reverify_s",
                        "reverify_in_decode_steps",
                        "scratch_s",
                        "saved_share",
                    )
                },
            }
            for gap, part in by_gap.items()
        },
        "machine": {"torch": torch.__version__, "cpu_threads": torch.get_num_threads()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

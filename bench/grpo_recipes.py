"""Compare learner recipes quickly: in-process GRPO on the tiny task, held-out accuracy every K updates.

The services are not involved (no Redis, no MQTT): one process generates each update's groups with the
rollout engine (T = 1, per-sample seeds), scores them, and runs the learner's own `LearnerCore.step` on them,
exactly what the learner service does per step, only without the streams. Deterministic for a seed, so two
recipes see the same prompts and differ only by what they learn. Held-out accuracy is measured at T = 1 on
`--eval` held-out prompts (the same ones, the same seeds, every time); at 256 prompts its noise is about +-3
points. `bench/rl_loop.py` then measures the chosen recipe in the real pipeline.

    python bench/grpo_recipes.py --lr 1e-4 --final-norm-lr-scale 200 --updates 100
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[grpo_recipes] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    from tlt_stream.basics.config import PRESETS  # defaults: `tlt-stream run`'s recipe on the tiny world
    from tlt_stream.rl.learner import LearnerSettings  # the rest: the learner's own

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    tiny = PRESETS["tiny-world"]["learner"]
    p.add_argument("--lr", type=float, default=tiny["lr"])
    p.add_argument("--final-norm-lr-scale", type=float, default=tiny["final_norm_lr_scale"])
    p.add_argument("--warmup-steps", type=int, default=tiny["warmup_steps"])
    p.add_argument("--clip-high", type=float, default=LearnerSettings.clip_high)
    p.add_argument("--max-grad-norm", type=float, default=LearnerSettings.max_grad_norm)
    p.add_argument("--kl-coef", type=float, default=LearnerSettings.kl_coef)
    p.add_argument("--no-scale-advantages", action="store_true", help="centre rewards in the group only (Dr. GRPO)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per update")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--updates", type=int, default=50)
    p.add_argument("--every", type=int, default=25, help="evaluate every this many updates")
    p.add_argument("--eval", type=int, default=256, help="held-out prompts per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="4 updates, 32 held-out prompts: a smoke check")
    args = p.parse_args()
    if args.quick:
        args.updates, args.every, args.eval, args.prompts = 4, 2, 32, 4
    return args


def main() -> None:
    args = parse_args()
    import torch
    import transformers
    from _grpo import update_groups  # bench/, on the path as the script's directory
    from transformers import AutoModelForCausalLM

    from tlt_stream.model import load_model
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings, final_norm_gain
    from tlt_stream.tasks.evaluate import evaluate
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    world = Path(args.world)
    if not (world / "policy").is_dir():
        sys.exit(f"{world}: no bootstrapped world (run `tlt-stream bootstrap --out {world}`)")
    tokenizer, task = build_tokenizer(), RepeatedAddTask()

    hf = AutoModelForCausalLM.from_pretrained(world / "policy")
    settings = LearnerSettings(
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        final_norm_lr_scale=args.final_norm_lr_scale,
        clip_high=args.clip_high,
        max_grad_norm=args.max_grad_norm,
        kl_coef=args.kl_coef,
        scale_advantages=not args.no_scale_advantages,
    )
    core = LearnerCore(hf, settings)
    scratch = Path(tempfile.mkdtemp(prefix="grpo-recipes-"))
    hf.save_pretrained(scratch)
    policy = load_model(scratch)

    def held_out() -> float:
        return round(evaluate(scratch, n=args.eval, seed=args.seed + 1234, batch_size=64)["accuracy"], 4)

    rows: list[dict[str, Any]] = [{"update": 0, "accuracy": held_out()}]
    log(f"update 0: held-out accuracy {rows[0]['accuracy']:.3f}")
    started, rewards = time.perf_counter(), []
    for update in range(1, args.updates + 1):
        problems = task.problems(args.prompts, (args.seed + 1) * 7919 + update, heldout=False)
        groups, _ = update_groups(policy, problems, tokenizer, group=args.group, update=update)
        rewards.append(core.step(groups)["reward_mean"])
        hf.save_pretrained(scratch)
        policy = load_model(scratch)
        if update % args.every == 0 or update == args.updates:
            row = {
                "update": update,
                "accuracy": held_out(),
                "train_reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3),
                "final_norm_gain": round(float(final_norm_gain(hf).detach().mean()), 3),
                "seconds": round(time.perf_counter() - started, 1),
            }
            rows.append(row)
            log(f"update {update}: {row}")
    print(
        json.dumps(
            {
                "benchmark": "grpo_recipes",
                "recipe": {
                    "lr": args.lr,
                    "final_norm_lr_scale": args.final_norm_lr_scale,
                    "warmup_steps": args.warmup_steps,
                    "clip_high": args.clip_high,
                    "max_grad_norm": args.max_grad_norm,
                    "kl_coef": args.kl_coef,
                    "scale_advantages": not args.no_scale_advantages,
                    "prompts": args.prompts,
                    "group": args.group,
                },
                "eval_prompts": args.eval,
                "rows": rows,
                "gain_points": round(100 * (rows[-1]["accuracy"] - rows[0]["accuracy"]), 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

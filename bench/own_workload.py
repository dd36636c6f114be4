"""A workload of one's own, end to end: `tlt-stream run --policy --dataset --eval-dataset --reward` on a
random Qwen2 saved in bf16 with a byte-level BPE tokenizer (chat template, two EOS ids) and a GSM8K-style verl
parquet, all built here, with the rollout in fp32 and in bf16 (the learner's fp32 masters published in the
rollout's dtype), interleaved.

Per step: rollout tokens/s, rollout and learn seconds, learner tokens/s, the rollout-vs-learner logprob
mismatch (mean |delta| and max), truncated responses; per run: wall seconds, steps/s over the training
steps. The run uses embedded Redis and MQTT unless TLT_REDIS_URL / TLT_MQTT_URL are set.

    python bench/own_workload.py             # 2 runs per dtype, 2 steps of 4 prompts x 8
    python bench/own_workload.py --quick     # 1 run per dtype

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REWARD = "def score(response, answer):\n    return float(len(response) % 2)  # variance on a random policy\n"


def build(root: Path) -> tuple[Path, Path, Path]:
    from tests.worlds import gsm8k_like_rows, qwen_like_policy, write_parquet

    policy = qwen_like_policy(root / "policy")
    rows = gsm8k_like_rows([(a, b) for a in range(8) for b in range(4)])
    write_parquet(rows[:24], root / "train.parquet")
    write_parquet(rows[24:], root / "test.parquet")
    (root / "reward.py").write_text(REWARD)
    return policy, root / "train.parquet", root / "test.parquet"


def one_run(root: Path, policy: Path, train: Path, test: Path, dtype: str, steps: int, tag: str) -> dict:
    out = root / f"run-{tag}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_") or k in ("TLT_REDIS_URL", "TLT_MQTT_URL")}
    command = [
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--run", f"own-{tag}-{int(time.time())}"),
        *("--policy", str(policy), "--dataset", str(train), "--eval-dataset", str(test)),
        *("--reward", f"{root / 'reward.py'}:score", "--steps", str(steps), "--prompts-per-step", "4"),
        *("--group-size", "8", "--max-len", "160", "--eval", "8", "--sd", "off", "--out", str(out)),
        *("--set", f"rollout.dtype={dtype}"),
    ]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run {tag} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spans = [r["time"] for r in rows]
    keys = ("rollout_tokens_per_s", "rollout_seconds", "learn_seconds", "learn_tokens_per_s")
    return {
        "dtype": dtype,
        "wall_seconds": round(wall, 1),
        "steps_per_s": round((len(rows) - 1) / (spans[-1] - spans[0]), 3) if len(rows) > 1 else None,
        "steps": [
            {
                "version": r["version"],
                **{k: round(r.get(k, 0.0), 3) for k in keys},
                "logprob_mismatch_mean": r["logprob_mismatch_mean"],
                "logprob_mismatch_max": r["logprob_mismatch_max"],
                "truncated": r["truncated"],
            }
            for r in rows
        ],
        "master_copy": (out / "checkpoints" / f"step-{steps:08d}" / "master").is_dir(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per dtype")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="own-workload-"))
    root.mkdir(parents=True, exist_ok=True)
    policy, train, test = build(root)
    runs = []
    for i in range(1 if args.quick else 2):
        for dtype in ("float32", "bfloat16"):  # interleaved: the machine is shared and noisy
            runs.append(one_run(root, policy, train, test, dtype, args.steps, f"{dtype}-{i}"))
    summary = {}
    for dtype in ("float32", "bfloat16"):
        mine = [r for r in runs if r["dtype"] == dtype]
        steps = [s for r in mine for s in r["steps"]]
        summary[dtype] = {
            "rollout_tokens_per_s_median": statistics.median(s["rollout_tokens_per_s"] for s in steps),
            "learn_tokens_per_s_median": statistics.median(s["learn_tokens_per_s"] for s in steps),
            "logprob_mismatch_mean_median": statistics.median(s["logprob_mismatch_mean"] for s in steps),
            "logprob_mismatch_max": max(s["logprob_mismatch_max"] for s in steps),
            "wall_seconds_median": statistics.median(r["wall_seconds"] for r in mine),
        }
    print(json.dumps({"runs": runs, "summary": summary, "dir": str(root)}, indent=2))


if __name__ == "__main__":
    main()

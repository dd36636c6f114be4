"""The group/history draft index on its own (issue 23): upkeep per token, draft cost and memory.

Every token of every running row is appended to its prompt's index on every decode step, drafted from or not,
so the index's upkeep is paid by plain steps too (`bench/adaptive_sd.py`'s `plain+sources`). This measures it
alone: G documents (a group's responses) grown one token at a time, interleaved as a batch grows them, then
a draft after every 7th prefix of each (depth 8, 8 nodes, match up to 12 tokens). Two workloads: the tiny
world's reference solutions of 8 prompts' problems (repetitive arithmetic text) and uniformly random tokens
over 64 ids (little repetition: the most states per token). Per index: microseconds per appended token,
milliseconds for all drafts, states (nodes) held per token.

With `--baseline DIR` (another checkout, e.g. `git worktree add /tmp/gi-before c6458da~1`), its index (the
depth-24 suffix trie before c6458da) is measured in a fresh process too, alternated `--repeats` times, and
the medians and per-alternation ratios are printed side by side.

    python bench/group_index.py [--repeats 5] [--baseline DIR]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(src: str) -> dict:
    """One pass over both workloads with the index of the checkout at `src`."""
    sys.path.insert(0, str(Path(src).resolve()))
    import tlt_stream.rollout.suffix as suffix
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    make = getattr(suffix, "SuffixAutomaton", None) or (lambda: suffix.SuffixTrie(24))
    tokenizer = build_tokenizer()
    problems = RepeatedAddTask().problems(64, 5, heldout=False)[:8]
    rng = random.Random(0)
    workloads = {
        "task_solutions": [tokenizer(p.solution, add_special_tokens=False)["input_ids"] for p in problems],
        "random64": [[rng.randrange(64) for _ in range(300)] for _ in range(8)],
    }
    out = {"index": type(make()).__name__}
    for name, docs in workloads.items():
        index, appended = make(), 0
        started = time.perf_counter()
        for i in range(max(map(len, docs))):
            for d, text in enumerate(docs):
                if i < len(text):
                    index.extend(d, [text[i]])
                    appended += 1
        extend_s = time.perf_counter() - started
        started = time.perf_counter()
        drafts = 0
        for text in docs:
            for cut in range(5, len(text), 7):
                index.draft(text[:cut], depth=8, budget=8, max_match=12)
                drafts += 1
        draft_s = time.perf_counter() - started
        out[name] = {
            "tokens": appended,
            "us_per_token": round(extend_s / appended * 1e6, 2),
            "drafts": drafts,
            "draft_ms_total": round(draft_s * 1e3, 2),
            "nodes_per_token": round(index.nodes / appended, 2),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--baseline", help="another checkout whose index to measure beside this one")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.src)))
        return
    trees = {"current": str(ROOT), **({"baseline": args.baseline} if args.baseline else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, src in trees.items():  # alternated: the machine's noise hits both alike
            cmd = [sys.executable, __file__, "--one", "--src", src]
            runs[name].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
            print(f"[group_index] repeat {repeat}: {name} done", file=sys.stderr, flush=True)
    result: dict = {"benchmark": "group_index", "repeats": args.repeats, "trees": trees}
    for name, passes in runs.items():
        result[name] = {"index": passes[0]["index"]}
        for workload in ("task_solutions", "random64"):
            result[name][workload] = {
                key: statistics.median(p[workload][key] for p in passes) for key in passes[0][workload]
            }
    if args.baseline:
        result["baseline_over_current"] = {
            workload: {
                key: round(
                    statistics.median(
                        b[workload][key] / c[workload][key]
                        for b, c in zip(runs["baseline"], runs["current"], strict=True)
                    ),
                    2,
                )
                for key in ("us_per_token", "draft_ms_total", "nodes_per_token")
            }
            for workload in ("task_solutions", "random64")
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

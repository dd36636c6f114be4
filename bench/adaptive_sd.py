"""Adaptive speculative decoding against every fixed strategy, on real long-tailed RL rollouts with groups.

One run of the bootstrapped policy (EOS stops) over an RL-shaped batch: P prompts x G samples each (64 = 8
x 8 by default), every row seeded apart. It starts full and drains to 1 as responses finish. Each SD engine
is the one a rollout worker with `sd.group` builds (`rollout.build.build_engine`: EAGLE beside the
group/history source, `MixedProposer`), so a row drafts from its group's running and finished siblings (the
rows of the same prompt) as it does in a worker. Each rollout starts with an empty index: no history from
earlier steps, only the step's own siblings; with `--history K`, with K responses per prompt from an earlier
epoch (sampled once per workload by the same policy with other seeds), as a worker's history cache holds them
when RL revisits a prompt. Strategies: no SD; no SD on that engine (`plain+sources`: the
sources observe every step, never draft, so their upkeep shows); SD always on with each fixed arm (EAGLE
chains, group-only trees, EAGLE + group merged); and adaptive SD (`rollout/adaptive.py`, the default
candidate arms, which hold all three source mixes per batch bucket; its tuner is warmed up on one rollout
of the workload, reported as `adaptive_cold`, and keeps its statistics from rep to rep, as a worker's tuner
does across RL steps). Three workloads:

- tail_heavy: prompts drawn from the task's own distribution at T = 1 (max/median length ~6x; the
  tiny world's siblings tend to agree);
- tail_light: prompts whose solutions all have 3-5 steps (similar lengths; less tail);
- differ: tail_heavy's prompts at T = `--differ-temperature` (1.6): siblings disagree with each other and
  with the row (as `bench/sd_speedup.py`'s `differ`), and EAGLE's drafts fit worse too.

Strategies run in alternation, rep by rep, on the same prompts and seeds. Per strategy (medians over
reps): total rollout time, tail-phase time (the steps run once fewer than 32 requests remain, TLT's
definition, and once at most 8 remain), tokens/s per phase, the time per token of the rollout's longest
response (each strategy samples its own responses, and a drained rollout lasts as long as its longest
one), the tail-phase speedup over plain as the median of per-rep ratios of its time, of its tokens/s, and
of its time per token of the row that ends it (the tail's critical path, the least sensitive to which tail
each strategy drew), acceptance (accepted / drafted nodes) per source over the rollout and in the tail,
and for adaptive the arms chosen per batch bucket. Where the time goes (`by_bucket`): per strategy and tuner
bucket of the running batch, seconds per rep and ms per token pooled over reps; and for adaptive
(`adaptive_greedy`) per bucket how often its exploit arm changed (`flips`), how often it explored, and its
estimates at the end. Prints progress to stderr and one JSON object to stdout.

    python bench/adaptive_sd.py [--quick] [--threads 1] [--group 8] [--reps 5] [--history 8]
    # --quick: 16 rows (2 x 8), 6 strategies, 1 rep (under a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED = ("d4k1v4", "d6k1v6", "group-d8v8", "group-d12v16", "d4k2v8+g8", "d6k1v6|g12")
"""EAGLE chains, group-only trees, a merged tree, and per row the group's or EAGLE's chain (all among the
tuner's default arms). `d6k2v6+g12`, `bench/sd_speedup.py`'s merged arm, lost everywhere in the runs of
2026-12-02 and 12-03 (docs/benchmarks.md) and made way for `d6k1v6|g12`."""
FIXED_QUICK = ("d4k1v4", "group-d12v16", "d4k2v8+g8")
UPKEEP = "plain+sources"
"""No SD on the SD strategies' engine: its draft sources observe every step and never draft (their upkeep,
which adaptive SD pays on its plain steps)."""
SOURCES = ("eagle", "group")
PHASES = {"total": lambda left: True, "tail_lt32": lambda left: left < 32, "tail_le8": lambda left: left <= 8}
"""Phase name -> whether a step with `left` unfinished requests belongs to it."""


def log(message: str) -> None:
    print(f"[adaptive_sd] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="rows: prompts x group")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G); 1: no siblings")
    p.add_argument("--differ-temperature", type=float, default=1.6, help="sampling temperature of `differ`")
    p.add_argument("--workloads", default="tail_heavy,tail_light,differ")
    p.add_argument("--crossover", type=int, default=16, help="measured SD crossover batch (bench/sd_speedup.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="K",
        help="K responses per prompt from an earlier epoch (sampled beforehand by the same policy, other seeds) "
        "in every SD engine's group index before each rollout, as a worker holds them when RL revisits a "
        "prompt; 0: the step's own siblings only",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="FIELD=VALUE[;FIELD=VALUE]",
        help="also run adaptive with these SdConfig fields changed, as a strategy of its own beside the "
        "default settings' adaptive (repeatable; e.g. 'context_rows=8', 'window=48', 'arms=plain/d6k1v6/group-d8v8': "
        "arm labels are separated by '/', since an either arm's label holds '|')",
    )
    args = p.parse_args()
    if args.quick:
        args.reps, args.batch = 1, 16
    if args.history < 0:
        p.error(f"--history must be >= 0, got {args.history}")
    if args.group < 1 or args.batch % args.group:
        p.error(f"--batch ({args.batch}) must be a positive multiple of --group ({args.group})")
    args.workloads = args.workloads.split(",")
    if unknown := set(args.workloads) - {"tail_heavy", "tail_light", "differ"}:
        p.error(f"unknown workloads {sorted(unknown)} (tail_heavy, tail_light, differ)")
    return args


def variant_settings(settings: Any, spec: str) -> Any:
    """`settings` with the fields of `spec` ("field=value;field=value") changed; a tuple field (`arms`,
    `edges`) takes its items separated by "/" (an either arm's label holds "|")."""
    changes: dict[str, Any] = {}
    for item in spec.split(";"):
        field, _, value = (part.strip() for part in item.partition("="))
        current = getattr(settings, field)  # AttributeError names an unknown field
        if isinstance(current, tuple):
            changes[field] = tuple(type(current[0])(v) for v in value.split("/"))
        else:
            changes[field] = type(current)(value)
    return msgspec.structs.replace(settings, **changes)


def bucket_label(running: int) -> str:
    """The SD tuner's bucket of a running batch, as "lo-hi" rows."""
    from tlt_stream.rollout.switch import DEFAULT_EDGES, bucket_of  # after main() set the thread counts

    i = bucket_of(running, DEFAULT_EDGES)
    lo = 1 if i == 0 else DEFAULT_EDGES[i - 1] + 1
    return f"{lo}-{DEFAULT_EDGES[i]}" if i < len(DEFAULT_EDGES) else f"{lo}-"


def add_to(cells: dict[str, list[float]], label: str, seconds: float, tokens: int) -> None:
    """Add a step's (or a rep's) seconds and tokens to `cells[label]`."""
    cell = cells.setdefault(label, [0.0, 0])
    cell[0], cell[1] = cell[0] + seconds, cell[1] + tokens


class GreedyWatch:
    """Per bucket, over the measured reps: the tuner's steps, how often its exploit arm changed from one step
    of the bucket to the next (`flips`: it follows its estimates, so a flip is a new best estimate), the steps
    it explored, and each arm's estimate (tokens/s) at the end."""

    def __init__(self, tuner: Any) -> None:
        self.tuner = tuner
        self.steps: Counter = Counter()
        self.flips: Counter = Counter()
        self.explored: Counter = Counter()
        self.last: dict[int, str] = {}

    def note(self, batch: int, greedy: Any, chosen: Any) -> None:
        bucket = self.tuner.bucket(batch)
        self.steps[bucket] += 1
        self.flips[bucket] += int(bucket in self.last and self.last[bucket] != greedy.label)
        self.explored[bucket] += int(chosen != greedy)
        self.last[bucket] = greedy.label

    def summary(self) -> dict[str, Any]:
        from tlt_stream.rollout.switch import DEFAULT_EDGES

        out = {}
        for bucket in sorted(self.steps):
            batch = DEFAULT_EDGES[min(bucket, len(DEFAULT_EDGES) - 1)]
            rates = self.tuner.rates(batch)
            out[bucket_label(batch)] = {
                "steps": self.steps[bucket],
                "flips": self.flips[bucket],
                "explored": self.explored[bucket],
                "estimates": {a.label: round(r) for a, r in sorted(rates.items(), key=lambda kv: -kv[1])},
            }
        return out


def watch_greedy(tuner: Any) -> GreedyWatch:
    """Wrap `tuner.choose` to count, per bucket, its exploit arm's changes and its explorations."""
    watch, choose = GreedyWatch(tuner), tuner.choose

    def watched(batch: int, rng: Any, *, expect_sd: bool = True, context: int = 0) -> Any:
        greedy = tuner.greedy(batch, expect_sd=expect_sd, context=context)
        chosen = choose(batch, rng, expect_sd=expect_sd, context=context)
        watch.note(batch, greedy, chosen)
        return chosen

    tuner.choose = watched
    return watch


def run_once(engine: Any, adaptive: Any, groups: list[list[int]], group_size: int, **request: Any) -> dict:
    """One drained rollout of `group_size` rows per prompt (`request`: budget, temperature, eos, seed);
    per-step running requests, seconds, tokens and per-source draft counts folded into phase totals."""
    rows = 0
    for g, prompt in enumerate(groups):
        for k in range(group_size):
            engine.add_request(
                prompt, request["budget"], request["temperature"], request["seed"] + rows, [request["eos"]],
                request_id=f"{g}/{k}",
            )  # fmt: skip
            rows += 1
    phases = {name: {"s": 0.0, "tokens": 0, "drafted": Counter(), "accepted": Counter()} for name in PHASES}
    by_bucket: dict[str, list[float]] = {}  # running-batch bucket -> [seconds, tokens], pooled over reps later
    finished = 0
    lengths: list[int] = []
    tail_start: dict[Any, int] = {}  # tokens each row had when at most 8 were left
    last: list[Any] = []  # the results of the step that ended the rollout
    while engine.has_unfinished:
        left = rows - finished
        if left <= 8 and not tail_start:
            tail_start = {s.request_id: s.num_generated for s in engine.scheduler.running}
        tokens, drafted, accepted = engine.tokens_generated, Counter(engine.drafted_by), Counter(engine.accepted_by)
        started = time.perf_counter()
        results = adaptive.step() if adaptive is not None else engine.step()
        seconds, emitted = time.perf_counter() - started, engine.tokens_generated - tokens
        finished += len(results)
        add_to(by_bucket, bucket_label(left), seconds, emitted)
        lengths += [len(r.token_ids) for r in results]
        last = results or last
        for name, inside in PHASES.items():
            if inside(left):
                phase = phases[name]
                phase["s"] += seconds
                phase["tokens"] += emitted
                phase["drafted"] += engine.drafted_by - drafted
                phase["accepted"] += engine.accepted_by - accepted
    out: dict[str, Any] = {}
    for name, phase in phases.items():
        out[f"{name}_s"] = phase["s"]
        out[f"{name}_tok_s"] = phase["tokens"] / phase["s"] if phase["s"] else 0.0
        for source in SOURCES:  # counts, pooled over reps for the acceptance
            out[f"{name}_drafted_{source}"] = phase["drafted"][source]
            out[f"{name}_accepted_{source}"] = phase["accepted"][source]
    out["tokens"] = phases["total"]["tokens"]
    out["by_bucket"] = by_bucket
    out["max_over_median_length"] = max(lengths) / max(1.0, statistics.median(lengths))
    # A drained rollout lasts as long as its longest response, and each strategy samples its own responses
    # (SD arms consume random numbers differently): time per token of the longest one compares strategies
    # without the luck of which tail each drew.
    out["ms_per_longest_token"] = 1000 * phases["total"]["s"] / max(lengths)
    # The same for the tail: it lasts until its last row ends, so its time per token that row emitted in it.
    last_tokens = max(len(r.token_ids) - tail_start.get(r.request_id, 0) for r in last)
    out["tail_le8_ms_per_last_row_token"] = 1000 * phases["tail_le8"]["s"] / max(1, last_tokens)
    return out


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """Per strategy: medians of the timings, acceptance per source and phase pooled over reps, and the
    tail-phase and total speedups over plain as medians of per-rep ratios (strategies alternate rep by rep)."""
    plain = runs["plain"]
    summary = {}
    for strategy, reps in runs.items():
        row: dict[str, Any] = {
            k: round(statistics.median(r[k] for r in reps), 3)
            for k in reps[0]
            if "_drafted_" not in k and "_accepted_" not in k and k != "by_bucket"
        }
        # Where the time goes: per running-batch bucket, seconds and ms per token pooled over reps (each
        # strategy samples its own responses, so compare ms per token, not seconds).
        pooled: dict[str, list[float]] = {}
        for r in reps:
            for label, (seconds, tokens) in r["by_bucket"].items():
                add_to(pooled, label, seconds, tokens)
        row["by_bucket"] = {
            label: {"s_per_rep": round(s / len(reps), 3), "ms_per_token": round(1000 * s / max(1, t), 3)}
            for label, (s, t) in sorted(pooled.items(), key=lambda kv: int(kv[0].split("-")[0]))
        }
        pairs = list(zip(plain, reps, strict=True))
        for name in ("total", "tail_le8"):
            key = f"{name}_s"
            row[f"{name}_speedup_vs_plain"] = round(statistics.median(p[key] / r[key] for p, r in pairs), 3)
        row["tail_le8_tok_s_vs_plain"] = round(
            statistics.median(r["tail_le8_tok_s"] / p["tail_le8_tok_s"] for p, r in pairs), 3
        )
        key = "tail_le8_ms_per_last_row_token"
        row["tail_le8_speedup_per_last_row_token"] = round(statistics.median(p[key] / r[key] for p, r in pairs), 3)
        for name in ("total", "tail_le8"):
            row[f"acceptance_{name}"] = {}
            for source in SOURCES:
                drafted = sum(r[f"{name}_drafted_{source}"] for r in reps)
                accepted = sum(r[f"{name}_accepted_{source}"] for r in reps)
                row[f"acceptance_{name}"][source] = round(accepted / drafted, 3) if drafted else None
        summary[strategy] = row
    return summary


def main() -> None:
    args = parse_args()
    import torch

    from tlt_stream.basics.config import DEFAULTS, SdConfig
    from tlt_stream.rollout.build import build_engine
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    world = Path(args.world)
    if not (world / "drafter").is_dir():
        sys.exit(f"{world}: no bootstrapped world (run `tlt-stream bootstrap --out {world}`)")
    max_len = json.loads((world / "policy" / "config.json").read_text())["max_position_embeddings"]
    tokenizer = build_tokenizer()
    task = RepeatedAddTask()
    pool = task.problems(4000, args.seed + 5, heldout=False)
    prompts_per_step = args.batch // args.group
    heavy = pool[:prompts_per_step]
    workloads = {
        "tail_heavy": (heavy, 1.0),
        "tail_light": ([p for p in pool if 3 <= p.steps <= 5][:prompts_per_step], 1.0),
        "differ": (heavy, args.differ_temperature),
    }
    fixed = FIXED_QUICK if args.quick else FIXED
    settings = SdConfig(crossover=args.crossover, seed=args.seed)
    variants = {"adaptive": settings}  # adaptive strategy -> its settings
    for spec in args.variant:
        variants[f"adaptive[{spec}]"] = variant_settings(settings, spec)
    strategies = ["plain", UPKEEP, *fixed, *variants]
    result: dict[str, Any] = {
        "benchmark": "adaptive_sd",
        "quick": args.quick,
        "batch": args.batch,
        "group": args.group,
        "prompts": prompts_per_step,
        "reps": args.reps,
        "crossover": args.crossover,
        "history_per_prompt": args.history,
        "adaptive_arms": [label for label in settings.arms if not label.startswith("ngram")],
        "adaptive_variants": {name: msgspec.structs.asdict(v) for name, v in variants.items()},
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__},
        "workloads": {},
    }

    def engine_for(strategy: str, temperature: float) -> tuple[Any, Any]:
        """The worker's engine (`build_engine`): plain, a fixed arm, or adaptive (with its controller)."""
        sd = strategy != "plain"
        base = msgspec.structs.replace(
            DEFAULTS,
            rollout=msgspec.structs.replace(
                DEFAULTS.rollout, max_batch=args.batch, max_len=max_len, temperature=temperature
            ),
        )
        if strategy in variants:  # adaptive, with the variant's settings
            section = msgspec.structs.replace(variants[strategy], drafter=str(world / "drafter"), group=True)
        elif sd:  # a fixed arm
            label = fixed[0] if strategy == UPKEEP else strategy
            section = SdConfig(drafter=str(world / "drafter"), group=True, adaptive=False, arm=label)
        else:
            section = SdConfig()
        config = msgspec.structs.replace(base, sd=section)
        engine, controller = build_engine(str(world / "policy"), config, drafter_version=0)  # -1: no EAGLE arms
        if strategy == UPKEEP:
            engine.arm = None
        if sd:  # an earlier epoch's responses to these prompts, as a worker's history cache holds them
            group = getattr(engine.proposer, "group", engine.proposer)
            for prompt, responses in history.items():
                for response in responses:
                    group.remember(prompt, response)
        return engine, controller

    for name in args.workloads:
        problems, temperature = workloads[name]
        groups = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
        request = {"budget": max_len - max(len(p) for p in groups), "temperature": temperature}
        request["eos"] = tokenizer.eos_token_id
        history: dict[tuple[int, ...], list[list[int]]] = {}  # prompt -> an earlier epoch's responses
        if args.history:  # the previous epoch of these prompts: the same policy and temperature, other seeds
            epoch, _ = engine_for("plain", temperature)
            for g, prompt in enumerate(groups):
                done = epoch.generate(
                    [prompt] * args.history, request["budget"], temperature, seed=7_000_000 + 1000 * g,
                    eos_ids=[request["eos"]],
                )  # fmt: skip
                history[tuple(prompt)] = [list(r.token_ids) for r in done]
            log(f"{name}: {args.history} responses per prompt from an earlier epoch in every SD engine's index")
        runs: dict[str, list[dict]] = {s: [] for s in strategies}
        # The tuner lives as long as the worker (across RL steps): warm it up on one rollout of the workload
        # (reported as adaptive_cold), then measure it warm, carrying its statistics from rep to rep. Each
        # rollout's engine, and so its group index, is new: the step's own siblings, and `history` if any.
        tuners, colds, greedies = {}, {}, {}
        for variant in variants:
            engine, tuners[variant] = engine_for(variant, temperature)
            colds[variant] = run_once(engine, tuners[variant], groups, args.group, **request, seed=999_999)
            greedies[variant] = watch_greedy(tuners[variant].tuner)  # from the measured reps on
            log(f"{name} warm-up: {variant} (cold) {colds[variant]['total_s']:.2f}s")
        for rep in range(args.reps):
            for strategy in strategies:
                engine, adaptive = engine_for(strategy, temperature)
                if adaptive is not None:  # the warm tuner, driving this rep's engine
                    adaptive = tuners[strategy]
                    adaptive.engine = engine
                run = run_once(engine, adaptive, groups, args.group, **request, seed=1000 * rep)
                runs[strategy].append(run)
                log(f"{name} rep {rep}: {strategy} {run['total_s']:.2f}s, tail<=8 {run['tail_le8_s']:.2f}s")
        summary = summarize(runs)
        fixed_names = [s for s in strategies if s not in variants]
        best = min(fixed_names, key=lambda s: summary[s]["total_s"])
        best_per_token = min(fixed_names, key=lambda s: summary[s]["ms_per_longest_token"])
        adaptive_total = summary["adaptive"]["total_s"]
        over_best = round(adaptive_total / summary[best]["total_s"], 3)
        result["workloads"][name] = {
            "temperature": temperature,
            "strategies": summary,
            "best_fixed": best,
            "adaptive_over_best_fixed": over_best,
            "adaptive_within_5pct_of_best_fixed": over_best <= 1.05,
            "adaptive_beats_every_fixed": all(adaptive_total < summary[s]["total_s"] for s in fixed_names),
            "best_fixed_per_longest_token": best_per_token,
            "adaptive_over_best_fixed_per_longest_token": round(
                summary["adaptive"]["ms_per_longest_token"] / summary[best_per_token]["ms_per_longest_token"], 3
            ),
            "tail_le8_best": {
                metric: max((s for s in strategies if s != "plain"), key=lambda s: summary[s][metric])
                for metric in ("tail_le8_speedup_vs_plain", "tail_le8_speedup_per_last_row_token")
            },
            "adaptive_cold": {k: round(v, 3) for k, v in colds["adaptive"].items() if k != "by_bucket"},
            "adaptive_arms_chosen": tuners["adaptive"].summary(),
            "adaptive_greedy": greedies["adaptive"].summary(),
            "variants": {
                variant: {
                    "over_best_fixed": round(summary[variant]["total_s"] / summary[best]["total_s"], 3),
                    "over_best_fixed_per_longest_token": round(
                        summary[variant]["ms_per_longest_token"] / summary[best_per_token]["ms_per_longest_token"],
                        3,
                    ),
                    "cold": {k: round(v, 3) for k, v in colds[variant].items() if k != "by_bucket"},
                    "arms_chosen": tuners[variant].summary(),
                    "greedy": greedies[variant].summary(),
                }
                for variant in variants
            },
        }
    result["goals"] = {"adaptive_over_best_fixed_max": 1.05, "tail_le8_speedup_vs_plain_min": 2.5}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

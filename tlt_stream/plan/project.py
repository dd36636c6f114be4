"""Projections: every mode's simulated step time and speedup over synchronous plain, the settings to use,
and the TLT paper's published setup.

A projection is a median over seeds of `simulate`, labelled with every input it used. The recommendations
read the same cost model and acceptance the simulation used:

- SD switch: the largest running batch at which the best SD arm's expected tokens/s beats plain decoding
  (the crossover is one more), from batch 1 up to `max_batch`;
- arm per bucket: the arm of highest expected tokens/s at the bucket's upper edge;
- staleness, `ahead_tokens` and the rollout/learner split: the candidates simulated, the fastest kept.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tlt_stream.plan.acceptance import Acceptance
from tlt_stream.plan.costs import EngineCosts
from tlt_stream.plan.lengths import LengthDist, named
from tlt_stream.plan.roofline import GPUS, MODELS, GpuCosts
from tlt_stream.plan.simulate import Mode, Setup, simulate
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import bucket_of

__all__ = ["MODES", "PAPER", "paper_setup", "project", "recommend"]

MODES: dict[str, Mode] = {
    "a_sync_plain": Mode("a_sync_plain"),
    "b_sync_tlt": Mode("b_sync_tlt", sd=True),
    "c_stream_tlt": Mode("c_stream_tlt", sd=True, max_staleness=1),
    "g_sync_partial": Mode("g_sync_partial", sd=True, partial=True),
    "h_stream_partial": Mode("h_stream_partial", sd=True, max_staleness=1, partial=True),
    "o_sync_overlap": Mode("o_sync_overlap", sd=True, overlapped=True),
}
"""`bench/e2e.py`'s configurations by its names (their learners the batch update, `learner.accumulate =
false`), and (o): (b) with the overlapped on-policy learner (a run's default, learner.accumulate = auto, for
a policy without dropout)."""

Progress = Callable[[str], None]


def project(
    setup: Setup,
    lengths: LengthDist,
    acceptance: Acceptance,
    costs: EngineCosts,
    modes: Iterable[str] = MODES,
    *,
    seeds: int = 3,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Each mode's median step time over `seeds` seeds, and its speedup over (a) where (a) is among them."""
    rows: dict[str, dict[str, Any]] = {}
    for name in modes:
        runs = []
        for seed in range(seeds):
            if progress:
                progress(f"simulating {name}, seed {seed + 1}/{seeds}")
            runs.append(simulate(MODES[name], dataclasses.replace(setup, seed=seed), lengths, acceptance, costs))
        summaries = [r.summary() for r in runs]
        times = [r.step_time for r in runs]
        if bad := [t for t in times if not (math.isfinite(t) and round(t, 4) > 0)]:
            raise ValueError(
                f"{name}: the cost model gives a step time of {bad[0]:.3g} s (a projection reports finite times of "
                "at least 0.0001 s); check its constants"
            )
        row = dict(summaries[len(summaries) // 2])
        row["step_time_s"] = round(statistics.median(times), 4)
        row["step_time_range_s"] = [round(min(times), 4), round(max(times), 4)]
        rows[name] = row
    if "a_sync_plain" in rows:
        base = rows["a_sync_plain"]["step_time_s"]
        for row in rows.values():
            row["speedup_over_a"] = round(base / row["step_time_s"], 3)
    return rows


def _rate(costs: EngineCosts, acceptance: Acceptance, arm: Arm, batch: int, context: float, edges) -> float:
    bucket = bucket_of(batch, edges)
    return batch * acceptance.mean(arm, bucket) / costs.round_s(batch, arm, context, acceptance.accepted(arm, bucket))


def recommend(
    setup: Setup,
    lengths: LengthDist,
    acceptance: Acceptance,
    costs: EngineCosts,
    *,
    progress: Progress | None = None,
    seeds: int = 1,
) -> dict[str, Any]:
    """The settings the cost model favours (see the module docstring)."""
    arms = [Arm.from_label(a) for a in setup.arms if a != "plain"]
    context = setup.prompt_len + statistics.fmean(lengths.lengths) / 2
    plain = Arm.plain()
    threshold = 0
    for b in range(1, setup.max_batch + 1):
        best = max(_rate(costs, acceptance, a, b, context, setup.edges) for a in arms) if arms else 0.0
        if best > _rate(costs, acceptance, plain, b, context, setup.edges):
            threshold = b
    per_bucket = {}
    for edge in [e for e in setup.edges if e <= setup.max_batch] + [setup.max_batch]:
        rates = {a.label: _rate(costs, acceptance, a, edge, context, setup.edges) for a in [plain, *arms]}
        best = max(rates, key=rates.__getitem__)
        per_bucket[f"<= {edge}"] = {"arm": best, "gain_over_plain": round(rates[best] / rates["plain"], 3)}

    def fastest(options: Sequence[tuple[Any, Mode, Setup]]) -> tuple[Any, dict[Any, float]]:
        times = {}
        for value, mode, s in options:
            if progress:
                progress(f"recommending: {mode.name} with {value}")
            runs = [simulate(mode, dataclasses.replace(s, seed=k), lengths, acceptance, costs) for k in range(seeds)]
            times[value] = round(statistics.median(r.step_time for r in runs), 4)
        return min(times, key=times.__getitem__), times

    staleness, by_staleness = fastest(
        [(k, dataclasses.replace(MODES["b_sync_tlt"], max_staleness=k), setup) for k in (0, 1, 2)]
    )
    longest = max(lengths.lengths)
    aheads = sorted({64, 256, 1024, min(longest, setup.max_response)})
    ahead, by_ahead = fastest(
        [(a, MODES["g_sync_partial"], dataclasses.replace(setup, ahead_tokens=a)) for a in aheads]
    )
    return {
        "sd_threshold": threshold,
        "sd_crossover": threshold + 1,
        "arm_per_bucket": per_bucket,
        "max_staleness": staleness,
        "step_time_by_staleness_s": by_staleness,
        "ahead_tokens": ahead,
        "step_time_by_ahead_tokens_s": by_ahead,
        "context_assumed": round(context, 1),
    }


def split_devices(
    setup: Setup,
    lengths: LengthDist,
    acceptance: Acceptance,
    gpu_costs: GpuCosts,
    total: int,
    *,
    mode: str = "c_stream_tlt",
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Rollout/learner splits of `total` devices (disaggregated, each engine `tp` devices; a quarter, half,
    three quarters and seven eighths of them generating), simulated in `mode`; the fastest kept."""
    times = {}
    candidates = {max(gpu_costs.tp, round(total * f / gpu_costs.tp) * gpu_costs.tp) for f in (0.25, 0.5, 0.75, 0.875)}
    for rollout in sorted(r for r in candidates if r < total):
        learner = total - rollout
        costs = gpu_costs.replace(learner_gpus=learner)
        s = dataclasses.replace(setup, workers=rollout // gpu_costs.tp, colocated=False)
        if progress:
            progress(f"split: {rollout} rollout / {learner} learner devices")
        times[f"{rollout}+{learner}"] = round(simulate(MODES[mode], s, lengths, acceptance, costs).step_time, 3)
    if not times:
        return {}
    best = min(times, key=times.__getitem__)
    return {"mode": mode, "best_rollout_plus_learner": best, "step_time_s": times}


# ------------------------------------------------------------------------------------------ the paper's setup

PAPER: dict[str, dict[str, Any]] = {
    "7B": {"gpus": 8, "tp": 4, "prompts": 64, "mem_util": 0.4, "prompt_len": 512},
    "32B": {"gpus": 64, "tp": 8, "prompts": 256, "mem_util": 0.55, "prompt_len": 1024},
}
"""FastRL's examples/grpo_7B.sh (8 GPUs, rollout TP 4, 64 prompts, gpu_memory_utilization 0.4, prompts up to
1024 tokens) and grpo_32B_multi_nodes.sh (8 nodes x 8 GPUs, TP 8, 32 prompts per node, 0.55, prompts up to
2048): 8 responses per prompt, 32768 response tokens at most, SD off above 32 running requests, colocated
(verl's hybrid engine). The mean prompt length is an assumption (half the limit)."""

PAPER_ARMS = ("plain", "d8k4v8", "d8k4v16", "d8k4v32", "d8k4v48")
"""FastRL's arms: 8 levels, top-4, 8 to 48 verified tokens."""

PAPER_ACCEPTANCE = 6.4
"""Tokens per round of FastRL's Qwen2.5-7B-Eagle-RL tree drafter at 48 verified tokens (fastrl#13: 6.36-6.57)."""

PAPER_LENGTHS = "lognormal:3000:1.0:32768"
"""An assumption, not a published distribution: a log-normal of median 3000 tokens, sigma 1.0 (the longest of
512 responses near the 32768 cap), varied in `--paper` output."""


def paper_setup(
    size: str, gpu: str = "h100", *, lengths: str = PAPER_LENGTHS, acceptance: float = PAPER_ACCEPTANCE, **gpu_changes
) -> tuple[Setup, LengthDist, Acceptance, GpuCosts]:
    shape = PAPER[size]
    costs = GpuCosts(
        GPUS[gpu], MODELS[size], tp=shape["tp"], learner_gpus=shape["gpus"], mem_util=shape["mem_util"]
    ).replace(**gpu_changes)
    setup = Setup(
        prompts=shape["prompts"],
        group_size=8,
        steps=4,
        workers=shape["gpus"] // shape["tp"],
        max_batch=shape["prompts"] * 8 * shape["tp"] // shape["gpus"],  # verl splits the batch evenly
        prompt_len=shape["prompt_len"],
        max_response=32768,
        arms=PAPER_ARMS,
        crossover=33,
        margin=0,
        edges=(1, 4, 20, 32),
        epsilon=0.0,
        above_crossover="plain",
        colocated=True,
        kv_capacity_tokens=costs.kv_capacity_tokens,
        preempt_s=1.0,
        macro_steps=32,
    )
    acc = Acceptance.published(acceptance, Arm.from_label("d8k4v48"), "fastrl#13 (6.36-6.57 at batch 1)")
    return setup, named(lengths).capped(32768), acc, costs

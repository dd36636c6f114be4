"""The comparison with TLT's published setup, and the GPU assumptions varied.

`compare` simulates verl's regime (a: synchronous, plain decoding) against TLT's (b: synchronous, adaptive SD,
the drafter trained in idle time) on FastRL's published configurations (`project.PAPER`), with the published
acceptance, and says how far the projected speedup is from the published 1.7-2.1x and why: by Amdahl's law
the step's speedup is 1 / ((1 - r) + r / s) for a rollout share r and rollout speedup s, so the rollout
speedup the published figure needs is printed beside the projected one. Nothing is fitted to the paper: the
inputs are the published ones, the datasheets', and the stated assumptions, each varied one at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from tlt_stream.plan.acceptance import Acceptance
from tlt_stream.plan.lengths import LengthDist, named
from tlt_stream.plan.project import PAPER_ACCEPTANCE, PAPER_LENGTHS, paper_setup, project, recommend
from tlt_stream.plan.roofline import GpuCosts
from tlt_stream.plan.simulate import Setup

__all__ = ["compare", "vary_assumptions"]

PUBLISHED = {"speedup_low": 1.7, "speedup_high": 2.1, "geomean_h100": 1.76, "source": "TLT (arXiv 2511.16665)"}

VARIED: dict[str, tuple[float, float]] = {
    "bw_frac": (0.6, 0.9),
    "flop_frac": (0.4, 0.75),
    "mfu": (0.2, 0.5),
    "step_overhead_s": (0.001, 0.006),
    "sync_bytes_per_s": (2e9, 50e9),
}
"""Each GPU assumption's low and high (the defaults are `GpuCosts`' fields)."""

Progress = Callable[[str], None]


def vary_assumptions(
    setup: Setup,
    lengths: LengthDist,
    acceptance: Acceptance,
    costs: GpuCosts,
    modes: Iterable[str],
    *,
    seeds: int = 1,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Each assumption at its low and high, the others at their defaults: speedup of each mode over (a)."""
    out: dict[str, Any] = {}
    modes = list(dict.fromkeys(["a_sync_plain", *modes]))
    for name, values in VARIED.items():
        for value in values:
            if progress:
                progress(f"varying {name} = {value}")
            rows = project(setup, lengths, acceptance, costs.replace(**{name: value}), modes, seeds=seeds)
            out[f"{name}={value}"] = {m: r.get("speedup_over_a") for m, r in rows.items()}
    return out


def _amdahl(rows: dict[str, Any]) -> dict[str, Any]:
    a, b = rows["a_sync_plain"], rows["b_sync_tlt"]
    share = a["rollout_span_s"] / a["step_time_s"]
    rollout_speedup = a["rollout_span_s"] / b["rollout_span_s"]
    needed = share / (1 / PUBLISHED["speedup_low"] - (1 - share)) if 1 / PUBLISHED["speedup_low"] > 1 - share else None
    return {
        "rollout_share_a": round(share, 3),
        "rollout_speedup_b": round(rollout_speedup, 3),
        "rollout_speedup_needed_for_1_7x": round(needed, 3) if needed else "unreachable at this rollout share",
        "largest_step_speedup_at_this_share": round(1 / (1 - share), 3),
    }


def compare(
    gpu: str = "h100", *, seeds: int = 3, progress: Progress | None = None, vary: bool = True
) -> dict[str, Any]:
    modes = ["a_sync_plain", "b_sync_tlt"]
    out: dict[str, Any] = {
        "kind": "COMPARISON with the published setup (simulated, not measured; nothing fitted to the paper)",
        "published": PUBLISHED,
        "inputs": {
            "setup": "FastRL examples/grpo_7B.sh, grpo_32B_multi_nodes.sh (see plan.project.PAPER)",
            "acceptance": f"{PAPER_ACCEPTANCE} tokens/round at d8k4v48 (fastrl#13), other arms by the budget law",
            "lengths": f"{PAPER_LENGTHS} (an assumption: no published distribution), varied below",
            "gpu": gpu,
        },
        "sizes": {},
    }
    for size in ("7B", "32B"):
        setup, lengths, acc, costs = paper_setup(size, gpu)
        if progress:
            progress(f"{size}: the published setup")
        rows = project(setup, lengths, acc, costs, modes, seeds=seeds, progress=progress)
        rec = recommend(dataclasses.replace(setup, max_batch=256), lengths, acc, costs, seeds=1) if vary else None
        entry: dict[str, Any] = {
            "costs": costs.describe(),
            "lengths": lengths.summary(),
            "modes": rows,
            "speedup_b_over_a": rows["b_sync_tlt"]["speedup_over_a"],
            "amdahl": _amdahl(rows),
        }
        if rec:
            tuned = dataclasses.replace(setup, crossover=rec["sd_crossover"], margin=0, above_crossover="measure")
            if progress:
                progress(f"{size}: SD threshold {rec['sd_threshold']} (the roofline's crossover)")
            again = project(tuned, lengths, acc, costs, modes, seeds=seeds)
            entry["with_recommended_threshold"] = {
                "sd_threshold": rec["sd_threshold"],
                "speedup_b_over_a": again["b_sync_tlt"]["speedup_over_a"],
            }
        if vary:
            sweeps: dict[str, Any] = {}
            for law in (
                "lognormal:3000:0.8:32768",
                "lognormal:3000:1.2:32768",
                "lognormal:6000:1.0:32768",
                "lognormal:1500:1.4:32768",
            ):
                if progress:
                    progress(f"{size}: lengths {law}")
                r = project(setup, named(law).capped(32768), acc, costs, modes, seeds=1)
                sweeps[f"lengths={law}"] = r["b_sync_tlt"]["speedup_over_a"]
            for tokens in (4.59, 6.57):
                a2 = dataclasses.replace(acc, table={k: tokens for k in acc.table}, ref_tokens=tokens)
                r = project(setup, lengths, a2, costs, modes, seeds=1)
                sweeps[f"acceptance={tokens}"] = r["b_sync_tlt"]["speedup_over_a"]
            for name, pair in VARIED.items():
                for value in pair:
                    if progress:
                        progress(f"{size}: {name} = {value}")
                    r = project(setup, lengths, acc, costs.replace(**{name: value}), modes, seeds=1)
                    sweeps[f"{name}={value}"] = r["b_sync_tlt"]["speedup_over_a"]
            entry["varied_b_over_a"] = sweeps
            entry["varied_range"] = [min(sweeps.values()), max(sweeps.values())]
        out["sizes"][size] = entry
    best = max(e["speedup_b_over_a"] for e in out["sizes"].values())
    projected = ", ".join(f"{k} {e['speedup_b_over_a']}x" for k, e in out["sizes"].items())
    out["verdict"] = (
        f"reproduced (>= 1.7x): {projected}"
        if best >= PUBLISHED["speedup_low"]
        else f"not reproduced: projected {projected} against >= 1.7x; see amdahl (the rollout share, and the "
        "rollout speedup 1.7x needs)"
    )
    out["modes"] = {f"{k}/{m}": r for k, e in out["sizes"].items() for m, r in e["modes"].items()}
    return out

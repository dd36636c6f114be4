"""Fit the planner's CPU cost model (`tlt_stream/plan/costs.py`, `CpuCosts`) on microbenchmarks alone.

Never on the end-to-end runs it is checked against (`bench/plan_check.py`). On the tiny world's policy and
drafter, with `--threads` torch threads (the e2e runs give each process 2 threads when synchronous, 1 when
streaming: fit both), wall clock, median of `--repeats`:

- decode curve: plain decode steps of b rows (b = 1 .. 128) at three context lengths -> step_s, row_s, ctx_s,
  ragged_s; beyond one row the rows' contexts differ (prompts of different lengths), as in a run, where the
  engine builds an attention mask that rows of one context do without;
- prefill: the first step's extra time over a decode step, b prompts -> prefill_step_s, prefill_token_s;
- round costs: speculative rounds of the drafter arms at b = 1, 4, 16, 64, near the responses' start and deep in
  them, the drafter's proposals timed apart, each point's draft tokens accepted per row counted; the same with a
  drafter of the same shape whose drafts are seldom accepted (`seldom_accepted`) -> the verify-cost curve
  (round_s_fixed, round_row_s, node_frac, node_ctx_frac), draft_step_s, draft_row_s, draft_ctx_s, and accept_s
  (per row and draft token accepted: the drafter's catch-up over them, their commit); decode and round points
  are measured alternately, pass after pass (`measure_engine`), so that the machine's drift moves both alike;
- the drafter's catch-up: each round point's first round (after a plain prefill step, so its drafter runs over
  every row's prompt) less a timed round (the fitted line taking out their contexts' difference), over the rows
  times the longest prompt -> catch_up_token_s;
- switching: on an engine that drafts, rounds and plain steps mixed as a worker mixes them (a round after one
  plain step, `SWITCH_SPAN` plain steps, a round after them, a round back to back, one plain step), each step
  timed -> after_round_frac and after_round_decay (the j-th plain step after a round over the decode line, j = 1
  .. `SWITCH_SPAN`), after_one_plain_frac and after_plain_frac (a round after one and after `SWITCH_SPAN` plain
  steps over one back to back); measured among the decode and round points, like them;
- learner: `LearnerCore.step` over 2, 4, 8 and 16 synthetic groups of the world's lengths, and 4 and 16 of
  shorter and of longer-tailed ones -> learn_token_s and learn_attn_s (per padded token of the micro-batches the
  learner makes, and per padded token per token of their width), optimizer_s (least squares); the plain
  learn_tokens_per_s of the world's lengths beside them;
- publication: `Trainer.save` (publish_s) and a worker's `read_weights` + `load_policy` (load_s), on a thread of
  its own as the worker loads (`in_worker_thread`);
- re-verification (partial rollouts): b rows (b = 4, 16, 64, 128) drafted 16 or 64 tokens ahead at T = 1, then the
  next version (one real GRPO update of the policy at the tiny-world preset's learning rate) loaded with
  `reverify=True` on a thread of its own, less a plain load of it -> reverify_step_s, reverify_token_s (per
  padded token of the rows' prompts and tokens);
- the rollout worker's loop (`fit_loop`, an embedded Redis in its own process): a hop's poll for new tasks ->
  hop_s; the rows in flight published after a hop in which rows finished -> finish_s; a finished group's output
  (decoded, scored, its samples and a report sent, the task acked) -> group_s; a finished row's hidden-state
  window built and sent to `hidden` (where the drafter trains) -> window_s.

    flock /tmp/tlt-heavy.lock python bench/plan_fit.py --world artifacts/world --threads 2 \
        --out artifacts/plan/cpu-t2.json
    flock /tmp/tlt-heavy.lock python bench/plan_fit.py --world artifacts/world --threads 1 \
        --out artifacts/plan/cpu-t1.json

Prints one JSON object (the model and every measurement) and writes the model to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plan_load import background_cores, cpu_seconds  # noqa: E402  (stdlib only)

CLOCK = time.perf_counter
"""Wall clock, or the thread's CPU time with `--clock cpu` (one torch thread: a shared machine's neighbours
then cost nothing, as they cost nothing on a machine of one's own)."""


def log(text: str) -> None:
    print(f"[plan_fit] {text}", file=sys.stderr, flush=True)


OUTLIER = 0.5
"""A measurement off the fit through the others by more than this share of its prediction, and by more than four
times their median miss, is left out of the fit (at most a quarter of the points): a moment the shared machine
stalled for longer than the repeats' median can reject (2026-12-05: one of 16 decode points at 10.3 ms where
its neighbours took 1.5-2.3 ms moved the fixed cost of a ragged batch 5x)."""


def lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares through the points, outliers left out (`OUTLIER`; each one logged)."""
    import numpy as np

    a, b = np.array(rows, dtype=float), np.array(y, dtype=float)
    keep = np.ones(len(b), dtype=bool)
    for _ in range(len(b) // 4):
        solution, *_ = np.linalg.lstsq(a[keep], b[keep], rcond=None)
        fitted = a @ solution
        miss = np.abs(b - fitted) / np.maximum(np.abs(fitted), 1e-9)
        miss[~keep] = 0.0
        worst = int(np.argmax(miss))
        if miss[worst] <= OUTLIER or miss[worst] <= 4 * float(np.median(miss[keep])):
            break
        log(f"left out of the fit: {b[worst]:.4g} where the others give {fitted[worst]:.4g} ({rows[worst]})")
        keep[worst] = False
    solution, *_ = np.linalg.lstsq(a[keep], b[keep], rcond=None)
    return [float(x) for x in solution]


def prompts_of(n: int) -> list[list[int]]:
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    problems = RepeatedAddTask().problems(max(n, 8), 3, heldout=True)
    ids = [tokenizer(q.prompt, add_special_tokens=False)["input_ids"] for q in problems]
    return [ids[i % len(ids)] for i in range(n)]


def ragged(prompts: list[list[int]], spread: int) -> list[list[int]]:
    """The prompts at contexts spread evenly over `spread` tokens (the first the longest: each prompt repeated
    and cut), so that a batch's rows differ as a run's do."""
    n = len(prompts)
    return [(p * (2 + spread // max(len(p), 1)))[: len(p) + (spread * (n - i)) // n] for i, p in enumerate(prompts)]


RAGGED_SPREAD = 50
"""Tokens over which a measured batch's contexts are spread (rows of a run's batch: prompts differ, rows join
and finish at different times); small, so that the first measurement is at a short context, where a wide
batch's rollout begins."""


def engine_steps(
    policy, batch: int, *, proposer=None, arm=None, skip: int, steps: int, new: int = 420, spread: int = 0
):
    """(seconds per step over `steps` steps after `skip`, the first step's seconds, the longest row's context
    at a timed step's start (their mean, as a worker's reports count it: `longest_context`), draft seconds per
    step, prompt tokens, draft tokens a row accepted per timed step, the longest prompt, the first round's seconds
    or None); with `spread`, the rows' contexts differ by up to that many tokens (`ragged`). The first step
    prefills the prompts and decodes plain, as a decode point's; with an arm, the next is the first round, whose
    drafter catches up on the prompts (`catch_up_constant`), timed apart and counted among the skipped."""
    from tlt_stream.rollout.engine import GenerationEngine

    prompts = prompts_of(batch)
    if spread and batch > 1:
        prompts = ragged(prompts, spread)
    longest = max(len(p) for p in prompts)
    engine = GenerationEngine(policy, batch, longest + new + 70, proposer=proposer, arm=arm, max_draft_nodes=64)
    drafting = [0.0]
    if proposer is not None:
        propose = proposer.propose

        def timed(*a, **k):
            started = CLOCK()
            try:
                return propose(*a, **k)
            finally:
                drafting[0] += CLOCK() - started

        proposer.propose = timed
    for i, p in enumerate(prompts):
        engine.add_request(p, new, 1.0, seed=i, eos_ids=())
    engine.arm = None
    started = CLOCK()
    engine.step()
    first = CLOCK() - started
    engine.arm, caught = arm, None
    if arm is not None:
        started = CLOCK()
        engine.step()
        caught = CLOCK() - started
    for _ in range(skip - (caught is not None)):
        engine.step()
    drafting[0] = 0.0
    generated, seconds, contexts = engine.tokens_generated, 0.0, 0
    for _ in range(steps):
        contexts += longest_context(engine)
        started = CLOCK()
        engine.step()
        seconds += CLOCK() - started
    accepted = (engine.tokens_generated - generated) / (steps * batch) - 1.0  # beyond the target's own token
    prompt = sum(len(p) for p in prompts)
    return seconds / steps, first, contexts / steps, drafting[0] / steps, prompt, accepted, longest, caught


def longest_context(engine) -> int:
    """The longest running row's context (prompt and tokens) at a step's start: what a worker's SD arm reports
    count (`SdArmReport.contexts`) and the model is charged at. Read after the step instead, a point of rounds
    that emit several tokens a row would stand at a context its steps had not reached (16 rounds of 4 tokens:
    ~30 tokens past their mean), and its share of the context's cost would land in the per-row constants."""
    return max(len(s.prompt_ids) + len(s.token_ids) for s in engine.scheduler.running)


BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
ROUND_BATCHES = (1, 4, 16, 64)
ARMS = ("d2k1v2", "d4k1v4", "d6k1v6", "d4k2v8")
"""The drafter arms whose rounds give the verify-cost curve and the drafter's cost."""
LATE = 240
"""Steps into the responses of the long-context decode measurement."""
LEARNER_GROUPS = (2, 4, 8, 16)
"""Groups per measured update: the range a step of the tiny world trains (16 prompts, fewer where groups have
no signal). The cost per token falls as the batch grows (2026-12-05: 182, 104, 100, 90 us a token between
these points at 2 threads), so a line through two points alone puts part of it into `optimizer_s`."""


ROUND_SKIPS = (4, 60)
"""Rounds into the responses at which rounds are measured: near their start and deep in them (contexts ~2-3x
longer). A verified node attends the whole context, as the drafter's candidates do theirs, so a round's cost
grows with the context faster than a decode step's (2026-12-06, 16 rows of `d6k1v6`: 11.5 ms at 179 tokens,
15 ms at 519, where the decode line's context term adds 0.8 ms); a fit at one context cannot see it, and a run's
tail, where speculation is on, is where the contexts are longest."""
ROUND_NEW = 1000
"""Tokens a measured round's rows may generate: the deepest arm's 7 a round for every skipped and timed round."""
SELDOM_SKIPS = (4, 120)
"""Rounds into the responses at which rounds of a drafter seldom accepted are measured (`seldom_accepted`):
~1 token a round, so more rounds than `ROUND_SKIPS` reach contexts like the world drafter's deep ones."""


def seldom_accepted(drafter):
    """A drafter of `drafter`'s shape, dtype and cost whose drafts the target seldom accepts: its own weights
    (not the target's embedding and head it borrows) drawn afresh at their scale, seeded. Its rounds beside the
    drafter's own part what a round costs per draft token accepted (the drafter's catch-up forward over them,
    their commit: `accept_s`) from the rest: a fit on one drafter alone folds its acceptance into the round's
    per-row cost, and a run's online-trained drafter accepts more than the fit's."""
    import copy

    import torch

    seldom = copy.deepcopy(drafter)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (p for p in seldom.parameters() if p.dim() >= 2):
            scale = weight.float().std().item() or 1.0
            weight.copy_((torch.randn(weight.shape, generator=generator) * 4 * scale).to(weight.dtype))
    return seldom


SWITCH_SPAN = 12
"""Plain steps timed after each round of a switching point (`switch_steps`), and before the round measured as
one after many: a round's cost to the plain steps after it lasts several steps on this CPU (2026-12-07, 16 rows,
2 threads: +21% on the first, +9% on the fourth, +7-8% on the eighth to twelfth)."""
SWITCH_CYCLES = 6
"""Cycles of rounds and plain steps timed per switching point and pass."""


def switch_steps(policy, drafter, batch: int, label: str, cycles: int = SWITCH_CYCLES) -> dict[str, list[tuple]]:
    """Rounds of arm `label` and plain steps of `batch` rows on one engine that drafts, switched as a worker
    switches them, every step timed: per cycle a round after one plain step, `SWITCH_SPAN` plain steps, a round
    after them, a round back to back, one plain step. {"plain": [(j, seconds, longest context)] for the j-th plain
    step after a round, "rounds": [(k, seconds, longest context)] for a round after k plain steps (0: after a
    round)}."""
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer

    arm = Arm.from_label(label)
    prompts = ragged(prompts_of(batch), RAGGED_SPREAD) if batch > 1 else prompts_of(batch)
    new = cycles * (3 * (arm.depth + 1) + SWITCH_SPAN + 1) + 8 * (arm.depth + 2) + 8
    engine = GenerationEngine(
        policy, batch, max(len(p) for p in prompts) + new + 70, proposer=EagleProposer(drafter), max_draft_nodes=64
    )
    for i, p in enumerate(prompts):
        engine.add_request(p, new, 1.0, seed=i, eos_ids=())
    engine.step()  # the prefill

    def step(speculate: bool) -> tuple[float, int]:
        engine.arm = arm if speculate else None
        context = longest_context(engine)
        started = CLOCK()
        engine.step()
        return CLOCK() - started, context

    for _ in range(4):  # warm-up: both kinds' code paths and buffers
        step(True)
        step(False)
    out: dict[str, list[tuple]] = {"plain": [], "rounds": []}
    for _ in range(cycles):
        out["rounds"].append((1, *step(True)))
        out["plain"] += [(j, *step(False)) for j in range(1, SWITCH_SPAN + 1)]
        out["rounds"].append((SWITCH_SPAN, *step(True)))
        out["rounds"].append((0, *step(True)))
        out["plain"].append((1, *step(False)))
    return out


def interleaved(*kinds: list) -> list:
    """The points of every kind in one order, each kind spread evenly over it (decode, round, decode, ...)."""
    tagged = [(i / len(points), k, i) for k, points in enumerate(kinds) for i in range(len(points))]
    return [kinds[k][i] for _, k, i in sorted(tagged)]


def measure_engine(policy, drafter, repeats: int) -> dict[tuple, list[tuple]]:
    """Every decode point (rows, steps skipped) and round point (arm, rows, rounds skipped; of `drafter` and,
    as "seldom" points, of one whose drafts are seldom accepted, `seldom_accepted`), measured in
    `repeats` passes over all of them, decode and round points alternating (`interleaved`), every other pass
    in reverse. A shared machine's speed drifts by tens of percent within minutes (the same decode point
    3.1-5.1 ms within 40 s, 2026-12-06), and the verify-cost curve is fitted on the rounds' excess over the decode
    line: measured in blocks, one after the other, the drift between the blocks lands in that excess. Spread
    over the same minutes, it moves both alike."""
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.proposers import EagleProposer

    results: dict[tuple, list] = {}
    drafters = {"round": drafter, "seldom": seldom_accepted(drafter)}
    for point in measuring_order(repeats):
        if point[0] == "decode":
            _, batch, skip = point
            measured = engine_steps(policy, batch, skip=skip, steps=24, spread=RAGGED_SPREAD)
        elif point[0] == "switch":
            _, label, batch = point
            measured = switch_steps(policy, drafter, batch, label)
        else:
            kind, label, batch, skip = point
            arm, proposer = Arm.from_label(label), EagleProposer(drafters[kind])
            measured = engine_steps(policy, batch, proposer=proposer, arm=arm, skip=skip, steps=16, new=ROUND_NEW)
        results.setdefault(point, []).append(measured)
    return results


def measuring_order(repeats: int) -> list[tuple]:
    """`measure_engine`'s points in the order it measures them, `repeats` passes."""
    decode = [("decode", batch, skip) for batch in BATCHES for skip in (4, LATE // 2, LATE)]
    rounds = [("round", label, batch, skip) for label in ARMS for batch in ROUND_BATCHES for skip in ROUND_SKIPS]
    seldom = [("seldom", label, batch, skip) for label in ARMS for batch in ROUND_BATCHES for skip in SELDOM_SKIPS]
    switching = [("switch", label, batch) for label in ARMS for batch in ROUND_BATCHES]
    order = interleaved(decode, rounds, seldom, switching)
    return [point for r in range(repeats) for point in (order if r % 2 == 0 else order[::-1])]


def fit_engine(world: Path, repeats: int) -> tuple[dict, dict]:
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model

    policy = load_model(world / "policy")
    return engine_constants(measure_engine(policy, load_drafter(world / "drafter", policy), repeats))


def engine_constants(results: dict[tuple, list[tuple]]) -> tuple[dict, dict]:
    """The decode line, prefill, verify-cost curve and drafter constants through `measure_engine`'s points
    (per point, the median of its passes), and the points as measured."""
    from tlt_stream.rollout.arms import Arm

    def median(point: tuple, field: int) -> float:
        return point_median(results, point, field)

    plain_rows, plain_y, prefill_rows, prefill_y, measured = [], [], [], [], {"decode": [], "rounds": []}
    for point in (p for p in results if p[0] == "decode"):
        _, batch, skip = point
        sec, first, ctx = median(point, 0), median(point, 1), median(point, 2)
        plain_rows.append([1.0, batch, batch * ctx, float(batch > 1)])
        plain_y.append(sec)
        if skip == 4:
            prefill_rows.append([1.0, results[point][0][4]])
            prefill_y.append(max(0.0, first - sec))
        measured["decode"].append({"batch": batch, "context": round(ctx, 1), "ms": round(1e3 * sec, 3)})
        log(f"decode b={batch} longest ctx={ctx:.0f}: {1e3 * sec:.2f} ms")
    step_s, row_s, ctx_s, ragged_s = lstsq(plain_rows, plain_y)
    prefill_step_s, prefill_token_s = lstsq(prefill_rows, prefill_y)
    verify_rows, verify_y, draft_rows, draft_y = [], [], [], []
    round_points = [p for p in results if p[0] in ("round", "seldom")]
    # the acceptance term where every point measured what its rows accepted and some accepted more than others
    acceptance = [median(p, 5) if len(results[p][0]) > 5 else None for p in round_points]
    with_acceptance = None not in acceptance and max(acceptance, default=0.0) - min(acceptance, default=0.0) > 0.5
    for point, accepted in zip(round_points, acceptance, strict=True):
        kind, label, batch, _ = point
        arm = Arm.from_label(label)
        sec, ctx, draft = median(point, 0), median(point, 2), median(point, 3)
        base = step_s + row_s * batch + ctx_s * batch * ctx
        accepting = [batch * accepted] if with_acceptance else []
        verify_rows.append([1.0, batch, row_s * batch * arm.nodes, ctx_s * batch * ctx * arm.nodes, *accepting])
        verify_y.append(sec - draft - base)
        width = arm.depth * batch * arm.topk
        draft_rows.append([1.0, batch, arm.depth, width, width * ctx, *accepting])
        draft_y.append(draft)
        measured["rounds"].append(
            {
                "arm": label,
                "drafter": "seldom accepted" if kind == "seldom" else "world",
                "batch": batch,
                "context": round(ctx, 1),
                "accepted": None if accepted is None else round(accepted, 3),
                "ms": round(1e3 * sec, 3),
                "draft_ms": round(1e3 * draft, 3),
            }
        )
        accepts = "" if accepted is None else f", accepting {accepted:.2f} a row"
        log(f"{kind} {label} b={batch} longest ctx={ctx:.0f}{accepts}: {1e3 * sec:.2f} ms (drafting {1e3 * draft:.2f})")
    # a round's fixed and per-row costs, whether the verify or the drafter pays them, are one figure each
    verify_fixed, verify_row_s, node_frac, node_ctx_frac, *verify_accept = lstsq(verify_rows, verify_y)
    draft_fixed, draft_round_row_s, draft_step_s, draft_row_s, draft_ctx_s, *draft_accept = lstsq(draft_rows, draft_y)
    if draft_fixed < 0:  # a line through deep arms' drafting, extended to depth 0: no drafter costs less than none
        draft_fixed = 0.0
        draft_round_row_s, draft_step_s, draft_row_s, draft_ctx_s, *draft_accept = lstsq(
            [r[1:] for r in draft_rows], draft_y
        )
    fitted: dict = {
        "step_s": step_s,
        "row_s": row_s,
        "ctx_s": ctx_s,
        "ragged_s": max(0.0, ragged_s),
        "node_frac": node_frac,
        "node_ctx_frac": max(0.0, node_ctx_frac),
        "round_s_fixed": verify_fixed + draft_fixed,
        "round_row_s": verify_row_s + draft_round_row_s,
        "draft_step_s": draft_step_s,
        "draft_row_s": draft_row_s,
        "draft_ctx_s": max(0.0, draft_ctx_s),
        "accept_s": max(0.0, sum(verify_accept) + sum(draft_accept)),
        "prefill_step_s": max(0.0, prefill_step_s),
        "prefill_token_s": max(0.0, prefill_token_s),
    }
    fitted["catch_up_token_s"] = catch_up_constant(results, round_points, fitted)
    switching = {p: passes for p, passes in results.items() if p[0] == "switch"}
    if switching:
        fitted_switch, measured["switching"] = switch_constants(switching, fitted)
        fitted |= fitted_switch
    return fitted, measured


def point_median(results: dict[tuple, list[tuple]], point: tuple, field: int) -> float:
    """A measured point's `field` (an index of `engine_steps`' tuple), the median over its passes."""
    return statistics.median(r[field] for r in results[point])


def catch_up_constant(results: dict[tuple, list[tuple]], round_points: list[tuple], fitted: dict) -> float:
    """`catch_up_token_s` through the round points' first rounds, each after a plain prefill step, so that its
    drafter ran over every row's prompt: the first round less a timed round, less what the fitted line (`fitted`,
    at the points' acceptance) puts between their contexts (the first at the longest prompt), over the rows times
    the longest prompt; a line through the origin over every point, medians of the passes; 0 where the points
    recorded no first round, or the line comes out below zero. (The prefill's fitted cost is no baseline: it is
    fitted on ragged prompts and folds their padding into a per-token cost.)"""
    from tlt_stream.plan.costs import CpuCosts
    from tlt_stream.rollout.arms import Arm

    line = CpuCosts(**fitted)
    xs, ys = [], []
    for point in round_points:
        first = results[point][0]
        if len(first) < 8 or first[7] is None:
            continue
        _, label, batch, _ = point
        arm, longest = Arm.from_label(label), first[6]
        caught, sec, ctx, accepted = (point_median(results, point, field) for field in (7, 0, 2, 5))
        apart = line.round_s(batch, arm, ctx, accepted) - line.round_s(batch, arm, longest, accepted)
        xs.append(batch * longest)
        ys.append(caught - sec + apart)
    if not xs:
        return 0.0
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    log(f"catch-up: {1e6 * slope:.3f} us a row and prompt token ({len(xs)} points)")
    return max(0.0, slope)


def switch_constants(results: dict[tuple, list[dict]], fitted: dict) -> tuple[dict, dict]:
    """The cost of switching between plain steps and rounds through `switch_steps`' points: each plain step
    over the decode line at its rows and context (`fitted`), the median per j over every point and pass, a
    geometric decay `after_round_frac * after_round_decay ** (j - 1)` through those medians (least squares,
    the decay on a grid); each round over the fitted round's cost at its shape, over the same point's rounds
    back to back, the median per k over every point and pass (1 and `SWITCH_SPAN`). Shares below 0 (a machine
    noisier than the effect) are 0."""
    from tlt_stream.plan.costs import CpuCosts
    from tlt_stream.rollout.arms import Arm

    line = CpuCosts(**fitted)
    by_j: dict[int, list[float]] = {}
    by_k: dict[int, list[float]] = {}
    for (_, label, batch), passes in results.items():
        arm = Arm.from_label(label)
        for measured in passes:
            for j, sec, ctx in measured["plain"]:
                by_j.setdefault(j, []).append(sec / line.decode_s(batch, ctx) - 1)
            relative = {}
            for k, sec, ctx in measured["rounds"]:
                relative.setdefault(k, []).append(sec / line.round_s(batch, arm, ctx))
            back_to_back = statistics.median(relative[0])
            for k in (1, SWITCH_SPAN):
                by_k.setdefault(k, []).append(statistics.median(relative[k]) / back_to_back - 1)
    js = sorted(by_j)
    y = [statistics.median(by_j[j]) for j in js]
    best = (float("inf"), 0.0, 0.0)
    for decay in (i / 100 for i in range(100)):
        weights = [decay ** (j - 1) for j in js]
        frac = sum(w * v for w, v in zip(weights, y, strict=True)) / sum(w * w for w in weights)
        error = sum((v - frac * w) ** 2 for w, v in zip(weights, y, strict=True))
        if error < best[0]:
            best = (error, frac, decay)
    _, after_round_frac, after_round_decay = best
    after = {k: statistics.median(v) for k, v in by_k.items()}
    constants = {
        "after_round_frac": max(0.0, after_round_frac),
        "after_round_decay": after_round_decay if after_round_frac > 0 else 0.0,
        "after_one_plain_frac": max(0.0, after[1]),
        "after_plain_frac": max(0.0, after[SWITCH_SPAN]),
        "after_plain_steps": SWITCH_SPAN,
    }
    log(
        "switching: plain steps after a round "
        + ", ".join(f"{1 + v:.3f}" for v in y)
        + f" the decode line; rounds after 1 and {SWITCH_SPAN} plain steps {1 + after[1]:.3f}, "
        f"{1 + after[SWITCH_SPAN]:.3f} one after a round"
    )
    return constants, {
        "plain_after_round": [round(1 + v, 4) for v in y],
        "round_after_plain": {str(k): round(1 + v, 4) for k, v in sorted(after.items())},
    }


LENGTH_LAWS = {"world": (5.0, 0.6), "short": (4.1, 0.5), "tail": (5.0, 1.0)}
"""(mu, sigma) of the synthetic responses' log-normal lengths: the world's (median ~150 tokens), shorter ones,
and a longer tail (wider micro-batches): the learner's cost per padded token and its attention's part apart."""
LAW_GROUPS = {"world": LEARNER_GROUPS, "short": (4, 16), "tail": (4, 16)}


def learner_batch(world: Path, n: int, seed: int = 0, law: str = "world") -> tuple:
    """(the world's policy as the learner loads it, `synthetic_groups` of it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy", dtype="float32")
    return model, synthetic_groups(int(model.get_input_embeddings().weight.shape[0]), n, seed, law)


def synthetic_groups(vocab: int, n: int, seed: int = 0, law: str = "world") -> list:
    """`n` synthetic groups of 8 samples of `law`'s lengths (`LENGTH_LAWS`, capped at 1400 tokens) after prompts
    of 40 random tokens, rewards alternating so every group has a signal."""
    from _grpo import synthetic_group  # bench/, on the path

    rng = random.Random(seed)
    mu, sigma = LENGTH_LAWS[law]
    out = []
    for g in range(n):
        prompt = [rng.randrange(vocab) for _ in range(40)]
        out.append(
            synthetic_group(rng, g, prompt, 8, lambda: min(1400, max(8, int(rng.lognormvariate(mu, sigma)))), vocab)
        )
    return out


def fit_learner(world: Path, repeats: int) -> tuple[dict, dict]:
    from tlt_stream.plan.costs import micro_batches
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings

    settings = LearnerSettings(lr=1e-6)
    model, _ = learner_batch(world, 0)
    core = LearnerCore(model, settings)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    plain_rows, padded_rows, y, measured = [], [], [], []
    for law, counts in LAW_GROUPS.items():
        groups = synthetic_groups(vocab, max(counts), law=law)
        for n in counts:
            batch = groups[:n]
            tokens = sum(s.response_len for g in batch for s in g.samples)
            shapes = micro_batches(
                [s.response_len for g in batch for s in g.samples], 40, settings.micro_batch_tokens
            )  # every synthetic prompt is 40 tokens
            core.step(batch)  # warm-up
            times = []
            for _ in range(repeats):
                started = CLOCK()
                core.step(batch)
                times.append(CLOCK() - started)
            sec = statistics.median(times)
            if law == "world":
                plain_rows.append([1.0, tokens])
            padded_rows.append([1.0, sum(b * w for b, w in shapes), sum(b * w * w for b, w in shapes)])
            y.append(sec)
            measured.append({"law": law, "groups": n, "tokens": tokens, "s": round(sec, 4)})
            log(f"learner {law} {n} groups, {tokens} tokens: {sec:.3f} s")
    _, per_token = lstsq(plain_rows, y[: len(plain_rows)])
    optimizer_s, token_s, attn_s = lstsq(padded_rows, y)
    if attn_s < 0:  # noise: no attention term is better than a negative one
        optimizer_s, token_s = lstsq([r[:2] for r in padded_rows], y)
        attn_s = 0.0
    fitted = {
        "learn_tokens_per_s": 1.0 / per_token,
        "learn_token_s": token_s,
        "learn_attn_s": attn_s,
        "micro_batch_tokens": settings.micro_batch_tokens,
        "optimizer_s": max(0.0, optimizer_s),
    }
    return fitted, {"learner": measured}


def in_worker_thread(fn, *args, **kwargs) -> float:
    """Seconds `fn(*args, **kwargs)` takes on a thread of its own, as a rollout worker loads a version and
    re-verifies its rows (`PolicyLoader.load`, `model.threads.in_own_thread`), with this thread's OpenMP team
    alive beside it as the worker's compute thread's is: two teams on the cores throttle libgomp's spinning,
    and the same re-verification ran ~1.26x longer so than on the compute thread (2 threads, 128 rows)."""
    import asyncio

    from tlt_stream.model.threads import in_own_thread

    def timed() -> float:
        started = CLOCK()
        fn(*args, **kwargs)
        return CLOCK() - started

    return asyncio.run(in_own_thread(timed))


def fit_publish(world: Path, repeats: int) -> tuple[dict, dict]:
    import torch

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.rl.learner import LearnerSettings
    from tlt_stream.rl.sharded import Trainer
    from tlt_stream.rollout.build import build_engine
    from tlt_stream.store.weights import read_weights

    trainer = Trainer(LearnerSettings(lr=1e-6), "cpu")
    trainer.build(world / "policy")
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        common = {"extra": {}, "tokenizer": None, "keep": 3, "publish_dtype": torch.float32}
        first = trainer.save(root, step=0, ledger=set(), **common)
        trainer.wait_for_writes()
        config = override(DEFAULTS, {"rollout.max_batch": 1, "rollout.max_len": 64, "rollout.temperature": 1.0})
        engine, _ = build_engine(str(first.policy_dir), config)
        for step in range(1, repeats + 1):
            started = CLOCK()
            info = trainer.save(root, step=step, ledger=set(), **common)
            saves.append(CLOCK() - started)
            trainer.wait_for_writes()

            def load(info=info) -> None:
                weights = read_weights(info.policy_dir, info.policy_sha256, scheme=info.digest)
                engine.load_policy(str(info.policy_dir), weights=weights)

            loads.append(in_worker_thread(load))
    publish_s, load_s = statistics.median(saves), statistics.median(loads)
    log(f"publish {publish_s * 1e3:.1f} ms, load {load_s * 1e3:.1f} ms")
    return {"publish_s": publish_s, "load_s": load_s}, {"publish_ms": [round(1e3 * x, 2) for x in saves]}


REVERIFY_BATCHES = (4, 16, 64, 128)
REVERIFY_AHEAD = (16, 64)
"""Rows and tokens drafted ahead at each measured re-verification (`policy.ahead_tokens` is 64 by default)."""


def fit_reverify(world: Path, repeats: int) -> tuple[dict, dict]:
    """A partial rollout's re-verification beyond a plain load: rows parked after drafting `ahead` tokens under
    the world's policy, re-verified under the next version (one GRPO update at the tiny-world preset's lr, so
    the rows the old policy's forward runs over are as few as after a real update)."""
    import shutil

    from tlt_stream.basics.config.tree import PRESETS
    from tlt_stream.model import load_model
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings
    from tlt_stream.rollout.engine import GenerationEngine

    model, groups = learner_batch(world, 4)
    LearnerCore(model, LearnerSettings(lr=PRESETS["tiny-world"]["learner"]["lr"])).step(groups)
    rows, y, measured = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        following = Path(tmp) / "next"
        shutil.copytree(world / "policy", following)
        model.save_pretrained(following)
        idle = GenerationEngine(load_model(world / "policy"), 1, 64)
        plain = []
        for _ in range(max(repeats, 3)):
            plain.append(in_worker_thread(idle.load_policy, following))
        load = statistics.median(plain)
        for batch in REVERIFY_BATCHES:
            prompts = ragged(prompts_of(batch), RAGGED_SPREAD)
            longest = max(len(q) for q in prompts)
            for ahead in REVERIFY_AHEAD:
                times, kept = [], []
                for _ in range(repeats):
                    engine = GenerationEngine(load_model(world / "policy"), batch, longest + ahead + 70)
                    for i, q in enumerate(prompts):
                        engine.add_request(q, ahead + 60, 1.0, seed=i, eos_ids=(), ahead_limit=ahead)
                    while engine.has_work:  # until every row has parked
                        engine.step()
                    times.append(in_worker_thread(engine.load_policy, following, reverify=True) - load)
                    kept.append(engine.tokens_kept / max(engine.tokens_kept + engine.tokens_discarded, 1))
                sec = statistics.median(times)
                rows.append([1.0, batch * (longest + ahead)])
                y.append(sec)
                measured.append(
                    {"batch": batch, "ahead": ahead, "ms": round(1e3 * sec, 2), "kept": round(min(kept), 4)}
                )
                log(f"re-verify b={batch} ahead={ahead}: {1e3 * sec:.1f} ms beyond a load (kept {min(kept):.3f})")
    step_s, token_s = lstsq(rows, y)
    return {"reverify_step_s": max(0.0, step_s), "reverify_token_s": max(0.0, token_s)}, {"reverify": measured}


LOOP_POLLS = 100
"""Empty reads timed for the worker loop's per-hop cost."""
LOOP_HOP = 8
"""Decode steps of 64 rows run before each timed poll or group output (`rollout.steps_per_hop`), untimed: the
loop runs right after the engine's threads, which a bare poll would not see."""
LOOP_GROUPS = 40
"""Finished groups whose output is timed for its per-group cost."""


def fit_loop(world: Path) -> tuple[dict, dict]:
    """The rollout worker's own loop beside its engine steps, on an embedded Redis in its own process (as a
    `tlt-stream run` on the embedded defaults has it, in the launcher's): a hop's poll for new tasks (a
    non-blocking read of the prompts stream, `StreamReader.read`) -> hop_s; after a hop in which rows finished,
    the rows in flight published to the worker's registry record (`WorkerRegistry.publish`) -> finish_s; a
    finished group's output (its 8
    responses decoded and scored with the world's reward, made samples, sent to `samples` in one pipeline, the
    task acked, a rollout report sent to `stats`) -> group_s; a finished row's hidden-state window built in the
    wire dtype and sent to `hidden` (`rl.samples.hidden_window`, as a worker that streams the row's states sends
    it) -> window_s. The responses are real ones of the world's policy, generated with their hidden states."""
    import asyncio
    import subprocess

    from transformers import AutoTokenizer

    from tlt_stream.basics.config import DEFAULTS
    from tlt_stream.model import load_model
    from tlt_stream.model.loader import stop_token_ids
    from tlt_stream.rl.rewards import resolve_reward
    from tlt_stream.rollout.engine import GenerationEngine

    group_size = DEFAULTS.policy.group_size
    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    reward = resolve_reward(DEFAULTS.rollout.reward)
    prompt = prompts_of(1)[0]
    policy = load_model(world / "policy")
    engine = GenerationEngine(policy, group_size, len(prompt) + 400)
    for i in range(group_size):
        engine.add_request(
            prompt, 300, 1.0, seed=i, eos_ids=stop_token_ids(world / "policy", tokenizer), return_hidden=True
        )
    results = []
    while engine.has_work:
        results += engine.step()
    results.sort(key=lambda r: r.request_id)
    rows = prompts_of(64)
    busy = GenerationEngine(policy, len(rows), max(len(q) for q in rows) + 1000)
    for i, q in enumerate(rows):
        busy.add_request(q, 990, 1.0, seed=i, eos_ids=())

    def hop() -> None:
        for _ in range(LOOP_HOP):
            if busy.has_work:
                busy.step()

    server = subprocess.Popen(
        [sys.executable, "-c", EMBEDDED_REDIS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        url = server.stdout.readline().strip()
        polls, finishes, groups, windows = asyncio.run(_loop_times(url, results, tokenizer, reward, hop))
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    hop_s, finish_s, group_s, window_s = (statistics.median(x) for x in (polls, finishes, groups, windows))
    log(
        f"worker loop: {hop_s * 1e3:.2f} ms a poll, {finish_s * 1e3:.2f} ms the rows in flight published, "
        f"{group_s * 1e3:.1f} ms a group's output, {window_s * 1e3:.2f} ms a row's hidden-state window"
    )
    return {"hop_s": hop_s, "finish_s": finish_s, "group_s": group_s, "window_s": window_s}, {
        "loop": {
            "poll_ms": round(hop_s * 1e3, 3),
            "finish_ms": round(finish_s * 1e3, 3),
            "group_ms": round(group_s * 1e3, 2),
            "window_ms": round(window_s * 1e3, 3),
            "rows": group_size,
        }
    }


EMBEDDED_REDIS = """
import sys
from tlt_stream.bus.embedded import EmbeddedServers
servers = EmbeddedServers()
print(servers.start_redis(), flush=True)
sys.stdin.read()
servers.close()
"""
"""A child process hosting the embedded Redis until its stdin closes (its URL on the first line of stdout)."""


async def _loop_times(url: str, results: list, tokenizer, reward, hop) -> tuple[list[float], ...]:
    import uuid

    import redis.asyncio as aioredis

    from tlt_stream.basics.config import DEFAULTS, BusConfig
    from tlt_stream.basics.messages import PromptGroup, RolloutStats
    from tlt_stream.bus.consumer import StreamReader
    from tlt_stream.bus.producer import StreamProducer
    from tlt_stream.bus.registry import WorkerRegistry
    from tlt_stream.bus.streams import Keys
    from tlt_stream.rl.rewards import call_reward
    from tlt_stream.rl.samples import hidden_window, make_sample

    redis = aioredis.Redis.from_url(url)
    keys, bus = Keys(f"planfit-{uuid.uuid4().hex[:8]}"), BusConfig()
    reader = StreamReader(redis, keys, bus, "prompts", "worker")
    producer = StreamProducer(redis, keys, bus)
    registry = WorkerRegistry(redis, keys, bus, producer, "worker", role="rollout")
    await reader.ensure_group()
    polls, finishes, groups = [], [], []
    for i in range(LOOP_POLLS):
        hop()
        started = CLOCK()
        await reader.read(count=bus.read_count, block_ms=0)
        polls.append(CLOCK() - started)
        hop()
        started = CLOCK()
        await registry.publish(rows_in_flight=LOOP_POLLS - i)
        finishes.append(CLOCK() - started)
    tasks = [
        PromptGroup(task_id=f"t{i}", prompt_id=f"p{i}", prompt_ids=list(results[0].prompt_ids), answer="42",
                    group_size=len(results))
        for i in range(LOOP_GROUPS)
    ]  # fmt: skip
    await producer.send("prompts", tasks)
    deliveries = []
    while len(deliveries) < len(tasks):
        deliveries += await reader.read(count=len(tasks), block_ms=100)
    for delivery in deliveries:
        hop()
        started = CLOCK()
        group = delivery.message
        samples = []
        for index, result in enumerate(results):
            text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
            score = call_reward(reward, text, group.answer, group.fields)
            samples.append(make_sample(result, group, index, reward=score, policy_version=1, drafter_version=0,
                                       worker_id="worker", gen_seconds=1.0))  # fmt: skip
        await producer.send("samples", samples)
        await reader.ack([delivery.entry_id])
        report = RolloutStats(worker_id="worker", policy_version=1, drafter_version=0, batch_size=64,
                              tokens=1000, seconds=0.5, target_forwards=100)  # fmt: skip
        await producer.send("stats", [report])
        groups.append(CLOCK() - started)
    windows = []
    for i in range(LOOP_GROUPS):
        result = results[i % len(results)]
        hop()
        started = CLOCK()
        window = hidden_window(result, f"t{i}/{i % len(results)}", 1, dtype=DEFAULTS.rollout.hidden_dtype)
        await producer.send("hidden", [window])
        windows.append(CLOCK() - started)
    for stream in ("prompts", "samples", "stats", "hidden"):
        await redis.delete(keys.stream(stream))
    await redis.delete(keys.worker("worker"))
    await redis.aclose()
    return polls, finishes, groups, windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (the process's share of the cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cores", type=float, default=None, help="cores the run shares (default: this machine's)")
    p.add_argument("--out", default=str(ROOT / "artifacts" / "plan" / "cpu.json"))
    p.add_argument("--quick", action="store_true", help="fewer batches and steps: a smoke check, not a fit")
    p.add_argument(
        "--light",
        action="store_true",
        help="the whole fit on fewer points (5 batches, 3 arms at 3 batches, one repeat): ~1/3 of the time, for "
        "fits beside each measured run on a loaded machine",
    )
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the thread's CPU time (1 thread)")
    args = p.parse_args()
    if args.clock == "cpu":
        if args.threads != 1:
            sys.exit("--clock cpu times the calling thread: use it with --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    global BATCHES, ROUND_BATCHES, ROUND_SKIPS, LATE, ARMS, LAW_GROUPS, REVERIFY_BATCHES, REVERIFY_AHEAD
    if args.light:
        BATCHES, ROUND_BATCHES, ARMS, args.repeats = (1, 4, 16, 64, 128), (1, 16, 64), ("d2k1v2", "d6k1v6", "d4k2v8"), 1
        LAW_GROUPS = {"world": (4, 16), "short": (16,), "tail": (16,)}
        REVERIFY_BATCHES, REVERIFY_AHEAD = (16, 64), (64,)
    if args.quick:
        BATCHES, ROUND_BATCHES, LATE, ROUND_SKIPS = (1, 8, 32), (1, 8), 40, (4, 20)
        REVERIFY_BATCHES, REVERIFY_AHEAD = (4, 16), (16,)
    import torch

    from tlt_stream.plan.costs import CpuCosts

    torch.set_num_threads(args.threads)
    world = Path(args.world)
    if not (world / "policy").is_dir() or not (world / "drafter").is_dir():
        sys.exit(f"{world}: no policy/drafter; run `tlt-stream bootstrap --out {world}` first")
    started = time.time()
    mine = {os.getpid()}
    load, clock = cpu_seconds(), time.time()
    engine, measured = fit_engine(world, args.repeats)
    load, clock, engine_background = (
        cpu_seconds(),
        time.time(),
        background_cores(load, cpu_seconds(), time.time() - clock, mine),
    )
    learner, measured_l = fit_learner(world, args.repeats)
    learner_background = background_cores(load, cpu_seconds(), time.time() - clock, mine)
    publish, measured_p = fit_publish(world, args.repeats)
    reverify, measured_r = fit_reverify(world, args.repeats)
    loop, measured_w = fit_loop(world)
    cores = args.cores or len(os.sched_getaffinity(0))
    model = CpuCosts(
        **engine,
        **learner,
        **publish,
        **reverify,
        **loop,
        cores=cores,
        source=f"bench/plan_fit.py --threads {args.threads}",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    background = {"engine": round(engine_background, 3), "learner": round(learner_background, 3)}
    # what else ran while the constants were measured (`bench/plan_load.py`): `plan_check --contention` takes
    # it out of them with the contention law
    Path(args.out).write_text(json.dumps({**model.describe(), "fit": {"background_cores": background}}, indent=2))
    print(
        json.dumps(
            {
                "bench": "plan_fit",
                "model": model.describe(),
                "measured": {**measured, **measured_l, **measured_p, **measured_r, **measured_w},
                "background_cores": background,
                "out": args.out,
                "seconds": round(time.time() - started, 1),
                "machine": {"cpus": os.cpu_count(), "threads": args.threads, "platform": platform.platform()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

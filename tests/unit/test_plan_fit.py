"""`bench/plan_fit.py`'s algebra: the constants it fits through measured points are those of a model that made
the points (no machine involved: the points are the model's own figures), and its measuring order spreads the
kinds of points over the same minutes."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tlt_stream.plan.costs import CpuCosts
from tlt_stream.rollout.arms import Arm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "plan_fit.py"


def bench_module(name: str):
    """`bench/NAME.py` imported as a module (the bench directory is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plan_fit():
    return bench_module("plan_fit")


TRUE = CpuCosts(
    step_s=1.1e-3, row_s=3.0e-5, ctx_s=1.5e-7, ragged_s=2.0e-4, node_frac=0.7, node_ctx_frac=0.45,
    round_s_fixed=6.0e-4, round_row_s=9.0e-5, draft_step_s=4.0e-4, draft_row_s=2.0e-5, draft_ctx_s=3.0e-8,
    prefill_step_s=2.0e-3, prefill_token_s=2.0e-5, after_round_frac=0.18, after_round_decay=0.55,
    after_one_plain_frac=0.03, after_plain_frac=0.12, after_plain_steps=12, accept_s=7.0e-6, catch_up_token_s=4.0e-7,
)  # fmt: skip


def points_of(model: CpuCosts, plan_fit) -> dict[tuple, list[tuple]]:
    """`measure_engine`'s points as `model` would time them: (seconds, first step's, longest context, drafting
    per round, prompt tokens, draft tokens accepted per row and round, the longest prompt, the first round) per
    pass, two passes each; the world
    drafter's rounds accept more the deeper the arm, the seldom-accepted drafter's almost nothing."""
    results = {}
    for batch, skip in itertools.product(plan_fit.BATCHES, (4, plan_fit.LATE // 2, plan_fit.LATE)):
        ctx, prompt = 60 + skip + batch % 7, 40 * batch
        sec = model.decode_s(batch, ctx)
        results[("decode", batch, skip)] = [(sec, sec + model.prefill_s(prompt), ctx, 0.0, prompt, 0.0)] * 2
    rounds = [("round", *p) for p in itertools.product(plan_fit.ARMS, plan_fit.ROUND_BATCHES, plan_fit.ROUND_SKIPS)]
    rounds += [("seldom", *p) for p in itertools.product(plan_fit.ARMS, plan_fit.ROUND_BATCHES, plan_fit.SELDOM_SKIPS)]
    for kind, label, batch, skip in rounds:
        arm = Arm.from_label(label)
        accepted = 0.5 + 0.6 * arm.depth - 0.1 * (batch % 3) if kind == "round" else 0.02 * (1 + batch % 3)
        ctx = 60 + skip * (1 + accepted) + batch % 5
        # the drafter's share of the round's fixed and per-row costs (the rest is the verify's), and of accepting
        catch_up = 0.25 * (model.round_s_fixed + model.round_row_s * batch) + 0.6 * model.accept_s * batch * accepted
        draft = catch_up + arm.depth * (
            model.draft_step_s + batch * arm.topk * (model.draft_row_s + model.draft_ctx_s * ctx)
        )
        sec = model.round_s(batch, arm, ctx, accepted)
        longest = 30 + batch % 4  # the first round, at the prompts' context, its drafter catching up on them
        prompt = batch * (longest - 1)
        first = model.prefill_s(prompt) + model.decode_s(batch, longest)
        caught = model.round_s(batch, arm, longest, accepted) + model.catch_up_s([longest] * batch)
        results[(kind, label, batch, skip)] = [(sec, first, ctx, draft, prompt, accepted, longest, caught)] * 2
    for label, batch in itertools.product(plan_fit.ARMS, plan_fit.ROUND_BATCHES):
        results[("switch", label, batch)] = [switching_of(model, plan_fit, Arm.from_label(label), batch)] * 2
    return results


def switching_of(model: CpuCosts, plan_fit, arm: Arm, batch: int) -> dict[str, list[tuple]]:
    """`switch_steps`' record as `model` would time it: two cycles, contexts growing as steps run."""
    out: dict[str, list[tuple]] = {"plain": [], "rounds": []}
    ctx = 80 + batch % 3
    plain, span = Arm.plain(), plan_fit.SWITCH_SPAN
    for _ in range(2):
        for k, after in ((1, 1), *((None, j - 1) for j in range(1, span + 1)), (span, span), (0, 0), (None, 0)):
            step = arm if k is not None else plain
            sec = model.round_s(batch, step, ctx) + model.switch_s(batch, step, ctx, after)
            out["rounds" if k is not None else "plain"].append((k if k is not None else after + 1, sec, ctx))
            ctx += 4 if k is not None else 1
    return out


def test_the_fit_gives_back_the_constants_that_made_the_points(plan_fit):
    fitted, measured = plan_fit.engine_constants(points_of(TRUE, plan_fit))
    for name, value in fitted.items():
        assert value == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-12), name
    skips = len(plan_fit.ROUND_SKIPS) + len(plan_fit.SELDOM_SKIPS)
    assert len(measured["rounds"]) == len(plan_fit.ARMS) * len(plan_fit.ROUND_BATCHES) * skips
    assert {"after_round_frac", "after_round_decay", "after_one_plain_frac", "after_plain_frac"} <= set(fitted)


def test_drafting_that_grows_faster_than_its_depth_fits_no_drafter_cost_below_zero(plan_fit):
    """Drafting measured at 0.5 ms a level at depth 2 and 1 ms a level deeper (as on this CPU at one row): a line
    through it crosses zero above depth 0, and a round without a drafter (an n-gram arm) would be charged less
    than its verify. The fit keeps the drafter's fixed cost at zero or more, so every arm's round stays a cost."""
    results = points_of(TRUE, plan_fit)
    for point, passes in results.items():
        if point[0] in ("round", "seldom"):
            depth = Arm.from_label(point[1]).depth
            sec, first, ctx, draft, prompt, accepted, longest, caught = passes[0]
            extra = 1e-3 * (depth - 2) * 1.5  # every level past the second costs 1.5 ms more
            results[point] = [(sec + extra, first, ctx, draft + extra, prompt, accepted, longest, caught + extra)] * 2
    fitted, _ = plan_fit.engine_constants(results)
    costs = CpuCosts(**fitted)
    assert costs._unusable() is None
    assert costs.round_s(1, Arm.from_label("ngram-d4"), 1) > costs.decode_s(1, 1)


def test_rounds_of_a_drafter_seldom_accepted_part_the_cost_of_accepting_from_the_rest(plan_fit):
    """With the seldom-accepted drafter's rounds beside the world drafter's, accept_s comes back and the rest is a
    round that accepts none (on a real machine one drafter's acceptance varies too little beside its arms' depth
    for the term to be told from the per-row constants). Points recorded without what their rows accepted fit
    no acceptance term."""
    both, _ = plan_fit.engine_constants(points_of(TRUE, plan_fit))
    assert both["accept_s"] == pytest.approx(TRUE.accept_s, rel=1e-6)
    no_cost = dataclasses.replace(TRUE, accept_s=0.0)
    unrecorded = {
        p: [v if isinstance(v, dict) else v[:5] for v in passes] for p, passes in points_of(no_cost, plan_fit).items()
    }
    fitted, measured = plan_fit.engine_constants(unrecorded)
    assert fitted["accept_s"] == 0.0 and fitted["round_row_s"] == pytest.approx(TRUE.round_row_s, rel=1e-6)
    assert fitted["catch_up_token_s"] == 0.0  # nor a catch-up without the prompts' lengths
    assert {r["accepted"] for r in measured["rounds"]} == {None}


def test_switching_points_measured_without_any_cost_fit_no_cost(plan_fit):
    """Steps that cost what they cost back to back whichever kind came before fit no switching cost, and
    steps measured faster after a switch (a machine noisier than the effect) fit none either."""
    for share in (0.0, -0.05):
        none = dataclasses.replace(TRUE, after_round_frac=share, after_one_plain_frac=share, after_plain_frac=share)
        fitted, _ = plan_fit.engine_constants(points_of(none, plan_fit))
        for name in ("after_round_frac", "after_one_plain_frac", "after_plain_frac"):
            assert fitted[name] == pytest.approx(0.0, abs=1e-9), (share, name)


def test_a_machine_drifting_during_the_fit_moves_rounds_and_decode_steps_alike(plan_fit):
    """The machine slows steadily from 1.0x to 1.6x over the fit's measuring order (`measuring_order`): each point
    is timed at its moment's speed. The round's cost over a decode step's, which decides what speculation buys,
    stays the model's within 5% with the fit's order; measured in blocks (every decode point, then every round),
    the drift between the blocks would land in the verify-cost curve (the check that the test can see that)."""
    clean = points_of(TRUE, plan_fit)
    arm = Arm.from_label("d4k2v8")

    def drifted(order: list[tuple]) -> CpuCosts:
        results: dict[tuple, list[tuple]] = {}
        for i, point in enumerate(order):
            speed = 1.0 + 0.6 * i / (len(order) - 1)
            sec, first, ctx, draft, prompt, accepted, *longest = clean[point][0]
            measured = (sec * speed, first * speed, ctx, draft * speed, prompt, accepted, *longest)
            results.setdefault(point, []).append(measured)
        return CpuCosts(**plan_fit.engine_constants(results)[0])

    def ratio(model: CpuCosts) -> float:
        return model.round_s(16, arm, 300) / model.decode_s(16, 300)

    fit_order = [p for p in plan_fit.measuring_order(3) if p[0] != "switch"]
    blocks = sorted(fit_order, key=lambda p: p[0] != "decode")  # every decode point first, stable otherwise
    assert ratio(drifted(fit_order)) == pytest.approx(ratio(TRUE), rel=0.05)
    assert abs(ratio(drifted(blocks)) / ratio(TRUE) - 1) > 0.10


def test_every_kind_of_point_is_spread_over_the_whole_measuring_order(plan_fit):
    decode, rounds = [("d", i) for i in range(24)], [("r", i) for i in range(32)]
    order = plan_fit.interleaved(decode, rounds)
    assert sorted(order) == sorted(decode + rounds)
    for part in (order[: len(order) // 2], order[len(order) // 2 :]):
        assert sum(p[0] == "d" for p in part) == pytest.approx(12, abs=1)
    assert max(len(list(g)) for _, g in itertools.groupby(p[0] for p in order)) <= 2


@pytest.fixture(scope="module")
def plan_check():
    return bench_module("plan_check")


def test_each_run_s_machine_factor_is_its_neighbouring_probes_over_the_fits(plan_check, tmp_path):
    """Probes in the order a hold makes them: around the fits at 2 threads (2.0 and 2.2 ms at 16 rows; 1.0 and
    1.1 at 1 row), then one before each run and one after the last. A run's factor is the mean of the probe
    before it and the next one, over the fits' mean, per row count; the median over the row counts."""

    def probe(label: str, at: float, t2: tuple[float, float], t1: tuple[float, float] = (1.0, 2.0)) -> None:
        ms = {"t2": {"1": t2[0], "16": t2[1]}, "t1": {"1": t1[0], "16": t1[1]}}
        (tmp_path / f"{label}.json").write_text(json.dumps({"label": label, "at": at, "ms": ms}))

    probe("fit-t2-pre-before", 1, (1.0, 2.0))
    probe("fit-t2-pre-after", 2, (1.1, 2.2))
    probe("fit-t1-pre-before", 3, (9.0, 9.0), (1.0, 2.0))  # the t2 figures of t1's fits are not the t2 reference
    probe("run-a_sync_plain-1", 10, (1.26, 2.52))
    probe("run-b_sync_tlt-1", 20, (1.47, 2.94))
    probe("run-end", 30, (1.05, 2.1), (2.0, 4.0))
    factors = plan_check.probe_factors(tmp_path)
    assert set(factors) == {"a_sync_plain-1", "b_sync_tlt-1"}
    assert factors["a_sync_plain-1"]["t2"] == pytest.approx(((1.26 + 1.47) / 2) / 1.05, rel=1e-3)
    assert factors["b_sync_tlt-1"]["t2"] == pytest.approx(((1.47 + 1.05) / 2) / 1.05, rel=1e-3)
    assert factors["b_sync_tlt-1"]["t1"] == pytest.approx(1.5, rel=1e-3)
    # the model on that machine: every engine and learner cost times the factor, publication as measured
    costs = TRUE.slower(1.2)
    arm = Arm.from_label("d4k2v8")
    assert costs.round_s(16, arm, 300) == pytest.approx(1.2 * TRUE.round_s(16, arm, 300))
    assert costs.decode_s(64, 300) == pytest.approx(1.2 * TRUE.decode_s(64, 300))
    assert costs.publish_s == TRUE.publish_s


def test_a_run_s_worker_time_per_step_comes_from_its_workers_state_changes(plan_check, tmp_path):
    """`worker_states`: the workers' states between the first version's announcement and the last's, per step,
    summed over workers (a state begun before the window counts from its start), with the rollout reports'
    hop seconds inside the window."""
    rows = [{"version": v, "time": t} for v, t in ((1, 100.0), (2, 110.0), (3, 120.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    changes = [
        ("w0", 95.0, "GENERATING"),
        ("w0", 104.0, "IDLE"),
        ("w0", 104.5, "TRAINING_DRAFTER"),
        ("w0", 109.0, "LOADING"),
        ("w0", 110.5, "GENERATING"),
        ("w0", 118.0, "IDLE"),
        ("w0", 125.0, "STOPPED"),
        ("w1", 100.0, "GENERATING"),
        ("w1", 120.0, "IDLE"),
    ]
    entries = [{"kind": "worker_state", "worker_id": w, "created_at": t, "state": s} for w, t, s in changes]
    loops = {103.0: {"admit": 0.25, "output": 0.5}, 115.0: {"output": 0.75}, 121.0: {"admit": 9.0}}
    entries += [
        {"kind": "rollout", "created_at": t, "seconds": x, "target_forwards": 8, "tokens": 64}
        | ({"loop_s": loops[t]} if t in loops else {})  # the first report as an older worker wrote it: no loop
        for t, x in ((99.0, 5.0), (103.0, 2.5), (115.0, 4.0), (121.0, 1.0))
    ]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    got = plan_check.worker_states(tmp_path)
    parts = got.pop("loop_parts")
    # w0: generating 4 + 7.5, loading 1.5, idle 0.5 + 4.5 + 2; w1: generating 20; the report at 121 is outside
    assert got == pytest.approx({"generating": 31.5 / 2, "loading": 0.75, "idle": 3.5, "hops": 3.25, "loop": 0.75})
    assert parts == pytest.approx({"admit": 0.125, "output": 0.625})


def test_the_simulators_parts_sum_into_the_states_with_hops_and_loop_apart(plan_check):
    got = plan_check.as_states({"plain": 2.0, "prefill": 0.5, "loop": 0.25, "load": 1.0, "reverify": 0.5, "idle": 3.0})
    assert got == {"generating": 2.75, "loading": 1.5, "idle": 3.0, "hops": 2.5, "loop": 0.25}


def test_the_streaming_configs_rounds_are_set_against_its_one_thread_model(plan_check, tmp_path):
    """`rounds_vs_model`: each SD config's rounds (its `sd_arm` reports) over its own model's charge for them,
    (c) with the 1-thread model its worker runs on, the synchronous configs with the 2-thread one."""
    from tlt_stream.plan.costs import FixedCosts

    def run_dir(name: str, seconds: float) -> str:
        path = tmp_path / name
        path.mkdir()
        reports = [
            {"kind": "sd_arm", "bucket": 0, "depth": 4, "topk": 1, "verify": 4, "tokens": 60, "rows": 20},
            {"kind": "sd_arm", "bucket": 5, "depth": 0, "topk": 0, "verify": 0, "tokens": 40, "rows": 40},
        ]
        lines = [json.dumps({**r, "steps": 10, "contexts": 2000, "seconds": seconds}) for r in reports]
        (path / "timeline.jsonl").write_text("\n".join(lines) + "\n")
        return str(path)

    runs = [
        {
            "configs": {
                n: {"run_dir": run_dir(n, s)}
                for n, s in [("b_sync_tlt", 4.0), ("g_sync_partial", 4.0), ("c_stream_tlt", 9.0)]
            }
        }
    ]
    sync, stream = FixedCosts(decode=0.2, round=0.4), FixedCosts(decode=0.3, round=0.6)
    got = plan_check.rounds_vs_model(runs, [(sync, 0.0)], [(stream, 0.0)])
    assert got["b_sync_tlt"] == got["g_sync_partial"] == [{"drafter": 1.0, "plain": 2.0}]
    assert got["c_stream_tlt"] == [{"drafter": 1.5, "plain": 3.0}]
    assert "c_stream_tlt" not in plan_check.rounds_vs_model(runs, [(sync, 0.0)])


def test_the_check_charges_the_update_beside_the_drafter_s_training_from_the_bench_s_fit(plan_check, tmp_path):
    """`--beside`: `bench/plan_beside.py`'s fitted factor reaches every fitted model beside the contention
    bench's constants (and without it the update pays nothing extra)."""
    fit = {f"{kind}_t{t}": {"k": 0.5, "wait_s": 0.0} for kind in ("engine", "learner") for t in (1, 2)}
    curve = {key: [[0.0, 1.0], [1.0, 2.0]] for key in fit}
    (tmp_path / "contention.json").write_text(json.dumps({"fit": fit, "curve": curve}))
    (tmp_path / "beside.json").write_text(json.dumps({"fit": {"learner_beside_training": 1.17}}))
    TRUE.save(tmp_path / "t2.json")

    def charged(beside: str | None) -> float:
        args = SimpleNamespace(contention=str(tmp_path / "contention.json"), contention_law=False, beside=beside)
        costs = plan_check.fitted_costs(str(tmp_path / "t2.json"), plan_check.contention_of(args))
        return costs.learner_beside_training

    assert charged(str(tmp_path / "beside.json")) == 1.17
    assert charged(None) == 1.0


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"points": []}', "no fit.learner_beside_training"),
        ('{"fit": {"learner_beside_training": 0.8}}', "not a slowdown of at least 1"),
        ('{"fit": {"learner_beside_training": "fast"}}', "not a slowdown of at least 1"),
    ],
)
def test_a_beside_file_that_is_not_the_bench_s_fit_is_refused_in_one_line(plan_check, tmp_path, content, says):
    """`--beside` with a missing file, a file that is not JSON, or one without a usable fit: one line naming the
    file and what is wrong, before any run is read (exit 2, argparse's)."""
    path = tmp_path / "beside.json"
    if content is not None:
        path.write_text(content)
    (tmp_path / "contention.json").write_text("{}")
    run = subprocess.run(
        [sys.executable, str(BENCH.parent / "plan_check.py"), "--e2e-json", str(tmp_path / "absent.json"),
         "--contention", str(tmp_path / "contention.json"), "--beside", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert str(path) in last and says in last
    assert "Traceback" not in run.stderr


def test_a_run_s_updates_are_set_against_the_model_s_cost_of_their_own_trained_rows(plan_check, tmp_path):
    """`updates_vs_model`: each update after the first over the model's cost of the rows it trained (its groups
    with a signal, at the step's trained share) plus the optimizer, slowed by the run's background through the
    learner's contention curve at 2 threads; the median over the run's updates. An update with no signal to
    train is left out, and so is the first (its warm-up)."""
    costs = dataclasses.replace(
        TRUE,
        learn_tokens_per_s=100.0,
        learn_token_s=0.0,  # cost per token, no micro-batch padding: the closed form below
        optimizer_s=0.04,
        learner_curve=(((0.0, 1.0), (1.0, 2.0)), ((0.0, 1.0), (1.0, 3.0))),  # 1 and 2 threads: 2.0x at 0.5 cores
    )

    def row(version, groups, trained, seconds):
        lens = [x for g, _ in groups for x in g]
        rewards = [r for _, rs in groups for r in rs]
        ids = [f"s{version:06d}-{i:04d}" for i in range(len(groups))]
        return {"version": version, "trained_groups": ids, "response_lens": lens, "rewards": rewards,
                "trained_tokens": trained, "update_seconds": seconds}  # fmt: skip

    rows = [
        row(1, [([10, 10], [1, 0])], 20, 99.0),  # the first update: left out
        # 40 tokens with a signal, 36 trained: (36 / 100 + 0.04) * 2.0 = 0.8 s modelled, 1.0 measured
        row(2, [([10, 30], [1, 0]), ([20, 20], [1, 1])], 36, 1.0),
        row(3, [([50, 50], [0, 1])], 100, 3.12),  # (100 / 100 + 0.04) * 2.0 = 2.08 s modelled: 1.5x
        row(4, [([5, 5], [1, 1])], 0, 0.5),  # no group with a signal: nothing to set it against
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [{"configs": {name: {"run_dir": str(tmp_path)} for name in plan_check.CONFIGS}}]
    got = plan_check.updates_vs_model(runs, [(costs, 0.5)])
    assert got == {name: [pytest.approx(1.375, rel=1e-3)] for name in ("a_sync_plain", "b_sync_tlt", "g_sync_partial")}
    streaming = plan_check.updates_vs_model(runs, [(costs, 0.5)], [(costs, 0.5)])["c_stream_tlt"]
    assert streaming == [pytest.approx(((1.0 / 0.6) + (3.12 / 1.56)) / 2, rel=1e-3)]  # 1 thread: 1.5x at 0.5
    # The update beside the drafter's idle training: charged to the synchronous configs that train it.
    charged = dataclasses.replace(costs, learner_beside_training=1.25)
    got = plan_check.updates_vs_model(runs, [(charged, 0.5)], [(charged, 0.5)])
    assert got["a_sync_plain"] == [pytest.approx(1.375, rel=1e-3)]
    assert got["b_sync_tlt"] == got["g_sync_partial"] == [pytest.approx(1.375 / 1.25, rel=1e-3)]
    assert got["c_stream_tlt"] == streaming

"""Fault injection on whole runs: services as real processes against a private Redis and Mosquitto that the
test may kill. After each fault the run must finish and the audit (`tests/faults/audit.py`: Redis and the
checkpoints, never the learner's own report) must find every dispatched task's samples trained exactly once,
by one update each and on-policy, nothing pending, nothing dead-lettered but the injected poison, versions
1..N with the mirror and the broker at N; the recovery path under test must show in the services' logs; and
every service must stop by itself on SIGTERM (exit code 0) unless the fault was aimed at it.

Scenarios marked `extended` run only with TLT_FAULTS_EXTENDED=1 (`bench/faults.py` sets it). The audit itself
is tested first, on made-up records: each broken promise must be caught."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.faults.audit import AuditResult, Checkpoint, RunRecord, audit
from tests.faults.harness import FaultRun, build_world, have_servers
from tests.faults.scenarios import SCENARIOS, SMALL, Scenario

EXTENDED = bool(os.environ.get("TLT_FAULTS_EXTENDED"))


async def run_scenario(scenario: Scenario, tmp_path: Path, init_policy: Path) -> tuple[AuditResult, FaultRun, dict]:
    """Run, inject, finish, audit; returns the audit, the run, and each service's exit code at the end (or
    None for one still running then)."""
    build_world(init_policy, tmp_path / "world")
    plan = {**SMALL, **scenario.plan}
    async with scenario.servers(tmp_path / "servers") as servers:
        run = FaultRun(
            servers, tmp_path / "world", tmp_path / "run", run=f"fault-{scenario.name}", env=scenario.env, **plan
        )
        around = scenario.prepare(run) if scenario.prepare is not None else contextlib.nullcontext()
        async with around:
            await run.start_all()
            try:
                await run.wait_version(2, 180)
                recovery = await scenario.inject(run, servers)
                await run.wait_version(run.plan.steps, 240)
                await run.wait_published(run.plan.steps, 60)
                await run.settle()
                result = await run.audit(scenario.name)
                result.recovery_s = recovery
                at_end = {name: p.returncode for name, p in run.processes.items()}
            finally:
                codes = await run.stop_all()
    run.notes["codes"] = codes
    return result, run, at_end


def _record(steps: int = 2) -> RunRecord:
    """A clean on-policy run of `steps` steps of one task of two samples, as `FaultRun.collect` reads one."""
    tasks = [NS(task_id=f"s{s:06d}-0000", group_size=2) for s in range(steps)]
    samples = [
        NS(sample_id=f"{t.task_id}/{i}", task_id=t.task_id, policy_version=s, worker_id="w0")
        for s, t in enumerate(tasks)
        for i in range(2)
    ]
    points, ledger = [Checkpoint(0, "0" * 64, frozenset(), (), Path("/ck/step-00000000"))], frozenset()
    for s, t in enumerate(tasks, start=1):
        ledger |= {f"{t.task_id}/0", f"{t.task_id}/1"}
        points.append(Checkpoint(s, f"{s:064d}", ledger, (t.task_id,), Path(f"/ck/step-{s:08d}")))
    mirror = NS(version=steps, sha256=points[-1].sha256, location=str(points[-1].path / "policy"))
    return RunRecord(
        prompts=[(f"{s}-0", t) for s, t in enumerate(tasks)],
        samples=[(f"{n}-0", x) for n, x in enumerate(samples)],
        added={"prompts": steps, "samples": 2 * steps},
        pending={"samples/learner": 0, "prompts/rollout": 0},
        dead=[],
        dead_counts={},
        mirror=mirror,
        retained=mirror,
        checkpoints=points,
        set_aside=[],
    )


def _set(name: str, value: object) -> Callable[[RunRecord], None]:
    return lambda r: setattr(r, name, value)


def _stale(r: RunRecord) -> None:  # step 1's first sample made by version 0, trained by update 2
    r.samples[2] = (r.samples[2][0], NS(**{**vars(r.samples[2][1]), "policy_version": 0}))


def _partial(r: RunRecord) -> None:  # update 1 trained half a group
    r.checkpoints[1] = dataclasses.replace(r.checkpoints[1], ledger=frozenset({"s000000-0000/0"}))


def _retrained(r: RunRecord) -> None:  # update 2 forgot a sample of update 1, update 3 trained it again
    two = r.checkpoints[2]
    r.checkpoints[2] = dataclasses.replace(two, ledger=two.ledger - {"s000000-0000/1"})
    r.checkpoints.append(dataclasses.replace(two, step=3, trained_groups=("s000000-0000",)))


BROKEN: dict[str, tuple[Callable[[RunRecord], None], str]] = {
    "a missing update": (lambda r: r.checkpoints.pop(), "checkpoint steps"),
    "trimmed samples": (lambda r: r.added.update(samples=9), "entries added"),
    "pending samples": (lambda r: r.pending.update({"samples/learner": 1}), "still pending"),
    "stale training": (_stale, "trained s000001-0000/0 of policy versions [0]"),
    "half a group": (_partial, "trained part of group"),
    "a stray dead letter": (
        lambda r: r.dead.append(NS(stream="samples", entry_id="9-0", origin="x", reason="y")),
        "not injected",
    ),
    "a mirror behind": (_set("mirror", NS(version=1, sha256="", location="")), "the mirror holds"),
    "a forged retained message": (_set("retained", NS(version=2, sha256="f" * 64)), "the broker retains"),
    "a worker going back": (lambda r: r.samples.append(("9-0", r.samples[0][1])), "after a newer"),
    "a sample trained twice": (_retrained, "lacks 1 ids"),
}


def test_the_audit_passes_a_clean_record_and_catches_each_broken_promise() -> None:
    clean = audit(_record(), scenario="t", steps=2, prompts_per_step=1, max_staleness=0)
    assert clean.clean and (clean.dispatched, clean.trained, clean.versions) == (2, 4, [1, 2]), clean
    for name, (breaks, says) in BROKEN.items():
        record = _record()
        breaks(record)
        result = audit(record, scenario=name, steps=2, prompts_per_step=1, max_staleness=0)
        assert not result.clean and any(says in p for p in result.problems + result.lost), (name, result)
    record = _record()
    _retrained(record)
    assert audit(record, scenario="dup", steps=2, prompts_per_step=1, max_staleness=0).duplicated == ["s000000-0000/1"]
    record = _record()
    record.dead.append(NS(stream="samples", entry_id="9-0", origin="learner/learner", reason="reward nan is bad"))
    record.dead_counts["samples"] = 1
    injected = {("samples", "9-0"): "reward nan"}
    assert audit(record, scenario="p", steps=2, prompts_per_step=1, max_staleness=0, injected=injected).clean


def _params() -> list:
    skip = pytest.mark.skipif(not EXTENDED, reason="extended fault scenario: set TLT_FAULTS_EXTENDED=1")
    params = []
    for s in SCENARIOS:
        marks = [skip] if s.extended else []
        if s.unavailable is not None and (why := s.unavailable()) is not None:
            marks.append(pytest.mark.skip(reason=why))
        if s.known_bug is not None:
            marks.append(pytest.mark.xfail(strict=True, reason=s.known_bug))
        params.append(pytest.param(s, id=s.name, marks=marks))
    return params


@pytest.mark.slow
@pytest.mark.xdist_group("faults")  # under `make test`'s two xdist workers: one scenario (a whole run) at a time
@pytest.mark.skipif(have_servers() is not None, reason=have_servers() or "")
@pytest.mark.parametrize("scenario", _params())
# The suite's 300 s would cut a scenario short inside its own bounds on a loaded machine: theirs summed
# (version 2: 180 s; the injection's restart and step: 120 s, 210 s with a checkpoint-dir round; the end:
# 240 + 60 s; settling: 15 s; four services stopping: 80 s) come to ~800 s.
@pytest.mark.timeout(900)
async def test_fault(scenario: Scenario, tmp_path: Path, init_policy: Path) -> None:
    started = time.monotonic()
    result, run, at_end = await run_scenario(scenario, tmp_path, init_policy)
    allowed = sorted(scenario.may_lose(run, result)) if scenario.may_lose is not None else []
    assert result.problems == [], result.problems
    assert result.duplicated == [], result.duplicated
    assert result.lost == allowed, (result.lost, allowed)
    assert result.trained == result.expected - len(allowed) > 0, result
    steps = run.plan.steps
    assert result.dispatched == steps * run.config.policy.prompts_per_step
    assert result.versions == list(range(1, steps + 1))
    for name, code in at_end.items():  # the learner and policy end by themselves (code 0)
        assert name in run.killed or code in (None, run.exit_codes.get(name, 0)), f"{name} died ({code}):\n" + (
            run.log_tail(name)
        )
    assert run.unclean_stops(run.notes["codes"]) == {}, run.notes["codes"]
    for name, starts in run.starts.items():  # every process saw versions only move forward
        for start in range(1, starts + 1):
            adopted = run.adopted(name, start)
            assert adopted == sorted(set(adopted)) and max(adopted, default=0) <= steps, (name, start, adopted)
    if scenario.evidence is not None:
        scenario.evidence(run, result)
    assert result.recovery_s is not None and result.recovery_s < 120
    if os.environ.get("TLT_FAULTS_REPORT"):
        row = {**result.row(), "what": scenario.what, "wall_s": round(time.monotonic() - started, 1)}
        row["hung_after_stop"] = sorted(run.hung_after_stop)  # a known open bug, recorded (see unclean_stops)
        with Path(os.environ["TLT_FAULTS_REPORT"]).open("a") as out:  # noqa: ASYNC230 - one small line
            out.write(json.dumps(row) + "\n")


def _dropped_record(*, stale: bool = True, replaced: bool = True) -> RunRecord:
    """Step 1's group came back made by version 0 (too stale for update 2 on-policy): the learner dropped it
    (its ids in update 2's ledger, untrained) and trained the copy the policy service sent again."""
    record = _record()
    again = NS(task_id="s000001-0000.r", group_size=2)
    made = 0 if stale else 1
    record.samples = [
        (i, NS(**{**vars(x), "policy_version": made}) if x.task_id == "s000001-0000" else x) for i, x in record.samples
    ]
    if replaced:
        record.prompts.append(("2-0", again))
        copy = {"task_id": again.task_id, "policy_version": 1, "worker_id": "w0"}
        record.samples += [(f"{4 + i}-0", NS(sample_id=f"{again.task_id}/{i}", **copy)) for i in range(2)]
        record.added = {"prompts": 3, "samples": 6}
        two = record.checkpoints[2]
        ledger = two.ledger | {f"{again.task_id}/0", f"{again.task_id}/1"}
        record.checkpoints[2] = dataclasses.replace(two, ledger=ledger, trained_groups=(again.task_id,))
        record.replaced = {"s000001-0000": again.task_id}
    else:
        record.checkpoints[2] = dataclasses.replace(record.checkpoints[2], trained_groups=())
    record.dropped = {"s000001-0000"}
    return record


def test_the_audit_accepts_a_stale_group_dropped_and_sent_again_and_nothing_less() -> None:
    result = audit(_dropped_record(), scenario="d", steps=2, prompts_per_step=1, max_staleness=0)
    assert result.clean and result.lost == [] and result.trained == 4, result
    for record, says in (
        (_dropped_record(replaced=False), "never sent again"),
        (_dropped_record(stale=False), "not stale"),
    ):
        result = audit(record, scenario="d", steps=2, prompts_per_step=1, max_staleness=0)
        assert any(says in p for p in result.problems), result

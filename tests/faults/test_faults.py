"""Fault injection on whole runs: services as real processes against a private Redis and Mosquitto that the
test may kill. After each fault the run must finish with every dispatched prompt group trained on exactly
once (0 lost, 0 duplicated), versions only moving forward, and the services that survived still working."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.harness import FaultRun, PrivateServers, build_world, have_servers
from tests.faults.scenarios import SCENARIOS, SMALL, Scenario

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(have_servers() is not None, reason=have_servers() or ""),
]


async def run_scenario(scenario: Scenario, tmp_path: Path, init_policy: Path) -> tuple[dict, float, dict]:
    build_world(init_policy, tmp_path / "world")
    plan = {**SMALL, **scenario.plan}
    async with PrivateServers(tmp_path / "servers") as servers:
        run = FaultRun(servers, tmp_path / "world", tmp_path / "run", run=f"fault-{scenario.name}", **plan)
        await run.start_all()
        try:
            await run.wait_version(2, 180)
            recovery = await scenario.inject(run, servers)
            await run.wait_version(plan["steps"], 240)
            result = await run.audit()
            survivors = {name: p.returncode for name, p in run.processes.items() if name not in run.killed}
        finally:
            codes = await run.stop_all()
    return {"audit": result, "survivors": survivors}, recovery, codes


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
async def test_fault(scenario: Scenario, tmp_path: Path, init_policy: Path) -> None:
    outcome, recovery, codes = await run_scenario(scenario, tmp_path, init_policy)
    result = outcome["audit"]
    steps = {**SMALL, **scenario.plan}["steps"]
    assert result.lost == [] and result.duplicated == [], result
    assert result.regressions == [], result
    assert result.versions == list(range(1, steps + 1)), result.versions
    assert result.trained == result.dispatched == steps * {**SMALL, **scenario.plan}["prompts_per_step"]
    for name, code in outcome["survivors"].items():  # the learner and policy end by themselves (code 0)
        assert code in (None, 0), f"{name} died ({code}) though the fault was not aimed at it"
    # every service still alive at the end stops cleanly on SIGTERM (killed ones report -9)
    assert all(code in (0, -9) for code in codes.values()), codes
    assert recovery < 120
    if os.environ.get("TLT_FAULTS_REPORT"):
        import json

        row = {"scenario": scenario.name, "what": scenario.what, **result.row(), "recovery_s": round(recovery, 1)}
        with Path(os.environ["TLT_FAULTS_REPORT"]).open("a") as out:  # noqa: ASYNC230 - one small line
            out.write(json.dumps(row) + "\n")

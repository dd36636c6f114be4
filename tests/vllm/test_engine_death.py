"""A vLLM rollout worker whose engine process dies in the middle of a run: the whole system as processes on
private Redis and Mosquitto servers (`tests/faults/harness.py`), a vLLM worker beside a torch worker. vLLM's
engine core process of the vLLM worker is killed (SIGKILL) while that worker is generating; the worker must
exit by itself, non-zero, with the cause in one line, and the groups it held must be taken over by the other
worker: audited from Redis and the checkpoints' ledgers, every sample of every dispatched task trained
exactly once.

One vLLM engine starts (35-140 s on a busy 2-core machine) beside the run's other services, so this test costs
minutes: it runs only with TLT_VLLM_EXTENDED=1 (docs/vllm.md gives the command), not in `make test-vllm`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.faults.harness import FaultRun, PrivateServers, have_servers
from tests.vllm.conftest import children, hf_policy, requires_vllm

pytestmark = [
    *requires_vllm,
    pytest.mark.skipif(not os.environ.get("TLT_VLLM_EXTENDED"), reason="minutes of CPU: TLT_VLLM_EXTENDED=1"),
    pytest.mark.skipif(have_servers() is not None, reason=str(have_servers())),
]

VICTIM, OTHER = "rollout-0", "rollout-1"
PLAN = {
    "preset": "tiny-world",
    "launch.workers": 2,
    "launch.sd": "off",
    "rollout.backend": "vllm",
    "policy.steps": 5,
    "policy.prompts_per_step": 4,
    "policy.group_size": 4,
    "rollout.max_len": 128,
    "rollout.max_batch": 4,
}
"""Four groups of four a step, four rows a worker: the vLLM worker holds one group at a time, so the others
wait in the stream for the worker that takes over."""
FAST_HEARTBEAT = {"TLT_BUS__HEARTBEAT_S": "0.5", "TLT_BUS__HEARTBEAT_TTL_S": "2"}
"""The dead worker's registry entry expires in 2 s: its groups are taken over within the test."""


async def wait_generating(run: FaultRun, worker: str, timeout: float) -> None:
    """Until `worker`'s registry entry says GENERATING (it holds groups in flight)."""
    from tlt_stream.bus.registry import list_workers

    deadline = time.monotonic() + timeout
    async with run.redis() as redis:
        while True:
            states = {w["worker_id"]: w.get("state") for w in await list_workers(redis, run.keys, run.config.bus)}
            if states.get(worker) == "GENERATING":
                return
            assert time.monotonic() < deadline, f"{worker} never generating:\n{run.log_tail(worker)}"
            await asyncio.sleep(0.005)


async def test_a_vllm_worker_whose_engine_dies_exits_in_one_line_and_its_groups_are_trained_once(
    tmp_path: Path,
) -> None:
    from tlt_stream.roles.rollout_worker import ENGINE_DIED

    world = tmp_path / "world"
    hf_policy(world / "policy", seed=0)
    async with PrivateServers(tmp_path / "servers") as servers:
        run = FaultRun(servers, world, tmp_path / "run", run="vllm-engine-death", env=FAST_HEARTBEAT, **PLAN)
        run.commands[OTHER] += ["--backend", "torch"]  # the worker that takes the groups over
        async with run.redis() as redis:  # the audit's own groups first, as `FaultRun.start_all` makes them
            for stream in ("prompts", "samples"):
                await redis.xgroup_create(run.keys.stream(stream), "audit", id="0", mkstream=True)
        for name in run.commands:  # the torch worker joins later: started now it would run the steps alone
            if name != OTHER:
                await run.start(name)
        try:
            await wait_generating(run, VICTIM, 600)  # its engine started and it holds a group
            worker = run.processes[VICTIM].pid
            cores = [pid for pid, line in children(worker).items() if "EngineCore" in line]
            assert len(cores) == 1, children(worker)
            os.kill(cores[0], signal.SIGKILL)
            run.exit_codes[VICTIM] = ENGINE_DIED
            await run.start(OTHER)
            assert await run.wait_exit(VICTIM, 120) == ENGINE_DIED
            line = run.expect_log(VICTIM, r"vLLM's engine died \((EngineCore\S* exited with code -9|its core failed)\)")
            assert line.startswith(f"tlt-stream rollout-worker {VICTIM}: ") and "another worker" in line, line
            await run.wait_version(run.plan.steps, 400)
            await run.wait_published(run.plan.steps, 60)
            await run.settle()
            result = await run.audit("vllm-engine-death")
        finally:
            codes = await run.stop_all()
    assert run.unclean_stops(codes) == {}, codes
    pattern = rf"rollout/{OTHER} reclaimed \d+ entries idle > \d+ ms from [^\n]*\b{VICTIM}\b"
    assert re.search(pattern, run.log_text(OTHER)), run.log_tail(OTHER, 40)
    assert result.clean, (result.lost, result.duplicated, result.problems)
    assert result.trained == result.expected == PLAN["policy.steps"] * 16, result.row()

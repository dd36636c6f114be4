"""The faults, one coroutine each: inject it into a running `FaultRun` and return the recovery seconds (from
the fault, or from its repair when it lasts, to the learner's next policy version)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tests.faults.harness import FaultRun, PrivateServers


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    inject: Callable[[FaultRun, PrivateServers], Awaitable[float]]
    plan: dict[str, Any] = field(default_factory=dict)
    """RunPlan settings beyond the common small ones."""


async def _next_version_after(run: FaultRun, started: float, timeout: float = 120.0) -> float:
    """Seconds from `started` to the next policy version (or to the end of the run, if it ended first)."""
    await run.wait_version(min(run.version() + 1, run.plan.steps), timeout)
    return time.monotonic() - started


async def kill_worker_generating(run: FaultRun, servers: PrivateServers) -> float:
    worker = await run.wait_any("GENERATING", 60)
    await run.kill(worker)  # its task stays pending; the other worker reclaims it after reclaim_idle_ms
    return await _next_version_after(run, time.monotonic())


async def kill_worker_training(run: FaultRun, servers: PrivateServers) -> float:
    """On-policy, the workers' idle time is the learner's update: milliseconds for the tests' tiny model.
    Freezing the learner for a moment makes a long idle period, in which the lease holder trains; it is
    killed inside that slice, and the learner let go."""
    await run.wait_version(3, 120)  # enough windows in `hidden` for a slice (min_windows)
    run.signal("learner", signal.SIGSTOP)
    trainer = await run.wait_any("TRAINING_DRAFTER", 60)  # the lease holder, inside a slice
    await run.kill(trainer)
    started = time.monotonic()
    run.signal("learner", signal.SIGCONT)
    return await _next_version_after(run, started)


async def kill_learner(run: FaultRun, servers: PrivateServers) -> float:
    """Killed mid-update: the moment its checkpoint's temporary directory appears, the update is applied in
    memory but not yet durable, acked or published (its samples must be trained on again, exactly once)."""
    checkpoints = run.plan.run_dir / "checkpoints"
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()):
        assert time.monotonic() < deadline, "never caught the learner inside a checkpoint save"
        await asyncio.sleep(0.001)
    await run.kill("learner")
    assert any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()), "the save finished before the kill"
    started = time.monotonic()
    await run.start("learner")  # resumes from its newest checkpoint; its pending samples are re-read
    return await _next_version_after(run, started)


async def kill_policy(run: FaultRun, servers: PrivateServers) -> float:
    await run.kill("policy")
    started = time.monotonic()
    await run.start("policy")  # resumes the dispatch cursor it keeps in Redis
    return await _next_version_after(run, started)


async def restart_redis(run: FaultRun, servers: PrivateServers) -> float:
    await servers.stop_redis(signal.SIGKILL)  # a crash: append-only with fsync always keeps every write
    await asyncio.sleep(2.0)
    await servers.start_redis()
    return await _next_version_after(run, time.monotonic())


async def restart_broker(run: FaultRun, servers: PrivateServers) -> float:
    """Ten seconds without a broker: the learner publishes into the Redis mirror, the workers follow the
    mirror, so training goes on; everything catches up from the retained messages once it is back."""
    at = run.version()
    await servers.stop_broker(signal.SIGKILL)
    await asyncio.sleep(10.0)
    assert run.version() > at, "no update while the broker was down: the workers did not follow the mirror"
    await servers.start_broker()
    return await _next_version_after(run, time.monotonic())


async def freeze_worker(run: FaultRun, servers: PrivateServers) -> float:
    worker = await run.wait_any("GENERATING", 60)
    run.signal(worker, signal.SIGSTOP)
    started = time.monotonic()
    await asyncio.sleep(6.0)  # twice the reclaim idle time: the other worker takes its tasks over meanwhile
    run.signal(worker, signal.SIGCONT)  # its late samples and ack must change nothing
    return await _next_version_after(run, started)


async def checkpoint_dir_unwritable(run: FaultRun, servers: PrivateServers) -> float:
    """The learner's checkpoint directory replaced by a plain file (root ignores permission bits, so a
    read-only mode would not stop it): every save fails with an OSError until the directory is back."""
    checkpoints = run.plan.run_dir / "checkpoints"
    held = checkpoints.with_name("checkpoints.held")
    logs = [run.plan.run_dir / "logs" / f"{name}.log" for name in run.commands if name not in ("learner", "policy")]

    def unreadable() -> int:  # the workers' "policy version N unreadable ... trying again" lines so far
        return sum(path.read_text(errors="replace").count("unreadable") for path in logs if path.exists())

    deadline = time.monotonic() + 90
    while True:
        before = unreadable()
        checkpoints.rename(held)
        checkpoints.write_text("not a directory\n")
        while "checkpoint of version" not in run.log_tail("learner", 400):  # the next save failed, and said so
            assert run.processes["learner"].returncode is None, run.log_tail("learner", 80)
            assert time.monotonic() < deadline, "the learner never tried to save:\n" + run.log_tail("learner", 80)
            if unreadable() > before:
                break  # a worker had not loaded the newest version yet: no samples, so no save to fail
            await asyncio.sleep(0.1)
        else:
            break
        # Bring it back (the worker loads it at its next try, which is what a transient outage should
        # cost) and inject the fault again once the run has moved on.
        checkpoints.unlink()
        held.rename(checkpoints)
        await asyncio.sleep(0.5)
    at = run.version()
    await asyncio.sleep(6.0)  # retrying all along, publishing nothing
    assert run.version() == at, "an update was recorded while no checkpoint could be written"
    assert run.processes["learner"].returncode is None, run.log_tail("learner", 80)
    checkpoints.unlink()
    held.rename(checkpoints)
    return await _next_version_after(run, time.monotonic())


LONG_ROLLOUTS = {"max_len": 1024, "prompts_per_step": 8}
"""For faults aimed at a worker mid-generation: the tiny test policy's rollouts at the small plan's max_len
take ~10 ms a step, too short a window to be caught in reliably."""

SCENARIOS = [
    Scenario(
        "kill9_rollout_generating", "kill -9 a rollout worker mid-generation", kill_worker_generating, LONG_ROLLOUTS
    ),
    Scenario(
        "kill9_rollout_training",
        "kill -9 the rollout worker inside a drafter-training slice",
        kill_worker_training,
        {"sd": "eagle", "prompts_per_step": 4, "hidden_share": 1.0},  # every window: training starts early
    ),
    Scenario("kill9_learner", "kill -9 the learner mid-update (inside its checkpoint save), restart it", kill_learner),
    Scenario("kill9_policy", "kill -9 the policy service, restart it", kill_policy),
    Scenario("restart_redis", "kill -9 Redis (append-only), restart it 2 s later", restart_redis),
    Scenario("restart_broker", "kill -9 the MQTT broker for 10 s (training must go on)", restart_broker),
    Scenario(
        "sigstop_rollout", "freeze a rollout worker (SIGSTOP) for 2x the reclaim time", freeze_worker, LONG_ROLLOUTS
    ),
    Scenario(
        "checkpoint_unwritable",
        "the learner's checkpoint directory unwritable until a save has failed, then 6 s more",
        checkpoint_dir_unwritable,
        {"steps": 12},  # room for a second injection when the first lands before a worker loaded its version
    ),
]

SMALL = {"workers": 2, "steps": 6, "prompts_per_step": 2, "group_size": 2, "max_len": 64, "max_batch": 8}

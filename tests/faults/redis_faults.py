"""Redis losing its newest writes, in whole runs.

compose runs Redis append-only with `appendfsync everysec`: a crash of the server (or of its machine) may
lose about the last second of writes that Redis had already acknowledged. What the services promise there:
every write is either redone or recognised when it is lost as a suffix. A lost task ack makes the task
pending again (its owner no longer holds it, so it is reclaimed and regenerated with the same sample ids); a
lost sample ack is redelivered and found in the ledger; a lost dispatch (cursor and tasks are one
transaction) is dispatched again with the same task ids; a lost version is written back into the mirror by
its owner; samples a worker sent just before come back by regeneration.

The scenario makes that loss exactly: it copies the append-only file as it stands (what an fsync a moment ago
would have kept), lets the run go on until a policy version has been published after the copy, kills Redis
and puts the copy back in place of the file before restarting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tests.faults.audit import AuditResult
from tests.faults.harness import FaultRun, PrivateServers
from tests.faults.scenario import Scenario

__all__ = ["REDIS_FAULTS_SCENARIOS"]


class EverySecServers(PrivateServers):
    """Private servers whose Redis fsyncs its append-only file once a second (compose's setting) and never
    rewrites it on its own (so the file the scenario copies stays the one Redis appends to)."""

    def redis_persistence(self) -> list[str]:
        return [
            *("--appendonly", "yes", "--appendfsync", "everysec", "--save", ""),
            *("--auto-aof-rewrite-percentage", "0", "--aof-load-truncated", "yes"),
        ]

    def incremental_aof(self) -> Path:
        """The append-only file Redis writes to now (Redis 7: `appendonlydir/*.incr.aof`, named in the
        manifest)."""
        folder = self.root / "redis" / "appendonlydir"
        manifest = next(folder.glob("*.manifest")).read_text()
        names = re.findall(r"^file (\S+) seq \d+ type i$", manifest, re.M)
        assert names, f"no incremental file in the manifest:\n{manifest}"
        return folder / names[-1]


PARKED_AT = 3
"""The first policy service dispatches this many steps and ends once they are trained: the run is parked there
(nothing dispatched, the learner idle) whatever its speed, so the loss always lands mid-run. On the tests'
random policy a step can take tens of ms: a run of 12 steps had ended before a poll saw version 2."""


@contextlib.asynccontextmanager
async def parked_policy(run: FaultRun) -> AsyncIterator[None]:
    run.notes["policy_argv"] = list(run.commands["policy"])
    run.commands["policy"] += ["--steps", str(PARKED_AT)]
    yield


LOST_ACK = r"\d+ entries of \S+ were pending for us though we did not hold them"
"""What a reader logs when it hands out again entries whose ack Redis lost (`StreamReader._maybe_resync`)."""


async def lose_last_writes(run: FaultRun, servers: PrivateServers) -> float:
    """Copy the append-only file while the run is parked, then let exactly one more step happen: the policy
    service (restarted for the whole run) dispatches it with the learner frozen, is frozen in turn once the
    step's samples are in, and the learner trains it, acks the previous step's samples and publishes a
    version. Then crash Redis and bring it back from the copy. Every service is frozen (SIGSTOP) across the
    crash, so what Redis loses is exactly that step (its dispatch, samples, acks and version) and what the
    harness read just before is the audit's evidence. Nothing here depends on how fast a step is."""
    assert isinstance(servers, EverySecServers)
    assert await run.wait_exit("policy", 120) == 0, "the parked policy service ends once its steps are trained"
    at = await run.published()
    assert at == PARKED_AT and run.version() == PARKED_AT, (at, run.version())
    aof = servers.incremental_aof()
    kept = aof.read_bytes()  # what survives: everything Redis wrote before this moment
    copied = time.monotonic()
    run.signal("learner", signal.SIGSTOP)
    run.commands["policy"] = run.notes["policy_argv"]
    await run.start("policy")  # the whole run's steps from here; it dispatches step `at` at once
    expected = run.config.policy.prompts_per_step * run.config.policy.group_size
    deadline = time.monotonic() + 60
    while await _samples_of_step(run, at) < expected:
        assert time.monotonic() < deadline, f"step {at}'s samples never arrived"
        await asyncio.sleep(0.05)
    run.signal("policy", signal.SIGSTOP)  # it waits for version at + 1 before the next dispatch: none comes
    run.signal("learner", signal.SIGCONT)
    await run.wait_published(at + 1, 60)
    live = [name for name, process in run.processes.items() if process.returncode is None]
    for name in live:
        run.signal(name, signal.SIGSTOP)
    async with run.redis() as redis:
        before = await redis.xrange(run.keys.stream("samples"))
    await servers.stop_redis(signal.SIGKILL)
    lost_s = time.monotonic() - copied
    lost_bytes = aof.stat().st_size - len(kept)
    aof.write_bytes(kept)
    await servers.start_redis()
    async with run.redis() as redis:
        after = {entry_id for entry_id, _ in await redis.xrange(run.keys.stream("samples"))}
    run.lost_samples = [(i.decode(), f[b"m"]) for i, f in before if i not in after]
    run.notes.update(lost_s=lost_s, lost_bytes=lost_bytes, learner_version=run.version())
    run.notes.update(mirror_after=await run.published(), lost_sample_entries=len(run.lost_samples))
    resumed = time.monotonic()
    for name in live:
        if name != "policy":
            run.signal(name, signal.SIGCONT)
    # The readers look for entries whose ack Redis lost once every quarter reclaim time; on a fast machine the
    # run's last steps take under a second, so the run could end before any reader looked, and the stop's
    # leftover ack would handle them instead. The policy service stays frozen (nothing more is dispatched)
    # until a reader has looked, or one period and a margin have passed.
    deadline = resumed + run.config.bus.reclaim_idle_ms / 4000 + 15
    while not any(re.search(LOST_ACK, run.log_text(name)) for name in run.commands):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    if "policy" in live:
        run.signal("policy", signal.SIGCONT)
    return await _next_version_after(run, resumed)


async def _samples_of_step(run: FaultRun, step: int) -> int:
    """Entries of `samples` that belong to step `step` (ids `s{step:06d}-...`)."""
    from tlt_stream.basics.messages import codec_for

    codec = codec_for("samples")
    async with run.redis() as redis:
        entries = await redis.xrange(run.keys.stream("samples"))
    return sum(codec.decode(fields[b"m"]).sample_id.startswith(f"s{step:06d}-") for _, fields in entries)


async def _next_version_after(run: FaultRun, started: float, timeout: float = 120.0) -> float:
    await run.wait_version(min(run.version() + 1, run.plan.steps), timeout)
    return time.monotonic() - started


def _lost_writes_redone(run: FaultRun, result: AuditResult) -> None:
    """The loss really happened (Redis came back without samples the harness had read and with an older
    mirror than the learner's checkpoint), and the recovery paths ran: the policy service dispatched the
    lost steps again, and a reader handled again entries whose ack Redis lost."""
    notes = run.notes
    assert notes["lost_bytes"] > 0 and notes["lost_sample_entries"] > 0, notes
    assert notes["mirror_after"] < notes["learner_version"], f"nothing published was lost: {notes}"
    run.expect_log("policy", r"the dispatch cursor is at step \d+, behind the \d+ steps this service sent")
    assert any(re.search(LOST_ACK, run.log_text(name)) for name in run.commands), "no reader handled a lost ack"


async def fill_memory(run: FaultRun, servers: PrivateServers) -> float:
    """`maxmemory` lowered to what Redis uses now (`noeviction`, compose's policy): every write that needs
    memory is refused for `FULL_S`, then the limit is lifted (an operator's fix: more memory, or consumers
    catching up). Nothing may be lost, no service may exit, and the run must go on."""
    async with run.redis() as redis:
        used = int((await redis.info("memory"))["used_memory"])
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", str(used))
        at = run.version()
        await asyncio.sleep(FULL_S)
        refused = int((await redis.info("stats")).get("total_error_replies", 0))
        run.notes.update(used_memory=used, version_before=at, version_full=run.version(), error_replies=refused)
        await redis.config_set("maxmemory", "0")
    return await _next_version_after(run, time.monotonic())


FULL_S = 6.0


def _memory_waited(run: FaultRun, result: AuditResult) -> None:
    """Redis refused writes for memory, the services said so and waited (or dropped what is droppable), and
    the run stalled while it was full (no version can be published without writing the mirror)."""
    assert run.notes["error_replies"] > 0, run.notes
    pattern = r"out of memory|OOM command not allowed"
    said = [name for name in run.commands if re.search(pattern, run.log_text(name))]
    assert said, "no service reported Redis out of memory"
    run.notes["reported_oom"] = said


REDIS_FAULTS_SCENARIOS = [
    Scenario(
        "redis_lost_writes",
        "Redis killed and restarted from an append-only file that lost its last writes (a published version, "
        "its acks, the next dispatch)",
        lose_last_writes,
        {"policy.steps": 12},  # the loss lands mid-run, with steps to go after it
        evidence=_lost_writes_redone,
        servers=EverySecServers,
        prepare=parked_policy,
    ),
    Scenario(
        "redis_maxmemory",
        f"Redis at maxmemory (noeviction) for {FULL_S:.0f} s: every write that needs memory refused, then room again",
        fill_memory,
        evidence=_memory_waited,
    ),
]

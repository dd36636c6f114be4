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
import re
import signal
import time
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


async def lose_last_writes(run: FaultRun, servers: PrivateServers) -> float:
    """Copy the append-only file, let the run publish a version, then crash Redis and bring it back from the
    copy. The services are frozen (SIGSTOP) across the crash, so that what Redis loses is exactly what the
    harness read just before (the `samples` entries the learner may have trained: the audit's evidence)."""
    assert isinstance(servers, EverySecServers)
    aof = servers.incremental_aof()
    at = await run.published()
    kept = aof.read_bytes()  # what survives: everything Redis wrote before this moment
    copied = time.monotonic()
    await run.wait_published(at + 1, 60)  # the suffix to lose holds a published version, its acks, a dispatch
    await asyncio.sleep(0.3)
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
    for name in live:
        run.signal(name, signal.SIGCONT)
    return await _next_version_after(run, time.monotonic())


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
    pattern = r"\d+ entries of \S+ were pending for us though we did not hold them"
    assert any(re.search(pattern, run.log_text(name)) for name in run.commands), "no reader handled a lost ack"


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
    ),
    Scenario(
        "redis_maxmemory",
        f"Redis at maxmemory (noeviction) for {FULL_S:.0f} s: every write that needs memory refused, then room again",
        fill_memory,
        evidence=_memory_waited,
    ),
]

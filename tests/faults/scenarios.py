"""The faults, one coroutine each: inject it into a running `FaultRun` and return the recovery seconds (from
the fault, or from its repair when it lasts, to the learner's next policy version), plus for each the evidence
that its recovery path really ran, read from the services' logs (`evidence`), and what the system is allowed
to lose to it (`may_lose`; nothing, except where a scenario says otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tests.faults.audit import AuditResult, read_checkpoints
from tests.faults.harness import FaultRun, PrivateServers
from tests.faults.partition import PARTITION_SCENARIOS
from tests.faults.redis_faults import REDIS_FAULTS_SCENARIOS
from tests.faults.scenario import Check, Scenario


async def _next_version_after(run: FaultRun, started: float, timeout: float = 120.0) -> float:
    """Seconds from `started` to the next policy version (or to the end of the run, if it ended first)."""
    await run.wait_version(min(run.version() + 1, run.plan.steps), timeout)
    return time.monotonic() - started


def _rollouts(run: FaultRun) -> list[str]:
    return [name for name in run.commands if name.startswith("rollout")]


def _victim_reclaimed(run: FaultRun, result: AuditResult) -> None:
    """Another worker reclaimed the tasks of the worker the fault was aimed at (`notes["victim"]`)."""
    victim = run.notes["victim"]
    pattern = rf"rollout/rollout-\d+ reclaimed \d+ entries idle > \d+ ms from [^\n]*\b{victim}\b"
    others = [w for w in _rollouts(run) if w != victim]
    assert any(re.search(pattern, run.log_text(w)) for w in others), (
        f"no worker reclaimed {victim}'s tasks:\n" + "\n".join(run.log_tail(w, 30) for w in others)
    )


# --------------------------------------------------------------------------------------- rollout workers

DRAFT_STARTED = r"started as a draft under policy version (\d+)"


async def kill_worker_holding_drafts(run: FaultRun, servers: PrivateServers) -> float:
    """Partial rollouts: a worker that started draft groups for the next version is frozen at once (so the
    version they wait for arrives while it cannot re-verify them), then killed -9: the other worker must
    reclaim every group it held, drafts included, and the run stay exactly on-policy (the audit's rule)."""
    deadline = time.monotonic() + 90
    while True:
        worker = next((w for w in _rollouts(run) if re.search(DRAFT_STARTED, run.log_text(w))), None)
        if worker is not None:
            run.signal(worker, signal.SIGSTOP)
            version = run.version()
            held = [task for task, (owner, _) in (await run.held("rollout", "prompts")).items() if owner == worker]
            if held:
                break
            run.signal(worker, signal.SIGCONT)  # its drafts were done and sent already: try again
        assert time.monotonic() < deadline, "never caught a worker holding a draft group"
        await asyncio.sleep(0.02)
    run.notes["victim"] = worker
    started = time.monotonic()
    await run.wait_version(min(version + 1, run.plan.steps), 120)  # what its drafts waited for, meanwhile
    await run.kill(worker)
    return await _next_version_after(run, started)


def _drafts_reclaimed(run: FaultRun, result: AuditResult) -> None:
    """The victim had started drafts, and the other worker reclaimed what it held."""
    run.expect_log(run.notes["victim"], DRAFT_STARTED)
    _victim_reclaimed(run, result)


def _failpoint(name: str) -> Callable[[FaultRun], contextlib.AbstractAsyncContextManager[None]]:
    """A `prepare` giving every service failpoint `name` (`tlt_stream.basics.failpoints`: SIGKILL, once per run),
    armed only when the injection makes the run's `failpoints/` directory (`_killed_at`)."""

    @contextlib.asynccontextmanager
    async def prepare(run: FaultRun) -> AsyncIterator[None]:
        run.env["TLT_FAILPOINTS"] = f"{name}=kill:once={run.plan.run_dir / 'failpoints' / name}"
        yield

    return prepare


async def _killed_at(run: FaultRun, name: str, services: list[str]) -> str:
    """Arm failpoint `name` and wait until one of `services` has killed itself there; its name."""
    (run.plan.run_dir / "failpoints").mkdir()  # armed: the next process to get there is the last
    said, deadline = f"failpoint {name}: kill", time.monotonic() + 120
    while (victim := next((s for s in services if said in run.log_text(s)), None)) is None:
        assert time.monotonic() < deadline, f"no service reached failpoint {name}"
        await asyncio.sleep(0.05)
    assert await run.wait_exit(victim, 30) == -signal.SIGKILL
    return victim


async def kill_worker_reverifying(run: FaultRun, servers: PrivateServers) -> float:
    """Partial rollouts: a worker dies inside `load_policy(reverify=True)`, after the new weights went in and
    its rows' KV caches were half rebuilt, before any row's outcome was committed or sent. The other worker
    must reclaim every group it held (drafts and re-verified rows alike) and the run stay on-policy."""
    victim = await _killed_at(run, "rollout.reverify", _rollouts(run))
    started = time.monotonic()
    run.exit_codes[victim] = -signal.SIGKILL  # it killed itself, exactly there, and stays dead
    run.notes["victim"] = victim
    return await _next_version_after(run, started)


async def kill_worker_generating(run: FaultRun, servers: PrivateServers) -> float:
    worker = await run.wait_any("GENERATING", 60)
    await run.kill(worker)  # its task stays pending; once its heartbeat expires the other worker reclaims it
    run.notes["victim"] = worker
    return await _next_version_after(run, time.monotonic())


async def kill_worker_training(run: FaultRun, servers: PrivateServers) -> float:
    """On-policy, the workers' idle time is the learner's update: milliseconds for the tests' tiny model.
    Freezing the learner for a moment makes a long idle period, in which the lease holder trains; it is
    killed inside that slice, and the learner let go."""
    await run.wait_version(3, 120)  # enough windows in `hidden` for a slice (min_windows)
    run.signal("learner", signal.SIGSTOP)
    deadline = time.monotonic() + 60
    async with run.redis() as redis:
        while True:  # the registry's state trails the lease: freeze the trainer, kill it only if it holds it
            trainer = await run.wait_any("TRAINING_DRAFTER", 60)  # the lease holder, inside a slice
            run.signal(trainer, signal.SIGSTOP)
            lease = await redis.hgetall(run.keys.prefix + "drafter_lease")
            if lease.get(b"worker") == trainer.encode():
                break
            run.signal(trainer, signal.SIGCONT)  # it had just let go of the lease: try the next slice
            assert time.monotonic() < deadline, "never caught a worker holding the drafter lease"
            await asyncio.sleep(0.01)
        await run.kill(trainer)
        run.notes["victim"] = trainer
        started = time.monotonic()
        # What the dead holder left: its lease, and the last committed state.
        lease = await redis.hgetall(run.keys.prefix + "drafter_lease")
        record = await redis.hgetall(run.keys.prefix + "drafter_lease:record")
    run.notes["lease"] = {k.decode(): v.decode() for k, v in lease.items()}
    run.notes["record"] = {k.decode(): v.decode() for k, v in record.items()}
    run.signal("learner", signal.SIGCONT)
    return await _next_version_after(run, started)


def _trainer_evidence(run: FaultRun, result: AuditResult) -> None:
    """Killed inside a slice while holding the lease; the committed record names a whole state directory
    (each is written under a temporary name and renamed before its fenced write), never the slice cut short."""
    victim, lease, record = run.notes["victim"], run.notes["lease"], run.notes["record"]
    assert lease.get("worker") == victim, f"{victim} did not hold the drafter lease when killed: {lease}"
    run.expect_log(victim, rf"-> TRAINING_DRAFTER \(lease fence {lease['fence']}\)")
    if record:
        state = Path(record["state"])
        assert state.is_dir() and not state.name.startswith("."), record
        assert int(record["fence"]) <= int(lease["fence"]), (record, lease)


async def freeze_worker(run: FaultRun, servers: PrivateServers) -> float:
    """A worker frozen (SIGSTOP) while it holds a task, for longer than its heartbeat's ttl plus the reclaim
    time: the other worker must take its task over (a live owner's tasks are never taken), and the frozen
    one, continued, must find it gone."""
    deadline = time.monotonic() + 90
    while True:
        worker = await run.wait_any("GENERATING", 60)
        run.signal(worker, signal.SIGSTOP)
        if any(owner == worker for owner, _ in (await run.held("rollout", "prompts")).values()):
            break
        run.signal(worker, signal.SIGCONT)  # it had just finished its tasks: try the next step
        assert time.monotonic() < deadline, "never froze a worker holding a task"
        await asyncio.sleep(0.05)
    run.notes["victim"] = worker
    started = time.monotonic()
    await asyncio.sleep(10.0)  # 2 x (heartbeat ttl 2 s + reclaim 3 s): the other worker takes its tasks over
    run.signal(worker, signal.SIGCONT)  # its late samples and ack must change nothing
    return await _next_version_after(run, started)


def _freeze_evidence(run: FaultRun, result: AuditResult) -> None:
    _victim_reclaimed(run, result)
    run.expect_log(run.notes["victim"], r"held entries of \S+ were taken over by another consumer")


# --------------------------------------------------------------------------------------- the learner


async def kill_learner(run: FaultRun, servers: PrivateServers) -> float:
    """Killed mid-update, inside its checkpoint save (a failpoint: the `.tmp-` directory whole, not yet renamed):
    the update is applied in memory but not durable, acked or published, so its samples must be trained on
    again, exactly once. (Caught from outside by polling for the `.tmp-` directory, a save of a few
    milliseconds could be missed at every step of a loaded run.)"""
    checkpoints = run.plan.run_dir / "checkpoints"
    await _killed_at(run, "learner.checkpoint", ["learner"])
    assert any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()), "no save was under way at the kill"
    started = time.monotonic()
    await _restart_killed_learner(run)  # resumes from its newest checkpoint; its pending samples are re-read
    return await _next_version_after(run, started)


async def _restart_killed_learner(run: FaultRun) -> None:
    """Start the learner again after a kill -9 and watch, in Redis, the lease the dead one left: it must still
    be there (a kill releases nothing), and the new learner must take it under a newer fence no earlier than
    it expired. Noted for `_restarted_learner`; whether the new process was up before the expiry (and logged
    that it waits) depends on how long its start-up took on a loaded machine, so that is not the evidence."""
    key = run.keys.prefix + "learner_lease"

    async def at_server(redis: Any, *reads: tuple[str, ...]) -> tuple[float, list[Any]]:
        """Redis's own clock (TIME) and `reads`, in one transaction: the lease expires by that clock, and
        reading it with the replies leaves no gap for this (loaded) process to be descheduled in."""
        async with redis.pipeline(transaction=True) as pipe:
            pipe.time()
            for command, *args in reads:
                getattr(pipe, command)(*args)
            (seconds, micros), *replies = await pipe.execute()
        return seconds + micros / 1e6, replies

    async with run.redis() as redis:
        now, (left_ms, fence) = await at_server(redis, ("pttl", key), ("hget", key, "fence"))
        expires, old_fence = now + max(left_ms, 0) / 1000, int(fence or 0)
        await run.start("learner")
        deadline, before = time.monotonic() + 120, now
        while True:
            now, (fence,) = await at_server(redis, ("hget", key, "fence"))
            if int(fence or 0) > old_fence:
                break
            before = now  # the newest moment (Redis's clock) at which the new learner did not hold it yet
            assert time.monotonic() < deadline, "the restarted learner never took the lease"
            await asyncio.sleep(0.01)
        taken_by = now
    run.notes["lease"] = {"left_ms": left_ms, "taken_after_expiry_s": (before - expires, taken_by - expires)}


async def kill_learner_writing_optimizer(run: FaultRun, servers: PrivateServers) -> float:
    """Killed inside the background optimizer write: its version is published and its samples acked (the
    policy, ledger and meta were durable first), the optimizer state is not. The restarted learner resumes
    from that checkpoint with the previous one's moments, says so, and trains every sample once."""
    await _killed_at(run, "learner.optimizer_write", ["learner"])
    started = time.monotonic()
    await _restart_killed_learner(run)
    return await _next_version_after(run, started)


async def kill_learner_accumulating(run: FaultRun, servers: PrivateServers) -> float:
    """learner.accumulate: the learner killed -9 right after a group's forward and backward were added to the
    step (a failpoint), before the step was applied. Nothing of the step was checkpointed or acked, so its
    groups' samples are still pending; the restarted learner accumulates them again, each trained once."""
    from tlt_stream.basics.messages import codec_for

    await _killed_at(run, "learner.accumulated", ["learner"])
    held = {e for e, (owner, _) in (await run.held()).items() if owner == "learner"}
    async with run.redis() as redis:
        entries = await redis.xrange(run.keys.stream("samples"))
    decode = codec_for("samples").decode
    held_ids = {
        decode(fields[b"m"]).sample_id
        for entry, fields in entries
        if (entry.decode() if isinstance(entry, bytes) else entry) in held
    }
    newest = read_checkpoints(run.plan.run_dir / "checkpoints")[0][-1]
    run.notes["untrained_held"] = held_ids - newest.ledger  # the step's accumulated groups, at least
    started = time.monotonic()
    await _restart_killed_learner(run)
    return await _next_version_after(run, started)


def _accumulated_evidence(run: FaultRun, result: AuditResult) -> None:
    """The kill came with a step's groups accumulated and their samples still pending (none acked before the
    step's checkpoint); the restarted learner resumed and accumulated steps again."""
    _restarted_learner(after_kill=True)(run, result)
    assert run.notes["untrained_held"], "the learner died accumulating, yet held no sample its checkpoints lack"
    run.expect_log("learner", r"failpoint learner\.accumulated: kill")


def _older_moments_evidence(run: FaultRun, result: AuditResult) -> None:
    """The restart found the newest checkpoint without optimizer state and took the one before's."""
    _restarted_learner(after_kill=True)(run, result)
    older = r"has no optimizer state \(its background write did not finish\): resuming with the optimizer moments"
    run.expect_log("learner", older, start=2)


def _restarted_learner(*, after_kill: bool) -> Check:
    def check(run: FaultRun, result: AuditResult) -> None:
        if after_kill:  # the dead holder's lease stayed until it expired; only then was it taken, anew
            lease = run.notes["lease"]
            assert lease["left_ms"] > 0, f"no live lease right after the kill: {lease}"
            # both ends on Redis's clock: PTTL's whole milliseconds are the only slack
            assert lease["taken_after_expiry_s"][1] > -0.002, f"taken before the dead holder's lease expired: {lease}"
        else:
            run.expect_log("learner", r"waiting for it to expire", start=2, absent=True)  # a clean stop released it
        run.expect_log("learner", r"resumed from \S+ \(version \d+, \d+ samples in the ledger\)", start=2)

    return check


async def _hold_samples(run: FaultRun, ms: int) -> dict[str, int]:
    """Until the learner holds samples (delivered, un-acked: groups waiting for the step's tail) that were
    added more than `ms` ago; returns them (entry id -> age in ms)."""
    deadline = time.monotonic() + 90
    while True:
        held = {e: age for e, (owner, age) in (await run.held()).items() if owner == "learner" and age > ms}
        if held:
            return held
        assert time.monotonic() < deadline, f"the learner never held a sample for {ms} ms"
        assert run.version() < run.plan.steps, f"the run ended before the learner held a sample for {ms} ms"
        await asyncio.sleep(0.02)


SLOW_TAIL_RECLAIM_MS = 300


async def kill_learner_holding(run: FaultRun, servers: PrivateServers) -> float:
    """A learner holding samples for several reclaim times (incomplete steps wait for their tail) must keep
    them pending (never reclaim them from itself and take them for duplicates); killed then, the restarted
    learner trains them from its own pending list."""
    run.notes["held"] = await _hold_samples(run, 2 * SLOW_TAIL_RECLAIM_MS)
    await run.kill("learner")
    still = await run.held()
    assert set(run.notes["held"]) <= set(still), "samples held by the killed learner were acked or taken"
    started = time.monotonic()
    await _restart_killed_learner(run)
    return await _next_version_after(run, started)


async def stop_learner_holding(run: FaultRun, servers: PrivateServers) -> float:
    """The same learner stopped with SIGTERM instead: it exits by itself (code 0) with the samples it holds
    still pending, releases its lease, and the next learner starts at once and trains them."""
    run.notes["held"] = await _hold_samples(run, 2 * SLOW_TAIL_RECLAIM_MS)
    started = time.monotonic()
    run.signal("learner", signal.SIGTERM)
    code = await run.wait_exit("learner", 60)
    assert code == 0, f"the learner exited with {code} on SIGTERM:\n{run.log_tail('learner')}"
    assert set(run.notes["held"]) <= set(await run.held()), "samples held at the stop were acked untrained"
    await run.start("learner")
    return await _next_version_after(run, started)


def _slow_tail_evidence(*, after_kill: bool) -> Check:
    restarted = _restarted_learner(after_kill=after_kill)

    def check(run: FaultRun, result: AuditResult) -> None:
        restarted(run, result)
        run.expect_log("learner", r"reclaimed \d+ entries", start=1, absent=True)  # never from itself
        run.expect_log("learner", r"taken over by another consumer", absent=True)
        if not after_kill:
            run.expect_log("learner", r"released the learner_lease", start=1)

    return check


async def second_learner(run: FaultRun, servers: PrivateServers) -> float:
    """A second learner for the same run while the first serves it. The policy service is frozen meanwhile
    so that the run cannot end (and the first learner release its lease) before the second one gave up;
    returns the seconds the second one took to refuse."""
    run.commands["learner-2"] = run.commands["learner"]
    run.exit_codes["learner-2"] = 2
    run.signal("policy", signal.SIGSTOP)
    try:
        started = time.monotonic()
        await run.start("learner-2")
        code = await run.wait_exit("learner-2", 120)
        refused = time.monotonic() - started
    finally:
        run.signal("policy", signal.SIGCONT)
    assert code == 2, f"the second learner exited with {code}:\n{run.log_tail('learner-2')}"
    assert run.processes["learner"].returncode is None, run.log_tail("learner")
    return refused


def _second_learner_evidence(run: FaultRun, result: AuditResult) -> None:
    run.expect_log("learner-2", rf"run '{re.escape(run.run)}' already has a learner \(learner@")
    run.expect_log("learner", r"lost the learner lease|lease expired", absent=True)
    assert run.starts["learner"] == 1


async def corrupt_newest_checkpoint(run: FaultRun, servers: PrivateServers) -> float:
    """The learner stopped (SIGTERM, clean), one byte of the newest checkpoint's weights flipped, the learner
    started again: it must set that checkpoint aside and resume from the one before."""
    run.signal("learner", signal.SIGTERM)
    code = await run.wait_exit("learner", 60)
    assert code == 0, run.log_tail("learner")
    root = run.plan.run_dir / "checkpoints"
    newest = root / (root / "LATEST").read_text().strip()
    weights = newest / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    run.notes["corrupted"] = newest.name
    started = time.monotonic()
    await run.start("learner")
    return await _next_version_after(run, started)  # start-up and a step: every restart's bound


def _fallback_evidence(run: FaultRun, result: AuditResult) -> None:
    name = run.notes["corrupted"]
    run.expect_log(
        "learner",
        rf"checkpoint \S+{name} is damaged \(ChecksumMismatch: [^\n]*set aside as corrupt-{name}-\d+, falling back",
        start=2,
    )
    assert [c for c in result.discarded if c.startswith(f"corrupt-{name}-")], result.discarded


async def _readers_idle(run: FaultRun) -> None:
    """Freeze the learner, then wait until every worker has loaded the published version: from then on nobody
    reads the checkpoint directory (a worker reads it only to load a newer version) until the learner is let
    go. A learner frozen between its compare-and-set on the mirror and its MQTT announcement has published a
    version no worker was told of: it is let go for a moment to announce it, and frozen again."""
    deadline = time.monotonic() + 90
    while True:
        run.signal("learner", signal.SIGSTOP)
        published = await run.published()
        settled = time.monotonic() + 10
        while time.monotonic() < settled:
            if all(re.search(rf"loaded policy version {published}\b", run.log_text(w)) for w in _rollouts(run)):
                return
            await asyncio.sleep(0.05)
        run.signal("learner", signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError(f"not every worker loaded version {published}:\n" + run.log_tail(_rollouts(run)[0]))
        await asyncio.sleep(0.5)


async def checkpoint_dir_unwritable(run: FaultRun, servers: PrivateServers) -> float:
    """The learner's checkpoint directory replaced by a plain file (root ignores permission bits, so a
    read-only mode would not stop it): every save fails with an OSError until the directory is back."""
    checkpoints = run.plan.run_dir / "checkpoints"
    held = checkpoints.with_name("checkpoints.held")
    logs = [run.plan.run_dir / "logs" / f"{name}.log" for name in _rollouts(run)]

    def unreadable() -> int:  # the workers' "policy version N unreadable ... trying again" lines so far
        return sum(path.read_text(errors="replace").count("unreadable") for path in logs if path.exists())

    def failed_saves() -> int:
        return run.log_text("learner").count("checkpoint of version")

    while True:
        before, saves = unreadable(), failed_saves()
        await _readers_idle(run)
        at = run.version()  # read while the directory is there and the learner frozen: nothing newer can appear
        checkpoints.rename(held)
        checkpoints.write_text("not a directory\n")
        run.signal("learner", signal.SIGCONT)
        deadline = time.monotonic() + 120  # each round waits for one step's save: a step's bound, per round
        while failed_saves() == saves:  # the next save failed, and said so
            assert run.processes["learner"].returncode is None, run.log_tail("learner", 80)
            assert time.monotonic() < deadline, "the learner never tried to save:\n" + run.log_tail("learner", 80)
            if unreadable() > before:
                break  # a checkpoint saved before the freeze went out after it: no worker can load it, no save
            await asyncio.sleep(0.1)
        else:
            break
        # Bring it back (the worker loads it at its next try, which is what a transient outage should
        # cost) and inject the fault again once the run has moved on.
        checkpoints.unlink()
        held.rename(checkpoints)
        await asyncio.sleep(0.5)
    await asyncio.sleep(6.0)  # retrying all along, publishing nothing
    assert run.version() == at, "an update was recorded while no checkpoint could be written"
    assert await run.published() == at, "a version was published while no checkpoint could be written"
    assert run.processes["learner"].returncode is None, run.log_tail("learner", 80)
    checkpoints.unlink()
    held.rename(checkpoints)
    return await _next_version_after(run, time.monotonic())


def _save_retried(reason: str = "") -> Check:
    def check(run: FaultRun, result: AuditResult) -> None:
        run.expect_log("learner", rf"checkpoint of version \d+ failed \([^\n]*{reason}[^\n]*\); retry \d+ in")

    return check


@contextlib.asynccontextmanager
async def small_disk(run: FaultRun) -> AsyncIterator[None]:
    """A 16 MiB tmpfs mounted on the run's checkpoint directory (a real file system that can fill up)."""
    import pytest

    async def sh(*argv: str) -> tuple[int, str]:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as exc:  # no mount(8) at all
            return 127, str(exc)
        out, _ = await process.communicate()
        return process.returncode or 0, out.decode(errors="replace").strip()

    target = run.plan.run_dir / "checkpoints"
    target.mkdir(parents=True, exist_ok=True)
    code, said = await sh("mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(target))
    if code != 0:
        pytest.skip(f"cannot mount a tmpfs here: {said}")
    try:
        yield
    finally:
        if (await sh("umount", str(target)))[0] != 0:
            await sh("umount", "-l", str(target))


async def fill_disk(run: FaultRun, servers: PrivateServers) -> float:
    """Fill the checkpoint file system (ENOSPC) until a save has failed and the learner said so, 3 s more, then
    free it: nothing may be published meanwhile, and nothing lost."""
    root = run.plan.run_dir / "checkpoints"
    filler = root / "filler"
    saves = run.log_text("learner").count("checkpoint of version")
    with filler.open("wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while out.write(b"\0" * chunk):
                    pass
    deadline = time.monotonic() + 90
    while run.log_text("learner").count("checkpoint of version") == saves:
        assert run.processes["learner"].returncode is None, run.log_tail("learner", 80)
        assert time.monotonic() < deadline, "no save failed on the full disk:\n" + run.log_tail("learner", 80)
        await asyncio.sleep(0.1)
    at = run.version()
    await asyncio.sleep(3.0)
    assert run.version() == at and await run.published() == at, "a version went out with the disk full"
    filler.unlink()
    return await _next_version_after(run, time.monotonic())


# --------------------------------------------------------------------------------------- the policy service


async def kill_policy(run: FaultRun, servers: PrivateServers) -> float:
    await run.kill("policy")
    started = time.monotonic()
    await run.start("policy")  # resumes the dispatch cursor it keeps in Redis
    return await _next_version_after(run, started)


def _cursor_resumed(run: FaultRun, result: AuditResult) -> None:
    line = run.expect_log("policy", r"policy: dispatching from step \d+", start=2)
    assert int(line.rsplit(" ", 1)[1]) > 0, line


# --------------------------------------------------------------------------------------- the servers


async def restart_redis(run: FaultRun, servers: PrivateServers) -> float:
    await servers.stop_redis(signal.SIGKILL)  # a crash: append-only with fsync always keeps every write
    await asyncio.sleep(2.0)
    await servers.start_redis()
    return await _next_version_after(run, time.monotonic())


def _redis_retried(run: FaultRun, result: AuditResult) -> None:
    pattern = r"Redis \S+ unreachable \(attempt \d+\); retrying"
    assert any(re.search(pattern, run.log_text(name)) for name in run.commands), "no service retried Redis"


async def restart_broker(run: FaultRun, servers: PrivateServers) -> float:
    """Ten seconds without a broker: the learner publishes into the Redis mirror, the workers follow the
    mirror, so training goes on; everything catches up from the retained messages once it is back."""
    at = run.version()
    await servers.stop_broker(signal.SIGKILL)
    await asyncio.sleep(10.0)
    assert run.version() > at, "no update while the broker was down: the workers did not follow the mirror"
    await servers.start_broker()
    return await _next_version_after(run, time.monotonic())


def _broker_lost(run: FaultRun, result: AuditResult) -> None:
    for name in run.commands:
        run.expect_log(name, r"MQTT \S+ unreachable or lost")


# --------------------------------------------------------------------------------------- hostile input


async def inject_poison(run: FaultRun, servers: PrivateServers) -> float:
    """Poison written straight into the streams (a raw client, the right codec): a sample with a NaN reward,
    one with a token id outside the vocabulary, a prompt longer than max_len. Each must be dead-lettered by
    the service that reads it, which goes on."""
    from tlt_stream.basics.messages import PromptGroup, Sample, Tensor, codec_for

    vocab = json.loads((run.plan.world / "policy" / "config.json").read_text())["vocab_size"]
    version = await run.published()

    def sample(task: str, reward: float, tokens: list[int]) -> Sample:
        return Sample(
            sample_id=f"{task}/0", task_id=task, prompt_id=task, index=0, group_size=2, prompt_ids=[3, 4],
            token_ids=Tensor.from_values(tokens, "int32"), logprobs=Tensor.from_values([-1.0] * len(tokens), "float32"),
            policy_version=version, drafter_version=-1, reward=reward, finish_reason="eos", worker_id="poisoner",
        )  # fmt: skip

    long = PromptGroup(
        task_id="poison-long",
        prompt_id="poison-long",
        prompt_ids=[3] * (run.config.rollout.max_len or 256),  # the tests' policy has 256 positions
        answer="0",
        group_size=2,
    )
    poison = [
        ("samples", sample("poison-nan", float("nan"), [3, 4]), "reward nan is not finite"),
        ("samples", sample("poison-vocab", 1.0, [3, vocab]), f"token id {vocab}, outside the policy's vocabulary"),
        ("prompts", long, "leaves no room for a response"),
    ]
    async with run.redis() as redis:
        for stream, message, reason in poison:
            entry = await redis.xadd(run.keys.stream(stream), {b"m": codec_for(stream).encode(message)})
            run.injected[(stream, entry.decode())] = reason
        started = time.monotonic()
        while sum(int(v) for v in (await redis.hgetall(run.keys.dead_counts)).values()) < len(poison):
            assert time.monotonic() - started < 60, "the poison was not dead-lettered"
            await asyncio.sleep(0.05)
    return await _next_version_after(run, started)


def _poison_evidence(run: FaultRun, result: AuditResult) -> None:
    run.expect_log("learner", r"dead-lettered samples entry \S+ from learner/learner: invalid sample: reward nan")
    run.expect_log("learner", r"dead-lettered samples entry \S+ from learner/learner: invalid sample: token_ids")
    pattern = r"dead-lettered prompts entry \S+ from rollout/rollout-\d+: invalid task: prompt of \d+ tokens"
    assert any(re.search(pattern, run.log_text(w)) for w in _rollouts(run)), "no worker dead-lettered the prompt"


FORGED_VERSION = 2**62


async def forge_control(run: FaultRun, servers: PrivateServers) -> float:
    """A raw MQTT client on the policy topic: a forged version 2**62 pointing at a checkpoint that does not
    exist, then a replay of an older genuine retained message (both retained, as an attacker would)."""
    from tlt_stream.basics.messages import CONTROL_CODEC, PolicyVersion
    from tlt_stream.bus.connect import mqtt_params

    genuine = await run.retained("policy")
    assert isinstance(genuine, PolicyVersion), genuine
    await run.wait_version(genuine.version + 1, 60)  # the captured message is an old one now
    forged = PolicyVersion(version=FORGED_VERSION, location="/nonexistent/forged", sha256="f" * 64, step=FORGED_VERSION)
    started = time.monotonic()
    async with mqtt_params(servers.mqtt_url).client(identifier="forger") as client:
        for message in (forged, genuine):
            await client.publish(run.config.topic_prefix + "policy", CONTROL_CODEC.encode(message), qos=1, retain=True)
    # Every service still running must refuse it; one that finished its work meanwhile (the policy service
    # once it dispatched the last step, on a fast run) cannot hear it, and is exempt.
    deadline = time.monotonic() + 30
    while not all("unconfirmed (forged?)" in run.log_text(name) for name in _running(run)):
        assert time.monotonic() < deadline, "not every running service refused the forged version"
        await asyncio.sleep(0.1)
    run.notes["refused_forgery"] = [name for name in run.commands if "unconfirmed (forged?)" in run.log_text(name)]
    return await _next_version_after(run, started)


def _running(run: FaultRun) -> list[str]:
    return [name for name, process in run.processes.items() if process.returncode is None]


def _forgery_evidence(run: FaultRun, result: AuditResult) -> None:
    refused = run.notes["refused_forgery"]
    assert set(_rollouts(run)) <= set(refused), f"a rollout worker did not refuse the forgery: {refused}"
    for name in refused:
        run.expect_log(name, rf"ignoring an unconfirmed \(forged\?\) policy version {FORGED_VERSION} from MQTT")
    for name in run.commands:
        assert FORGED_VERSION not in run.adopted(name, 1), f"{name} adopted the forged version"


LONG_ROLLOUTS = {"rollout.max_len": 256, "policy.prompts_per_step": 8, "rollout.max_batch": 4}
"""For faults aimed at a worker mid-generation, or at groups waiting for their step's tail: the tiny test
policy's rollouts at the small plan's max_len take ~10 ms a step, too short a window to be caught in
reliably. 256 is the test policy's context (the learner dead-letters a longer sample); 4 rows a worker make
each step's 16 responses run in waves."""

PARTIAL_ROLLOUTS = {**LONG_ROLLOUTS, "policy.partial_rollouts": True, "policy.ahead_tokens": 16}
"""Long rollouts with partial rollouts on, drafts parking after 16 tokens: workers hold drafts and
re-verify rows at every version."""
FAST_HEARTBEAT = {"TLT_BUS__HEARTBEAT_S": "0.5", "TLT_BUS__HEARTBEAT_TTL_S": "2"}
"""A dead or frozen worker's heartbeat expires in 2 s, so its tasks are reclaimed within the scenario."""

SLOW_TAIL = {"rollout.max_len": 256, "policy.prompts_per_step": 16, "rollout.max_batch": 1}
"""Steps of ~1.5 s (16 responses a worker, one at a time): a step's first groups wait at the learner for well
over the slow-tail scenarios' reclaim time (300 ms) while the rest is generated."""

EXTENDED_WHY = """.ci/run must stay under 20 minutes on 2 cores, and 21 whole-run scenarios take about 10. CI
runs the ones no other test covers; the extended ones (`bench/faults.py` runs every scenario, and the tests do
with TLT_FAULTS_EXTENDED=1) each have a faster test of the same mechanism in CI: a dead or frozen worker's
task taken over (tests/integration/test_reclaim.py, and kill9_rollout_training), the policy service's cursor
(tests/integration/test_rl_loop.py), the broker away (tests/integration/test_control.py), the SIGTERM
restart of a learner holding samples (test_learner_service.py, and slow_tail_kill9_learner), a failed save
retried (checkpoint_unwritable), a silent peer (test_partition.py, and the regression tests of what the
partition found), a learner killed with a step accumulated (tests/integration/test_accumulated_learner.py's stop
mid-step, and kill9_learner_writing_optimizer's kill, restart and resume)."""

SCENARIOS = [
    Scenario(
        "kill9_rollout_generating",
        "kill -9 a rollout worker mid-generation",
        kill_worker_generating,
        LONG_ROLLOUTS,
        _victim_reclaimed,
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
    Scenario(
        "kill9_rollout_holding_drafts",
        "partial rollouts: a worker holding draft groups frozen until their version is out, then killed -9",
        kill_worker_holding_drafts,
        PARTIAL_ROLLOUTS,
        _drafts_reclaimed,
        env=FAST_HEARTBEAT,
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
    Scenario(
        "kill9_rollout_reverifying",
        "partial rollouts: a worker killed -9 inside load_policy's re-verification (a failpoint), new weights in",
        kill_worker_reverifying,
        PARTIAL_ROLLOUTS,
        _victim_reclaimed,
        env=FAST_HEARTBEAT,
        prepare=_failpoint("rollout.reverify"),
    ),
    Scenario(
        "kill9_learner_writing_optimizer",
        "the learner killed -9 inside its background optimizer-state write (a failpoint), restarted",
        kill_learner_writing_optimizer,
        evidence=_older_moments_evidence,
        prepare=_failpoint("learner.optimizer_write"),
    ),
    Scenario(
        "kill9_rollout_training",
        "kill -9 the rollout worker inside a drafter-training slice",
        kill_worker_training,
        {
            "launch.sd": "eagle",
            "policy.prompts_per_step": 4,
            "rollout.hidden_share": 1.0,
        },  # every window: training starts early
        _trainer_evidence,
    ),
    Scenario(
        "kill9_learner",
        "kill -9 the learner mid-update (inside its checkpoint save, a failpoint), restart it",
        kill_learner,
        evidence=_restarted_learner(after_kill=True),
        prepare=_failpoint("learner.checkpoint"),
    ),
    Scenario(
        "kill9_learner_accumulating",
        "learner.accumulate: the learner killed -9 with a step's groups accumulated, not applied (a failpoint)",
        kill_learner_accumulating,
        {"learner.accumulate": True, "policy.prompts_per_step": 3},
        _accumulated_evidence,
        prepare=_failpoint("learner.accumulated"),
        extended=True,  # CI time (see EXTENDED_WHY): 41-48 s here, most of it the dead learner's lease expiring
    ),
    Scenario(
        "kill9_policy",
        "kill -9 the policy service, restart it",
        kill_policy,
        evidence=_cursor_resumed,
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
    Scenario(
        "restart_redis", "kill -9 Redis (append-only), restart it 2 s later", restart_redis, evidence=_redis_retried
    ),
    Scenario(
        "restart_broker",
        "kill -9 the MQTT broker for 10 s (training must go on)",
        restart_broker,
        evidence=_broker_lost,
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
    Scenario(
        "sigstop_rollout",
        "freeze a rollout worker holding a task (SIGSTOP) for 2 x (heartbeat ttl + reclaim time)",
        freeze_worker,
        LONG_ROLLOUTS,
        _freeze_evidence,
        env=FAST_HEARTBEAT,
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
    Scenario(
        "checkpoint_unwritable",
        "the learner's checkpoint directory unwritable until a save has failed, then 6 s more",
        checkpoint_dir_unwritable,
        {"policy.steps": 12},  # room for a second injection when the first lands before a worker loaded its version
        _save_retried(),
    ),
    Scenario(
        "slow_tail_kill9_learner",
        "samples held at the learner > 2 x the reclaim time (300 ms), the learner killed -9 then, restarted",
        kill_learner_holding,
        SLOW_TAIL,
        _slow_tail_evidence(after_kill=True),
        env={"TLT_BUS__RECLAIM_IDLE_MS": str(SLOW_TAIL_RECLAIM_MS)},
    ),
    Scenario(
        "slow_tail_sigterm_learner",
        "samples held at the learner > 2 x the reclaim time (300 ms), the learner stopped (SIGTERM), restarted",
        stop_learner_holding,
        SLOW_TAIL,
        _slow_tail_evidence(after_kill=False),
        env={"TLT_BUS__RECLAIM_IDLE_MS": str(SLOW_TAIL_RECLAIM_MS)},
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
    Scenario(
        "poison",
        "a NaN-reward sample, a sample with a token id >= vocab and a prompt longer than max_len, written raw",
        inject_poison,
        evidence=_poison_evidence,
    ),
    Scenario(
        "forged_control",
        "a forged policy version 2**62 and a replayed old retained one, published raw on the policy topic",
        forge_control,
        evidence=_forgery_evidence,
    ),
    Scenario(
        "two_learners",
        "a second learner started for the run (recovery: seconds until it refused)",
        second_learner,
        evidence=_second_learner_evidence,
    ),
    Scenario(
        "corrupt_checkpoint",
        "one byte flipped in the newest checkpoint's weights while the learner was stopped, restarted",
        corrupt_newest_checkpoint,
        evidence=_fallback_evidence,  # and nothing lost: the set-aside update's samples were still pending
    ),
    Scenario(
        "disk_full",
        "the checkpoint file system (a 16 MiB tmpfs) full until a save has failed, then 3 s more",
        fill_disk,
        evidence=_save_retried("No space left"),
        prepare=small_disk,
        extended=True,  # CI time (see EXTENDED_WHY)
    ),
]

SCENARIOS += REDIS_FAULTS_SCENARIOS + PARTITION_SCENARIOS

SMALL = {
    "preset": "tiny-world",
    "launch.workers": 2,
    "launch.sd": "off",
    "policy.steps": 6,
    "policy.prompts_per_step": 2,
    "policy.group_size": 2,
    "rollout.max_len": 64,
    "rollout.max_batch": 8,
}
"""The common small run of every scenario (configuration keys; a scenario's own `plan` adds to them)."""

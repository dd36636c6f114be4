"""One GRPO update over complete groups, and what makes it count: a checkpoint, then the acks, then the version.

An update runs `LearnerCore.step` on the event loop's thread (torch's CPU thread pool is markedly slower
driven from a secondary thread; heartbeats and keepalives tolerate the pause, and the lease is renewed for
it first). A step that raises applied nothing: its groups go back to the front of the queue and are tried
again after a pause, and a group that failed `bus.max_deliveries` times is dead-lettered, so one group that
breaks the update cannot stop the run; ranks out of step are no such failure, and end the service for a
restart. An applied update is checkpointed (retried until the disk takes it, or the service stops: `disk.py`), the
previous update's entries are acked (this one's after the next checkpoint, so a damaged newest checkpoint
can be fallen back from and its samples trained again), the version is published, groups the new version
left outside the window are dropped, and the update's records are written (`records.py`).

When the learner accumulates (learner.accumulate; by default unless the policy has dropout) the step is built
while its groups arrive (`rl/accumulate.py`): `next_step` hands each group complete at the front of the ready
queue to the `StepAccumulator` at once (its forward and backward, on the loop's thread, the lease renewed
first as for an update), and the update applies the accumulated step once it has `groups_per_step` groups. A
group added while the step still waits for others shares the cores with the rollout generating the step's
tail, so it runs on learner.accumulate_threads (one by default); once the step's groups are all in, they and
the step itself run on all of the learner's.
With learner.accumulate_below_rows a complete group is added only while the rollout workers report fewer rows
in flight than that (their registry records, read when groups are waiting), else it waits in the ready
queue, in its place, until the rows drop or the step's groups are all in: the same groups in the same order.
Nothing else changes: a step that raises voids all its groups, which go back first as a failed batch
update's do, and nothing of a step is acked before its checkpoint, so a learner stopped or killed mid-step
loses only memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from tlt_stream.basics.aio import sleep_or_stop
from tlt_stream.basics.config import Config
from tlt_stream.basics.errors import ConfigError
from tlt_stream.bus.registry import rollout_rows
from tlt_stream.rl.accumulate import StepAccumulator, dropout_of
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.metrics import accept_by_drafter, rollout_timing, staleness_histogram
from tlt_stream.rl.ranks import RanksOutOfStep
from tlt_stream.roles.learner_parts.checkpoints import Checkpoints
from tlt_stream.roles.learner_parts.disk import until_written
from tlt_stream.roles.learner_parts.intake import SampleIntake
from tlt_stream.roles.learner_parts.lease import RunLease
from tlt_stream.roles.learner_parts.records import UpdateRecords

__all__ = ["HOLD_RECHECK_MS", "UpdateFailed", "Updates"]

log = logging.getLogger("tlt_stream.roles.learner")

HOLD_RECHECK_MS = 200
"""While complete groups wait for the rollout's rows to drop, the loop reads samples at most this long before
it reads the rows again (else bus.block_ms): a few reads a second, during a step's tail only."""


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Torch's CPU threads at most `count` inside (None: unchanged)."""
    before = torch.get_num_threads()
    if count is None or count >= before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class UpdateFailed(Exception):
    """An update raised before it was applied (the weights, the ledger and the version are unchanged)."""


class Updates:
    """The learner's updates: each one applied, checkpointed, acked and published, or tried again."""

    def __init__(
        self,
        config: Config,
        checkpoints: Checkpoints,
        intake: SampleIntake,
        lease: RunLease,
        records: UpdateRecords,
    ) -> None:
        self.config = config
        self.checkpoints = checkpoints
        self.intake = intake
        self.lease = lease
        self.records = records
        self.stop: asyncio.Event | None = None
        """The service's stop event, once it runs: a failing disk is retried until it is set."""
        self.idle_since = time.perf_counter()
        """Since when the learner has waited for complete groups (the last update's end, or the start)."""
        self.failures: dict[str, int] = {}
        """Failed update attempts per task id: a group whose updates keep failing is dead-lettered."""
        self.failed_updates = 0
        self.last_entries: list[str] = []
        """Entries of the newest applied update: acked once the next checkpoint exists (or on a clean stop)."""
        self.last_dead: list[str] = []
        """Its groups' dead-lettered members: their records (`Keys.dead_members`) are forgotten with those acks."""
        self.accumulator: StepAccumulator | None = None
        """The step being built group by group, when the learner accumulates (`attach`, once the policy is
        final: learner.accumulate resolved against it)."""
        self.holding = False
        """Complete groups wait in the ready queue while the rollout is busy (learner.accumulate_below_rows)."""
        self.held: set[str] = set()
        """Tasks of the step being built whose groups waited for the rollout's rows (the step's `held_groups`)."""

    def attach(self) -> None:
        """Build the step accumulator around the policy the checkpoints resumed, as learner.accumulate says:
        auto accumulates unless the policy has dropout, which it names in one log line (the batch update runs);
        true refuses a policy with dropout, naming the setting; false never accumulates."""
        core, setting = self.checkpoints.core, self.config.learner.accumulate
        self.accumulator = None
        if setting is False or core is None:
            return
        if setting == "auto" and (found := dropout_of(core.model)):
            log.info(
                "learner.accumulate = auto: the policy has dropout (%s), so each update runs after its step's last "
                "group (the batch update; learner.accumulate = false says so and quiets this)",
                ", ".join(found),
            )
            return
        try:
            self.accumulator = StepAccumulator(core, self.config.groups_per_step)
        except ValueError as exc:
            raise ConfigError(f"learner.accumulate: {exc}; set learner.accumulate = false") from exc

    async def next_step(self) -> list[ReadyGroup] | None:
        """The next update's groups, taken from the front of the ready queue in their order of completion, or
        None while it holds fewer than the step needs. Accumulating, each group taken is computed now and the
        step's groups are returned once it has them all."""
        ready, per_step = self.intake.ready, self.config.groups_per_step
        if self.accumulator is None:
            if len(ready) < per_step:
                return None
            groups = ready[:per_step]
            del ready[:per_step]
            return groups
        accumulator, tail = self.accumulator, self.config.learner.accumulate_threads
        # All the step's groups are here (the rollout's share of it is done): add them now, on all threads.
        completes = len(accumulator.groups) + len(ready) >= per_step
        self.holding = bool(ready) and not completes and await self._rollout_busy()
        if self.holding:
            self.held |= {g.task_id for g in ready}
        if ready and not self.holding:
            await self.lease.renew()  # adding groups blocks the loop, as an update does
            while ready and not accumulator.full:
                with _threads(None if completes else tail or None):  # beside the step's tail: its share
                    accumulator.add(ready.pop(0))
        return accumulator.groups if accumulator.full else None

    async def _rollout_busy(self) -> bool:
        """learner.accumulate_below_rows: whether the rollout workers report at least that many rows in flight
        (their registry records; none reporting: not busy)."""
        below = self.config.learner.accumulate_below_rows
        if not below:
            return False
        rows = await rollout_rows(self.intake.redis, self.intake.keys, self.config.bus)
        return rows is not None and rows >= below

    def put_back(self) -> None:
        """A stop mid-step: the groups accumulated so far go back to the front of the queue, their gradients
        cleared (nothing of them was acked: a restart or the next run computes them again)."""
        if self.accumulator is not None and self.accumulator.groups:
            self.intake.ready[:0] = self.accumulator.discard()

    async def try_update(self, groups: list[ReadyGroup]) -> bool:
        """One update over `groups`; an update that raises is not applied: its groups go back to the front of
        the queue and are tried again after a pause, and a group that failed `bus.max_deliveries` times is
        dead-lettered (a group that keeps breaking the update must not stop the run)."""
        try:
            await self.update(groups)
            for group in groups:
                self.failures.pop(group.task_id, None)
            return True
        except UpdateFailed as failed:
            exc = failed.__cause__ or failed
            self.failed_updates += 1
            log.exception("update to version %d failed; it was not applied", self.checkpoints.version + 1)
            limit = self.config.bus.max_deliveries
            keep = []
            for group in groups:
                tries = self.failures[group.task_id] = self.failures.get(group.task_id, 0) + 1
                if tries < limit:
                    keep.append(group)
                    continue
                self.failures.pop(group.task_id, None)
                reason = f"the update failed {tries} times on this group: {type(exc).__name__}: {exc}"
                await self.intake.dead_group(group, reason)
            self.intake.ready[:0] = keep
            if self.stop is not None:
                await sleep_or_stop(self.stop, min(10.0, 0.5 * 2 ** (self.failed_updates - 1)))
            return False

    async def update(self, groups: list[ReadyGroup]) -> dict[str, float]:
        mine, intake = self.checkpoints, self.intake
        assert mine.core is not None
        started = time.perf_counter()
        staleness = [g.staleness(mine.version) for g in groups]
        samples = [s for g in groups for s in g.samples]
        await self.lease.renew()  # the update blocks the loop: the renewed ttl covers the longest one yet
        # On the loop's thread, as the rollout worker's decode steps: torch's CPU thread pool is markedly
        # slower driven from a secondary thread. Heartbeats and MQTT keepalives tolerate an update's pause.
        try:
            metrics = self.accumulator.finish() if self.accumulator is not None else mine.core.step(groups)
        except RanksOutOfStep:  # a rank died or disagrees: no retry can help; a restart resumes
            raise
        except Exception as exc:  # nothing was applied: LearnerCore.step fails before its optimizer step
            raise UpdateFailed(str(exc)) from exc
        # Since the last update (or start): waiting for complete groups, not adding them to the step.
        wait = started - self.idle_since - metrics.get("accumulate_seconds", 0.0)
        if self.config.learner.accumulate_below_rows:
            metrics["held_groups"] = float(sum(g.task_id in self.held for g in groups))
        self.held.clear()
        await asyncio.sleep(0)
        for group in groups:
            intake.assembler.consume(group)
        mine.version += 1
        histogram = staleness_histogram(staleness)
        metrics.update(
            **rollout_timing(samples),
            wait_seconds=wait,
            staleness_max=float(max(staleness)),
            staleness_mean=sum(staleness) / len(staleness),
            dropped_groups=float(intake.assembler.dropped_groups),
            **intake.dropped_since_last(),
            duplicates=float(intake.assembler.duplicates),
            **{f"staleness_{k}": float(v) for k, v in histogram.items()},
            **{f"accept_length_drafter_{v}": a for v, a in accept_by_drafter(samples).items()},
        )
        if metrics["learn_seconds"] > 0:
            metrics["learn_tokens_per_s"] = metrics["trained_tokens"] / metrics["learn_seconds"]
        saving = time.perf_counter()
        extra = {"metrics": metrics, "trained_groups": [g.task_id for g in groups]}
        # A full disk or an unwritable directory must not cost the update or its samples: nothing is acked or
        # published before the checkpoint exists, so retry (capped backoff, said once and reported to `stats`)
        # until it is written or the service is stopped, which then exits non-zero with the samples still
        # pending for a restart (`disk.py`).
        mine.checkpoint, failed = await until_written(
            lambda: mine.save_or_stop(extra, intake.assembler.ledger, self.stop),
            what="checkpoint",
            version=mine.version,
            stop=self.stop,
            meanwhile="nothing of the update is acked or published before it is written",
            report=self.records.disk_trouble,
        )
        metrics["checkpoint_failed_attempts"] = float(failed)
        metrics["checkpoint_seconds"] = time.perf_counter() - saving  # the optimizer's write is not in it
        metrics.update(mine.optimizer_write_figures())
        # The previous update's entries are acked now, this one's after the next checkpoint: a newest
        # checkpoint found damaged on restart is fallen back from, and its update's samples are then still
        # pending, so they are trained again instead of lost.
        await intake.ack(self.last_entries)
        await intake.forget_dead(self.last_dead)
        self.last_entries = [entry for g in groups for entry in g.entry_ids]
        self.last_dead = [d for g in groups for d in g.dead_ids]
        await intake.trim()
        published = await mine.publish(mine.checkpoint)
        metrics["last_sample_to_publish_s"] = published.published_at - max(s.created_at for s in samples)
        await self._drop_left_behind()
        metrics["update_seconds"] = time.perf_counter() - started
        self.lease.longest_update_s = max(self.lease.longest_update_s, metrics["update_seconds"])
        await self.records.record_update(
            mine.version, groups, samples, metrics, histogram=histogram, wait=wait, stop=self.stop
        )
        self.idle_since = time.perf_counter()
        return metrics

    async def _drop_left_behind(self) -> None:
        """Groups assembled under the old version that the new one has left behind: dropped visibly."""
        intake, version = self.intake, self.checkpoints.version
        expired = intake.assembler.evict_stale(version)
        keep = []
        for group in intake.ready:
            if group.staleness(version) > intake.max_staleness:
                intake.assembler.drop(group)
                expired.append(group)
            else:
                keep.append(group)
        intake.ready = keep
        await intake.note_dropped(expired)
        await intake.ack([entry for g in expired for entry in g.entry_ids])

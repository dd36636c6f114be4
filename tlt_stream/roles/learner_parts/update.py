"""One GRPO update over complete groups, and what makes it count: a checkpoint, then the acks, then the version.

An update runs `LearnerCore.step` on the event loop's thread (torch's CPU thread pool is markedly slower
driven from a secondary thread; heartbeats and keepalives tolerate the pause, and the lease is renewed for
it first). A step that raises applied nothing: its groups go back to the front of the queue and are tried
again after a pause, and a group that failed `bus.max_deliveries` times is dead-lettered, so one group that
breaks the update cannot stop the run; ranks out of step are no such failure, and end the service for a
restart. An applied update is checkpointed (retried until the disk takes it, or the service stops), the
previous update's entries are acked (this one's after the next checkpoint, so a damaged newest checkpoint
can be fallen back from and its samples trained again), the version is published, groups the new version
left outside the window are dropped, and the update's records are written (`records.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from tlt_stream.basics.aio import retry, sleep_or_stop
from tlt_stream.basics.config import Config
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.metrics import accept_by_drafter, rollout_timing, staleness_histogram
from tlt_stream.rl.ranks import RanksOutOfStep
from tlt_stream.roles.learner_parts.checkpoints import Checkpoints
from tlt_stream.roles.learner_parts.intake import SampleIntake
from tlt_stream.roles.learner_parts.lease import RunLease
from tlt_stream.roles.learner_parts.records import UpdateRecords

__all__ = ["UpdateFailed", "Updates"]

log = logging.getLogger("tlt_stream.roles.learner")


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
        wait = started - self.idle_since  # since the last update (or start): waiting for complete groups
        staleness = [g.staleness(mine.version) for g in groups]
        samples = [s for g in groups for s in g.samples]
        await self.lease.renew()  # the update blocks the loop: the renewed ttl covers the longest one yet
        # On the loop's thread, as the rollout worker's decode steps: torch's CPU thread pool is markedly
        # slower driven from a secondary thread. Heartbeats and MQTT keepalives tolerate an update's pause.
        try:
            metrics = mine.core.step(groups)
        except RanksOutOfStep:  # a rank died or disagrees: no retry can help; a restart resumes
            raise
        except Exception as exc:  # nothing was applied: LearnerCore.step fails before its optimizer step
            raise UpdateFailed(str(exc)) from exc
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
        # published before the checkpoint exists, so retry (capped backoff, saying why) until it is written
        # or the service is stopped, which then exits non-zero with the samples still pending for a restart.
        # Any error: inside safetensors' writer an I/O failure surfaces as SafetensorError, not OSError.
        mine.checkpoint = await retry(
            lambda: mine.save_or_stop(extra, intake.assembler.ledger, self.stop),
            retry_on=(Exception,),
            what=f"checkpoint of version {mine.version}",
            max_attempts=None,
            base=0.5,
            cap=10.0,
            stop=self.stop,
        )
        metrics["checkpoint_seconds"] = time.perf_counter() - saving  # the optimizer's write is not in it
        metrics.update(mine.optimizer_write_figures())
        # The previous update's entries are acked now, this one's after the next checkpoint: a newest
        # checkpoint found damaged on restart is fallen back from, and its update's samples are then still
        # pending, so they are trained again instead of lost.
        await intake.ack(self.last_entries)
        self.last_entries = [entry for g in groups for entry in g.entry_ids]
        await intake.trim()
        await mine.publish(mine.checkpoint)
        await self._drop_left_behind()
        metrics["update_seconds"] = time.perf_counter() - started
        self.lease.longest_update_s = max(self.lease.longest_update_s, metrics["update_seconds"])
        await self.records.record_update(mine.version, groups, samples, metrics, histogram=histogram, wait=wait)
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

"""What a rollout worker takes on: tasks read while the engine has room, poison dead-lettered, groups started.

The worker reads as many `PromptGroup` tasks as fit in its free rows at once (one per engine hop would fill
the batch over dozens of steps), so groups overlap in one continuously batched engine. A task that would
fail the same way everywhere (a prompt outside the vocabulary or too long, a version never to come) goes
to `dead` on the spot. A task ahead of the loaded policy waits for it, or with partial rollouts starts a
version early as a draft that parks after `ahead_tokens` until its version arrives. Each of a group's G
requests is seeded by its sample id, so a redelivered task generates the same responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from tlt_stream.basics.common import stable_int
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PromptGroup
from tlt_stream.bus.consumer import Delivery, LostTasks, StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.rl.validate import prompt_problem
from tlt_stream.roles.worker.loading import PolicyLoader
from tlt_stream.roles.worker.tasks import GroupTask, InFlight, streams_hidden

__all__ = ["TaskIntake"]

log = logging.getLogger("tlt_stream.roles.rollout_worker")


class _Task(msgspec.Struct):
    """What a `prompts` entry the reader refused (undecodable, too large, delivered too often) may still say:
    which task of which step it was (every other field ignored)."""

    task_id: str
    step: int = 0


_TASK = msgspec.msgpack.Decoder(_Task)


class TaskIntake:
    """The worker's intake: what to read, and which of the tasks read may start under the loaded policy."""

    def __init__(
        self,
        config: Config,
        reader: StreamReader[PromptGroup],
        control: ControlPlane,
        flight: InFlight,
        loader: PolicyLoader,
        worker_id: str,
    ) -> None:
        self.config = config
        self.reader = reader
        self.control = control
        self.flight = flight
        self.loader = loader
        self.worker_id = worker_id
        self.partial = config.policy.partial_rollouts
        self.invalid_tasks = 0
        self.lost = LostTasks(reader.redis, reader.keys)
        """Tasks dead-lettered here, recorded as lost before their ack."""
        reader.on_refused = self._refused
        self._group_hint = 1
        """Group size of the last task read (how many tasks fit in the free rows)."""

    async def _refused(self, payload: bytes) -> None:
        """A task the reader dead-lettered itself (one that, say, killed every worker that took it, delivered
        too often): recorded as lost before its ack, so its step gets another prompt."""
        try:
            task = _TASK.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("%s: a dead-lettered prompts entry names no task: its step may wait for it", self.worker_id)
            return
        self.lost.note(task.task_id, task.step)
        await self.lost.record()

    async def lose(self, delivery: Delivery[PromptGroup], reason: str) -> None:
        """Dead-letter a task that no worker can turn into a group (`reason`), recorded first as lost
        (`Keys.lost`, once per task) for the policy service to send another prompt in its place: its step
        would wait for ever for the group. Recorded before the dead letter and ack, so a worker that dies
        between the two leaves the task pending (another worker takes it), never lost unrecorded."""
        task = delivery.message
        self.invalid_tasks += 1
        self.lost.note(task.task_id, task.step)
        await self.lost.record()
        await self.reader.give_up(delivery, reason)

    def room(self) -> int:
        """How many tasks to read now: as many as fit at once (admitting one per engine hop would fill the
        batch over dozens of steps and stretch every rollout), 0 when the engine is full."""
        cache = getattr(self.loader.engine, "cache", None)  # torch: the rows the KV budget allowed
        rows = cache.max_batch if cache is not None else self.config.rollout.max_batch
        free = rows * 2 - self.flight.rows_left()
        return max(1, min(self.config.bus.read_count, free // self._group_hint)) if free > 0 else 0

    async def read(self, count: int, block_ms: int | None) -> None:
        """Read up to `count` tasks into `waiting`; poison (it would fail the same way on every worker and
        every redelivery) is dead-lettered, and the worker goes on."""
        deliveries = await self.lost.set_aside(self.reader, await self.reader.read(count=count, block_ms=block_ms))
        usable = []
        for delivery in deliveries:
            if problem := await self._problem(delivery.message):
                await self.lose(delivery, f"invalid task: {problem}")
                continue
            usable.append(delivery)
        if usable:
            self._group_hint = max(1, usable[-1].message.group_size)
        self.flight.waiting += usable

    async def _problem(self, task: PromptGroup) -> str | None:
        def problem() -> str | None:
            return prompt_problem(
                task,
                vocab_size=self.loader.vocab_size or 2**31,
                max_len=self.loader.max_len or self.config.rollout.max_len or 2**31,
                newest_version=self.control.version("policy"),
            )

        found = problem()
        if found is not None and task.min_policy_version > self.control.version("policy"):
            # Our view may lag the mirror the dispatcher went by; a mirror we cannot read proves nothing.
            if not await self.control.refresh_from_mirror():
                return None
            found = problem()
        return found

    async def wait_for_work(self) -> None:
        """Idle, and not training a drafter: wait up to `bus.block_ms` for what would end it. Holding tasks
        ahead of our policy, that is a newer policy version; holding none, new tasks (a blocking read, never
        cancelled halfway: a cancelled XREADGROUP could leave delivered entries to the claim timeout)."""
        if not self.flight.waiting:
            # With drafts parked, read even when full: a read is also how tasks of a dead worker are reclaimed,
            # and the version the drafts wait for needs them (the next step is the only one dispatched early, so
            # what else a read brings is bounded); and block briefly, so that version is noticed at once.
            engine = self.loader.engine
            parked = engine is not None and getattr(engine, "num_parked", 0) > 0
            await self.read(max(1, self.room()), min(self.config.bus.block_ms, 100) if parked else None)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.bus.block_ms / 1000):
                await self.control.wait_for("policy", self.loader.version + 1)

    async def admit(self) -> None:
        """Take the new tasks there are (without waiting: waiting is idle time, and the worker says so) while
        the engine has room; tasks ahead of our policy wait for it. Once a newer policy is announced nothing
        new starts, so the tasks in flight drain and the worker can load it."""
        if self.loader.loadable() is not None and self.flight.started and not self.partial:
            return
        if count := self.room():
            await self.read(count, 0)
        if self.loader.loadable() is not None:  # announced while we read: load it before starting anything
            return
        await self._drop_too_long()
        waiting = self.flight.waiting
        self.flight.waiting = [d for d in waiting if not self.startable(d.message)]
        for delivery in waiting:
            if self.startable(delivery.message):
                self._start(delivery)

    async def _drop_too_long(self) -> None:
        """Dead-letter waiting tasks read before the first load whose prompt leaves no room in the loaded
        policy's context (the read-time check knew no length yet)."""
        limit = self.loader.max_len
        if limit is None:
            return
        for delivery in [d for d in self.flight.waiting if len(d.message.prompt_ids) >= limit]:
            self.flight.waiting.remove(delivery)
            await self.lose(
                delivery, f"invalid task: prompt of {len(delivery.message.prompt_ids)} tokens within max_len={limit}"
            )

    def startable(self, task: PromptGroup) -> bool:
        """Whether the task may start under our policy: its version, or the version before as a draft."""
        oldest = task.startable_version if self.partial else task.min_policy_version
        return oldest <= self.loader.version

    def any_startable(self) -> bool:
        return any(self.startable(d.message) for d in self.flight.waiting)

    def _start(self, delivery: Delivery[PromptGroup]) -> None:
        group = delivery.message
        if group.task_id in self.flight.started:  # the same task redelivered while we still work on it
            return
        own, loader = self.config.rollout, self.loader
        budget = (loader.max_len or 0) - len(group.prompt_ids)  # >= 1: `read` dead-letters the rest
        if own.max_response_len is not None:
            budget = min(budget, own.max_response_len)
        draft = group.min_policy_version > loader.version  # started ahead: parks at ahead_tokens until verified
        extra = {"ahead_limit": self.config.policy.ahead_tokens} if draft else {}
        for index in range(group.group_size):
            sample_id = f"{group.task_id}/{index}"
            loader.engine.add_request(
                group.prompt_ids,
                budget,
                own.temperature,
                stable_int(sample_id, 12),
                loader.stop_ids,
                request_id=(group.task_id, index),
                stop=loader.stop_rule,
                return_hidden=own.stream_hidden and streams_hidden(sample_id, own.hidden_share),
                **extra,
            )
        self.flight.started[group.task_id] = GroupTask(delivery, loader.version, time.perf_counter())
        if draft:
            log.info(
                "%s: task %s started as a draft under policy version %d (re-verified under version %d)",
                self.worker_id,
                group.task_id,
                loader.version,
                group.min_policy_version,
            )

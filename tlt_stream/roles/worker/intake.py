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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tlt_stream.basics.common import stable_int
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PromptGroup, Sample
from tlt_stream.bus.consumer import Delivery, StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.rl.validate import prompt_problem
from tlt_stream.roles.worker import log

if TYPE_CHECKING:
    from tlt_stream.roles.rollout_worker import RolloutSettings
    from tlt_stream.rollout.protocol import RolloutEngine
    from tlt_stream.rollout.stops import StopStrings

__all__ = ["GroupTask", "TaskIntake", "streams_hidden"]


def streams_hidden(sample_id: str, settings: RolloutSettings) -> bool:
    """Whether the sample's hidden states are streamed: a stable hash of its id against `hidden_share` (the
    same in every process and on redelivery; salted apart from the drafter trainer's held-out split)."""
    if settings.hidden_share >= 1:
        return True
    digest = stable_int(f"hidden-share/{sample_id}", 8)
    return digest < settings.hidden_share * 2**32


@dataclass
class GroupTask:
    """A prompt group in flight: its G requests in the engine, its samples as they finish."""

    delivery: Delivery[PromptGroup]
    policy_version: int
    started: float
    samples: dict[int, Sample] = field(default_factory=dict)
    finished: dict[int, tuple[Any, str, float]] = field(default_factory=dict)
    """With a reward pool: (result, response text, generation seconds) per row, until the group is scored."""
    failed: str | None = None
    """Why the task cannot be scored (its reward raised): dead-lettered whole once its rows are done, never
    sent with some samples scored 0, which would bias the update."""
    versions: dict[int, int] = field(default_factory=dict)
    """The policy version each finished row was last verified under (what its sample is stamped with)."""


class TaskIntake:
    """The worker's intake: what to read, and which of the tasks read may start under the loaded policy."""

    config: Config
    control: ControlPlane
    reader: StreamReader
    settings: RolloutSettings
    worker_id: str
    engine: RolloutEngine | None
    tasks: dict[str, GroupTask]
    stop_ids: list[int]
    stop_rule: StopStrings | None
    vocab_size: int | None

    def _init_intake(self) -> None:
        self.waiting: list[Delivery[PromptGroup]] = []
        """Tasks read and not started: ahead of the loaded policy, or read while a newer one was announced."""
        self.invalid_tasks = 0
        self._group_hint = 1
        """Group size of the last task read (how many tasks fit in the free rows)."""

    def _room(self) -> int:
        """How many tasks to read now: as many as fit at once (admitting one per engine hop would fill the
        batch over dozens of steps and stretch every rollout; measured: 3x the rollout span at 16 tasks of
        8), 0 when the engine is full."""
        free = self.settings.max_batch * 2 - sum(
            t.delivery.message.group_size - len(t.samples) for t in self.tasks.values()
        )
        return max(1, min(self.config.bus.read_count, free // self._group_hint)) if free > 0 else 0

    async def _read_tasks(self, count: int, block_ms: int | None) -> None:
        deliveries = await self.reader.read(count=count, block_ms=block_ms)
        usable = []
        for delivery in deliveries:
            if problem := await self._task_problem(delivery.message):
                # Poison (it would fail the same way on every worker and every redelivery): dead-lettered,
                # and the worker goes on.
                self.invalid_tasks += 1
                await self.reader.give_up(delivery, f"invalid task: {problem}")
                continue
            usable.append(delivery)
        if usable:
            self._group_hint = max(1, usable[-1].message.group_size)
        self.waiting += usable

    async def _task_problem(self, task: PromptGroup) -> str | None:
        def problem() -> str | None:
            return prompt_problem(
                task,
                vocab_size=self.vocab_size or 2**31,
                max_len=self.settings.max_len,
                newest_version=self.control.version("policy"),
            )

        found = problem()
        if found is not None and task.min_policy_version > self.control.version("policy"):
            # Our view may lag the mirror the dispatcher went by; a mirror we cannot read proves nothing.
            if not await self.control.refresh_from_mirror():
                return None
            found = problem()
        return found

    async def _wait_for_work(self) -> None:
        """Idle, and not training a drafter: wait up to `bus.block_ms` for what would end it. Holding tasks
        ahead of our policy, that is a newer policy version; holding none, new tasks (a blocking read, never
        cancelled halfway: a cancelled XREADGROUP could leave delivered entries to the claim timeout)."""
        if not self.waiting:
            # With drafts parked, read even when full: a read is also how tasks of a dead worker are reclaimed,
            # and the version the drafts wait for needs them (the next step is the only one dispatched early, so
            # what else a read brings is bounded); and block briefly, so that version is noticed at once.
            parked = self.engine is not None and getattr(self.engine, "num_parked", 0) > 0
            await self._read_tasks(max(1, self._room()), min(self.config.bus.block_ms, 100) if parked else None)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.bus.block_ms / 1000):
                await self.control.wait_for("policy", self.control.version("policy") + 1)

    async def _admit(self) -> None:
        """Take the new tasks there are (without waiting: waiting is idle time, and the worker says so) while
        the engine has room; tasks ahead of our policy wait for it. Once a newer policy is announced nothing
        new starts, so the tasks in flight drain and the worker can load it."""
        if self._loadable_policy() is not None and self.tasks and not self.settings.partial_rollouts:
            return
        if count := self._room():
            await self._read_tasks(count, 0)
        if self._loadable_policy() is not None:  # announced while we read: load it before starting anything
            return
        ready = [d for d in self.waiting if self._startable(d.message)]
        self.waiting = [d for d in self.waiting if not self._startable(d.message)]
        for delivery in ready:
            self._start(delivery)

    def _startable(self, task: PromptGroup) -> bool:
        """Whether the task may start under our policy: its version, or the version before as a draft."""
        oldest = task.startable_version if self.settings.partial_rollouts else task.min_policy_version
        return oldest <= self.version

    def _start(self, delivery: Delivery[PromptGroup]) -> None:
        group = delivery.message
        if group.task_id in self.tasks:  # the same task redelivered while we still work on it
            return
        budget = self.settings.max_len - len(group.prompt_ids)  # >= 1: `_read_tasks` dead-letters the rest
        if self.settings.max_response_len is not None:
            budget = min(budget, self.settings.max_response_len)
        draft = group.min_policy_version > self.version  # started ahead: parks at ahead_tokens until verified
        extra = {"ahead_limit": self.settings.ahead_tokens} if draft else {}
        eos = self.stop_ids
        for index in range(group.group_size):
            seed = stable_int(f"{group.task_id}/{index}", 12)
            self.engine.add_request(
                group.prompt_ids,
                budget,
                self.settings.temperature,
                seed,
                eos,
                request_id=(group.task_id, index),
                stop=self.stop_rule,
                return_hidden=self.settings.stream_hidden and streams_hidden(f"{group.task_id}/{index}", self.settings),
                **extra,
            )
        self.tasks[group.task_id] = GroupTask(delivery, self.version, time.perf_counter())
        if draft:
            log.info(
                "%s: task %s started as a draft under policy version %d (re-verified under version %d)",
                self.worker_id,
                group.task_id,
                self.version,
                group.min_policy_version,
            )

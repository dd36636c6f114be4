"""What a rollout worker produces: one hop of engine steps, each response scored, whole groups sent.

A hop runs up to `steps_per_hop` engine steps on the event loop's own thread and hands control back. Each
finished response is decoded and scored with the task's reward (inline, or with a reward pool for the
whole group at once in worker processes, with a timeout), and its hidden-state window, if kept, goes to
the lossy `hidden` buffer. Once all G responses of a task are scored its G samples go to `samples` in one
pipeline and only then is the task acked: a worker that dies mid-group leaves the task pending for another
to reclaim, and the deterministic sample ids (`{task_id}/{index}`) let the learner drop anything sent
twice. A group whose reward raised or hung goes to `dead` whole, never sent with some samples scored 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import HiddenWindow, Sample
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.rl.reward_pool import RewardFailed, RewardPool
from tlt_stream.rl.rewards import call_reward
from tlt_stream.rl.samples import hidden_window, make_sample
from tlt_stream.roles.worker.drafters import DrafterSwaps
from tlt_stream.roles.worker.intake import TaskIntake
from tlt_stream.roles.worker.loading import PolicyLoader
from tlt_stream.roles.worker.reports import RolloutReports
from tlt_stream.roles.worker.tasks import GroupTask, InFlight

__all__ = ["Generation"]

log = logging.getLogger("tlt_stream.roles.rollout_worker")


class Generation:
    """The worker's output side: engine hops, rewards, and each whole group sent, then acked."""

    def __init__(
        self,
        config: Config,
        reader: StreamReader[Any],
        producer: StreamProducer,
        parts: tuple[InFlight, PolicyLoader, DrafterSwaps, TaskIntake, RolloutReports],
        *,
        worker_id: str,
        reward: Callable[[str, str], float],
        reward_pool: RewardPool | None,
        registry: WorkerRegistry | None = None,
    ) -> None:
        self.config = config
        self.reader = reader
        self.producer = producer
        self.flight, self.loader, self.drafters, self.intake, self.reports = parts
        self.worker_id = worker_id
        self.reward = reward
        self.reward_pool = reward_pool
        """Scores whole groups in worker processes (slow rewards, with a timeout); None: `reward` inline."""
        self.scoring: dict[str, asyncio.Task[list[float]]] = {}
        """Groups whose responses are all generated, being scored by the pool (task id -> their rewards)."""
        self.reward_failures = 0
        self.samples_sent = 0
        self.tasks_done = 0
        self.registry = registry
        """Where the rows in flight are reported (`report_rows`); None: not reported."""
        self._rows_reported: int | None = None

    async def hop(self) -> None:
        """Up to `steps_per_hop` engine steps, then what finished scored and, for whole groups, sent."""
        started = time.perf_counter()
        # Decode steps run on the event loop's own thread, one hop of at most `steps_per_hop` steps at a
        # time, then the loop gets control back: torch's OpenMP pool runs markedly slower driven from a
        # secondary thread on the CPU, and a hop (tens of ms) is far below any heartbeat or keepalive period.
        finished, tokens, forwards = self._steps()
        seconds = time.perf_counter() - started
        await asyncio.sleep(0)  # the loop's other tasks run now: their time is the loop's, not the engine's
        ran = time.perf_counter() - started
        version = self.loader.version
        complete = []
        windows: list[HiddenWindow] = []
        for result in finished:
            task_id, index = result.request_id
            task = self.flight.started[task_id]
            group = task.group
            text = self.loader.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            since_start = time.perf_counter() - task.started
            task.versions[index] = version  # every row out of step() was last verified under ours
            if result.hidden is not None and result.token_ids:
                sample_id = f"{task_id}/{index}"  # `make_sample`'s id
                windows.append(hidden_window(result, sample_id, version, dtype=self.config.rollout.hidden_dtype))
            if self.reward_pool is not None:  # scored with its group, in the pool, once the group is whole
                task.finished[index] = (result, text, since_start)
                if len(task.finished) == group.group_size:
                    texts = [task.finished[i][1] for i in range(group.group_size)]
                    score = self.reward_pool.score(texts, group.answer, group.fields)
                    self.scoring[task_id] = asyncio.create_task(score, name=f"score-{task_id}")
                continue
            try:
                reward = call_reward(self.reward, text, group.answer, group.fields)
            except Exception as exc:  # a task whose answer breaks the reward must not stop the worker
                if task.failed is None:
                    log.exception("%s: the reward raised on task %s; it goes to dead", self.worker_id, task_id)
                task.failed = task.failed or f"the reward raised: {type(exc).__name__}: {exc}"
                reward = 0.0
            task.samples[index] = self._sample(task, index, result, reward, since_start)
            if len(task.samples) == group.group_size:
                complete.append(task)
        if windows:  # a lossy, bounded buffer: never waits on the drafter trainer
            await self.producer.send("hidden", windows)
        self.reports.count_hop(tokens, forwards, seconds)
        if finished:  # before the groups they complete: a learner reading on their arrival sees the rows left
            await self.report_rows()
        for task in complete:
            await self._send_task(task)
        if complete:  # one stats entry per batch of completed tasks, covering the steps since the last
            await self.reports.send()
        self.reports.count_loop({"tasks": ran - seconds, "output": time.perf_counter() - started - ran})

    async def report_rows(self) -> None:
        """The rows in flight to the worker's registry record, now, when they changed: the learner holds
        complete groups back while the rollout is busy (learner.accumulate_below_rows). Drafts of the next
        step (partial rollouts) are not counted: they would keep the rows up through every tail."""
        rows = self.flight.rows_in_flight(self.loader.version if self.loader is not None else None)
        if self.registry is None or rows == self._rows_reported:
            return
        self._rows_reported = rows
        await self.registry.publish(rows_in_flight=rows)

    async def wait_for_scores(self) -> None:
        """Nothing to decode but groups being scored: until one is (or half a second)."""
        await asyncio.wait(list(self.scoring.values()), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)

    async def _send_task(self, task: GroupTask) -> None:
        """A whole group's samples to `samples`, then the task's ack; a group that cannot be scored goes to
        `dead` whole instead."""
        group = task.group
        if task.failed is not None:
            await self.intake.lose(task.delivery, f"invalid task: {task.failed}")
            del self.flight.started[group.task_id]
            return
        samples = [task.samples[i] for i in range(group.group_size)]
        await self.producer.send("samples", samples)
        await self.reader.ack([task.delivery.entry_id])
        del self.flight.started[group.task_id]
        self.samples_sent += len(samples)
        self.tasks_done += 1

    async def send_scored(self) -> None:
        """The groups the reward pool has scored: their samples out (or, for a reward that raised or hung, the
        whole group to `dead`, counted, its error logged once with the traceback)."""
        for task_id in [t for t, future in self.scoring.items() if future.done()]:
            future = self.scoring.pop(task_id)
            task = self.flight.started[task_id]
            try:
                rewards = future.result()
            except RewardFailed as exc:
                self.reward_failures += 1
                log.error("%s: task %s goes to dead whole: %s\n%s", self.worker_id, task_id, exc.reason, exc.detail)
                task.failed = exc.reason
                await self._send_task(task)
                continue
            for index in range(task.group.group_size):
                result, _, seconds = task.finished[index]
                task.samples[index] = self._sample(task, index, result, rewards[index], seconds)
            await self._send_task(task)

    def _sample(self, task: GroupTask, index: int, result: Any, reward: float, seconds: float) -> Sample:
        return make_sample(
            result,
            task.group,
            index,
            reward=reward,
            policy_version=task.versions.get(index, task.policy_version),
            drafter_version=self.drafters.version,
            worker_id=self.worker_id,
            gen_seconds=seconds,
        )

    def _steps(self) -> tuple[list[Any], int, int]:
        """Up to `steps_per_hop` engine steps (fewer once something finishes): finished, tokens, forwards."""
        finished: list[Any] = []
        engine, adaptive = self.loader.engine, self.loader.adaptive
        tokens, forwards = engine.tokens_generated, engine.rounds + engine.plain_steps
        for _ in range(self.config.rollout.steps_per_hop):
            if not engine.has_work:
                break
            finished += adaptive.step() if adaptive is not None else engine.step()
            if finished:
                break
        return finished, engine.tokens_generated - tokens, engine.rounds + engine.plain_steps - forwards

    async def close(self) -> None:
        """The worker's process ends: groups still being scored are dropped unacked (another worker, or this
        one restarted, generates them again)."""
        for task in self.scoring.values():
            task.cancel()
        await asyncio.gather(*self.scoring.values(), return_exceptions=True)
        self.scoring.clear()

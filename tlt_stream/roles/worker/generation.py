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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tlt_stream.basics.messages import HiddenWindow, Sample
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.rl.reward_pool import RewardFailed, RewardPool
from tlt_stream.rl.rewards import call_reward
from tlt_stream.rl.samples import hidden_window, make_sample
from tlt_stream.roles.worker import log
from tlt_stream.roles.worker.intake import GroupTask

if TYPE_CHECKING:
    from tlt_stream.roles.rollout_worker import RolloutSettings
    from tlt_stream.rollout.adaptive import AdaptiveSd
    from tlt_stream.rollout.protocol import RolloutEngine

__all__ = ["Generation"]


class Generation:
    """The worker's output side: engine hops, rewards, and each whole group sent, then acked."""

    reader: StreamReader
    producer: StreamProducer
    settings: RolloutSettings
    worker_id: str
    engine: RolloutEngine | None
    adaptive: AdaptiveSd | None
    tasks: dict[str, GroupTask]
    tokenizer: Any
    reward: Callable[[str, str], float]
    reward_pool: RewardPool | None
    invalid_tasks: int

    def _init_generation(self) -> None:
        self.scoring: dict[str, asyncio.Future[list[float]]] = {}
        """Groups whose responses are all generated, being scored by the pool (task id -> their rewards)."""
        self.reward_failures = 0
        self.samples_sent = 0
        self.tasks_done = 0

    async def _generate(self) -> None:
        started = time.perf_counter()
        # Decode steps run on the event loop's own thread, one hop of at most `steps_per_hop` steps at a
        # time, then the loop gets control back. Torch's OpenMP pool runs ~1.6-2x slower when driven from a
        # secondary thread on CPU (measured: the same rollout 5.3 s from a worker thread, 3.3 s from the
        # main one), and a hop (tens of ms) is far below any heartbeat or keepalive period.
        finished, tokens, forwards = self._steps()
        await asyncio.sleep(0)
        seconds = time.perf_counter() - started
        complete = []
        windows: list[HiddenWindow] = []
        for result in finished:
            task_id, index = result.request_id
            task = self.tasks[task_id]
            group = task.delivery.message
            text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            since_start = time.perf_counter() - task.started
            task.versions[index] = self.version  # every row out of step() was last verified under ours
            if result.hidden is not None and result.token_ids:
                sample_id = f"{task_id}/{index}"  # `make_sample`'s id
                windows.append(hidden_window(result, sample_id, self.version, dtype=self.settings.hidden_dtype))
            if self.reward_pool is not None:  # scored with its group, in the pool, once the group is whole
                task.finished[index] = (result, text, since_start)
                if len(task.finished) == group.group_size:
                    texts = [task.finished[i][1] for i in range(group.group_size)]
                    score = self.reward_pool.score(texts, group.answer, group.fields)
                    self.scoring[task_id] = asyncio.ensure_future(score)
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
        self._count_hop(tokens, forwards, seconds)
        for task in complete:
            await self._send_task(task)
        if complete:  # one stats entry per batch of completed tasks, covering the steps since the last
            await self._send_reports()

    async def _send_task(self, task: GroupTask) -> None:
        """A whole group's samples to `samples`, then the task's ack; a group that cannot be scored goes to
        `dead` whole instead."""
        if task.failed is not None:
            self.invalid_tasks += 1
            await self.reader.give_up(task.delivery, f"invalid task: {task.failed}")
            del self.tasks[task.delivery.message.task_id]
            return
        samples = [task.samples[i] for i in range(task.delivery.message.group_size)]
        await self.producer.send("samples", samples)
        await self.reader.ack([task.delivery.entry_id])
        del self.tasks[task.delivery.message.task_id]
        self.samples_sent += len(samples)
        self.tasks_done += 1

    async def _send_scored(self) -> None:
        """The groups the reward pool has scored: their samples out (or, for a reward that raised or hung, the
        whole group to `dead`, counted, its error logged once with the traceback)."""
        for task_id in [t for t, future in self.scoring.items() if future.done()]:
            future = self.scoring.pop(task_id)
            task = self.tasks[task_id]
            group = task.delivery.message
            try:
                rewards = future.result()
            except RewardFailed as exc:
                self.reward_failures += 1
                log.error("%s: task %s goes to dead whole: %s\n%s", self.worker_id, task_id, exc.reason, exc.detail)
                task.failed = exc.reason
                await self._send_task(task)
                continue
            for index in range(group.group_size):
                result, _, seconds = task.finished[index]
                task.samples[index] = self._sample(task, index, result, rewards[index], seconds)
            await self._send_task(task)

    def _sample(self, task: GroupTask, index: int, result: Any, reward: float, seconds: float) -> Sample:
        return make_sample(
            result,
            task.delivery.message,
            index,
            reward=reward,
            policy_version=task.versions.get(index, task.policy_version),
            drafter_version=self.drafter_version,
            worker_id=self.worker_id,
            gen_seconds=seconds,
        )

    def _running(self) -> int:
        """Rows the engine is decoding now (vLLM: requests it holds, running or waiting)."""
        return int(self.engine.num_running)

    def _steps(self) -> tuple[list[Any], int, int]:
        """Up to `steps_per_hop` engine steps (fewer once something finishes): finished, tokens, forwards."""
        finished: list[Any] = []
        engine = self.engine
        tokens, forwards = engine.tokens_generated, engine.rounds + engine.plain_steps
        for _ in range(self.settings.steps_per_hop):
            if not engine.has_work:
                break
            finished += self.adaptive.step() if self.adaptive is not None else engine.step()
            if finished:
                break
        return finished, engine.tokens_generated - tokens, engine.rounds + engine.plain_steps - forwards

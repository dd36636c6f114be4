"""A rollout worker: prompt groups in, scored samples out, on the newest verified policy.

The worker reads `PromptGroup` tasks through the `rollout` consumer group and runs their G requests
through one continuously batched engine, so groups overlap and a slot freed by a short response is
refilled at once. Each finished response is scored with the task's reward and, when all G responses of a
task are done, the G samples go to `samples` in one pipeline and only then is the task acked: a worker
that dies mid-group leaves the task pending, another worker reclaims it, and the deterministic sample ids
(`{task_id}/{index}`) let the learner discard anything sent twice.

Policy versions: the worker loads the retained `PolicyVersion` after checking its sha256 (a mismatch is
refused, logged and reported as a `WorkerState` reason; the old weights stay in use). A newer version is
loaded between engine steps once the requests in flight have finished (every sample comes from exactly
one policy version, the one it reports). A task whose `min_policy_version` is ahead of the loaded
policy waits until that version arrives.

The worker owns a few components (`roles/worker/`), each handed the configuration and the other parts it
needs: the policy loader (the engine and the version in it), the drafter swaps, the intake of tasks, the
generation of samples, the reports, and the follower of other workers' samples; this file holds the loop
that drives them and the process's wiring.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

import redis.asyncio as aioredis

from tlt_stream.basics.aio import one_error
from tlt_stream.basics.config import Config
from tlt_stream.basics.config.rules import trains_drafter
from tlt_stream.basics.messages import WorkerStatus
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.reward_pool import RewardPool, pool_size
from tlt_stream.roles.drafter_trainer import IdleDrafterTrainer
from tlt_stream.roles.worker.drafters import DrafterSwaps
from tlt_stream.roles.worker.follow import SampleFollower
from tlt_stream.roles.worker.generation import Generation
from tlt_stream.roles.worker.intake import TaskIntake
from tlt_stream.roles.worker.loading import PolicyLoader
from tlt_stream.roles.worker.reports import LoopClock, RolloutReports
from tlt_stream.roles.worker.tasks import InFlight
from tlt_stream.store.durable import describe_write_error, disk_full

__all__ = ["RolloutWorker", "serve_rollout_worker"]

log = logging.getLogger(__name__)


class RolloutWorker:
    """One rollout worker process (run as many as there are devices)."""

    def __init__(
        self,
        config: Config,
        redis: aioredis.Redis,
        control: ControlPlane,
        *,
        worker_id: str,
        reward: Callable[[str, str], float],
        device: str = "cpu",
        reward_pool: RewardPool | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.worker_id = worker_id
        keys = Keys(config.run)
        self.reader = StreamReader(redis, keys, config.bus, "prompts", worker_id)
        self.producer = StreamProducer(redis, keys, config.bus)
        self.registry = WorkerRegistry(redis, keys, config.bus, self.producer, worker_id, role="rollout")
        training = trains_drafter(config)
        self.flight = InFlight()
        self.loader = PolicyLoader(
            config, control, self.registry, device=device, hidden=config.rollout.stream_hidden or training
        )
        self.drafters = DrafterSwaps(config, control, self.registry, worker_id)
        self.intake = TaskIntake(config, self.reader, control, self.flight, self.loader, worker_id)
        self.reports = RolloutReports(self.producer, worker_id, self.flight, self.loader, self.drafters)
        parts = (self.flight, self.loader, self.drafters, self.intake, self.reports)
        self.generation = Generation(
            config,
            self.reader,
            self.producer,
            parts,
            worker_id=worker_id,
            reward=reward,
            reward_pool=reward_pool,
            registry=self.registry,
        )
        self.follower = SampleFollower(redis, keys, worker_id, self.loader)
        self.idle_trainer: IdleDrafterTrainer | None = None
        if training:
            self.idle_trainer = IdleDrafterTrainer(
                config,
                redis,
                control,
                self.registry,
                self.producer,
                self.reader,
                worker_id=worker_id,
                initial_drafter=str(config.sd.drafter),
            )

    @property
    def version(self) -> int:
        """The policy version loaded (-1: none yet)."""
        return self.loader.version

    async def run(self, stop: asyncio.Event, *, max_tasks: int | None = None) -> None:
        """Generate until `stop` is set (or `max_tasks` tasks were completed by this call)."""
        ended = asyncio.Event()
        """Set when the loop ends, for whatever reason: the heartbeat and the follower end with it."""
        with one_error():
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.registry.heartbeat(ended), name=f"{self.worker_id}-heartbeat")
                if self.config.sd.group:
                    tasks.create_task(self.follower.run(ended), name=f"{self.worker_id}-follow-samples")
                try:
                    await self._loop(stop, max_tasks)
                finally:  # groups being scored stay unacked: sent when run again, else redone by another worker
                    await self.registry.set_state(WorkerStatus.STOPPED)
                    ended.set()

    async def _loop(self, stop: asyncio.Event, max_tasks: int | None) -> None:
        await self.registry.set_state(WorkerStatus.LOADING, "waiting for a policy version")
        while self.loader.policy is None and not stop.is_set():
            await self.load_announced()
            if self.loader.policy is None:
                await self._wait_for_policy(stop)
        done_before = self.generation.tasks_done
        partial = self.config.policy.partial_rollouts
        while not stop.is_set() and (max_tasks is None or self.generation.tasks_done - done_before < max_tasks):
            clock = LoopClock()  # where a pass that runs a hop spends its time beside it (the stats' `loop_s`)
            await self.reader.maybe_refresh()  # what we hold stays ours however long it generates
            clock.lap("refresh")
            if not self.flight.started or partial:  # partial: rows in flight are re-verified
                version = self.loader.version
                await self.load_announced()
                clock.lap("policy" if self.loader.version == version else None)  # a load: LOADING time
            engine = self.loader.engine
            await self.drafters.maybe_swap(engine, self.loader.adaptive)
            self.drafters.adopt_sd_config(engine, self.loader.adaptive)
            clock.lap("drafter")
            await self.intake.admit()
            clock.lap("admit")
            await self.generation.report_rows()
            clock.lap("rows")
            await self.generation.send_scored()
            clock.lap("scored")
            if engine.has_work:
                if self.registry.state != WorkerStatus.GENERATING:
                    await self.registry.set_state(WorkerStatus.GENERATING)
                    clock.lap("state")
                # the hop's steps count as the report's `seconds`, the rest as "tasks" and "output"
                await self.generation.hop()
                clock.lap(None)
                self.drafters.judge(engine)
                clock.lap("judge")
                self.reports.count_loop(clock.parts)
            elif self.generation.scoring:  # nothing to decode but groups being scored: their samples go first
                await self.generation.wait_for_scores()
            elif not self.intake.any_startable():
                await self._idle(stop)

    async def _idle(self, stop: asyncio.Event) -> None:
        """No work we can start: our tasks are done while others run the tail, or the tasks we hold wait for
        the next policy version. Idle time: train the drafter if we may."""
        if self.registry.state not in (WorkerStatus.IDLE, WorkerStatus.TRAINING_DRAFTER):
            await self.registry.set_state(WorkerStatus.IDLE)
        if self.loader.loadable() is not None:
            return  # a new version to load first (at the top of the loop)
        if self.loader.awaiting_retry():
            await self.loader.wait_to_retry(stop)
        elif self.idle_trainer is not None:
            await self._train_while_idle(stop)
        else:
            await self.intake.wait_for_work()

    async def _wait_for_policy(self, stop: asyncio.Event) -> None:
        """No version loaded yet: until a newer one is announced (or an unreadable one's retry is due), or
        `stop`."""
        if self.loader.awaiting_retry():
            await self.loader.wait_to_retry(stop)
        else:
            newest = max(self.control.version("policy"), self.loader.version)
            await self.loader.wait_for_newer(newest, stop)

    async def load_announced(self) -> None:
        """Load the announced policy if it is newer than ours: the hops so far are reported under the version
        they ran under first, and the swap is judged by the acceptance after it."""
        announced = self.loader.loadable()
        if announced is None:
            return
        if self.loader.engine is not None and self.reports.seconds > 0:
            # A report spanning the load would file the seconds drafts ran ahead under the new version.
            await self.reports.send()
        latency = await self.loader.load(announced, self.drafters.location, self.drafters.version)
        if latency is None:
            return
        self.reports.loaded(announced.version, latency)
        self.drafters.swapped("policy", announced.version, self.loader.engine)

    async def _train_while_idle(self, stop: asyncio.Event) -> None:
        trainer = self.idle_trainer
        assert trainer is not None
        try:
            await trainer.run_idle(self.loader.engine, self.loader.version, self.flight.waiting, stop)
        except Exception as exc:  # training is an extra: a failure there must never stop generation
            if disk_full(exc):  # a full data volume: one line, not a traceback per slice
                log.warning("%s: drafter training could not save (%s); generating on", self.worker_id,
                            describe_write_error(exc))  # fmt: skip
            else:
                log.exception("%s: drafter training failed; generating on", self.worker_id)
            await asyncio.sleep(1.0)
        self.registry.update_info(
            idle_s=round(trainer.idle_seconds, 1),
            drafter_training_s=round(trainer.training_seconds, 1),
            drafter_slices=trainer.slices,
        )
        if self.registry.state == WorkerStatus.TRAINING_DRAFTER:
            await self.registry.set_state(WorkerStatus.IDLE)


def serve_rollout_worker(config: Config) -> int:
    """`tlt-stream rollout-worker` / `services/rollout_worker.py`: generate until SIGTERM/SIGINT."""
    import os
    import socket

    import torch

    from tlt_stream.rl.rewards import RewardError, resolve_reward
    from tlt_stream.roles.serve import device_or_refuse, refuse, serve

    own = config.rollout
    command = "tlt-stream rollout-worker"
    try:
        reward = resolve_reward(own.reward)
    except RewardError as exc:
        return refuse(command, str(exc))
    if own.backend == "vllm":
        from tlt_stream.rollout.vllm.backend import BackendUnavailable, require_vllm

        try:
            require_vllm()
        except BackendUnavailable as exc:
            return refuse(command, str(exc))
    device = device_or_refuse(own.device, "rollout-worker")
    if device is None:
        return 2
    torch.set_num_threads(own.threads)
    worker_id = own.worker_id or f"rollout-{socket.gethostname()}-{os.getpid()}"
    workers = pool_size(own.reward, own.reward_workers)

    async def body(config: Config, redis: aioredis.Redis, control: ControlPlane, stop: asyncio.Event) -> None:
        pool = RewardPool(own.reward, workers=workers, timeout_s=own.reward_timeout_s) if workers else None
        worker = RolloutWorker(
            config, redis, control, worker_id=worker_id, reward=reward, device=device, reward_pool=pool
        )
        print(f"{worker_id}: waiting for a policy version", file=sys.stderr)
        try:
            await worker.run(stop, max_tasks=own.max_tasks)
        finally:
            await worker.generation.close()
            if pool is not None:
                pool.close()
        done, sent = worker.generation.tasks_done, worker.generation.samples_sent
        print(f"{worker_id}: stopped after {done} tasks ({sent} samples)", file=sys.stderr)

    try:
        return serve(config, "rollout", ["drafter"] if trains_drafter(config) else [], body)
    except Exception as exc:
        died = _engine_died(exc)
        if died is None:
            raise
        # One line and a non-zero exit for the supervisor: the groups this worker held stay pending in Redis
        # and another worker takes them over once its heartbeat has expired (bus/consumer.py).
        print(f"{command} {worker_id}: {died}; its unfinished groups go to another worker", file=sys.stderr)
        return ENGINE_DIED


ENGINE_DIED = 4
"""The exit code of a worker whose rollout engine died (vLLM's engine process, `EngineDied`)."""


def _engine_died(exc: BaseException) -> BaseException | None:
    """The `EngineDied` inside `exc` (itself, or one inside an exception group), or None."""
    from tlt_stream.rollout.vllm.lifecycle import EngineDied

    if isinstance(exc, EngineDied):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _engine_died(inner)) is not None:
                return found
    return None

"""A rollout worker: prompt groups in, scored samples out, on the newest verified policy.

The worker reads `PromptGroup` tasks through the `rollout` consumer group and runs their G requests
through one continuously batched `GenerationEngine`, so groups overlap and a slot freed by a short
response is refilled at once. Each finished response is scored with the task's reward and, when all G
responses of a task are done, the G samples go to `samples` in one pipeline and only then is the task
acked: a worker that dies mid-group leaves the task pending, another worker reclaims it, and the
deterministic sample ids (`{task_id}/{index}`) let the learner discard anything sent twice.

Policy versions: the worker loads the retained `PolicyVersion` after checking its sha256 (a mismatch is
refused, logged and reported as a `WorkerState` reason; the old weights stay in use). A newer version is
loaded between engine steps once the requests in flight have finished (every sample comes from exactly
one policy version, the one it reports). A task whose `min_policy_version` is ahead of the loaded
policy waits until that version arrives.

This file holds the worker's settings, its loop and its wiring; the loop's parts (intake, generation,
policy loading, drafter swaps, reports, following `samples`) live in `roles/worker/`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from tlt_stream.basics.config import DEFAULTS, Config
from tlt_stream.basics.messages import WorkerStatus
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.reward_pool import RewardPool, pool_size
from tlt_stream.roles.drafter_trainer import DrafterTrainingSettings, IdleDrafterTrainer
from tlt_stream.roles.worker.drafters import DrafterSwaps
from tlt_stream.roles.worker.follow import SampleFollowing
from tlt_stream.roles.worker.generation import Generation
from tlt_stream.roles.worker.intake import GroupTask, TaskIntake, streams_hidden
from tlt_stream.roles.worker.loading import PolicyLoading
from tlt_stream.roles.worker.reports import RolloutReports
from tlt_stream.rollout.adaptive import AdaptiveSd, AdaptiveSettings
from tlt_stream.rollout.tuner import Arm

if TYPE_CHECKING:
    from tlt_stream.rollout.protocol import RolloutEngine

__all__ = ["RolloutSettings", "RolloutWorker", "serve_rollout_worker", "streams_hidden"]


DEFAULT_ARM = Arm.from_label(DEFAULTS.sd.arm)


@dataclass(frozen=True)
class RolloutSettings:
    max_batch: int = DEFAULTS.rollout.max_batch
    """Rows the engine decodes together (requests of several groups share them)."""
    max_len: int = DEFAULTS.rollout.max_len
    """Prompt + response tokens per row; responses stop at EOS or when they reach it."""
    max_response_len: int | None = DEFAULTS.rollout.max_response_len
    """Response tokens per row at most (None: up to `max_len`)."""
    stop: tuple[str, ...] = DEFAULTS.rollout.stop
    """Stop strings (`rollout.stops.StopStrings`), beside the checkpoint's EOS ids."""
    temperature: float = DEFAULTS.rollout.temperature
    """Sampling temperature (RL rollouts sample at 1.0)."""
    steps_per_hop: int = DEFAULTS.rollout.steps_per_hop
    """Engine steps run per trip to the worker thread (fewer trips, a little more latency)."""
    drafter: str | None = DEFAULTS.sd.drafter
    """Speculative decoding: a drafter checkpoint directory, "ngram" for prompt lookup, or None (off)."""
    sd_arm: Arm = DEFAULT_ARM
    """The arm when speculative decoding is on and not adaptive (an n-gram drafter makes it a chain)."""
    stream_hidden: bool = DEFAULTS.rollout.stream_hidden
    """Stream each sample's hidden-state window to `hidden` (the drafter's training data)."""
    hidden_share: float = DEFAULTS.rollout.hidden_share
    """Share of samples whose hidden states are kept and streamed, chosen by a stable hash of the sample id
    (a uniform sample: the length distribution, long tail included, is kept). Below 1 it cuts what producing
    the windows costs generation, for a drafter trainer that could not use them all anyway."""
    hidden_dtype: str = DEFAULTS.rollout.hidden_dtype
    """Wire dtype of the streamed hidden states."""
    drafter_training: DrafterTrainingSettings | None = None
    """Train the drafter online in idle time (needs an EAGLE `drafter` to start from)."""
    adaptive: AdaptiveSettings | None = None
    """Decide SD per step (on/off by running batch, arm by bucket) instead of the fixed `sd_arm`."""
    group: bool = DEFAULTS.sd.group
    """Draft also from the prompt's own responses and history (`rollout.proposers.GroupProposer`)."""
    group_strong_match: int = DEFAULTS.sd.group_strong_match
    """Match length from which an either arm takes the group's chain instead of EAGLE's."""
    collapse_min_drafted: int = DEFAULTS.sd.collapse_min_drafted
    """Draft nodes after a swap before its acceptance is judged against the previous version's."""
    device: str = "cpu"
    """Where the policy (and the drafter bound to it) runs: "cpu", "cuda" or "cuda:N" (resolved already)."""
    dtype: str = DEFAULTS.rollout.dtype
    """The engine's weights and KV cache (auto: bfloat16 on CUDA, float32 on the CPU)."""
    graphs: str = DEFAULTS.rollout.graphs
    """Replay captured forwards: off, auto, cuda or trace (`model.graphs`)."""
    backend: str = DEFAULTS.rollout.backend
    """"torch" (this project's engine) or "vllm" (`rollout/vllm/backend.py`, optional extra, GPU; one engine
    for the worker's life: policy versions and drafters are loaded into it in place)."""
    partial_rollouts: bool = DEFAULTS.policy.partial_rollouts
    """Start draft groups a version early and re-verify every row in flight at each new version (losslessly:
    `rollout/reverify.py`) instead of draining before loading it."""
    ahead_tokens: int = DEFAULTS.policy.ahead_tokens
    """Tokens a draft row may generate before its version arrives."""
    ahead_rows: int = DEFAULTS.policy.ahead_rows
    """Drafts start only while fewer rows than this run (0: any free slot)."""

    def __post_init__(self) -> None:
        if self.drafter == "ngram" and self.sd_arm.kind == "drafter":  # prompt lookup drafts a chain
            object.__setattr__(self, "sd_arm", Arm.ngram(self.sd_arm.depth))
        if self.drafter == "ngram" and self.group and self.sd_arm.kind == "ngram":  # the group source includes it
            object.__setattr__(self, "sd_arm", Arm.group_source(self.sd_arm.depth, self.sd_arm.depth))
        if self.drafter is not None and self.sd_arm.kind == "plain":
            raise ValueError("sd.arm is plain but sd.drafter is set: name a drafting arm, or leave sd.drafter unset")
        if not 0 < self.hidden_share <= 1:
            raise ValueError(f"hidden_share must be in (0, 1], got {self.hidden_share}")
        if self.drafter_training is not None and self.drafter in (None, "ngram"):
            raise ValueError("online drafter training needs a drafter checkpoint to start from (--drafter DIR)")
        if self.backend not in ("torch", "vllm"):
            raise ValueError(f"unknown rollout backend {self.backend!r} (torch, vllm)")
        if self.backend == "vllm" and self.partial_rollouts:
            raise ValueError(
                "partial rollouts re-verify rows under each new policy version, which the vLLM backend cannot "
                "(docs/vllm.md): use the torch backend or turn policy.partial_rollouts off"
            )
        if self.ahead_tokens < 1:
            raise ValueError(f"ahead_tokens must be >= 1, got {self.ahead_tokens}")
        if self.ahead_rows < 0:
            raise ValueError(f"ahead_rows must be >= 0, got {self.ahead_rows}")
        if self.group_strong_match < 1:
            raise ValueError(f"group_strong_match must be >= 1, got {self.group_strong_match}")
        if self.backend == "vllm" and self.adaptive is not None:
            raise ValueError(
                "adaptive SD decides per decode step, which vLLM cannot (it fixes speculation when the engine is "
                "built): on the vllm backend use a fixed --sd-arm (docs/vllm.md)"
            )

    @classmethod
    def from_config(cls, config: Config, *, device: str) -> RolloutSettings:
        """The worker's settings from the configuration tree (sections rollout, sd and drafter) on a resolved
        `device`."""
        own, sd = config.rollout, config.sd
        arm = Arm.from_label(sd.arm)
        return cls(
            max_batch=own.max_batch,
            max_len=own.max_len,
            max_response_len=own.max_response_len,
            stop=own.stop,
            temperature=own.temperature,
            steps_per_hop=own.steps_per_hop,
            drafter=sd.drafter,
            sd_arm=arm,
            stream_hidden=own.stream_hidden,
            hidden_share=own.hidden_share,
            hidden_dtype=own.hidden_dtype,
            drafter_training=DrafterTrainingSettings.from_config(config),
            adaptive=AdaptiveSettings.from_config(config) if sd.adaptive and sd.drafter is not None else None,
            group=sd.group,
            group_strong_match=sd.group_strong_match,
            collapse_min_drafted=sd.collapse_min_drafted,
            device=device,
            dtype=own.dtype,
            graphs=own.graphs,
            backend=own.backend,
            partial_rollouts=config.policy.partial_rollouts,
            ahead_tokens=config.policy.ahead_tokens,
            ahead_rows=config.policy.ahead_rows,
        )

    @property
    def eagle(self) -> bool:
        return self.drafter not in (None, "ngram")


class RolloutWorker(TaskIntake, Generation, RolloutReports, PolicyLoading, DrafterSwaps, SampleFollowing):
    """One rollout worker process (run as many as there are devices)."""

    def __init__(
        self,
        config: Config,
        redis: aioredis.Redis,
        control: ControlPlane,
        *,
        worker_id: str,
        reward: Callable[[str, str], float],
        settings: RolloutSettings = RolloutSettings(),
        reward_pool: RewardPool | None = None,
    ) -> None:
        self.config = config
        self.redis = redis
        self.control = control
        self.worker_id = worker_id
        self.reward = reward
        self.reward_pool = reward_pool
        """Scores whole groups in worker processes (slow rewards, with a timeout); None: `reward` inline."""
        self.settings = settings
        self.keys = Keys(config.run)
        self.reader = StreamReader(redis, self.keys, config.bus, "prompts", worker_id)
        self.producer = StreamProducer(redis, self.keys, config.bus)
        self.registry = WorkerRegistry(redis, self.keys, config.bus, self.producer, worker_id, role="rollout")
        self.engine: RolloutEngine | None = None
        """Built at the first policy load, then kept for the worker's life (`roles/worker/loading.py`)."""
        self.adaptive: AdaptiveSd | None = None
        self.tasks: dict[str, GroupTask] = {}
        """The tasks in flight, by task id: started, not yet sent or dead-lettered."""
        self._init_intake()
        self._init_generation()
        self._init_loading()
        self._init_drafters()
        self._init_reports()
        self._init_following()
        self.idle_trainer: IdleDrafterTrainer | None = None
        if settings.drafter_training is not None:
            assert settings.drafter is not None
            self.idle_trainer = IdleDrafterTrainer(
                config,
                redis,
                control,
                self.registry,
                self.producer,
                self.reader,
                worker_id=worker_id,
                settings=settings.drafter_training,
                initial_drafter=settings.drafter,
            )

    async def run(self, stop: asyncio.Event, *, max_tasks: int | None = None) -> None:
        """Generate until `stop` is set (or `max_tasks` tasks were completed by this call)."""
        heartbeat = asyncio.create_task(self.registry.heartbeat(stop))
        follower = asyncio.create_task(self._follow_samples(stop)) if self.settings.group else None
        try:
            await self.registry.set_state(WorkerStatus.LOADING, "waiting for a policy version")
            while self.policy is None and not stop.is_set():
                await self._maybe_load()
                if self.policy is None:
                    await asyncio.sleep(0.2)
            done_before = self.tasks_done
            while not stop.is_set() and (max_tasks is None or self.tasks_done - done_before < max_tasks):
                await self.reader.maybe_refresh()  # what we hold stays ours however long it generates
                if not self.tasks or self.settings.partial_rollouts:  # partial: rows in flight are re-verified
                    await self._maybe_load()
                await self._maybe_swap_drafter()
                self._maybe_adopt_sd_config()
                await self._admit()
                await self._send_scored()
                if self.engine.has_work:
                    if self.registry.state != WorkerStatus.GENERATING:
                        await self.registry.set_state(WorkerStatus.GENERATING)
                    await self._generate()
                    self._judge_swap()
                elif self.scoring:  # nothing to decode but groups being scored: their samples go first
                    await asyncio.wait(list(self.scoring.values()), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                elif not any(self._startable(d.message) for d in self.waiting):
                    # No work we can start: our tasks are done while others run the tail, or the tasks
                    # we hold wait for the next policy version. Idle time: train the drafter if we may.
                    if self.registry.state not in (WorkerStatus.IDLE, WorkerStatus.TRAINING_DRAFTER):
                        await self.registry.set_state(WorkerStatus.IDLE)
                    if self._loadable_policy() is not None:
                        continue  # a new version to load first (at the top of the loop)
                    if self._awaiting_retry():
                        await self._wait_to_retry(stop)
                        continue
                    if self.idle_trainer is not None:
                        await self._train_while_idle(stop)
                    else:
                        await self._wait_for_work()
        finally:  # groups still being scored stay unacked: sent when run again, else redone by another worker
            await self.registry.set_state(WorkerStatus.STOPPED)
            heartbeat.cancel()
            if follower is not None:
                follower.cancel()


def serve_rollout_worker(config: Config) -> int:
    """`tlt-stream rollout-worker` / `services/rollout_worker.py`: generate until SIGTERM/SIGINT."""
    import os
    import socket

    import torch

    from tlt_stream.rl.rewards import RewardError, resolve_reward
    from tlt_stream.roles.serve import device_or_refuse, refuse, serve

    own, sd = config.rollout, config.sd
    command = "tlt-stream rollout-worker"
    if config.drafter.state_dir is not None and config.drafter.train and sd.drafter in (None, "ngram"):
        return refuse(command, "drafter.state_dir (--train-drafter) needs sd.drafter DIR (the drafter to start from)")
    try:
        reward = resolve_reward(own.reward)
    except RewardError as exc:
        return refuse(command, str(exc))
    if own.backend == "vllm":
        from tlt_stream.rollout.vllm.backend import BackendUnavailable, require_vllm

        if sd.adaptive and sd.drafter is not None:
            return refuse(
                command,
                "adaptive SD decides per decode step, which vLLM cannot; use a fixed sd.arm with the vllm "
                "backend (--fixed-sd --sd-arm LABEL; docs/vllm.md)",
            )
        try:
            require_vllm()
        except BackendUnavailable as exc:
            return refuse(command, str(exc))
    device = device_or_refuse(own.device, "rollout-worker")
    if device is None:
        return 2
    try:
        settings = RolloutSettings.from_config(config, device=device)
    except ValueError as exc:
        return refuse(command, str(exc))
    torch.set_num_threads(own.threads)
    worker_id = own.worker_id or f"rollout-{socket.gethostname()}-{os.getpid()}"
    workers = pool_size(own.reward, own.reward_workers)

    async def body(config: Config, redis: aioredis.Redis, control: ControlPlane, stop: asyncio.Event) -> None:
        pool = RewardPool(own.reward, workers=workers, timeout_s=own.reward_timeout_s) if workers else None
        worker = RolloutWorker(
            config, redis, control, worker_id=worker_id, reward=reward, settings=settings, reward_pool=pool
        )
        print(f"{worker_id}: waiting for a policy version", file=sys.stderr)
        try:
            await worker.run(stop, max_tasks=own.max_tasks)
        finally:
            if pool is not None:
                pool.close()
        print(f"{worker_id}: stopped after {worker.tasks_done} tasks ({worker.samples_sent} samples)", file=sys.stderr)

    return serve(config, "rollout", ["drafter"] if settings.drafter_training else [], body)

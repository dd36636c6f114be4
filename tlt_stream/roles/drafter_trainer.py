"""The adaptive drafter on a rollout worker: train it in idle time, publish it, hot-swap it.

TLT's first half (DESIGN section 6). A worker with no generation work (its tasks done while the long tail
runs elsewhere, or waiting for the next policy version) is IDLE; it tries to take the drafter-training
lease (`bus/lease.py`). The holder, in state TRAINING_DRAFTER:

1. drains new hidden-state windows from `hidden` (group `drafter`) into its window buffer, holding back a
   fixed share (by a hash of the sample id) as the guard rail's evaluation set;
2. restores the newest training state the lease record points to (weights, AdamW moments, step count,
   batch generator) unless it already holds it, bound to the embedding and LM head of its own policy;
3. trains one slice in a worker thread; a task watching `prompts` sets a flag the slice checks before
   every step, so new work preempts training within one step;
4. saves the state atomically under a new name and commits it with a fenced write (a holder that lost the
   lease cannot commit over a newer one); the state's metadata names the samples whose windows this worker
   took into its buffer and held-out set since its previous commit (`windows_added`, `held_out_added`), so
   an auditor can trace a published drafter to the samples it was trained on;
5. once `judge_every_steps` steps have passed since its last judgement, measures held-out acceptance of the
   new drafter and of the one in use; only if the new one is not worse does it publish a `DrafterVersion`
   (MQTT retained + Redis mirror, forward-only). A judgement costs as much as several training steps, so it
   is not made after every (often one-step) slice of a short idle period. Nothing is published without a
   held-out window to judge on, nor by a worker that is stopping (its control plane is closing);
6. reports one `DrafterStats` entry per slice to `stats` (with the judgement when one was made), and
   releases the lease when work arrives, so another idle worker can continue from the committed state.

Every worker swaps a newly announced drafter into its engine between decode steps (`swap_drafter`): the
weights change in place, in-flight sequences keep going (speculative decoding is lossless whatever the
drafter proposes), and samples report the drafter version they were generated with.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tlt_stream.basics.common import stable_int
from tlt_stream.basics.config import Config
from tlt_stream.basics.errors import ConfigError
from tlt_stream.basics.messages import DrafterStats, DrafterVersion, HiddenWindow, PromptGroup, WorkerStatus
from tlt_stream.bus.consumer import Delivery, StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.lease import DrafterLease, LeaseGrant
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys
from tlt_stream.drafter.online import WindowBuffer, held_out_acceptance, judgeable
from tlt_stream.model.threads import one_torch_thread
from tlt_stream.store.digest import directory_sha256

__all__ = ["IdleDrafterTrainer"]

log = logging.getLogger(__name__)


def _side_thread() -> None:
    one_torch_thread()  # no second OpenMP team beside the engine's (`model/threads.py`)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread (Linux semantics)
        return
    except (AttributeError, OSError) as exc:
        log.debug("no SCHED_IDLE for the drafter-training thread (%s); trying nice 19", exc)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted: train at normal priority
        log.debug("could not lower the drafter-training thread's priority: %s", exc)


def _stable_hash(text: str) -> int:
    """A 32-bit hash of `text` that is the same in every process (Python's `hash` of a str is salted)."""
    return stable_int(text, 8)


def _held_out(sample_id: str, percent: int) -> bool:
    return _stable_hash(sample_id) % 100 < percent


@dataclass(frozen=True)
class _Slice:
    """A committed slice: where its state went and what it did (reported once, judged or not)."""

    path: Path
    fence: int
    step: int
    policy_version: int
    result: Any
    latency: float


class IdleDrafterTrainer:
    """Owned by one rollout worker; `run_idle` uses the worker's idle time, `swap_drafter` its engine."""

    def __init__(
        self,
        config: Config,
        redis: Any,
        control: ControlPlane,
        registry: WorkerRegistry,
        producer: StreamProducer,
        prompts: StreamReader,
        *,
        worker_id: str,
        initial_drafter: str,
    ) -> None:
        own = config.drafter
        if own.state_dir is None:
            raise ConfigError("drafter.state_dir: online drafter training needs a directory for its states")
        self.own = own
        """The drafter section: training, judging and buffer settings."""
        self.state_dir = Path(config.expand(own.state_dir))
        """Where training states go (shared by every worker of the run: a volume on a cluster)."""
        self.control = control
        self.registry = registry
        self.producer = producer
        self.prompts = prompts
        self.worker_id = worker_id
        self.keys = Keys(config.run)
        self.lease = DrafterLease(redis, self.keys, ttl_ms=own.lease_ttl_ms)
        self.hidden = StreamReader(redis, self.keys, config.bus, "hidden", worker_id)
        self.buffer = WindowBuffer(
            recent_tokens=own.recent_tokens,
            reservoir_tokens=own.reservoir_tokens,
            seed=_stable_hash(worker_id),
        )
        self.holdout: list[Any] = []
        self.added: dict[str, list[str]] = {"windows_added": [], "held_out_added": []}
        """Sample ids of the windows taken in since this worker's last committed state (its metadata)."""
        self.initial_drafter = initial_drafter
        self.trainer: Any = None
        self._unevaluated: _Slice | None = None
        """A committed slice, due for judgement, that new work preempted before its drafter was judged."""
        self.judged_step = 0
        """The trainer's step count at this worker's last judgement (or at the state it restored)."""
        self.record: dict[str, str] | None = None
        """The newest committed training state (from the lease record): state, step, policy_version."""
        self.idle_seconds = 0.0
        self.training_seconds = 0.0
        self.slices = 0
        self._stopping = asyncio.Event()
        """The worker's stop: a stopping worker publishes no drafter (its control plane is closing: a version
        would reach the Redis mirror but not MQTT, and no other worker would hear of it)."""
        # Slices run in one low-priority thread (Linux nice is per thread): "idle" rollout time may still be
        # busy time for a learner sharing the machine, which must not be slowed by the drafter. And on one torch
        # thread: a second OpenMP team beside the engine's would slow every decode step (`model/threads.py`).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="drafter-train", initializer=_side_thread)

    async def _low(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` in the low-priority thread: everything the drafter's training does (rebinding,
        training, saving, judging), so none of it competes with a learner sharing the machine."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # ------------------------------------------------------------------------------------------ idle time

    async def run_idle(
        self, engine: Any, policy_version: int, waiting: list[Delivery[PromptGroup]], stop: asyncio.Event
    ) -> None:
        """Spend idle time training under the lease until work arrives (appended to `waiting`), a newer
        policy is announced, or `stop` is set."""
        started = time.monotonic()
        self._stopping = stop
        try:
            grant = await self.lease.acquire(self.worker_id)
            if grant is None:  # another worker trains; wait for work as an ordinary idle worker would
                waiting += await self.prompts.read(count=1, block_ms=500)
                return
            try:
                await self._hold(grant, engine, policy_version, waiting, stop)
            finally:
                await self.lease.release(grant)
        finally:
            self.idle_seconds += time.monotonic() - started

    async def _hold(
        self,
        grant: LeaseGrant,
        engine: Any,
        policy_version: int,
        waiting: list[Delivery[PromptGroup]],
        stop: asyncio.Event,
    ) -> None:
        preempt = threading.Event()
        arrived: list[float] = []
        lost = asyncio.Event()

        async def watch_prompts() -> None:
            while not preempt.is_set():
                found = await self.prompts.read(count=1, block_ms=200)
                if found:
                    waiting.extend(found)
                newer = self.control.version("policy") > policy_version
                if found or newer or stop.is_set():
                    arrived.append(time.monotonic())
                    preempt.set()

        async def keep_lease() -> None:
            if not await self.lease.keep_alive(grant, lost):
                preempt.set()  # lost the lease: stop training, commit nothing

        committed = await self.lease.record()
        if committed is not None:
            self.record = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in committed.fields.items()}
        async with asyncio.TaskGroup() as tasks:
            watcher = tasks.create_task(watch_prompts(), name=f"{self.worker_id}-watch-prompts")
            keeper = tasks.create_task(keep_lease(), name=f"{self.worker_id}-keep-drafter-lease")
            try:
                await self.registry.set_state(WorkerStatus.TRAINING_DRAFTER, f"lease fence {grant.fence}")
                while not preempt.is_set() and not stop.is_set():
                    short = len(self.buffer) < self.own.min_windows  # then wait for windows (a blocking read)
                    await self._drain_hidden(block_ms=200 if short else 0)
                    if len(self.buffer) < self.own.min_windows:
                        continue
                    restored = await self._low(self._prepare, engine, policy_version)
                    if self._unevaluated is not None and not stop.is_set():  # idle again: judge the preempted state
                        pending, self._unevaluated = self._unevaluated, None
                        if restored:  # another holder trained past it: our trainer no longer holds its drafter
                            await self._report(pending)
                        else:
                            await self._judge_and_report(engine, pending)
                        continue
                    result = await self._low(
                        functools.partial(
                            self.trainer.train_slice,
                            max_seconds=self.own.slice_seconds,
                            should_stop=preempt.is_set,
                        )
                    )
                    self.training_seconds += result.seconds
                    if result.steps == 0:
                        continue
                    latency = time.monotonic() - arrived[0] if arrived else 0.0
                    await self._commit(grant, engine, result, latency)
            finally:
                preempt.set()
                lost.set()
                watcher.cancel()
                keeper.cancel()
        if stop.is_set() and self._unevaluated is not None:  # no next idle period to judge it in: report it
            pending, self._unevaluated = self._unevaluated, None
            await self._report(pending)

    async def _drain_hidden(self, *, block_ms: int = 0, batch: int = 16, most: int = 256) -> None:
        """Move up to `most` new windows from `hidden` into the buffer (or the held-out set), `batch` per
        read: a window is ~40 KB, and replies of a few hundred KB keep every Redis server (and the
        embedded one, which fails on multi-MB replies under load) responsive. The first read waits up to
        `block_ms` for a window when none is there. The windows are decoded and checked in the low-priority
        thread: that tensor work is most of what the event loop did in idle time, beside a learner's update."""
        taken = 0
        while taken < most:
            wait = block_ms if taken == 0 else 0
            deliveries: list[Delivery[HiddenWindow]] = await self.hidden.read(count=batch, block_ms=wait)
            if not deliveries:
                return
            await self._low(self._take, [d.message for d in deliveries])
            await self.hidden.ack([d.entry_id for d in deliveries])
            taken += len(deliveries)

    def _take(self, messages: list[HiddenWindow]) -> None:
        """The windows into the buffer, or the held-out set (runs in the low-priority thread, as training does,
        so the buffer is never read and written at once)."""
        from tlt_stream.drafter.buffer import window_from_message

        for message in messages:
            window = window_from_message(message)
            if _held_out(message.sample_id, self.own.holdout_percent) and judgeable(window):
                self.holdout = [*self.holdout, window][-self.own.holdout_max :]
                self.added["held_out_added"].append(message.sample_id)
            else:
                self.buffer.add(window, message.policy_version)
                self.added["windows_added"].append(message.sample_id)

    def _prepare(self, engine: Any, policy_version: int) -> bool:
        """A trainer bound to our policy, holding the newest committed state (runs in a worker thread);
        True when that meant restoring another holder's newer state."""
        from tlt_stream.drafter.model import load_drafter
        from tlt_stream.drafter.online import OnlineDrafterTrainer

        target = engine.model
        if self.trainer is None:
            drafter = load_drafter(self._current_location(), target)
            self.trainer = OnlineDrafterTrainer(drafter, self.buffer, self.own, policy_version=policy_version)
        elif self.trainer.policy_version != policy_version:
            self.trainer.rebind(target, policy_version)
        record = self.record
        if record is None or int(record.get("step", -1)) <= self.trainer.step_count:
            return False
        self.trainer.load_state(record["state"])
        self.judged_step = self.trainer.step_count
        log.info("%s: continued drafter training from %s (step %d)", self.worker_id, record["state"], self.judged_step)
        return True

    def _current_location(self) -> str:
        current = self.control.current.get("drafter")
        return current.location if isinstance(current, DrafterVersion) else self.initial_drafter

    async def _commit(self, grant: LeaseGrant, engine: Any, result: Any, latency: float) -> None:
        """Save and commit the slice's state. Judge its drafter when `judge_every_steps` have passed since
        the last judgement: now, or, when new work preempted the slice, at the start of the next idle period
        (the judgement takes a second or two that generation should not wait for)."""
        assert self.trainer is not None
        step = self.trainer.step_count
        path = self.state_dir / f"fence-{grant.fence:08d}-step-{step:08d}"
        metadata = {"worker": self.worker_id, **{key: list(ids) for key, ids in self.added.items()}}
        await self._low(functools.partial(self.trainer.save_state, path, metadata=metadata))
        fields = {"state": str(path), "step": str(step), "policy_version": str(self.trainer.policy_version)}
        if not await self.lease.fenced_write(grant.fence, fields):
            log.warning("%s: lost the drafter lease; state %s is not committed", self.worker_id, path)
            return  # the windows taken in since the last commit go into the next one's metadata
        self.record = fields
        self.added = {key: [] for key in self.added}
        self.slices += 1
        done = _Slice(path, grant.fence, step, self.trainer.policy_version, result, latency)
        if step - self.judged_step < self.own.judge_every_steps:
            await self._report(done)
        elif str(result.end) == "preempted":
            self._unevaluated = done
        else:
            await self._judge_and_report(engine, done)

    async def _judge_and_report(self, engine: Any, done: _Slice) -> None:
        """Measure the slice's drafter against the one in use on the held-out windows; publish it if it is
        not worse; report the slice with the verdict. With no held-out window yet there is nothing to judge on:
        the slice is reported unjudged and the next one is judged (a drafter is never published unjudged)."""
        if not self.holdout:
            await self._report(done)
            return
        started = time.monotonic()
        try:
            accept_new, accept_current = await self._low(self._accepts, engine)
        except ValueError as exc:  # no held-out position to measure on yet: judged later, never published unjudged
            log.warning("%s: cannot judge the slice's drafter yet (%s)", self.worker_id, exc)
            await self._report(done)
            return
        self.judged_step = done.step
        adopted = accept_new >= accept_current - self.own.tolerance
        if adopted and self._stopping.is_set():
            log.info("%s: stopping; not publishing the slice's drafter (held-out acceptance %.3f)", self.worker_id,
                     accept_new)  # fmt: skip
            adopted = False
        version = -1
        if adopted:
            location = str((done.path / "drafter").resolve())
            message = DrafterVersion(
                version=max(self.control.version("drafter") + 1, 1),
                location=location,
                sha256=await self._low(directory_sha256, location),
                policy_version=done.policy_version,
            )
            if await self.control.publish(message):
                version = message.version
                log.info("%s: published drafter version %d (held-out acceptance %.3f >= %.3f)",
                         self.worker_id, version, accept_new, accept_current)  # fmt: skip
            else:
                adopted = False
        verdict = dict(accept_new=accept_new, accept_current=accept_current, adopted=adopted, drafter_version=version)
        await self._report(done, judge_s=time.monotonic() - started, **verdict)

    async def _report(self, done: _Slice, *, judge_s: float | None = None, **verdict: Any) -> None:
        """One `DrafterStats` entry for the slice (`judge_s` None: not judged)."""
        result = done.result
        await self.producer.send_one(
            "stats",
            DrafterStats(
                worker_id=self.worker_id,
                fence=done.fence,
                policy_version=done.policy_version,
                step=done.step,
                steps=result.steps,
                seconds=result.seconds,
                loss=float(result.loss if result.loss is not None else 0.0),
                end=str(result.end),
                windows=len(self.buffer),
                preempt_latency_s=done.latency,
                judged=judge_s is not None,
                judge_s=judge_s or 0.0,
                **verdict,
            ),
        )

    def _accepts(self, engine: Any) -> tuple[float, float]:
        """Held-out acceptance of the slice's drafter and of the drafter the engine uses now."""
        new = held_out_acceptance(self.trainer.drafter, self.holdout, self.own.accept_depth)
        proposer = getattr(engine, "proposer", None)
        drafter = getattr(proposer, "drafter", None)
        current = held_out_acceptance(drafter, self.holdout, self.own.accept_depth) if drafter is not None else 0.0
        return new, current

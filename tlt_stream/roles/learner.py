"""The learner as a service: samples stream in, GRPO updates go out as checkpointed policy versions.

The loop reads `samples` through the `learner` consumer group, assembles complete groups (`rl/groups.py`),
and every `groups_per_step` usable groups runs one update (`rl/learner.py`, on the loop's thread: torch's
CPU pool is slower driven from another, and the lease is renewed first to cover the pause; accumulating,
learner.accumulate's default for a policy without dropout, each group's share is computed as the group
completes, `rl/accumulate.py`), then, in this order:

1. saves a checkpoint (weights, RNG and the ledger of every sample id applied so far, durable; the optimizer
   state is written in the background while the next update runs, `rl/checkpoint.py`);
2. acks the stream entries the update before it consumed (this update's once the next checkpoint exists:
   a newest checkpoint found damaged on restart is fallen back from, and its samples trained again);
3. publishes the new `PolicyVersion` (retained MQTT + Redis mirror) with the checkpoint's sha256;
4. writes `LearnerStats` to `stats` and one JSON line to `{run_dir}/metrics.jsonl`: reward and accuracy,
   the response-length distribution, the step's rollout span, tail phase and tokens/s (`rl/metrics.py`), the
   time spent learning, checkpointing and waiting for groups, and the staleness histogram.

A crash before 1 loses nothing (the entries are still pending and come back); a crash between 1 and 2
applies nothing twice (the restored ledger recognises the redelivered samples). On start the service
resumes from the newest complete checkpoint, or makes checkpoint 0 from the initial policy, and
(re)publishes the current version, so workers that start later find it retained.

The service owns a few components (`roles/learner_parts/`), each handed the configuration and the other
parts it uses: the run's lease, the checkpoints (and the policy trained from them), the intake of samples
into groups, the updates, and their records; this file holds the loop that drives them and the process's
wiring (the follower ranks' entry too).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import torch

from tlt_stream.basics.aio import one_error
from tlt_stream.basics.config import Config
from tlt_stream.basics.errors import ConfigError
from tlt_stream.basics.messages import PolicyVersion
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.model.threads import in_own_thread
from tlt_stream.rl.learner import LearnerSettings
from tlt_stream.rl.ranks import RanksOutOfStep
from tlt_stream.rl.sharded import Trainer, follow
from tlt_stream.rl.tracking import MissingTracker, require_trackers
from tlt_stream.roles.learner_parts.checkpoints import Checkpoints
from tlt_stream.roles.learner_parts.intake import SampleIntake
from tlt_stream.roles.learner_parts.lease import RunLease, RunTaken
from tlt_stream.roles.learner_parts.records import UpdateRecords
from tlt_stream.roles.learner_parts.update import HOLD_RECHECK_MS, UpdateFailed, Updates

__all__ = ["LearnerService", "RunTaken", "UpdateFailed", "follow_rank_0", "serve_learner"]

log = logging.getLogger(__name__)


class LearnerService:
    """One learner process (there is exactly one per run: it owns the policy version)."""

    def __init__(
        self,
        config: Config,
        redis: aioredis.Redis,
        control: ControlPlane,
        *,
        run_dir: str | Path,
        init_policy: str | Path,
        device: str = "cpu",
        consumer: str = "learner",
        trainer: Trainer | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        keys = Keys(config.run)
        self.reader = StreamReader(redis, keys, config.bus, "samples", consumer)
        self.producer = StreamProducer(redis, keys, config.bus)
        trainer = trainer or Trainer(LearnerSettings.from_config(config), device)
        self.lease = RunLease(config, redis, keys)
        self.checkpoints = Checkpoints(
            config, control, trainer, run_dir=self.run_dir, init_policy=Path(init_policy), device=device
        )
        self.intake = SampleIntake(
            redis, keys, self.reader, control, self.checkpoints, max_staleness=config.policy.max_staleness
        )
        self.records = UpdateRecords(config, self.run_dir, self.producer, lambda: self.checkpoints.tokenizer)
        self.updates = Updates(config, self.checkpoints, self.intake, self.lease, self.records)

    @property
    def version(self) -> int:
        """The policy version trained so far (-1 before `start`)."""
        return self.checkpoints.version

    async def start(self) -> PolicyVersion:
        """Take the run's learner lease, resume from the newest checkpoint (or create checkpoint 0) and publish
        the current version."""
        await self.lease.take()
        # Resuming (verify, build, maybe write checkpoint 0) can outlast the lease's ttl on a loaded machine:
        # keep renewing while it runs, or a restarted learner would find its own lease expired and taken.
        loading = asyncio.create_task(in_own_thread(self.checkpoints.resume), name="learner-resume")
        while not loading.done():
            await asyncio.wait([loading], timeout=self.lease.lease.ttl_ms / 3000)
            await self.lease.renew()
        resumed = await loading
        try:  # around the policy resumed (a fallback past a damaged checkpoint built it again)
            self.updates.attach()
        except ConfigError:
            await self.lease.release()
            raise
        self.intake.resume(resumed.ledger)
        await self.intake.restore_dead()
        if resumed.found is not None:
            self.records.recover_row(resumed.found, resumed.meta)
        assert self.checkpoints.checkpoint is not None
        self.records.open_trackers()
        message = await self.checkpoints.publish(self.checkpoints.checkpoint)
        self.updates.idle_since = time.perf_counter()
        return message

    async def run(self, stop: asyncio.Event, *, max_updates: int | None = None) -> None:
        """Consume and update until `stop` is set or `max_updates` updates were applied in this run."""
        if self.checkpoints.core is None:
            await self.start()
        elif self.lease.grant is None:  # run again after a run that released it
            await self.lease.take()
        self.updates.stop = stop
        try:
            with one_error():
                async with asyncio.TaskGroup() as tasks:
                    keeper = tasks.create_task(self.lease.keep(stop), name="learner-lease")
                    try:
                        finished = await self._consume(stop, max_updates)
                        self.updates.put_back()  # a step stopped half accumulated: its groups wait in front
                        if finished and self.updates.last_entries:  # done: nothing to redo, whatever the disk
                            await self.intake.ack(self.updates.last_entries)
                            await self.intake.forget_dead(self.updates.last_dead)
                            self.updates.last_entries, self.updates.last_dead = [], []
                        if finished:
                            await self.intake.ack_trained_leftovers()
                    finally:
                        # The optimizer state being written is the newest checkpoint's: done, the lease still
                        # renewed, before another learner may take the run (a stop and a normal end both come
                        # through here).
                        await asyncio.to_thread(self.checkpoints.trainer.wait_for_writes)
                        keeper.cancel()
        finally:
            await self.lease.release()

    async def _consume(self, stop: asyncio.Event, max_updates: int | None) -> bool:
        """Read, assemble and update until `stop` or `max_updates`; True when the updates asked for are done
        (a stop leaves the newest update's entries pending: a restart finds them in the ledger, or, past a
        damaged checkpoint, trains them again)."""
        applied, intake = 0, self.intake
        while not stop.is_set() and (max_updates is None or applied < max_updates):
            holding = self.updates.holding  # groups wait for the rollout's rows: read them again soon
            deliveries = await self.reader.read(
                block_ms=min(HOLD_RECHECK_MS, self.config.bus.block_ms) if holding else None
            )
            if self.reader.lost:
                intake.entries_vanished()
            to_ack = await intake.take_all(deliveries)
            await intake.ack(to_ack)
            while max_updates is None or applied < max_updates:
                groups = await self.updates.next_step()
                if groups is None:
                    break
                if await self.updates.try_update(groups):
                    applied += 1
                elif stop.is_set():
                    break
        return max_updates is not None and applied >= max_updates

    def describe(self) -> dict[str, Any]:
        """What the service holds now (for logs, the dashboard and tests)."""
        assembler = self.intake.assembler
        return {
            "version": self.version,
            "ready_groups": len(self.intake.ready),
            "open_groups": assembler.open_groups,
            "ledger": len(assembler.ledger),
            "dropped_groups": assembler.dropped_groups,
            "duplicates": assembler.duplicates,
        }

    def close_trackers(self) -> None:
        self.records.close_trackers()


def follow_rank_0(trainer: Trainer, *, root: Path, init_policy: Path) -> None:
    """A sharded learner's rank other than 0: do what rank 0 says (`rl/sharded.py`, `follow`) until its STOP.

    torchrun forwards SIGTERM and SIGINT to every rank. Rank 0's service stops after the update in hand, and
    its `Trainer.stop` sends STOP once its own optimizer write is done; STOP ends this rank once its write
    has landed too. Dying on the signal instead could cut this rank's piece of the newest checkpoint's
    optimizer state short, leaving that step without a complete state (a resume then takes older moments).
    So a follower ignores both signals and leaves when told; if rank 0 is gone (the link breaks, or the
    collective timeout runs out), the write in flight still lands before the error ends the rank."""
    ignored = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    try:
        follow(trainer, root=root, init_policy=init_policy)
    except Exception as exc:
        rank = trainer.link.rank if trainer.link is not None else -1
        log.error("rank %d stops following rank 0 (%s); its optimizer write in flight lands first", rank, exc)
        raise
    finally:
        trainer.wait_for_writes()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_learner(config: Config) -> int:
    """`tlt-stream learner` / `services/learner.py`: run the service until SIGTERM/SIGINT, learner.max_updates
    or the final policy version (learner.until_version, else policy.steps). Under torchrun (WORLD_SIZE > 1)
    the policy is sharded over the ranks: rank 0 runs the service, the others follow it (`follow_rank_0`: a
    signal ends them through rank 0, which stops them after its update)."""

    from tlt_stream.rl.ranks import join_ranks, leave_ranks
    from tlt_stream.roles.serve import device_or_refuse, refuse, serve

    own = config.learner
    if own.run_dir is None or own.policy is None:
        return refuse("tlt-stream learner", "learner.run_dir (--run-dir) and learner.policy (--policy) are required")
    device = device_or_refuse(own.device, "learner")
    if device is None:
        return 2
    try:
        require_trackers(own.log_to)
    except MissingTracker as exc:
        return refuse("tlt-stream learner", str(exc))
    torch.set_num_threads(own.threads)
    link = join_ranks(device, timeout_s=own.collective_timeout_s)
    if link is not None and link.device.type == "cuda":
        device = str(link.device)  # one GPU per rank: LOCAL_RANK's
    trainer = Trainer(LearnerSettings.from_config(config), device, link)
    if link is not None and not link.leader:
        follow_rank_0(trainer, root=Path(config.expand(own.run_dir)) / "checkpoints", init_policy=Path(own.policy))
        leave_ranks(link)
        return 0

    async def body(config: Config, redis: aioredis.Redis, control: ControlPlane, stop: asyncio.Event) -> None:
        run_dir = config.expand(own.run_dir)
        service = LearnerService(
            config, redis, control, run_dir=run_dir, init_policy=own.policy, device=device, trainer=trainer
        )
        try:
            message = await service.start()
            print(f"learner: policy version {message.version} at {message.location}", file=sys.stderr)
            updates = own.max_updates
            left = max(0, config.until_version - service.version)  # a restarted learner counts its checkpoint's
            updates = left if updates is None else min(updates, left)
            await service.run(stop, max_updates=updates)
            print(f"learner: stopped at policy version {service.version}", file=sys.stderr)
        finally:
            service.close_trackers()

    try:
        code = serve(config, "learner", ["policy"], body)
    except RanksOutOfStep:
        raise  # a rank died or disagrees: nothing more can be said to the others (torchrun ends them)
    except Exception:
        trainer.stop()  # the other ranks, if any, leave too
        raise
    trainer.stop()
    leave_ranks(link)
    return code

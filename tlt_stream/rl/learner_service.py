"""The learner as a service: samples stream in, GRPO updates go out as checkpointed policy versions.

The loop reads `samples` through the `learner` consumer group, assembles complete groups (`groups.py`),
and every `groups_per_step` usable groups runs one update (`learner.py`, in a worker thread so the event
loop keeps heartbeating), then, in this order:

1. saves a checkpoint (weights, optimizer, RNG and the ledger of every sample id applied so far);
2. acks the stream entries the update consumed;
3. publishes the new `PolicyVersion` (retained MQTT + Redis mirror) with the checkpoint's sha256;
4. writes `LearnerStats` to `stats` and one JSON line to `{run_dir}/metrics.jsonl`: reward and accuracy,
   the response-length distribution, the step's rollout span, tail phase and tokens/s (`metrics.py`), the
   time spent learning, checkpointing and waiting for groups, and the staleness histogram.

A crash before 1 loses nothing (the entries are still pending and come back); a crash between 1 and 2
applies nothing twice (the restored ledger recognises the redelivered samples). On start the service
resumes from the newest complete checkpoint, or makes checkpoint 0 from the initial policy, and
(re)publishes the current version, so workers that start later find it retained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tlt_stream.aio import retry
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.config import Config
from tlt_stream.messages import LearnerStats, PolicyVersion
from tlt_stream.model.loader import CheckpointError
from tlt_stream.rl.checkpoint import CheckpointInfo, latest_checkpoint, restore_checkpoint, save_checkpoint
from tlt_stream.rl.groups import GroupAssembler, ReadyGroup
from tlt_stream.rl.learner import LearnerCore, LearnerSettings
from tlt_stream.rl.metrics import accept_by_drafter, rollout_timing, staleness_histogram

__all__ = ["LearnerRunSettings", "LearnerService", "serve_learner"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerRunSettings:
    groups_per_step: int = 8
    """Complete, usable groups per update."""
    max_staleness: int = 0
    """A group is used only while learner version - its oldest sample's policy version <= this (0: on-policy)."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept on disk (the newest ones)."""
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    device: str = "cpu"
    """Where the policy trains: "cpu", "cuda" or "cuda:N" (resolved already); checkpoints are device-free."""

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.max_staleness < 0 or self.keep_checkpoints < 1:
            raise ValueError("need groups_per_step >= 1, max_staleness >= 0 and keep_checkpoints >= 1")


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
        settings: LearnerRunSettings = LearnerRunSettings(),
        consumer: str = "learner",
    ) -> None:
        self.config = config
        self.redis = redis
        self.control = control
        self.run_dir = Path(run_dir)
        self.init_policy = Path(init_policy)
        self.settings = settings
        self.keys = Keys(config.run)
        self.reader = StreamReader(redis, self.keys, config.bus, "samples", consumer)
        self.producer = StreamProducer(redis, self.keys, config.bus)
        self.core: LearnerCore | None = None
        self.tokenizer: Any = None
        self.assembler = GroupAssembler(settings.max_staleness)
        self.version = -1
        self.checkpoint: CheckpointInfo | None = None
        self.ready: list[ReadyGroup] = []
        self._idle_since = time.perf_counter()
        self._stop: asyncio.Event | None = None

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    async def start(self) -> PolicyVersion:
        """Resume from the newest checkpoint (or create checkpoint 0) and publish the current version."""
        await asyncio.to_thread(self._load)
        assert self.checkpoint is not None
        message = await self._publish(self.checkpoint)
        self._idle_since = time.perf_counter()
        return message

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        found = latest_checkpoint(self.checkpoints, clean=True)
        source = found.policy_dir if found is not None else self.init_policy
        if not source.is_dir():
            raise FileNotFoundError(f"{source}: initial policy directory does not exist")
        try:  # safetensors only: a pickled `pytorch_model.bin` is refused, never unpickled
            model = AutoModelForCausalLM.from_pretrained(source, use_safetensors=True).to(self.settings.device)
        except (OSError, ValueError, KeyError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{source}: cannot load the policy ({reason})") from exc
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):  # a checkpoint without a tokenizer is fine; workers bring their own
            self.tokenizer = None
        self.core = LearnerCore(model, self.settings.learner)
        if found is not None:
            ledger, meta = restore_checkpoint(found, optimizer=self.core.optimizer)
            self._recover_metrics_row(found, meta)
            self.assembler = GroupAssembler(self.settings.max_staleness, ledger)
            self.version, self.checkpoint = found.step, found
            self.core.updates = found.step  # the learning-rate schedule continues where it stopped
            log.info("resumed from %s (version %d, %d samples in the ledger)", found.path, found.step, len(ledger))
        else:
            self.version = 0
            self.checkpoint = self._save({"initial_policy": str(self.init_policy)})
            log.info("version 0 from %s", self.init_policy)

    def _save(self, extra: dict[str, Any]) -> CheckpointInfo:
        assert self.core is not None
        return save_checkpoint(
            self.checkpoints,
            step=self.version,
            model=self.core.model,
            optimizer=self.core.optimizer,
            ledger=self.assembler.ledger,
            extra=extra,
            tokenizer=self.tokenizer,
            keep=self.settings.keep_checkpoints,
        )

    async def _publish(self, info: CheckpointInfo) -> PolicyVersion:
        message = PolicyVersion(
            version=info.step, location=str(info.policy_dir.resolve()), sha256=info.policy_sha256, step=info.step
        )
        await self.control.publish(message)
        return message

    async def run(self, stop: asyncio.Event, *, max_updates: int | None = None) -> None:
        """Consume and update until `stop` is set or `max_updates` updates were applied in this run."""
        if self.core is None:
            await self.start()
        assert self.core is not None
        self._stop = stop
        applied = 0
        while not stop.is_set() and (max_updates is None or applied < max_updates):
            deliveries = await self.reader.read()
            to_ack: list[str] = []
            for delivery in deliveries:
                offer = self.assembler.offer(delivery.message, delivery.entry_id, self.version)
                if offer.status == "duplicate":
                    to_ack.append(delivery.entry_id)
                elif offer.status == "stale":
                    assert offer.group is not None
                    to_ack += offer.group.entry_ids
                    log.warning("dropped stale group %s", offer.group.task_id)
                elif offer.status == "ready":
                    assert offer.group is not None
                    self.ready.append(offer.group)
            await self.reader.ack(to_ack)
            while len(self.ready) >= self.settings.groups_per_step and (max_updates is None or applied < max_updates):
                groups = self.ready[: self.settings.groups_per_step]
                del self.ready[: self.settings.groups_per_step]
                await self._update(groups)
                applied += 1

    async def _update(self, groups: list[ReadyGroup]) -> dict[str, float]:
        assert self.core is not None
        started = time.perf_counter()
        wait = started - self._idle_since  # since the last update (or start): waiting for complete groups
        staleness = [g.staleness(self.version) for g in groups]
        samples = [s for g in groups for s in g.samples]
        # On the loop's thread, as the rollout worker's decode steps: torch's CPU thread pool is markedly
        # slower driven from a secondary thread. Heartbeats and MQTT keepalives tolerate an update's pause.
        metrics = self.core.step(groups)
        await asyncio.sleep(0)
        for group in groups:
            self.assembler.consume(group)
        self.version += 1
        histogram = staleness_histogram(staleness)
        metrics.update(
            **rollout_timing(samples),
            wait_seconds=wait,
            staleness_max=float(max(staleness)),
            staleness_mean=sum(staleness) / len(staleness),
            dropped_groups=float(self.assembler.dropped_groups),
            duplicates=float(self.assembler.duplicates),
            **{f"staleness_{k}": float(v) for k, v in histogram.items()},
            **{f"accept_length_drafter_{v}": a for v, a in accept_by_drafter(samples).items()},
        )
        if metrics["learn_seconds"] > 0:
            metrics["learn_tokens_per_s"] = metrics["trained_tokens"] / metrics["learn_seconds"]
        saving = time.perf_counter()
        trained = [g.task_id for g in groups]
        extra = {"metrics": metrics, "trained_groups": trained}
        # A full disk or an unwritable directory must not cost the update or its samples: nothing is acked or
        # published before the checkpoint exists, so retry (capped backoff, saying why) until it is written
        # or the service is stopped, which then exits non-zero with the samples still pending for a restart.
        self.checkpoint = await retry(
            lambda: asyncio.to_thread(self._save, extra),
            retry_on=(OSError,),
            what=f"checkpoint of version {self.version}",
            max_attempts=None,
            base=0.5,
            cap=10.0,
            stop=self._stop,
        )
        metrics["checkpoint_seconds"] = time.perf_counter() - saving
        await self.reader.ack([entry for g in groups for entry in g.entry_ids])
        await self._publish(self.checkpoint)
        # Groups assembled under the old version that the new one has left behind: drop them visibly.
        expired = self.assembler.evict_stale(self.version)
        keep = []
        for group in self.ready:
            if group.staleness(self.version) > self.settings.max_staleness:
                self.assembler.drop(group)
                expired.append(group)
            else:
                keep.append(group)
        self.ready = keep
        await self.reader.ack([entry for g in expired for entry in g.entry_ids])
        metrics["update_seconds"] = time.perf_counter() - started
        await self.producer.send_one(
            "stats",
            LearnerStats(
                step=self.version,
                policy_version=self.version,
                groups=len(groups),
                samples=len(samples),
                metrics=metrics,
            ),
        )
        line = {
            "version": self.version,
            "time": time.time(),
            **metrics,
            "staleness_hist": histogram,
            "response_lens": [s.response_len for s in samples],
            "trained_groups": trained,
        }
        self._append_metrics(line)
        log.info(
            "version %d: reward %.3f over %d groups (%d degenerate), rollout %.1fs (tail %.1fs), learn %.1fs, "
            "waited %.1fs",
            self.version,
            metrics["reward_mean"],
            len(groups),
            int(metrics["degenerate_groups"]),
            metrics["rollout_seconds"],
            metrics["tail_seconds"],
            metrics["learn_seconds"],
            wait,
        )
        self._idle_since = time.perf_counter()
        return metrics

    def _append_metrics(self, line: dict[str, Any]) -> None:
        path = self.run_dir / "metrics.jsonl"
        with path.open("a+b") as out:
            out.seek(0, 2)
            if out.tell() > 0:
                out.seek(-1, 2)
                torn = out.read(1) != b"\n"  # a line cut short by a crash: end it, so this one stays whole
                out.seek(0, 2)
                if torn:
                    out.write(b"\n")
            out.write(json.dumps(line).encode() + b"\n")

    def _recover_metrics_row(self, found: CheckpointInfo, meta: dict[str, Any]) -> None:
        """A learner killed after its checkpoint but before its `metrics.jsonl` line left an update that counts
        (the weights have it) with no row: write the row from the checkpoint, which carries the same figures
        and groups, so the run's record of what was trained stays complete."""
        extra = meta.get("extra", {})
        if "metrics" not in extra:
            return
        from tlt_stream.report import load_metrics  # skips a line torn by the crash: the row is rewritten

        rows = load_metrics(self.run_dir)
        if found.step > (rows[-1]["version"] if rows else 0):
            created = datetime.fromisoformat(meta["created"]).timestamp()
            line = {"version": found.step, "time": created, **extra["metrics"]}
            line["trained_groups"] = extra.get("trained_groups", [])
            self._append_metrics({**line, "recovered": True})
            log.warning("version %d had no metrics line (killed after its checkpoint): recovered it", found.step)

    def describe(self) -> dict[str, Any]:
        """What the service holds now (for logs, the dashboard and tests)."""
        return {
            "version": self.version,
            "ready_groups": len(self.ready),
            "open_groups": self.assembler.open_groups,
            "ledger": len(self.assembler.ledger),
            "dropped_groups": self.assembler.dropped_groups,
            "duplicates": self.assembler.duplicates,
            "settings": asdict(self.settings),
        }


def serve_learner(config: Config, args: Any) -> int:
    """`tlt-stream learner` / `services/learner.py`: run the service until SIGTERM/SIGINT or --max-updates."""
    from tlt_stream.rl.serve import device_or_refuse, serve

    if args.max_staleness < 0 or args.warmup_steps < 0:
        print("tlt-stream learner: --max-staleness and --warmup-steps must be >= 0", file=sys.stderr)
        return 2
    if not args.final_norm_lr_scale > 0:
        print("tlt-stream learner: --final-norm-lr-scale must be > 0", file=sys.stderr)
        return 2
    device = device_or_refuse(args.device, "learner")
    if device is None:
        return 2
    settings = LearnerRunSettings(
        groups_per_step=args.groups_per_step,
        max_staleness=args.max_staleness,
        learner=LearnerSettings(
            lr=args.lr, warmup_steps=args.warmup_steps, final_norm_lr_scale=args.final_norm_lr_scale
        ),
        device=device,
    )

    async def body(config: Config, redis: aioredis.Redis, control: ControlPlane, stop: asyncio.Event) -> None:
        service = LearnerService(
            config, redis, control, run_dir=args.run_dir, init_policy=args.policy, settings=settings
        )
        message = await service.start()
        print(f"learner: policy version {message.version} at {message.location}", file=sys.stderr)
        await service.run(stop, max_updates=args.max_updates)
        print(f"learner: stopped at policy version {service.version}", file=sys.stderr)

    return serve(config, "learner", ["policy"], body)

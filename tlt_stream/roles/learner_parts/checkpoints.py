"""The learner's policy on disk and on the bus: resumed from the newest checkpoint that verifies, saved after
every update, published as the new `PolicyVersion`.

On start the learner verifies the newest complete checkpoint against its recorded digests before anything
reads it, and falls back past a damaged one (set aside as `corrupt-step-*`, and said so: its update's
samples are still pending, so that update is trained again); with no checkpoint at all it makes version 0
from the initial policy. A save goes through the `Trainer` (`rl/sharded.py`: one process, or rank 0 of a
sharded learner) and returns once the weights, the RNG and the ledger are durable; the optimizer state
follows in the background, and how that write went (every rank's, as rank 0 hears it) is reported in the
next update's metrics. Workers are told of each version with its location in the store and the sha256 they
check it against.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PolicyVersion
from tlt_stream.bus.control import ControlPlane
from tlt_stream.model.loader import CheckpointError, resolve_dtype
from tlt_stream.model.threads import in_own_thread
from tlt_stream.rl.checkpoint import CheckpointInfo, complete_checkpoints, latest_checkpoint
from tlt_stream.rl.learner import LearnerCore
from tlt_stream.rl.ranks import RanksOutOfStep
from tlt_stream.rl.sharded import Trainer
from tlt_stream.store.digest import ChecksumMismatch, verify_directory
from tlt_stream.store.locations import announced_location

__all__ = ["Checkpoints", "Resumed"]

log = logging.getLogger("tlt_stream.roles.learner")


@dataclass(frozen=True)
class Resumed:
    """What the learner resumed from: the ledger of every sample id applied so far, and the checkpoint (None:
    version 0 was just made from the initial policy) with its recorded metadata."""

    ledger: set[str]
    found: CheckpointInfo | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Checkpoints:
    """The learner's checkpoints: the resume, the policy built from one, each save and its announcement."""

    def __init__(
        self, config: Config, control: ControlPlane, trainer: Trainer, *, run_dir: Path, init_policy: Path, device: str
    ) -> None:
        self.config = config
        self.control = control
        self.trainer = trainer
        """The policy's training and checkpoints: one process, or rank 0 of a sharded learner (`rl/sharded.py`)."""
        self.init_policy = init_policy
        self.root = run_dir / "checkpoints"
        self.publish_dtype = resolve_dtype(config.rollout.dtype, device)
        """The dtype of the weights workers load (rollout.dtype on this device); fp32 masters are kept beside."""
        self.core: LearnerCore | None = None
        """Built from the checkpoint resumed."""
        self.version = -1
        self.checkpoint: CheckpointInfo | None = None
        """The newest checkpoint, the one `version` is published from."""
        self.tokenizer: Any = None
        self.vocab_size = 0
        self.max_positions: int | None = None
        self._resume_note: dict[str, float] = {}
        """Set when a resume took older optimizer moments (-1: none); reported in the next update's metrics."""

    def resume(self) -> Resumed:
        """Resume from the newest checkpoint that verifies, falling back past damaged ones (set aside as
        `corrupt-step-*`, and said so); with none at all, start version 0 from the initial policy."""
        latest = latest_checkpoint(self.root, clean=True)
        if latest is None:
            self._build(self.init_policy)
            self.version = 0
            self.checkpoint = self.save({"initial_policy": str(self.init_policy)}, set())
            log.info("version 0 from %s", self.init_policy)
            return Resumed(set())
        candidates = [latest, *(c for c in reversed(complete_checkpoints(self.root)) if c.step != latest.step)]
        from safetensors import SafetensorError

        for found in candidates:
            try:  # verified before anything reads it; a checkpoint that fits no learner is the user's to fix
                verify_directory(found.policy_dir, found.policy_sha256, scheme=found.digest)
                if found.master_sha256 is not None:
                    verify_directory(found.master_dir, found.master_sha256, scheme=found.digest)
                self._build(found.master_dir, step=found.step)
                ledger, meta = self.trainer.restore(found)
            except (ChecksumMismatch, OSError, SafetensorError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                aside = found.path.with_name(f"corrupt-{found.path.name}-{int(time.time())}")
                found.path.rename(aside)
                log.error(
                    "checkpoint %s is damaged (%s: %s); set aside as %s, falling back to the previous one "
                    "(its update's samples are still pending: that update is trained again)",
                    found.path,
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                    aside.name,
                )
                continue
            if meta.get("optimizer_step", found.step) != found.step:  # said in the next update's metrics too
                self._resume_note = {"optimizer_resumed_from_step": float(meta["optimizer_step"])}
            self.version, self.checkpoint = found.step, found
            assert self.core is not None
            self.core.updates = found.step  # the learning-rate schedule continues where it stopped
            log.info("resumed from %s (version %d, %d samples in the ledger)", found.path, found.step, len(ledger))
            return Resumed(set(ledger), found, meta)
        raise CheckpointError(
            f"{self.root}: no checkpoint verifies (each was set aside as corrupt-step-*); starting over from "
            "the initial policy would train every sample again, so restore one or use a new --run-dir"
        )

    def _build(self, source: Path, *, step: int = -1) -> None:
        """The policy (safetensors only: a pickled `pytorch_model.bin` is refused, never unpickled), its
        tokenizer when it has one, and the learner core around them; `step` is the checkpoint `source` is in."""
        from tlt_stream.model import load_tokenizer

        if not source.is_dir():
            raise FileNotFoundError(f"{source}: initial policy directory does not exist")
        try:
            self.core = self.trainer.build(source, step=step)
        except (OSError, ValueError, KeyError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{source}: cannot load the policy ({reason})") from exc
        try:  # saved into every version it publishes, where the workers load it
            self.tokenizer = load_tokenizer(self.config.data.tokenizer or source)
        except CheckpointError as exc:  # none to train with: the workers, which need one, say so
            log.warning("no tokenizer to publish with the policy: %s", exc)
            self.tokenizer = None
        model = self.core.model
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    def save(self, extra: dict[str, Any], ledger: set[str]) -> CheckpointInfo:
        return self.trainer.save(
            self.root,
            step=self.version,
            ledger=ledger,
            extra=extra,
            tokenizer=self.tokenizer,
            keep=self.config.learner.keep_checkpoints,
            publish_dtype=self.publish_dtype,
        )

    async def save_or_stop(self, extra: dict[str, Any], ledger: set[str], stop: asyncio.Event | None) -> CheckpointInfo:
        """`save` off the loop; ranks out of step (a rank died mid-save) stop the service, since no retry can
        bring the dead rank back: the update's samples stay pending and a restart trains them."""
        try:
            return await in_own_thread(self.save, extra, ledger)
        except RanksOutOfStep:
            if stop is not None:
                stop.set()
            raise

    async def publish(self, info: CheckpointInfo) -> PolicyVersion:
        bus = self.config.bus
        location = announced_location(info.policy_dir, bus.store_root, relative=bus.relative_locations)
        message = PolicyVersion(
            version=info.step,
            location=location,
            sha256=info.policy_sha256,
            step=info.step,
            digest=info.digest,
            published_at=time.time(),
        )
        await self.control.publish(message)
        return message

    def optimizer_write_figures(self) -> dict[str, float]:
        """The background optimizer writes (`Trainer.write_figures`: the newest one's seconds, the failures of
        every rank, the newest failure's rank and step) and, once after a resume that took older optimizer
        moments, the step they came from."""
        out = self.trainer.write_figures()
        out.update(self._resume_note)
        self._resume_note = {}
        return out

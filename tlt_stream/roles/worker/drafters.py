"""The drafter side of a rollout worker: hot swaps, a verdict on every swap, the SD table.

An EAGLE worker compares the announced `DrafterVersion` with its own before each engine hop and swaps a
newer one into the engine in place (in-flight rows go on: speculative decoding is lossless whatever the
drafter proposes), after checking its sha256; an engine that holds the draft weights in processes of its
own (vLLM's workers) is asked for one tensor back, which must be the announced checkpoint's. Every policy
and drafter swap is judged by the acceptance after it (`rollout/collapse.py`): a collapse is logged,
counted and shown to the monitor, and a collapsed drafter is answered by going back to the one before it
and never swapping it in again. With adaptive SD the worker exploits the best-arm table the SD-config
publisher announces (`roles/sd_config.py`); a vLLM
engine takes that table as its batch-size schedule in place (`VllmEngine.set_schedule`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import DrafterVersion, SdArmChoice, SdConfigVersion
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.model.loader import CheckpointError
from tlt_stream.model.threads import in_own_thread
from tlt_stream.rl.validate import location_problem
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.collapse import AcceptanceWatch
from tlt_stream.rollout.switch import bucket_of
from tlt_stream.rollout.vllm.config import UnsupportedSetting
from tlt_stream.store.digest import ChecksumMismatch, verify_directory

if TYPE_CHECKING:
    from tlt_stream.rollout.adaptive import AdaptiveSd
    from tlt_stream.rollout.protocol import RolloutEngine

__all__ = ["DrafterSwaps", "read_back"]

log = logging.getLogger("tlt_stream.roles.rollout_worker")

READ_BACK = ("layer.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight")
"""The tensor read back after a swap (H values, changed by training): its name in a drafter checkpoint, and in
vLLM's EAGLE draft model."""


def read_back(engine: RolloutEngine, location: str) -> str | None:
    """After a swap into an engine whose draft model lives in other processes (`draft_tensor`: vLLM's workers):
    the sha256 of the float32 bytes of `READ_BACK` as the engine holds it; CheckpointError when it is not the
    checkpoint's at `location`. None for an engine holding the drafter in this process."""
    held_by = getattr(engine, "draft_tensor", None)
    if held_by is None:
        return None
    from safetensors import safe_open

    from tlt_stream.drafter.model import WEIGHTS

    ours, theirs = READ_BACK
    with safe_open(str(Path(location) / WEIGHTS), framework="pt") as weights:
        announced = weights.get_tensor(ours).float().flatten()
    held = held_by(theirs).float().flatten()
    if not torch.equal(held, announced):
        raise CheckpointError(f"{location}: after the swap the engine holds other {theirs} than the checkpoint")
    return hashlib.sha256(held.numpy().tobytes()).hexdigest()


class DrafterSwaps:
    """The drafter in the worker's engine, the swaps that put it there, and the verdict on each swap."""

    def __init__(self, config: Config, control: ControlPlane, registry: WorkerRegistry, worker_id: str) -> None:
        self.config = config
        self.control = control
        self.registry = registry
        self.worker_id = worker_id
        self.eagle = config.sd.drafter not in (None, "ngram")
        self.drafter: DrafterVersion | None = None
        """The announced drafter version in use (None: the warm-up drafter given by `sd.drafter`)."""
        self.swaps = 0
        self.in_use: tuple[str | None, DrafterVersion | None] = (config.sd.drafter, None)
        """(location, announcement) of the drafter in the engine; the warm-up drafter has no announcement."""
        self._before: tuple[str | None, DrafterVersion | None] | None = None
        self.refused: set[int] = set()
        """Drafter versions gone back from after their acceptance collapsed (never swapped in again)."""
        self.watch = AcceptanceWatch(min_drafted=config.sd.collapse_min_drafted)
        """Judges every policy and drafter swap by the acceptance after it (no silent collapse)."""
        self.collapses = 0
        self.sd_config = -1
        """The `sd_config` version adopted."""

    @property
    def version(self) -> int:
        """The drafter version samples report: an announced version, 0 for the warm-up drafter, -1 without."""
        if self.drafter is not None:
            return self.drafter.version
        return 0 if self.eagle else -1

    @property
    def location(self) -> str | None:
        """Where the drafter a new engine should start with lies (None: no draft source)."""
        return self.drafter.location if self.drafter is not None else self.config.sd.drafter

    async def maybe_swap(self, engine: RolloutEngine | None, adaptive: AdaptiveSd | None) -> None:
        """Swap a newly announced drafter into the engine between decode steps (in-flight rows go on)."""
        announced = self.control.current.get("drafter")
        if not isinstance(announced, DrafterVersion) or not self.eagle or engine is None:
            return
        if announced.version <= self.version or announced.version in self.refused:
            return

        def load() -> str | None:
            if problem := location_problem(announced.location, self.config.bus.store_root):
                raise CheckpointError(problem)
            verify_directory(announced.location, announced.sha256)
            engine.load_drafter(announced.location)  # in place: in-flight requests go on
            return read_back(engine, announced.location)

        try:
            held = await in_own_thread(load)
        except (ChecksumMismatch, CheckpointError, OSError, ValueError) as exc:
            log.error("refused drafter version %d: %s", announced.version, exc)
            self.registry.update_info(refused_drafter=f"{announced.version}: {exc}")
            self.drafter = announced  # do not retry the same version on every step
            return
        if held is not None:  # what the monitor (and an auditor) can compare with the checkpoint's own bytes
            self.registry.update_info(drafter_read_back=f"{announced.version}:{held}")
        self.drafter = announced
        self.swaps += 1
        self._before, self.in_use = self.in_use, (announced.location, announced)
        self.swapped("drafter", announced.version, engine)
        if adaptive is not None:
            adaptive.on_new_drafter(announced.version)
        self.registry.update_info(drafter_version=announced.version)
        log.info("%s: swapped in drafter version %d", self.worker_id, announced.version)

    def swapped(self, kind: str, version: int, engine: RolloutEngine | None) -> None:
        """A policy or drafter version just went into `engine`: the acceptance after it will be judged."""
        if engine is not None and hasattr(engine, "drafted_by"):
            self.watch.swapped(kind, version, engine.drafted_by, engine.accepted_by)

    def judge(self, engine: RolloutEngine) -> None:
        """After a swap's first rounds: say how acceptance moved; a collapse is logged, counted (stats, the
        monitor) and, for a drafter, answered by going back to the drafter before it."""
        verdict = self.watch.check(engine.drafted_by, engine.accepted_by) if hasattr(engine, "drafted_by") else None
        if verdict is None:
            return
        before = "unknown" if verdict.before is None else f"{verdict.before:.2f}"
        if not verdict.collapsed:
            log.info("acceptance after %s version %d: %.2f (before: %s)", verdict.kind, verdict.version,
                     verdict.after, before)  # fmt: skip
            return
        self.collapses += 1
        reason = f"{verdict.kind} v{verdict.version}: acceptance {before} -> {verdict.after:.2f}"
        log.warning("%s: acceptance collapsed after %s", self.worker_id, reason)
        self.registry.update_info(acceptance_collapse=reason)
        if verdict.kind != "drafter" or self._before is None or self._before[0] is None:
            return
        location, announcement = self._before
        try:
            engine.load_drafter(location)
        except (CheckpointError, OSError, ValueError) as exc:
            log.error("could not go back to the drafter at %s (%s); keeping drafter v%d", location, exc,
                      verdict.version)  # fmt: skip
            return
        self.refused.add(verdict.version)
        self.drafter = announcement
        self.in_use, self._before = self._before, None
        back = "the warm-up one" if announcement is None else f"v{announcement.version}"
        log.warning("%s: went back to drafter %s after drafter v%d collapsed", self.worker_id, back, verdict.version)

    def adopt_sd_config(self, engine: RolloutEngine | None, adaptive: AdaptiveSd | None) -> None:
        """A newly published table of best arms per bucket: the torch engine's tuner exploits it (still
        exploring with epsilon); a vLLM engine takes it as its batch-size schedule in place (`set_schedule`,
        from vLLM's next step). A table the engine cannot run (a deeper chain or another method than
        it was built with, a tree arm) is refused once, logged and shown in the worker's info; the schedule in
        use stays."""
        announced = self.control.current.get("sd_config")
        if not isinstance(announced, SdConfigVersion) or announced.version <= self.sd_config:
            return
        schedules = engine is not None and hasattr(engine, "set_schedule")
        if adaptive is None and not schedules:
            return
        edges = adaptive.tuner.edges if adaptive is not None else self.config.sd.edges
        best = {bucket_of(choice.max_batch, edges): _arm(choice) for choice in announced.table}
        self.sd_config = announced.version
        self.registry.update_info(sd_config_version=announced.version)
        if adaptive is not None:
            adaptive.adopt(best, announced.drafter_version)
            return
        drafted = any(arm.uses_drafter for arm in best.values())
        if drafted and announced.drafter_version < self.version:
            why = f"measured with drafter v{announced.drafter_version}, older than ours (v{self.version})"
            log.info("%s: sd_config version %d %s: kept the schedule in use", self.worker_id, announced.version, why)
            return
        try:
            schedule = engine.set_schedule({bucket: arm.label for bucket, arm in best.items()})  # type: ignore[union-attr]
        except UnsupportedSetting as exc:
            log.warning("%s: refused sd_config version %d: %s", self.worker_id, announced.version, exc)
            self.registry.update_info(refused_sd_config=f"{announced.version}: {exc}")
            return
        log.info("%s: sd_config version %d as the engine's schedule %s", self.worker_id, announced.version, schedule)


def _arm(choice: SdArmChoice) -> Arm:
    if not choice.enabled:
        return Arm.plain()
    return Arm(choice.proposer, choice.depth, choice.topk, choice.verify, choice.group)

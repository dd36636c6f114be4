"""Adaptive speculative decoding: the engine decides per step, from measurements, whether and how to speculate.

TLT's second half (DESIGN section 7). `AdaptiveSd.step()` replaces `engine.step()`:

1. the running batch size of the coming step sets `SdSwitch` on or off (hysteresis around the measured
   crossover: SD pays at small batches, costs at large ones);
2. `SdTuner` picks an arm for the batch-size bucket (epsilon-greedy on each arm's throughput over its
   recent steps, `SdTuner.estimate`; a published table of best arms is exploited first). Where the switch
   is on it tries every arm; where it is off it runs plain decoding unless exploring found an arm that
   beats plain there (`above_crossover = "measure"`, the default) or, with `"plain"`, always plain;
3. the engine runs the step with that arm (`engine.arm`, switchable between any two steps without
   disturbing in-flight rows: SD is lossless either way), and the step's emitted tokens over its wall
   time (draft + verify) are recorded for the arm, except for steps that also prefilled new requests,
   whose time is not the arm's.

Measurements accumulate per (bucket, arm) for `drain_reports()` (tokens, seconds, steps and the rows those
steps ran, so both the arm's speed and its acceptance), which the worker sends to `stats` as
`SdArmReport`s; the policy service aggregates every worker's reports into the published `sd_config`.
The engine holds one proposer, so the arms are plain decoding plus the arms of the kinds that proposer drafts
(EAGLE drafter arms, n-gram arms, group/history arms, or drafter, group and mixed arms when EAGLE and the
group source sit side by side).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tlt_stream.basics.config import DEFAULTS, SdConfig
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import SdSwitch, SdTable
from tlt_stream.rollout.tuner import SdTuner

__all__ = ["AdaptiveSd", "ArmMeasurement", "arm_kinds", "sd_tuner"]


def arm_kinds(proposer: Any) -> frozenset[str]:
    """The arm kinds a proposer drafts: its `kinds` attribute; a proposer without one (a test's or a
    benchmark's own) drafts drafter arms."""
    return frozenset(getattr(proposer, "kinds", ("drafter",)))


def sd_tuner(arms: Sequence[Arm], settings: SdConfig, *, drafter_version: int, contexts: int = 1) -> SdTuner:
    """The per-bucket tuner of adaptive SD on either engine (`AdaptiveSd` here, `VllmTuning` on vLLM): `arms`
    over `settings`' batch buckets, exploration and challenge; `drafter_version` -1 when no arm drafts with
    an EAGLE drafter."""
    return SdTuner(
        arms,
        edges=settings.edges,
        epsilon=settings.epsilon,
        window=settings.window,
        drafter_version=drafter_version,
        contexts=contexts,
        challenge=settings.challenge,
    )


@dataclass
class ArmMeasurement:
    bucket: int
    arm: Arm
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    rows: int = 0
    """Rounds of single rows: the running rows summed over the steps, so `tokens / rows` is what one row's
    round emitted (the arm's acceptance; 1 for plain decoding)."""
    contexts: int = 0
    """The longest running row's context (tokens in the KV cache) at each step's start, summed over the steps
    (0: not counted), so `contexts / steps` is the context a step's forward attended over."""


@dataclass
class _Log:
    switches: list[tuple[float, int, bool]] = field(default_factory=list)
    """(time, batch size, SD on) at every switch."""
    chosen: Counter[tuple[int, str]] = field(default_factory=Counter)
    """Steps per (bucket, arm label)."""


class AdaptiveSd:
    """Per-step SD decisions for one engine (which must have a proposer)."""

    def __init__(
        self,
        engine: Any,
        settings: SdConfig = DEFAULTS.sd,
        *,
        drafter_version: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`clock` times each step for the tuner (a test hands in a steady one, so its measurements, and with
        them the arms chosen, do not depend on how busy the machine is)."""
        proposer = getattr(engine, "proposer", None)
        if proposer is None:
            raise ValueError("adaptive SD needs an engine with a proposer (a drafter or the n-gram proposer)")
        kinds = arm_kinds(proposer)
        arms = [a for a in (Arm.from_label(label) for label in settings.arms) if a.kind in ("plain", *kinds)]
        if not any(a.kind != "plain" for a in arms):
            raise ValueError(f"no {' or '.join(sorted(kinds))} arm among {settings.arms}")
        self.engine = engine
        self.settings = settings
        self.kinds = kinds
        self.tuner = sd_tuner(
            arms,
            settings,
            drafter_version=drafter_version if "drafter" in kinds else -1,
            contexts=getattr(proposer, "contexts", 1) if settings.context_rows > 0 else 1,
        )
        self.switch = SdSwitch.from_crossover(settings.crossover, settings.margin)
        self.rng = random.Random(settings.seed)
        self.log = _Log()
        self._pending: dict[tuple[int, Arm], ArmMeasurement] = {}
        self.arm: Arm = Arm.plain()
        self.clock = clock

    def step(self) -> list[Any]:
        engine = self.engine
        scheduler = engine.scheduler
        batch = max(1, min(scheduler.max_batch, scheduler.num_running + scheduler.num_waiting))
        on = self.switch.update(batch)
        if self.switch.changed:
            self.log.switches.append((time.time(), batch, on))
        running = scheduler.num_running
        context = 0
        if self.tuner.contexts > 1 and running > 0 and batch <= self.settings.context_rows:
            context = engine.proposer.context(running)
        if on or self.settings.above_crossover == "measure":
            arm = self.tuner.choose(batch, self.rng, expect_sd=on, context=context)
        else:
            arm = Arm.plain()
        engine.arm = None if arm.kind == "plain" else arm
        self.arm = arm
        waiting, tokens = scheduler.num_waiting, engine.tokens_generated
        cache = getattr(engine, "cache", None)  # running rows hold slots 0..running-1
        longest = int(cache.lengths[:running].max()) if cache is not None and running else 0
        started = self.clock()
        results = engine.step()
        seconds = self.clock() - started
        emitted = engine.tokens_generated - tokens
        bucket = self.tuner.bucket(batch)
        self.log.chosen[(bucket, arm.label)] += 1
        if scheduler.num_waiting == waiting and seconds > 0 and emitted > 0:  # no prefill in this step
            self.tuner.record(batch, arm, emitted, seconds, context=context)
            pending = self._pending.setdefault((bucket, arm), ArmMeasurement(bucket, arm))
            pending.tokens += emitted
            pending.seconds += seconds
            pending.steps += 1
            pending.rows += running
            pending.contexts += longest
        return results

    def drain_reports(self) -> list[ArmMeasurement]:
        """Measurements since the last call, one per (bucket, arm) (for `SdArmReport`s)."""
        reports, self._pending = list(self._pending.values()), {}
        return reports

    def adopt(self, best: Mapping[int, Arm], drafter_version: int) -> bool:
        """Exploit a published table of best arms per bucket (arms this engine cannot run are ignored)."""
        usable = {b: a for b, a in best.items() if a.kind in ("plain", *self.kinds)}
        return self.tuner.adopt_table(SdTable(best=usable, drafter_version=drafter_version))

    def on_new_drafter(self, version: int) -> bool:
        return "drafter" in self.kinds and self.tuner.on_new_drafter(version, self.settings.on_new_drafter)

    def summary(self) -> dict[str, Any]:
        """Arms chosen per bucket (steps) and the on/off switches so far."""
        per_bucket: dict[str, dict[str, int]] = {}
        for (bucket, label), steps in sorted(self.log.chosen.items()):
            per_bucket.setdefault(str(bucket), {})[label] = steps
        return {"switches": self.switch.switches, "chosen": per_bucket}

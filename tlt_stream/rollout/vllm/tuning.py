"""The per-bucket tuner on a vLLM engine (pure: no vllm import).

The torch engine's `AdaptiveSd` picks an arm before every step. vLLM fixes a step's chain length in its
scheduler from a batch-size schedule, which `VllmEngine.set_schedule` replaces in place (`scheduling.py`), and
its worker measures every decode step (`measure.py`). `VllmTuning` closes the loop with the same `SdTuner`:
every `every` engine steps it reads the steps vLLM measured (rows, chain length K, tokens, seconds), records
each for the arm of K in the rows' bucket, asks the tuner for each bucket's arm (epsilon-greedy, a published
table exploited first, the `SdSwitch` threshold as the prior) and hands the engine the resulting schedule
when it changed. The steps also become the `SdArmReport`s the worker sends (`drain_reports`), so the policy
service's SD-config publisher pools vLLM workers' measurements with everyone's, and a published table comes
back through `adopt`.

The arms are what one vLLM engine can switch between per step: plain decoding and chains of its own method
(EAGLE or n-gram) no deeper than it was built with (`build.py` builds it with the deepest chain of
`sd.arms`). Trees, group drafts and the other method need another engine and are left out.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tlt_stream.basics.config import DEFAULTS, SdConfig
from tlt_stream.rollout.adaptive import ArmMeasurement, sd_tuner
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import SdSwitch, SdTable, bucket_of

__all__ = ["VllmTuning", "deepest_chain", "pool_steps", "tunable_arms"]


def pool_steps(steps: Iterable[Any], arm_of: Callable[[int], Arm], edges: Sequence[int]) -> list[ArmMeasurement]:
    """Steps (`measure.Step`: rows, k, tokens, seconds, ...) pooled per (bucket of `edges`, arm of k)."""
    pooled: dict[tuple[int, Arm], ArmMeasurement] = {}
    for step in steps:
        bucket, arm = bucket_of(step.rows, edges), arm_of(step.k)
        m = pooled.setdefault((bucket, arm), ArmMeasurement(bucket, arm))
        m.tokens += step.tokens
        m.seconds += step.seconds
        m.steps += 1
    return list(pooled.values())


def tunable_arms(labels: Iterable[str], kind: str, depth: int) -> list[Arm]:
    """Plain and the chains of `kind` ("drafter" or "ngram") among `labels` no deeper than `depth`."""
    arms = [Arm.plain()]
    for arm in map(Arm.from_label, labels):
        chain = arm.kind == kind and arm.topk == 1 and arm.verify == arm.depth and arm.depth <= depth
        if chain and arm not in arms:
            arms.append(arm)
    return arms


def deepest_chain(labels: Iterable[str], kind: str) -> Arm | None:
    """The deepest chain of `kind` among `labels` (what a tuned vLLM engine is built to draft)."""
    chains = [a for a in tunable_arms(labels, kind, 1 << 16) if a.kind != "plain"]
    return max(chains, key=lambda a: a.depth, default=None)


class VllmTuning:
    """`AdaptiveSd`'s surface (`step`, `drain_reports`, `adopt`, `on_new_drafter`, `summary`, `tuner`) for a
    `VllmEngine` built with a chain arm (module docstring)."""

    def __init__(
        self, engine: Any, settings: SdConfig = DEFAULTS.sd, *, drafter_version: int = 0, every: int = 8
    ) -> None:
        top = engine.arm
        if top is None or top.kind not in ("drafter", "ngram"):
            raise ValueError("the tuner on vLLM switches between plain decoding and EAGLE or n-gram chains")
        built = getattr(getattr(engine, "settings", None), "edges", settings.edges)
        if tuple(built) != tuple(settings.edges):
            raise ValueError(f"the engine's schedule buckets {tuple(built)} are not the tuner's {settings.edges}")
        arms = tunable_arms(settings.arms, top.kind, top.depth)
        if top not in arms:
            arms.append(top)
        self.engine = engine
        self.settings = settings
        self.every = every
        self.tuner = sd_tuner(arms, settings, drafter_version=drafter_version if top.kind == "drafter" else -1)
        self.switch = SdSwitch.from_crossover(settings.crossover, settings.margin)
        self.rng = random.Random(settings.seed)
        self.schedule: dict[int, str] | None = None
        """The per-bucket arms the engine runs now (None until the first choice)."""
        self.chosen: Counter[tuple[int, str]] = Counter()
        """Measured steps per (bucket, arm label)."""
        self._pending: dict[tuple[int, Arm], ArmMeasurement] = {}
        self._since = 0
        engine.drain_steps()  # steps the engine ran before this tuner (another schedule) are not its measurements
        self.choose()

    @property
    def arm(self) -> Arm:
        return self.engine.arm

    def step(self) -> list[Any]:
        results = self.engine.step()
        self._since += 1
        if self._since >= self.every:
            self.refresh()
        return results

    def refresh(self) -> None:
        """Record the steps vLLM measured since the last refresh, then choose each bucket's arm again."""
        self._since = 0
        steps = self.engine.drain_steps()
        for step in steps:
            arm = self.engine.arm_of(step.k)
            if arm not in self.tuner.arms:
                continue
            self.tuner.record(step.rows, arm, step.tokens, step.seconds)
            self.chosen[(self.tuner.bucket(step.rows), arm.label)] += 1
        for m in pool_steps(steps, self.engine.arm_of, self.tuner.edges):
            pending = self._pending.setdefault((m.bucket, m.arm), ArmMeasurement(m.bucket, m.arm))
            pending.tokens += m.tokens
            pending.seconds += m.seconds
            pending.steps += m.steps
        self.choose()

    def choose(self) -> dict[int, str]:
        """Each bucket's arm from the tuner, given to the engine as its schedule when it changed."""
        edges = self.tuner.edges
        table = {}
        for bucket in range(len(edges) + 1):
            batch = edges[bucket] if bucket < len(edges) else edges[-1] + 1
            arm = self.tuner.choose(batch, self.rng, expect_sd=batch <= self.switch.threshold)
            table[bucket] = arm.label
        if table != self.schedule:
            self.engine.set_schedule(table)
            self.schedule = table
        return table

    def drain_reports(self) -> list[ArmMeasurement]:
        """Measurements since the last call, one per (bucket, arm) (for `SdArmReport`s)."""
        self.refresh()
        reports, self._pending = list(self._pending.values()), {}
        return reports

    def adopt(self, best: Mapping[int, Arm], drafter_version: int) -> bool:
        """Exploit a published table of best arms per bucket (arms this engine cannot switch to are ignored);
        the engine's schedule follows at once."""
        usable = {b: a for b, a in best.items() if a in self.tuner.arms}
        adopted = self.tuner.adopt_table(SdTable(best=usable, drafter_version=drafter_version))
        self.choose()
        return adopted

    def on_new_drafter(self, version: int) -> bool:
        return self.arm.kind == "drafter" and self.tuner.on_new_drafter(version, self.settings.on_new_drafter)

    def summary(self) -> dict[str, Any]:
        """Measured steps per bucket and arm, and the schedule in use."""
        per_bucket: dict[str, dict[str, int]] = {}
        for (bucket, label), steps in sorted(self.chosen.items()):
            per_bucket.setdefault(str(bucket), {})[label] = steps
        return {"chosen": per_bucket, "schedule": dict(self.schedule or {})}

"""Adaptive speculative decoding, the pure parts around the tuner: the batch-size buckets arms are chosen
per, when SD is on at all, and the table several workers' measurements are pooled into.

- `bucket_of`: the bucket of a running batch size (bucket i holds batches in (edges[i-1], edges[i]]);
- `SdSwitch` turns SD on and off by running batch size, with a hysteresis band so that a batch hovering
  around the threshold does not flap (SD pays while the running batch is small, since verifying k tokens
  costs little more than one, and costs once it is large);
- `aggregate_reports` merges several workers' measurements into the table the policy service publishes;
  workers exploit that table and keep exploring with probability epsilon.

Nothing here does I/O or keeps time.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.rollout.arms import Arm

__all__ = [
    "DEFAULT_EDGES",
    "ArmReport",
    "SdSwitch",
    "SdTable",
    "aggregate_reports",
    "arm_of_report",
    "bucket_of",
    "check_edges",
    "threshold_from_crossover",
]

DEFAULT_EDGES: tuple[int, ...] = DEFAULTS.sd.edges
"""Bucket upper bounds by running batch size: bucket i holds batches in (edges[i-1], edges[i]]."""


def bucket_of(batch_size: int, edges: Sequence[int] = DEFAULT_EDGES) -> int:
    """Bucket index of a running batch size: i with edges[i-1] < batch_size <= edges[i]; len(edges) above."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return bisect.bisect_left(check_edges(edges), batch_size)


def check_edges(edges: Sequence[int]) -> tuple[int, ...]:
    edges = tuple(edges)
    if not edges or edges[0] < 1 or any(a >= b for a, b in itertools.pairwise(edges)):
        raise ValueError(f"bucket edges must be positive and strictly increasing, got {edges}")
    return edges


# ---------------------------------------------------------------------------------------------------- on/off


def threshold_from_crossover(crossover: int, margin: int) -> int:
    """The `SdSwitch` threshold for a measured crossover (the smallest batch where SD lost).

    The hysteresis band lies below the crossover: SD turns on at `crossover - 1 - margin` and off above
    `crossover - 1`, so it never runs where it was measured to lose, and inside the band, where SD is within
    noise of plain decoding, keeping either state costs little. 0 (never on) when the crossover is 1.
    """
    if crossover < 1 or margin < 0:
        raise ValueError(f"need crossover >= 1 and margin >= 0, got {crossover}, {margin}")
    return max(0, crossover - 1 - margin)


class SdSwitch:
    """SD on when the running batch is <= `threshold`, off when it is > `threshold + margin`.

    In between (the band) the switch keeps its state, so a batch size oscillating inside
    [threshold, threshold + margin] flips it at most once. It starts off: a rollout starts with a full
    batch. `update` is called once per engine step; switching between steps leaves in-flight sequences
    alone (SD is lossless either way).
    """

    def __init__(self, threshold: int, margin: int = 0, *, on: bool = False) -> None:
        if threshold < 0 or margin < 0:
            raise ValueError(f"need threshold >= 0 and margin >= 0, got {threshold}, {margin}")
        self.threshold = threshold
        self.margin = margin
        self._on = on
        self._changed = False
        self.switches = 0
        """State changes so far (on and off together)."""

    @classmethod
    def from_crossover(cls, crossover: int, margin: int, *, on: bool = False) -> SdSwitch:
        return cls(threshold_from_crossover(crossover, margin), margin, on=on)

    @property
    def on(self) -> bool:
        return self._on

    @property
    def changed(self) -> bool:
        """Whether the last `update` switched (for the engine to log)."""
        return self._changed

    @property
    def off_above(self) -> int:
        return self.threshold + self.margin

    def update(self, batch_size: int) -> bool:
        """Feed the running batch size of the next step; returns whether SD runs in it."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        previous = self._on
        if batch_size <= self.threshold:
            self._on = True
        elif batch_size > self.off_above:
            self._on = False
        self._changed = self._on != previous
        self.switches += int(self._changed)
        return self._on


# ---------------------------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class SdTable:
    """Per-bucket best arms aggregated across workers, measured with drafter `drafter_version` (-1: none)."""

    best: Mapping[int, Arm]
    drafter_version: int = -1
    rates: Mapping[int, Mapping[Arm, float]] = field(default_factory=dict)
    """Every aggregated arm's tokens/s per bucket (for logs and dashboards)."""


class ArmReport(Protocol):
    """What `aggregate_reports` reads; `messages.SdArmReport` fits. An n-gram report must carry
    `proposer = "ngram"` (without that attribute, depth >= 1 means the drafter; depth 0 means plain)."""

    @property
    def drafter_version(self) -> int: ...
    @property
    def bucket(self) -> int: ...
    @property
    def depth(self) -> int: ...
    @property
    def topk(self) -> int: ...
    @property
    def verify(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def seconds(self) -> float: ...


def arm_of_report(report: ArmReport) -> Arm:
    """The arm a report measured (raises ValueError for a field combination no arm has)."""
    kind = "plain" if report.depth == 0 else getattr(report, "proposer", "drafter")
    return Arm(kind, report.depth, report.topk, report.verify, getattr(report, "group", 0))


def aggregate_reports(reports: Iterable[ArmReport]) -> SdTable:
    """Merge reports from any number of workers into the per-bucket best arms.

    Rate of (bucket, arm) = total tokens / total seconds over its reports: pooled, so each report weighs
    by the time it measured, and splitting or merging reports does not change the table. Drafter-arm
    reports from a drafter older than the newest version any report names (or from no drafter) are
    ignored; plain and n-gram reports stay valid whatever drafter their worker held. Ties go to the
    simpler arm.
    """
    reports = list(reports)
    newest = max((r.drafter_version for r in reports), default=-1)
    tokens: dict[tuple[int, Arm], int] = defaultdict(int)
    seconds: dict[tuple[int, Arm], float] = defaultdict(float)
    for report in reports:
        arm = arm_of_report(report)
        if arm.uses_drafter and (report.drafter_version < newest or report.drafter_version < 0):
            continue
        tokens[report.bucket, arm] += report.tokens
        seconds[report.bucket, arm] += report.seconds
    rates: dict[int, dict[Arm, float]] = defaultdict(dict)
    for (bucket, arm), total in seconds.items():
        if total > 0:
            rates[bucket][arm] = tokens[bucket, arm] / total
    best = {
        bucket: max(sorted(by_arm, key=lambda a: a.simplicity), key=by_arm.__getitem__)
        for bucket, by_arm in sorted(rates.items())
    }
    return SdTable(best=best, drafter_version=newest, rates=dict(rates))

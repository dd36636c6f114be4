"""Tokens a speculative round emits (accepted draft tokens + the bonus token), per arm and batch bucket.

An input the simulator does not derive: it comes from a run (`from_run`: each arm's measured tokens per row
and round in each batch bucket, from the SD arm reports `timeline.jsonl` keeps; older runs: the samples'
tokens per target forward), from a table the user gives, or from a published figure plus a stated law for the
arms it does not cover.

- `Acceptance.mean(arm, bucket)`: the table's entry for (arm, bucket), else (arm, any bucket), else ("*", any
  bucket), else the budget law: tau(arm) = 1 + (tau_ref - 1) * log2(1 + nodes) / log2(1 + nodes_ref), at most
  the arm's `most_tokens` (more verified nodes help with diminishing returns; an assumption, varied in the
  output);
- `Acceptance.draw(arm, bucket, rng)`: one round's emitted tokens, 1 .. L + 1 for an arm of L = `Arm.levels`,
  from the chain model whose per-token acceptance `a` gives that mean: P(k accepted) = a^k (1 - a) for k < L,
  a^L at L, so the mean is (1 - a^(L + 1)) / (1 - a).
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import arm_of_report

__all__ = ["Acceptance", "chain_alpha", "chain_mean", "from_reports", "from_run", "measured_table", "timeline_reports"]


def chain_mean(alpha: float, depth: int) -> float:
    """Expected tokens a chain round of `depth` drafts emits when each draft is accepted with `alpha`."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


@lru_cache(maxsize=4096)
def chain_alpha(mean: float, depth: int) -> float:
    """The per-token acceptance whose chain of `depth` emits `mean` tokens per round (bisection)."""
    if mean <= 1.0:
        return 0.0
    if mean >= depth + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_mean(mid, depth) < mean else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Acceptance:
    """Mean tokens per round per (arm label or "*", bucket or None), with a budget law for the rest."""

    table: Mapping[tuple[str, int | None], float] = field(default_factory=dict)
    ref_nodes: int = 48
    """Verified nodes of the arm the reference acceptance was measured with."""
    ref_tokens: float = 1.0
    """Tokens per round of that arm (1: no reference, unlisted arms gain nothing)."""
    source: str = "given"

    def __post_init__(self) -> None:
        for key, value in self.table.items():
            if not (value >= 1.0 and math.isfinite(value)):
                raise ValueError(f"acceptance {key}: tokens per round must be >= 1, got {value}")

    def mean(self, arm: Arm, bucket: int) -> float:
        if arm.kind == "plain":
            return 1.0
        for key in ((arm.label, bucket), (arm.label, None), ("*", bucket), ("*", None)):
            if key in self.table:
                return min(self.table[key], float(arm.most_tokens))
        scale = math.log2(1 + arm.nodes) / math.log2(1 + self.ref_nodes)
        return min(1.0 + (self.ref_tokens - 1.0) * scale, float(arm.most_tokens))

    def accepted(self, arm: Arm, bucket: int) -> float:
        """The draft tokens a row accepts in a round, on average: `mean` less the one token the target adds
        (0 for plain decoding)."""
        return max(0.0, self.mean(arm, bucket) - 1.0)

    def draw(self, arm: Arm, bucket: int, rng: random.Random | None) -> float:
        """One round's emitted tokens; with no `rng`, the mean itself (the expected-value simulation)."""
        mean = self.mean(arm, bucket)
        if rng is None or arm.kind == "plain":
            return mean
        alpha = chain_alpha(round(mean, 6), arm.levels)
        k = 0
        while k < arm.levels and rng.random() < alpha:
            k += 1
        return float(k + 1)

    @classmethod
    def published(cls, tokens: float, ref: Arm, source: str) -> Acceptance:
        """Only a published figure for `ref` (every bucket); other arms by the budget law."""
        return cls({(ref.label, None): tokens}, ref_nodes=ref.nodes, ref_tokens=tokens, source=source)

    @classmethod
    def uniform(cls, tokens: float, source: str = "given") -> Acceptance:
        """Every SD arm emits `tokens` per round (capped at its `Arm.most_tokens`) in every bucket."""
        return cls({("*", None): tokens}, ref_tokens=tokens, source=source)


def _pooled(reports: Iterable[Mapping[str, Any]], *, by_bucket: bool) -> dict[tuple[str, int | None], float]:
    """Tokens over rows per (arm label, bucket or None) over the reports that counted rows (a report of more
    tokens per row than its arm's `most_tokens`, which no round emits, is left out as damaged)."""
    tokens: dict[tuple[str, int | None], int] = defaultdict(int)
    rows: dict[tuple[str, int | None], int] = defaultdict(int)
    for report in reports:
        if report.get("kind", "sd_arm") != "sd_arm" or not report.get("rows"):
            continue
        try:
            arm = arm_of_report(SimpleNamespace(**{"proposer": "drafter", "group": 0, **report}))
            key = (arm.label, _count(report["bucket"]) if by_bucket else None)
            n_tokens, n_rows = _count(report["tokens"]), _count(report["rows"])
        except (KeyError, TypeError, ValueError):  # a report of another shape: the others stay usable
            continue
        if not n_rows or n_tokens > n_rows * arm.most_tokens:  # more than a round can emit: a damaged report
            continue
        tokens[key] += n_tokens
        rows[key] += n_rows
    return {key: tokens[key] / n for key, n in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))}


def _count(value: object) -> int:
    """A non-negative whole count from a report (ValueError for anything else: a string, NaN, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return int(value)


def measured_table(reports: Iterable[Mapping[str, Any]]) -> dict[str, dict[int, float]]:
    """Tokens per row and round per arm label and batch bucket, pooled over SD arm reports (`sd_arm` rows of
    a timeline: tokens and the running rows summed over the steps they measured). Reports without rows
    (from a worker that did not count them) are left out."""
    table: dict[str, dict[int, float]] = {}
    for (label, bucket), value in _pooled(reports, by_bucket=True).items():
        table.setdefault(label, {})[bucket] = value  # type: ignore[index]
    return table


def from_run(run_dir: str | Path, fallback: float | None = None) -> Acceptance | None:
    """The run's measured acceptance per (arm, bucket) from `RUN/timeline.jsonl` (`from_reports`). None when
    the run recorded no SD arm with rows (an older run, or no adaptive SD)."""
    path = Path(run_dir) / "timeline.jsonl"
    return from_reports(timeline_reports(path), fallback, str(path)) if path.exists() else None


def timeline_reports(path: Path) -> list[dict[str, Any]]:
    """The SD arm reports (`sd_arm` rows) of a timeline file."""
    reports = []
    if not path.is_file():
        return reports
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # a line cut short: the rest stays usable
            continue
        if isinstance(entry, dict) and entry.get("kind") == "sd_arm":
            reports.append(entry)
    return reports


def from_reports(reports: Iterable[Mapping[str, Any]], fallback: float | None, source: str) -> Acceptance | None:
    """Each SD arm's measured tokens per row and round per bucket, its pooled figure for its other buckets, and
    `fallback` (tokens per round) for arms never measured; None when no SD arm report counted rows."""
    reports = [r for r in reports if isinstance(r.get("depth"), int) and r["depth"] > 0]
    table = {key: max(1.0, value) for key, value in _pooled(reports, by_bucket=True).items()}
    if not table:
        return None
    table |= {key: max(1.0, value) for key, value in _pooled(reports, by_bucket=False).items()}
    if fallback is not None:
        table["*", None] = max(1.0, fallback)
    measured = sum(1 for _, bucket in table if bucket is not None)
    return Acceptance(table, ref_tokens=fallback or 1.0, source=f"{source} ({measured} arm-bucket entries measured)")

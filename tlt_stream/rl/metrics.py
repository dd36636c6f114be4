"""Per-step figures the learner reports besides its own loss statistics: when the step's samples were
generated, how long its tail ran, how long its responses were and how stale its groups were.

Everything comes from the samples themselves (each carries its creation time, `created_at`, and how long
its group had been generating, `gen_seconds`), so the figures are the same whichever process computes
them and however many workers produced the samples:

- rollout span: from the earliest generation start to the last sample's finish;
- tail phase: from the moment `tail_fraction` of the step's samples had finished to the last finish, i.e.
  the stretch where only the longest few responses still run (the long tail TLT targets);
- rollout tokens/s: the step's response tokens over its rollout span.

Pure functions of the samples: no I/O, unit-tested.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tlt_stream.basics.messages import Sample

__all__ = ["accept_by_drafter", "length_summary", "rollout_timing", "staleness_histogram"]


def _quantile(ordered: Sequence[float], q: float) -> float:
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def length_summary(samples: Sequence[Sample]) -> dict[str, float]:
    """Response-length distribution: mean, p10/p50/p90, max and max/median (the tail's reach)."""
    if not samples:
        raise ValueError("no samples")
    lengths = sorted(float(s.response_len) for s in samples)
    median = _quantile(lengths, 0.5)
    return {
        "response_len_mean": statistics.fmean(lengths),
        "response_len_p10": _quantile(lengths, 0.1),
        "response_len_p50": median,
        "response_len_p90": _quantile(lengths, 0.9),
        "response_len_max": lengths[-1],
        "response_len_max_over_median": lengths[-1] / max(median, 1.0),
    }


def rollout_timing(samples: Sequence[Sample], *, tail_fraction: float = 0.75) -> dict[str, float]:
    """Rollout span, tail-phase length and rollout throughput of one step's samples (seconds, tokens/s)."""
    if not samples:
        raise ValueError("no samples")
    if not 0 < tail_fraction < 1:
        raise ValueError(f"tail_fraction must be in (0, 1), got {tail_fraction}")
    finishes = sorted(s.created_at for s in samples)
    start = min(s.created_at - s.gen_seconds for s in samples)
    span = finishes[-1] - start
    # The tail begins when ceil(tail_fraction * n) samples are done; with one sample there is no tail.
    done = max(1, math.ceil(tail_fraction * len(finishes) - 1e-9))
    tail = finishes[-1] - finishes[done - 1]
    tokens = sum(s.response_len for s in samples)
    return {
        "rollout_seconds": span,
        "tail_seconds": tail,
        "tail_share": tail / span if span > 0 else 0.0,
        "rollout_tokens": float(tokens),
        "rollout_tokens_per_s": tokens / span if span > 0 else 0.0,
        "accept_length_mean": statistics.fmean(s.accept_length or 1.0 for s in samples),
    }


def staleness_histogram(staleness: Sequence[int]) -> dict[str, Any]:
    """Groups per staleness (learner version - the group's policy version), as {"0": n0, "1": n1, ...}."""
    return {str(k): v for k, v in sorted(Counter(staleness).items())}


def accept_by_drafter(samples: Sequence[Sample]) -> dict[int, float]:
    """Mean tokens per target forward of the samples generated with each drafter version (-1: none),
    weighted by response length (a long sample ran more rounds)."""
    tokens: dict[int, float] = {}
    forwards: dict[int, float] = {}
    for s in samples:
        if s.response_len and s.accept_length > 0:
            tokens[s.drafter_version] = tokens.get(s.drafter_version, 0.0) + s.response_len
            forwards[s.drafter_version] = forwards.get(s.drafter_version, 0.0) + s.response_len / s.accept_length
    return {v: tokens[v] / forwards[v] for v in sorted(tokens)}

"""Which rows share a learner micro-batch: widths only, no tensors (the learner's `batches.micro_batches`
builds them; the planner's CPU model costs them without importing torch)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_by_width"]


def split_by_width(widths: Sequence[float], tokens: int) -> list[list[int]]:
    """The positions of rows of these widths (prompt + response tokens) in each micro-batch: longest first
    (rows of one width in their order), `max(1, tokens // width)` rows to a batch padded to its first row's
    width. The learner's rule, and the planner's (`plan.costs.micro_batches`)."""
    order = sorted(range(len(widths)), key=lambda j: widths[j], reverse=True)
    out = []
    while order:
        count = max(1, int(tokens // max(widths[order[0]], 1)))
        out.append(order[:count])
        order = order[count:]
    return out

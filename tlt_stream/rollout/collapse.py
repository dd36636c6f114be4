"""No silent collapse: after a policy or drafter swap, the first rounds' acceptance against the previous
version's.

A peer's acceptance fell from 2.71 to 1.00 tokens per round after a weight sync, with no error: the drafter
no longer matched the policy's numbers and nobody noticed. SD stays lossless whatever the drafts, so
nothing but speed is at stake, and only a measurement can tell. `AcceptanceWatch` takes the engine's
cumulative per-source counters (`drafted_by`, `accepted_by`) at each swap, the acceptance (accepted /
drafted nodes) since the previous swap as the baseline, and judges once enough nodes were drafted after it:
a collapse is an acceptance below `ratio` times the baseline. A drafter swap is judged on the drafter's own
nodes (source `eagle`), a policy swap on every source's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["AcceptanceWatch", "SwapVerdict"]


@dataclass(frozen=True)
class SwapVerdict:
    """The judgement of one swap."""

    kind: str
    """"policy" or "drafter"."""
    version: int
    before: float | None
    """Acceptance since the previous swap (None: too few nodes drafted to tell)."""
    after: float
    """Acceptance over the first `min_drafted` nodes after the swap."""
    collapsed: bool


@dataclass
class _Pending:
    kind: str
    version: int
    sources: tuple[str, ...] | None
    drafted: dict[str, int]
    accepted: dict[str, int]
    before: float | None


def _total(counts: Mapping[str, int], base: Mapping[str, int], sources: Iterable[str] | None) -> int:
    names = counts.keys() if sources is None else sources
    return sum(counts.get(name, 0) - base.get(name, 0) for name in names)


class AcceptanceWatch:
    """Judges each swap by the acceptance after it against the acceptance before it."""

    def __init__(self, *, min_drafted: int = 256, ratio: float = 0.5) -> None:
        if min_drafted < 1 or not 0 < ratio < 1:
            raise ValueError(f"need min_drafted >= 1 and 0 < ratio < 1, got {min_drafted}, {ratio}")
        self.min_drafted = min_drafted
        self.ratio = ratio
        self._base: tuple[dict[str, int], dict[str, int]] = ({}, {})
        """The counters at the previous swap: the baseline window starts there."""
        self._pending: _Pending | None = None
        self.verdicts: list[SwapVerdict] = []

    def swapped(self, kind: str, version: int, drafted: Mapping[str, int], accepted: Mapping[str, int]) -> None:
        """A swap just happened; `drafted` and `accepted` are the engine's cumulative counters now. A swap not
        yet judged when the next one comes is left unjudged (its window is the next one's baseline)."""
        sources = ("eagle",) if kind == "drafter" else None
        base_d, base_a = self._base
        drafted_before = _total(drafted, base_d, sources)
        before = _total(accepted, base_a, sources) / drafted_before if drafted_before >= self.min_drafted else None
        self._pending = _Pending(kind, version, sources, dict(drafted), dict(accepted), before)
        self._base = (dict(drafted), dict(accepted))

    def check(self, drafted: Mapping[str, int], accepted: Mapping[str, int]) -> SwapVerdict | None:
        """The pending swap's verdict once `min_drafted` nodes were drafted after it (then once only)."""
        pending = self._pending
        if pending is None:
            return None
        drafted_after = _total(drafted, pending.drafted, pending.sources)
        if drafted_after < self.min_drafted:
            return None
        after = _total(accepted, pending.accepted, pending.sources) / drafted_after
        collapsed = pending.before is not None and after < self.ratio * pending.before
        verdict = SwapVerdict(pending.kind, pending.version, pending.before, after, collapsed)
        self._pending = None
        self.verdicts.append(verdict)
        return verdict

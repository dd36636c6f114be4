"""Which announced policy version a rollout worker should load next: the worker's version state machine.

A version is *loaded*, *refused* for good (its bytes do not match the announced sha256, its location lies
outside the store, its config cannot serve this worker) or *unavailable* for now (its directory is not
there: pruned by the learner for a newer version, or storage away for a while). An unavailable version is
tried again after a capped exponential backoff unless a newer one is announced first: refusing it for good
would stall an on-policy run whose tasks need exactly that version. Pure bookkeeping on version numbers
and a monotonic clock the caller passes in, so every transition is a plain unit test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PolicyVersions"]


@dataclass
class PolicyVersions:
    """Refused and unavailable versions, and when an unavailable one may be tried again."""

    backoff_base_s: float = 0.5
    backoff_cap_s: float = 10.0
    refused: set[int] = field(default_factory=set)
    unavailable: int | None = None
    """The newest version that could not be read (None: none pending a retry)."""
    retry_at: float = 0.0
    """Monotonic time of the unavailable version's next try."""
    tries: int = 0
    """Failed reads of the unavailable version so far."""

    def loadable(self, announced: int | None, current: int, now: float) -> bool:
        """Whether to load `announced` now: newer than `current`, never refused, and past its backoff."""
        if announced is None or announced <= current or announced in self.refused:
            return False
        return announced != self.unavailable or now >= self.retry_at

    def awaiting_retry(self, announced: int | None, current: int) -> bool:
        """Whether the newest announced version is one that could not be read and will be tried again."""
        return announced is not None and announced == self.unavailable and announced > current

    def refuse(self, version: int) -> None:
        """Never load `version` (a newer announcement is still loaded when it comes)."""
        self.refused.add(version)

    def unreadable(self, version: int, now: float) -> float:
        """`version` could not be read; returns the seconds until its next try (doubling, capped)."""
        self.tries = self.tries if self.unavailable == version else 0
        delay = min(self.backoff_cap_s, self.backoff_base_s * 2**self.tries)
        self.unavailable, self.retry_at, self.tries = version, now + delay, self.tries + 1
        return delay

    def loaded(self, version: int) -> None:
        """`version` is in use: nothing is pending a retry any more."""
        self.unavailable, self.retry_at, self.tries = None, 0.0, 0

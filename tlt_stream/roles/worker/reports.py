"""What a rollout worker reports to `stats`: one `RolloutStats` per batch of completed tasks, plus the
adaptive controller's `SdArmReport`s.

A report covers the engine hops since the previous one: tokens, target forwards and seconds, the running
batch, whether SD is on, per-source drafted and accepted nodes and the tokens re-verification kept or
discarded (deltas of the engine's cumulative counters), the seconds with a draft group in flight, and how
long each policy version loaded since took from its announcement. The monitor and `tlt-stream report` read
these entries; the SD-config publisher pools the arm reports of every worker into its table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tlt_stream.basics.messages import RolloutStats, SdArmReport
from tlt_stream.bus.producer import StreamProducer

if TYPE_CHECKING:
    from tlt_stream.roles.worker.intake import GroupTask
    from tlt_stream.rollout.adaptive import AdaptiveSd
    from tlt_stream.rollout.protocol import RolloutEngine

__all__ = ["RolloutReports"]


class RolloutReports:
    """The worker's counters since its last report, and the entries that report them."""

    producer: StreamProducer
    worker_id: str
    engine: RolloutEngine | None
    adaptive: AdaptiveSd | None
    tasks: dict[str, GroupTask]
    collapses: int

    def _init_reports(self) -> None:
        self._tokens = 0
        self._forwards = 0
        self._seconds = 0.0
        self._ahead_seconds = 0.0
        self._reported_sources: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._reported_reverify = (0, 0)
        """The engine's (tokens kept, tokens discarded) by re-verification at the last stats report."""
        self._load_latencies: dict[str, float] = {}
        """Versions loaded since the last stats report: seconds from their announcement to loaded."""

    def _count_hop(self, tokens: int, forwards: int, seconds: float) -> None:
        """One hop of engine steps into the next report (its seconds also as ahead time while a draft runs)."""
        self._tokens += tokens
        self._forwards += forwards
        self._seconds += seconds
        if any(t.delivery.message.min_policy_version > self.version for t in self.tasks.values()):  # a draft
            self._ahead_seconds += seconds

    async def _send_reports(self) -> None:
        """The report of the steps since the last one and the arm reports the controller holds, then the
        counters restart."""
        await self.producer.send_one("stats", self._rollout_stats())
        if self.adaptive is not None:
            reports = [
                SdArmReport(
                    worker_id=self.worker_id,
                    drafter_version=self.drafter_version,
                    bucket=m.bucket,
                    depth=m.arm.depth,
                    topk=m.arm.topk,
                    verify=m.arm.verify,
                    tokens=m.tokens,
                    seconds=m.seconds,
                    proposer=m.arm.kind,
                    steps=m.steps,
                    group=m.arm.group_nodes,
                )
                for m in self.adaptive.drain_reports()
            ]
            if reports:
                await self.producer.send("stats", reports)
        self._tokens, self._forwards, self._seconds, self._ahead_seconds = 0, 0, 0.0, 0.0

    def _rollout_stats(self) -> RolloutStats:
        """The report of the steps since the last one (the loop restarts its counters after it is sent)."""
        latencies, self._load_latencies = self._load_latencies, {}
        return RolloutStats(
            worker_id=self.worker_id,
            policy_version=self.version,
            drafter_version=self.drafter_version,
            batch_size=self._running(),
            tokens=self._tokens,
            seconds=self._seconds,
            target_forwards=self._forwards,
            sd_on=self.engine.arm is not None,
            collapses=self.collapses,
            load_latency_s=latencies,
            **self._source_counts(),
            **self._reverify_counts(),
        )

    def _source_counts(self) -> dict[str, dict[str, int]]:
        """Per-source drafted and accepted counts since the last report (deltas of the engine's counters)."""
        drafted = dict(getattr(self.engine, "drafted_by", {}))
        accepted = dict(getattr(self.engine, "accepted_by", {}))
        before_d, before_a = self._reported_sources
        self._reported_sources = (drafted, accepted)
        return {
            "drafted": {k: v - before_d.get(k, 0) for k, v in drafted.items() if v > before_d.get(k, 0)},
            "accepted": {k: v - before_a.get(k, 0) for k, v in accepted.items() if v > before_a.get(k, 0)},
        }

    def _reverify_counts(self) -> dict[str, Any]:
        """Partial rollouts since the last report: tokens kept and discarded by re-verification, seconds with
        a draft group in flight."""
        kept, discarded = getattr(self.engine, "tokens_kept", 0), getattr(self.engine, "tokens_discarded", 0)
        before_k, before_d = self._reported_reverify
        self._reported_reverify = (kept, discarded)
        return {
            "kept_tokens": kept - before_k,
            "discarded_tokens": discarded - before_d,
            "ahead_seconds": self._ahead_seconds,
        }

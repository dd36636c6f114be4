"""What a rollout worker reports to `stats`: one `RolloutStats` per batch of completed tasks, plus the
`SdArmReport`s of the adaptive controller (or of a vLLM engine's own step measurements).

A report covers the engine hops since the previous one: tokens, target forwards and seconds, the running
batch, whether SD is on, per-source drafted and accepted nodes and the tokens re-verification kept or
discarded (deltas of the engine's cumulative counters), the seconds with a draft group in flight, and how
long each policy version loaded since took from its announcement. The monitor and `tlt-stream report` read
these entries; the SD-config publisher pools the arm reports of every worker into its table.

A report also says where the worker's loop spent its time outside the hops (`loop_s`, by `LOOP_PARTS`), over
the passes of its loop that ran a hop: with `seconds`, the time the worker was generating. A version's load
is not in it (the worker's LOADING time), nor are passes that found nothing to decode (IDLE).
"""

from __future__ import annotations

import time
from typing import Any

from tlt_stream.basics.messages import RolloutStats, SdArmReport
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.roles.worker.drafters import DrafterSwaps
from tlt_stream.roles.worker.loading import PolicyLoader
from tlt_stream.roles.worker.tasks import InFlight

__all__ = ["LOOP_PARTS", "LoopClock", "RolloutReports"]

LOOP_PARTS = {
    "refresh": "the tasks held kept claimed (`StreamReader.maybe_refresh`)",
    "policy": "an announced policy looked for (loads themselves are LOADING time, not counted)",
    "drafter": "an announced drafter or SD config looked for and swapped in",
    "admit": "new tasks polled for and started",
    "rows": "the rows in flight written to the registry",
    "scored": "groups the reward pool scored, sent",
    "state": "the change to GENERATING written",
    "tasks": "the event loop's other tasks, run when a hop hands control back (buffered sends, heartbeats, messages)",
    "output": "a hop's finished rows decoded, scored, their windows and whole groups sent, reports sent",
    "judge": "a swap's acceptance judged",
}
"""The parts of the worker's loop outside its engine hops, as `RolloutStats.loop_s` names them."""


class LoopClock:
    """Seconds per part of one pass of the worker's loop: `lap(part)` charges the time since the last lap."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str | None) -> None:
        """The time since the last lap to `part` (None: to nothing, e.g. a hop, counted on its own)."""
        now = time.perf_counter()
        if part is not None:
            self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now


class RolloutReports:
    """The worker's counters since its last report, and the entries that report them."""

    def __init__(
        self, producer: StreamProducer, worker_id: str, flight: InFlight, loader: PolicyLoader, drafters: DrafterSwaps
    ) -> None:
        self.producer = producer
        self.worker_id = worker_id
        self.flight = flight
        self.loader = loader
        self.drafters = drafters
        self.tokens = 0
        self.forwards = 0
        self.seconds = 0.0
        self.ahead_seconds = 0.0
        self._sources: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._reverify = (0, 0)
        """The engine's (tokens kept, tokens discarded) by re-verification at the last stats report."""
        self.load_latencies: dict[str, float] = {}
        """Versions loaded since the last stats report: seconds from their announcement to loaded."""
        self.loop: dict[str, float] = {}
        """Seconds per `LOOP_PARTS` part since the last stats report."""

    def count_hop(self, tokens: int, forwards: int, seconds: float) -> None:
        """One hop of engine steps into the next report (its seconds also as ahead time while a draft runs)."""
        self.tokens += tokens
        self.forwards += forwards
        self.seconds += seconds
        if self.flight.drafting(self.loader.version):
            self.ahead_seconds += seconds

    def count_loop(self, parts: dict[str, float]) -> None:
        """Seconds the loop spent outside hops, per part, into the next report."""
        for part, seconds in parts.items():
            self.loop[part] = self.loop.get(part, 0.0) + seconds

    def loaded(self, version: int, latency: float) -> None:
        self.load_latencies[str(version)] = latency

    async def send(self) -> None:
        """The report of the steps since the last one and the arm reports the controller holds, then the
        counters restart."""
        await self.producer.send_one("stats", self.rollout_stats())
        measured = self._measured()
        if measured:
            reports = [
                SdArmReport(
                    worker_id=self.worker_id,
                    drafter_version=self.drafters.version,
                    bucket=m.bucket,
                    depth=m.arm.depth,
                    topk=m.arm.topk,
                    verify=m.arm.verify,
                    tokens=m.tokens,
                    seconds=m.seconds,
                    proposer=m.arm.kind,
                    steps=m.steps,
                    group=m.arm.group_nodes,
                    rows=m.rows,
                    contexts=m.contexts,
                )
                for m in measured
            ]
            if reports:
                await self.producer.send("stats", reports)
        self.tokens, self.forwards, self.seconds, self.ahead_seconds = 0, 0, 0.0, 0.0

    def _measured(self) -> list[Any]:
        """The arm measurements since the last report: the adaptive controller's, else those of a vLLM engine
        that drafts with a fixed arm or schedule (measured in vLLM's worker, `rollout/vllm/measure.py`)."""
        if self.loader.adaptive is not None:
            return self.loader.adaptive.drain_reports()
        engine = self.loader.engine
        if engine is not None and engine.arm is not None and hasattr(engine, "drain_measurements"):
            return engine.drain_measurements()
        return []

    def rollout_stats(self) -> RolloutStats:
        """The report of the steps since the last one (`send` restarts the counters after it is sent)."""
        latencies, self.load_latencies = self.load_latencies, {}
        loop, self.loop = self.loop, {}
        engine = self.loader.engine
        return RolloutStats(
            worker_id=self.worker_id,
            policy_version=self.loader.version,
            drafter_version=self.drafters.version,
            batch_size=int(engine.num_running) if engine is not None else 0,
            tokens=self.tokens,
            seconds=self.seconds,
            target_forwards=self.forwards,
            sd_on=engine is not None and engine.arm is not None,
            collapses=self.drafters.collapses,
            load_latency_s=latencies,
            loop_s={part: round(seconds, 6) for part, seconds in loop.items()},
            **self._source_counts(engine),
            **self._reverify_counts(engine),
        )

    def _source_counts(self, engine: Any) -> dict[str, dict[str, int]]:
        """Per-source drafted and accepted counts since the last report (deltas of the engine's counters)."""
        drafted = dict(getattr(engine, "drafted_by", {}))
        accepted = dict(getattr(engine, "accepted_by", {}))
        before_d, before_a = self._sources
        self._sources = (drafted, accepted)
        return {
            "drafted": {k: v - before_d.get(k, 0) for k, v in drafted.items() if v > before_d.get(k, 0)},
            "accepted": {k: v - before_a.get(k, 0) for k, v in accepted.items() if v > before_a.get(k, 0)},
        }

    def _reverify_counts(self, engine: Any) -> dict[str, Any]:
        """Partial rollouts since the last report: tokens kept and discarded by re-verification, seconds with
        a draft group in flight."""
        kept, discarded = getattr(engine, "tokens_kept", 0), getattr(engine, "tokens_discarded", 0)
        before_k, before_d = self._reverify
        self._reverify = (kept, discarded)
        return {
            "kept_tokens": kept - before_k,
            "discarded_tokens": discarded - before_d,
            "ahead_seconds": self.ahead_seconds,
        }

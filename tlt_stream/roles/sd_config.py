"""The SD-config publisher: every worker's measured arms, pooled into one table per batch bucket.

It runs inside the policy service's process (it owns the `sd_config` kind) but is a role of its own: it
reads `stats`, never `prompts`, and publishes a new `sd_config` version only when the best arm of a bucket
changes, so workers exploit what all of them measured and a late joiner starts from it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import PAYLOAD_FIELD
from tlt_stream.bus.streams import Keys

__all__ = ["SdConfigPublisher", "table_choices"]

log = logging.getLogger(__name__)


def table_choices(best: Any, edges: Any) -> list[Any]:
    """Per-bucket best arms (`SdTable.best`) as the `SdArmChoice` rows of an `sd_config` version."""
    from tlt_stream.basics.messages import SdArmChoice

    return [
        SdArmChoice(
            max_batch=edges[bucket] if bucket < len(edges) else edges[-1] + 1,
            depth=arm.depth,
            topk=arm.topk,
            verify=arm.verify,
            enabled=arm.kind != "plain",
            proposer=arm.kind,
            group=arm.group_nodes,
        )
        for bucket, arm in sorted(best.items())
    ]


class SdConfigPublisher:
    """Aggregates every worker's `SdArmReport`s from `stats` into per-bucket best arms and publishes them
    as a new `sd_config` version whenever the table changes (workers exploit it, late joiners start from it).

    Reports are pooled over the newest `window` of them (total tokens / total seconds per bucket and arm,
    `rollout.tuner.aggregate_reports`); drafter-arm reports from an older drafter than the newest are left
    out, so a new drafter's arms are judged on their own measurements.
    """

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, control: ControlPlane, *, edges: Sequence[int], window: int = 2000
    ) -> None:
        """`edges`: the workers' batch buckets (`sd.edges`): a report's bucket index is read with them, and
        each row of the table names its bucket by their upper edge, which workers bucket again."""
        from collections import deque

        from tlt_stream.rollout.switch import check_edges

        self.redis = redis
        self.keys = keys
        self.control = control
        self.edges = check_edges(edges)
        self.reports: deque[Any] = deque(maxlen=window)
        self.last_id = "0-0"
        self.published: dict[int, Any] | None = None
        self.codec = codec_for("stats")

    async def poll(self) -> bool:
        """Read new reports and publish a new version if the table changed; returns whether it published."""
        from tlt_stream.basics.messages import SdArmReport, SdConfigVersion
        from tlt_stream.rollout.switch import aggregate_reports

        stream = self.keys.stream("stats")
        while True:
            replies = await self.redis.xread({stream: self.last_id}, count=1000)
            if not replies:
                break
            for entry_id, fields in replies[0][1]:
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    message = self.codec.decode(fields[PAYLOAD_FIELD])
                except Exception:  # a malformed stats entry is the dead-letter path's business, not ours
                    continue
                if isinstance(message, SdArmReport):
                    self.reports.append(message)
        if not self.reports:
            return False
        table = aggregate_reports(self.reports)
        if dict(table.best) == self.published:
            return False
        message = SdConfigVersion(
            version=max(1, self.control.version("sd_config") + 1),
            drafter_version=table.drafter_version,
            table=table_choices(table.best, self.edges),
        )
        if not await self.control.publish(message):
            return False
        self.published = dict(table.best)
        summary = ", ".join(f"bucket {b}: {table.best[b].label}" for b in sorted(table.best))
        log.info("published sd_config version %d: %s", message.version, summary)
        return True

    async def run(self, stop: asyncio.Event, *, every_s: float = 5.0) -> None:
        from tlt_stream.basics.aio import sleep_or_stop

        while not await sleep_or_stop(stop, every_s):
            await self.poll()

"""History for group drafts across workers: other workers' finished responses, read as they are produced.

A worker with `sd.group` drafts from the responses of the same prompt (`rollout/proposers.py`,
`GroupProposer`). Its own responses are indexed while they run; the others' come from the `samples`
stream, followed with a plain XREAD from the stream's end (no consumer group, no round trip per decode
step). Lossy by design: an entry trimmed before it is read is one draft source missed, nothing else, and a
Redis outage only pauses the following (the bus's outage handling is the main loop's).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from tlt_stream.bus.streams import Keys

if TYPE_CHECKING:
    from tlt_stream.rollout.protocol import RolloutEngine

__all__ = ["SampleFollowing"]


class SampleFollowing:
    """The worker's follower of `samples`, feeding other workers' responses to its group draft source."""

    redis: aioredis.Redis
    keys: Keys
    worker_id: str
    engine: RolloutEngine | None

    def _init_following(self) -> None:
        self.remembered = 0
        """Other workers' finished responses indexed for group/history drafts (`_follow_samples`)."""
        self.following = asyncio.Event()
        """Set once `_follow_samples` reads `samples` from a position: entries added after it are seen."""

    def _group_source(self) -> Any:
        """The engine's group/history draft source (`GroupProposer`), or None."""
        proposer = getattr(self.engine, "proposer", None)
        source = getattr(proposer, "group", proposer)
        return source if hasattr(source, "remember") else None

    async def _follow_samples(self, stop: asyncio.Event) -> None:
        """Index other workers' finished responses as history for group drafts, read from `samples` as they
        are produced (a plain XREAD from the stream's end, no consumer group, no round trip per decode
        step). Lossy by design: an entry trimmed before it is read is a draft source missed, nothing else.
        Our own responses are indexed while they run."""
        from tlt_stream.basics.aio import sleep_or_stop
        from tlt_stream.basics.messages import codec_for
        from tlt_stream.bus.producer import PAYLOAD_FIELD

        stream, codec = self.keys.stream("samples"), codec_for("samples")
        last: str | bytes | None = None
        while not stop.is_set():
            source = self._group_source()
            if source is None:  # no engine yet (or no group source): read nothing, lose nothing
                await sleep_or_stop(stop, 0.2)
                continue
            try:
                if last is None:  # start at the stream's end: the history from now on
                    newest = await self.redis.xrevrange(stream, count=1)
                    last = newest[0][0] if newest else "0-0"
                    self.following.set()
                replies = await self.redis.xread({stream: last}, count=256, block=500)
            except aioredis.RedisError:  # the bus's outage handling is the main loop's; drafts can wait
                await sleep_or_stop(stop, 1.0)
                continue
            for _, entries in replies or []:
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        sample = codec.decode(fields[PAYLOAD_FIELD])
                    except Exception:  # a malformed entry is the learner's to dead-letter
                        continue
                    if sample.worker_id != self.worker_id and sample.token_ids.shape[0]:
                        source.remember(sample.prompt_ids, sample.token_ids.to_torch().tolist())
                        self.remembered += 1

"""History for group drafts across workers: other workers' finished responses, read as they are produced.

A worker with `sd.group` drafts from the responses of the same prompt (`rollout/proposers/group.py`,
`GroupProposer`). Its own responses are indexed while they run; the others' come from the `samples`
stream, followed with a plain XREAD from the stream's end (no consumer group, no round trip per decode
step). Lossy by design: an entry trimmed before it is read is one draft source missed, nothing else, and a
Redis outage only pauses the following (the bus's outage handling is the main loop's).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from tlt_stream.bus.streams import Keys
from tlt_stream.roles.worker.loading import PolicyLoader

__all__ = ["SampleFollower"]


class SampleFollower:
    """The worker's follower of `samples`, feeding other workers' responses to its group draft source."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, worker_id: str, loader: PolicyLoader) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.loader = loader
        self.remembered = 0
        """Other workers' finished responses indexed for group/history drafts."""
        self.following = asyncio.Event()
        """Set once `run` reads `samples` from a position: entries added after it are seen."""

    def _group_source(self) -> Any:
        """The engine's group/history draft source (`GroupProposer`), or None."""
        proposer = getattr(self.loader.engine, "proposer", None)
        source = getattr(proposer, "group", proposer)
        if not hasattr(source, "remember"):  # a vLLM engine's group proposer lives in vLLM's worker
            source = getattr(self.loader.engine, "group_history", None)
        return source if hasattr(source, "remember") else None

    async def run(self, stop: asyncio.Event) -> None:
        """Index other workers' finished responses as history for group drafts, read from `samples` as they
        are produced (a plain XREAD from the stream's end, no consumer group, no round trip per decode
        step). Lossy by design: an entry trimmed before it is read is a draft source missed, nothing else.
        Our own responses are indexed while they run. It starts once the worker's engine exists, and ends at
        once when that engine has no group source."""
        from tlt_stream.basics.aio import sleep_or_stop, wait_or_stop
        from tlt_stream.basics.messages import codec_for
        from tlt_stream.bus.producer import PAYLOAD_FIELD

        if not await wait_or_stop(self.loader.built, stop) or (source := self._group_source()) is None:
            return
        stream, codec = self.keys.stream("samples"), codec_for("samples")
        last: str | bytes | None = None
        while not stop.is_set():
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

"""Writing to streams: pipelined XADD with per-stream retention and backpressure on durable streams.

Backpressure is credit-based, so the common path costs nothing extra: after measuring a durable stream's
un-acked backlog `b`, a producer may add `limit - b` entries without looking again (consumers only shrink
the backlog). When the credit runs out it measures again and, if the stream is still full, waits for an
ack notification on the stream's pub/sub channel (with a periodic re-check in case one was missed). With P
producers the bound is soft: the backlog can reach at most P x limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from tlt_stream.bus.streams import Keys, spec
from tlt_stream.config import BusConfig
from tlt_stream.messages import codec_for

__all__ = ["StreamProducer", "stream_backlog", "trim_acked"]

log = logging.getLogger(__name__)

PAYLOAD_FIELD = b"m"
RECHECK_S = 1.0


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


async def stream_backlog(redis: aioredis.Redis, key: str) -> int:
    """Entries of `key` some consumer group has not acked yet (the slowest group's lag + pending).

    With no group yet, every entry counts. When Redis cannot compute a group's lag (possible after
    deletions), the stream length stands in as an upper bound.
    """
    try:
        groups = await redis.xinfo_groups(key)
    except aioredis.ResponseError:  # no such key
        return 0
    if not groups:
        return int(await redis.xlen(key))
    worst = 0
    length: int | None = None
    for group in groups:
        lag = group.get("lag")
        if lag is None:
            if length is None:
                length = int(await redis.xlen(key))
            lag = length
        worst = max(worst, int(lag) + int(group.get("pending", 0)))
    return worst


async def trim_acked(redis: aioredis.Redis, key: str) -> int:
    """Delete the entries of a durable stream that every consumer group has delivered and acked.

    Returns how many entries were removed. Never removes a pending or undelivered entry.
    """
    try:
        groups = await redis.xinfo_groups(key)
    except aioredis.ResponseError:
        return 0
    if not groups:
        return 0
    safe: tuple[int, int] | None = None
    for group in groups:
        name = group["name"]
        summary = await redis.xpending(key, name)
        if summary["pending"]:
            bound = _parse_id(summary["min"])
        else:
            ms, seq = _parse_id(group["last-delivered-id"])
            bound = (ms, seq + 1)
        safe = bound if safe is None else min(safe, bound)
    assert safe is not None
    return int(await redis.xtrim(key, minid=f"{safe[0]}-{safe[1]}", approximate=False))


class StreamProducer:
    """Appends messages to the run's streams.

    `on_backpressure(stream, waiting)` is called when a producer starts and stops waiting on a full
    durable stream, so a service can show the state (its worker registry entry, a log line, a gauge).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        bus: BusConfig,
        *,
        on_backpressure: Callable[[str, bool], Any] | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.bus = bus
        self.on_backpressure = on_backpressure
        self._credit: dict[str, int] = {}
        self._buffers: list[bytearray] = []
        self.waiting: set[str] = set()
        self.wait_seconds = 0.0

    async def send(self, stream: str, messages: Sequence[Any]) -> list[str]:
        """Encode and append `messages` in one pipeline; returns their entry ids.

        On a durable stream this first waits (without dropping anything) until the backlog has room.
        """
        if not messages:
            return []
        stream_spec = spec(stream)
        codec = codec_for(stream)
        key = self.keys.stream(stream)
        if stream_spec.durable:
            await self._reserve(stream, key, len(messages))
        maxlen = stream_spec.maxlen(self.bus)
        # Encoding into pooled buffers avoids a fresh allocation (and its page faults) per large entry;
        # a buffer returns to the pool once the pipeline has been sent.
        buffers = [self._buffers.pop() if self._buffers else bytearray() for _ in messages]
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for message, buffer in zip(messages, buffers, strict=True):
                    codec.encode_into(message, buffer)
                    pipe.xadd(key, {PAYLOAD_FIELD: memoryview(buffer)}, maxlen=maxlen, approximate=True)
                ids = await pipe.execute()
        finally:
            self._buffers.extend(buffers)
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def send_one(self, stream: str, message: Any) -> str:
        return (await self.send(stream, [message]))[0]

    async def _reserve(self, stream: str, key: str, count: int) -> None:
        limit = self.bus.backlog_limit
        if self._credit.get(stream, 0) >= count:
            self._credit[stream] -= count
            return
        backlog = await stream_backlog(self.redis, key)
        if backlog + count > limit and backlog > 0:
            backlog = await self._wait_for_room(stream, key, count, limit)
        self._credit[stream] = max(0, limit - backlog - count)

    async def _wait_for_room(self, stream: str, key: str, count: int, limit: int) -> int:
        started = time.monotonic()
        self.waiting.add(stream)
        log.warning("backpressure: %s holds %d+ un-acked entries (limit %d); waiting", stream, limit, limit)
        if self.on_backpressure is not None:
            self.on_backpressure(stream, True)
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.acked_channel(stream))
            while True:
                backlog = await stream_backlog(self.redis, key)
                # A batch larger than the limit may go once the stream has fully drained.
                if backlog + count <= limit or backlog == 0:
                    return backlog
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=RECHECK_S)
        finally:
            await pubsub.aclose()
            self.waiting.discard(stream)
            waited = time.monotonic() - started
            self.wait_seconds += waited
            log.info("backpressure on %s released after %.1fs", stream, waited)
            if self.on_backpressure is not None:
                self.on_backpressure(stream, False)

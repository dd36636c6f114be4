"""Writing to streams: pipelined XADD with per-stream retention and backpressure on durable streams.

Backpressure is credit-based, so the common path costs nothing extra: after measuring a durable stream's
un-acked backlog `b`, a producer may add `limit - b` entries without looking again (consumers only shrink
the backlog). When the credit runs out it measures again and, if the stream is still full, waits for an
ack notification on the stream's pub/sub channel (with a periodic re-check in case one was missed). With P
producers the bound is soft: the backlog can reach at most P x limit.

Memory is bounded on a run of any length, and a full Redis never stops a service. Buffer streams are
capped in entries and `hidden` also in bytes: its MAXLEN is lowered to `bus.hidden_max_bytes` over a
running mean of what its entries cost in Redis. When Redis refuses a write for memory (`maxmemory` with
`noeviction`), an entry of a buffer stream is dropped and counted (`dropped`), while an entry of a durable
stream is retried with capped backoff until Redis takes it (reported like a backlog wait): a buffer may
lose data by design, a durable stream never.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from tlt_stream.basics.aio import retry
from tlt_stream.basics.common import as_text
from tlt_stream.basics.config import BusConfig
from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.streams import Keys, spec

__all__ = ["StreamProducer", "stream_backlog", "trim_acked"]

log = logging.getLogger(__name__)

PAYLOAD_FIELD = b"m"
RECHECK_S = 1.0
MAX_SEQ = 2**64 - 1

OOM_BACKOFF_CAP_S = 5.0
"""Longest pause between two tries of a durable write Redis refused for memory."""
DROP_LOG_INTERVAL_S = 30.0
"""Dropped buffer entries are logged at most this often per stream (the count in `dropped` is exact)."""
EXACT_TRIM_BELOW = 1000
"""A MAXLEN under this is applied exactly: `MAXLEN ~` removes whole radix-tree nodes only (up to
`stream-node-max-entries`, 100 by default), which would let a small bound be overshot many times over."""
SIZE_MEAN_WEIGHT = 1 / 32
"""Weight of each new entry in the running mean of entry sizes that bounds a stream in bytes."""


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, seq = _parse_id(entry_id)
    return (ms, seq + 1) if seq < MAX_SEQ else (ms + 1, 0)


def stored_bytes(payload_bytes: int) -> int:
    """What an entry with this payload costs in Redis, a little over: the allocator rounds an allocation up to
    its size class (up to a quarter more, jemalloc), and each stream node adds its radix-tree key, listpack
    header and master entry (a large entry has a node to itself). An upper bound of what `MEMORY USAGE`
    reports on Redis 7 for payloads from 40 bytes to 1 MiB."""
    return payload_bytes + payload_bytes // 4 + 512


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

    Returns how many entries were removed. Never removes a pending or undelivered entry: what goes is what
    lies before, for every group, both its oldest pending entry and the first entry after its last-delivered
    id. A stream without groups keeps everything (nobody has read it yet). Readers and ackers may run
    meanwhile: a group's state read later only allows more (acks shrink its PEL, deliveries move forward,
    an acked entry never becomes pending again). A group created while this runs, from an id before the
    trim point, misses the trimmed entries exactly as if it had been created just after.
    """
    try:
        groups = await redis.xinfo_groups(key)
    except aioredis.ResponseError:  # no such key, or not a stream
        return 0
    if not groups:
        return 0
    bounds = [_next_id(group["last-delivered-id"]) for group in groups]
    busy = [group["name"] for group in groups if int(group.get("pending", 0))]
    if busy:
        async with redis.pipeline(transaction=False) as pipe:
            for name in busy:
                pipe.xpending(key, name)
            summaries = await pipe.execute()
        bounds += [_parse_id(summary["min"]) for summary in summaries if summary["pending"]]
    ms, seq = min(bounds)
    if (ms, seq) <= (0, 1):
        return 0
    return int(await redis.xtrim(key, minid=f"{ms}-{seq}", approximate=False))


class StreamProducer:
    """Appends messages to the run's streams.

    `on_backpressure(stream, waiting)` is called when a producer starts and stops waiting on a durable
    stream, whether it is full (backlog) or Redis refuses writes for memory, so a service can show the state
    (its worker registry entry, a log line, a gauge). `dropped` counts, per buffer stream, the entries Redis
    refused for memory.
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
        self._waits: Counter[str] = Counter()
        self.wait_seconds = 0.0
        self.dropped: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        self._reported_at: dict[str, float] = {}
        self._entry_bytes: dict[str, float] = {}

    async def send(self, stream: str, messages: Sequence[Any]) -> list[str]:
        """Encode and append `messages` in one pipeline; returns the ids of the entries Redis stored.

        On a durable stream this first waits (without dropping anything) until the backlog has room, and
        retries what Redis refuses for memory until it is stored: every message gets an id, in order. On a
        buffer stream what Redis refuses for memory is dropped (counted in `dropped`) and has no id.
        """
        if not messages:
            return []
        stream_spec = spec(stream)
        codec = codec_for(stream)
        key = self.keys.stream(stream)
        if stream_spec.durable:
            await self._reserve(stream, key, len(messages))
        # Encoding into pooled buffers avoids a fresh allocation (and its page faults) per large entry;
        # a buffer returns to the pool once the pipeline has been sent. Not after an error reply: the error's
        # traceback holds the pipeline's views of the buffers (a cycle only the garbage collector breaks), and
        # a viewed bytearray cannot be resized by the next encode.
        buffers = [self._buffers.pop() if self._buffers else bytearray() for _ in messages]
        reusable = False
        try:
            for i, message in enumerate(messages):
                try:
                    codec.encode_into(message, buffers[i])
                except BufferError:  # still viewed by a retried pipeline's traceback (a cycle): not reusable
                    buffers[i] = bytearray()
                    codec.encode_into(message, buffers[i])
            maxlen = self._maxlen(stream, buffers)
            ids: list[str | None] = [None] * len(buffers)
            if stream_spec.durable:
                reusable = await self._append_durable(stream, key, buffers, ids)
            else:
                refused, error = await self._append(key, buffers, range(len(buffers)), ids, maxlen)
                if refused:
                    self._drop(stream, len(refused), error)
                reusable = not refused
        finally:
            if reusable:
                self._buffers.extend(buffers)
        return [i for i in ids if i is not None]

    async def send_one(self, stream: str, message: Any) -> str | None:
        """`send` of one message: its id, or None when a buffer stream dropped it."""
        ids = await self.send(stream, [message])
        return ids[0] if ids else None

    def _maxlen(self, stream: str, buffers: Sequence[bytearray]) -> int | None:
        """The MAXLEN of this batch's XADDs: the stream's entry bound, for `hidden` also its bytes bound over
        the running mean of what an entry costs."""
        maxlen = spec(stream).maxlen(self.bus)
        if maxlen is None or stream != "hidden":
            return maxlen
        mean = self._entry_bytes.get(stream, float(stored_bytes(len(buffers[0]))))
        for buffer in buffers:
            mean += SIZE_MEAN_WEIGHT * (stored_bytes(len(buffer)) - mean)
        self._entry_bytes[stream] = mean
        return max(1, min(maxlen, int(self.bus.hidden_max_bytes // mean)))

    async def _append(
        self,
        key: str,
        buffers: Sequence[bytearray],
        todo: Sequence[int],
        ids: list[str | None],
        maxlen: int | None,
    ) -> tuple[list[int], OutOfMemoryError | None]:
        """XADD `buffers[i]` for each i in `todo` in one pipeline, filling `ids`; returns the indices Redis
        refused for memory and its reply. Any other error reply is raised."""
        approximate = maxlen is not None and maxlen >= EXACT_TRIM_BELOW
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in todo:
                pipe.xadd(key, {PAYLOAD_FIELD: memoryview(buffers[i])}, maxlen=maxlen, approximate=approximate)
            replies = await pipe.execute(raise_on_error=False)
        refused: list[int] = []
        error: OutOfMemoryError | None = None
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, OutOfMemoryError):
                refused.append(i)
                error = error or reply
            elif isinstance(reply, Exception):
                raise reply
            else:
                ids[i] = as_text(reply)
        return refused, error

    async def _append_durable(self, stream: str, key: str, buffers: Sequence[bytearray], ids: list[str | None]) -> bool:
        """Append every buffer, retrying what Redis refuses for memory (capped backoff with jitter, no limit:
        a durable entry is never dropped) and reporting the wait like a backlog wait. Returns whether Redis
        took everything at the first try."""
        todo: Sequence[int] = range(len(buffers))
        started: float | None = None

        async def attempt() -> None:
            nonlocal todo, started
            todo, error = await self._append(key, buffers, todo, ids, None)
            if error is None:
                return
            if started is None:
                started = self._begin_wait(stream)
                log.warning(
                    "Redis is out of memory (maxmemory): %d %s entries wait, retried until it takes them (%s)",
                    len(todo),
                    stream,
                    error,
                )
            raise error

        try:
            await retry(
                attempt,
                retry_on=(OutOfMemoryError,),
                what=f"append to {stream}",
                max_attempts=None,
                cap=OOM_BACKOFF_CAP_S,
            )
        finally:
            if started is not None:
                self._end_wait(stream, started, "Redis took the entries again")
        return started is None

    def _drop(self, stream: str, count: int, error: OutOfMemoryError | None) -> None:
        self.dropped[stream] += count
        self._unreported[stream] += count
        now = time.monotonic()
        if now - self._reported_at.get(stream, -DROP_LOG_INTERVAL_S) >= DROP_LOG_INTERVAL_S:
            log.warning(
                "Redis is out of memory (maxmemory): dropped %d %s entries (%d since the start; reported at most "
                "every %.0fs): %s",
                self._unreported[stream],
                stream,
                self.dropped[stream],
                DROP_LOG_INTERVAL_S,
                error,
            )
            self._reported_at[stream] = now
            self._unreported[stream] = 0

    def _begin_wait(self, stream: str) -> float:
        self._waits[stream] += 1
        if self._waits[stream] == 1:
            self.waiting.add(stream)
            if self.on_backpressure is not None:
                self.on_backpressure(stream, True)
        return time.monotonic()

    def _end_wait(self, stream: str, started: float, why: str) -> None:
        waited = time.monotonic() - started
        self.wait_seconds += waited
        log.info("backpressure on %s released after %.1fs (%s)", stream, waited, why)
        self._waits[stream] -= 1
        if self._waits[stream] == 0:
            self.waiting.discard(stream)
            if self.on_backpressure is not None:
                self.on_backpressure(stream, False)

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
        log.warning("backpressure: %s holds %d+ un-acked entries (limit %d); waiting", stream, limit, limit)
        started = self._begin_wait(stream)
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
            self._end_wait(stream, started, "the backlog has room")

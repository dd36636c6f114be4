"""Reading a stream through a consumer group: at-least-once delivery that survives dead consumers.

`StreamReader.read()` returns decoded deliveries in this order of preference:
1. after a (re)start, this consumer's own pending entries (work it took but never acked);
2. entries other consumers left pending for longer than `bus.reclaim_idle_ms` (XAUTOCLAIM), checked at
   most every half idle time;
3. new entries, waiting with `XREADGROUP ... BLOCK` (never sleep-polling).

An entry that is missing its payload, is larger than `bus.max_message_bytes`, fails to decode or validate,
or has been delivered more than `bus.max_deliveries` times goes to the `dead` stream with the reason and
origin, is acked, and the reader goes on. Entries are acked only when the caller says so (`ack`), after
its handler succeeded; `consume()` wraps that into a loop with bounded concurrency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import redis.asyncio as aioredis

from tlt_stream.bus.producer import PAYLOAD_FIELD
from tlt_stream.bus.streams import Keys, spec
from tlt_stream.config import BusConfig
from tlt_stream.messages import DeadLetter, codec_for

__all__ = ["DEAD_PAYLOAD_LIMIT", "Delivery", "StreamReader", "consume", "dead_letter"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEAD_PAYLOAD_LIMIT = 64 * 1024
"""Bytes of a dead entry's raw payload kept in its dead letter."""


@dataclass(frozen=True, slots=True)
class Delivery(Generic[T]):
    """One decoded entry handed to the caller; ack it by `entry_id` once handled."""

    entry_id: str
    message: T
    deliveries: int
    """How many times the group has delivered this entry (1 on first delivery)."""


async def dead_letter(
    redis: aioredis.Redis,
    keys: Keys,
    bus: BusConfig,
    *,
    stream: str,
    entry_id: str,
    reason: str,
    origin: str,
    payload: bytes = b"",
    deliveries: int = 0,
) -> None:
    """Record an entry in the bounded `dead` stream and count it per stream (the count is never trimmed)."""
    letter = DeadLetter(
        stream=stream,
        entry_id=entry_id,
        reason=reason[:2000],
        origin=origin,
        deliveries=deliveries,
        payload=bytes(payload[:DEAD_PAYLOAD_LIMIT]),
        payload_size=len(payload),
    )
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xadd(
            keys.stream("dead"),
            {PAYLOAD_FIELD: codec_for("dead").encode(letter)},
            maxlen=bus.dead_maxlen,
            approximate=True,
        )
        pipe.hincrby(keys.dead_counts, stream, 1)
        await pipe.execute()
    log.warning("dead-lettered %s entry %s from %s: %s", stream, entry_id, origin, reason)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamReader(Generic[T]):
    """One consumer of one consumer group on one stream."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        bus: BusConfig,
        stream: str,
        consumer: str,
        *,
        group: str | None = None,
    ) -> None:
        group = group or spec(stream).group
        if group is None:
            raise ValueError(f"stream {stream!r} has no consumer group; read it with XRANGE")
        self.redis = redis
        self.keys = keys
        self.bus = bus
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.key = keys.stream(stream)
        self.codec = codec_for(stream)
        self._history_cursor: str | None = "0"
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._group_ready = False
        self._durable = spec(stream).durable
        self._channel = keys.acked_channel(stream)
        self.dead = 0
        self.acked = 0
        self.reclaimed = 0

    @property
    def origin(self) -> str:
        return f"{self.group}/{self.consumer}"

    async def ensure_group(self) -> None:
        """Create the consumer group (reading from the start of the stream) unless it exists."""
        try:
            await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery[T]]:
        """The next deliveries (possibly none when the block time passes with nothing new).

        `block_ms=0` polls without blocking. (A short BLOCK is no cheaper: Redis notices a blocked
        client's timeout only when its event loop next wakes, up to 1/hz = 100 ms later, which made a
        rollout worker's 1 ms polls cost ~70 ms each.)"""
        if not self._group_ready:
            await self.ensure_group()
        count = count or self.bus.read_count
        block = self.bus.block_ms if block_ms is None else block_ms

        if self._history_cursor is not None:
            reply = await self.redis.xreadgroup(
                self.group, self.consumer, {self.key: self._history_cursor}, count=count
            )
            entries = reply[0][1] if reply else []
            if entries:
                self._history_cursor = _text(entries[-1][0])
                found = await self._accept(entries, lookup_deliveries=True)
                if found:
                    return found
                return await self.read(count, block_ms)
            self._history_cursor = None

        now = time.monotonic()
        if now >= self._next_claim:
            found = await self._reclaim(count)
            if found:
                return found

        reply = await self._xreadgroup_new(count, block)
        entries = reply[0][1] if reply else []
        return await self._accept(entries, lookup_deliveries=False)

    async def _xreadgroup_new(self, count: int, block: int) -> Any:
        try:
            return await self.redis.xreadgroup(
                self.group, self.consumer, {self.key: ">"}, count=count, block=block if block > 0 else None
            )
        except aioredis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("consumer group %s on %s vanished (stream deleted?); recreating", self.group, self.key)
            await self.ensure_group()
            return []

    async def _reclaim(self, count: int) -> list[Delivery[T]]:
        next_cursor, entries, deleted = await self._xautoclaim(count)
        self._claim_cursor = _text(next_cursor)
        if self._claim_cursor == "0-0":
            self._next_claim = time.monotonic() + self.bus.reclaim_idle_ms / 2000
        if deleted:
            log.warning("%d entries of %s were deleted while pending; dropped from the PEL", len(deleted), self.key)
        if not entries:
            return []
        self.reclaimed += len(entries)
        log.warning("%s reclaimed %d entries idle > %d ms", self.origin, len(entries), self.bus.reclaim_idle_ms)
        return await self._accept(entries, lookup_deliveries=True)

    async def _xautoclaim(self, count: int) -> tuple[Any, list, list]:
        reply = await self.redis.xautoclaim(
            self.key,
            self.group,
            self.consumer,
            min_idle_time=self.bus.reclaim_idle_ms,
            start_id=self._claim_cursor,
            count=count,
        )
        next_cursor, entries = reply[0], reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        return next_cursor, entries, deleted

    async def _delivery_counts(self, first: str, last: str, n: int) -> dict[str, int]:
        rows = await self.redis.xpending_range(
            self.key, self.group, min=first, max=last, count=n, consumername=self.consumer
        )
        return {_text(r["message_id"]): int(r["times_delivered"]) for r in rows}

    async def _accept(self, entries: list, *, lookup_deliveries: bool) -> list[Delivery[T]]:
        if not entries:
            return []
        counts: dict[str, int] = {}
        if lookup_deliveries:
            counts = await self._delivery_counts(_text(entries[0][0]), _text(entries[-1][0]), len(entries))
        found: list[Delivery[T]] = []
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            deliveries = counts.get(entry_id, 1)
            if not fields:  # deleted or trimmed while pending: nothing left to process
                log.warning("%s entry %s has no data (deleted while pending); acking", self.key, entry_id)
                await self.ack([entry_id])
                continue
            payload = fields.get(PAYLOAD_FIELD)
            reason = self._refusal(payload, deliveries)
            if reason is None:
                try:
                    found.append(Delivery(entry_id, self.codec.decode(payload), deliveries))
                    continue
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    reason = f"undecodable {self.stream} entry: {exc}"
            await self._dead(entry_id, reason, payload or b"", deliveries)
        return found

    def _refusal(self, payload: bytes | None, deliveries: int) -> str | None:
        if payload is None:
            return f"entry has no {PAYLOAD_FIELD.decode()!r} field"
        if len(payload) > self.bus.max_message_bytes:
            return f"entry of {len(payload)} bytes exceeds max_message_bytes={self.bus.max_message_bytes}"
        if deliveries > self.bus.max_deliveries:
            return f"delivered {deliveries} times without an ack (max_deliveries={self.bus.max_deliveries})"
        return None

    async def _dead(self, entry_id: str, reason: str, payload: bytes, deliveries: int) -> None:
        await dead_letter(
            self.redis,
            self.keys,
            self.bus,
            stream=self.stream,
            entry_id=entry_id,
            reason=reason,
            origin=self.origin,
            payload=payload,
            deliveries=deliveries,
        )
        self.dead += 1
        await self.ack([entry_id])

    async def give_up(self, delivery: Delivery[T], reason: str) -> None:
        """Dead-letter an entry whose handling failed for good (a handler's choice), and ack it."""
        payload = self.codec.encode(delivery.message)
        await self._dead(delivery.entry_id, reason, payload, delivery.deliveries)

    async def ack(self, entry_ids: list[str]) -> int:
        """Ack handled entries; on a durable stream also wake producers waiting on backpressure (one round
        trip either way: the durable case is one small Lua script)."""
        if not entry_ids:
            return 0
        if self._durable:
            acked = await self.redis.eval(_ACK_AND_NOTIFY, 2, self.key, self._channel, self.group, *entry_ids)
        else:
            acked = await self.redis.xack(self.key, self.group, *entry_ids)
        self.acked += int(acked)
        return int(acked)


_ACK_AND_NOTIFY = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
if acked > 0 then redis.call('PUBLISH', KEYS[2], acked) end
return acked
"""


async def consume(
    reader: StreamReader[T],
    handler: Callable[[Delivery[T]], Awaitable[None]],
    stop: asyncio.Event,
    *,
    concurrency: int = 1,
) -> None:
    """Hand every delivery to `handler` (at most `concurrency` at once) and ack it when the handler returns.

    A handler that raises leaves its entry pending: it is redelivered after the reclaim idle time and, past
    `max_deliveries`, dead-lettered. On `stop` (noticed within one block time) the loop takes no new entries,
    waits for the running handlers and acks what they finished.
    """
    handled: list[str] = []
    in_flight = 0
    freed = asyncio.Event()

    async def run_one(delivery: Delivery[T]) -> None:
        nonlocal in_flight
        try:
            await handler(delivery)
            handled.append(delivery.entry_id)
        except Exception:
            log.exception("%s: handler failed on %s (it will be redelivered)", reader.origin, delivery.entry_id)
        finally:
            in_flight -= 1
            freed.set()

    async def flush() -> None:
        if handled:
            batch = handled[:]
            del handled[: len(batch)]
            await reader.ack(batch)

    async def wait_below(limit: int) -> None:
        while in_flight > limit:
            freed.clear()
            await flush()
            if in_flight > limit:
                await freed.wait()

    async with asyncio.TaskGroup() as tasks:
        while not stop.is_set():
            await wait_below(concurrency - 1)
            await flush()
            room = min(concurrency - in_flight, reader.bus.read_count)
            for delivery in await reader.read(count=room):
                in_flight += 1
                tasks.create_task(run_one(delivery), name=f"handle:{reader.stream}:{delivery.entry_id}")
        await wait_below(0)
    await flush()

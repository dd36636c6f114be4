"""Reading a stream through a consumer group: at-least-once delivery that survives dead consumers.

`StreamReader.read()` returns decoded deliveries in this order of preference:
1. after a (re)start, this consumer's own pending entries (work it took but never acked);
2. entries pending for longer than `bus.reclaim_idle_ms` whose owner is gone, checked at most every half
   idle time: an owner is gone when its registry heartbeat (`tlt:{run}:worker:{consumer}`) has expired, or
   when it never had one; this consumer's own entries count as gone only once it let go of them (`abandon`);
3. new entries, waiting with `XREADGROUP ... BLOCK` (never sleep-polling).

A delivered entry is *held* until the caller acks or abandons it. While held it is never handed out again,
not even to this consumer, however long the caller keeps it (a learner's open group, a worker's
minutes-long generation): the reader refreshes the idle time of what it holds (`XCLAIM ... JUSTID`, which
leaves the delivery count alone) so that the PEL shows it alive, and other consumers do not take over
entries whose owner still heartbeats. Before this rule a learner that held a sample longer than the reclaim
time claimed it back from itself, took it for a duplicate and acked it while it existed only in memory.

An entry that is missing its payload, is larger than `bus.max_message_bytes`, fails to decode or validate,
or has been delivered more than `bus.max_deliveries` times goes to the `dead` stream with the reason and
origin, is acked, and the reader goes on. Entries are acked only when the caller says so (`ack`), after
its handler succeeded; a handler that failed `abandon`s its entry, which is then redelivered after the
reclaim time (and dead-lettered past `max_deliveries`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import redis.asyncio as aioredis

from tlt_stream.basics.aio import retry
from tlt_stream.basics.common import as_text
from tlt_stream.basics.config import BusConfig
from tlt_stream.basics.messages import DeadLetter, codec_for
from tlt_stream.bus.connect import connections_opened
from tlt_stream.bus.producer import PAYLOAD_FIELD
from tlt_stream.bus.streams import Keys, spec

__all__ = ["DEAD_PAYLOAD_LIMIT", "Delivery", "LostTasks", "StreamReader", "dead_letter", "until_memory"]

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

    async def write() -> None:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.xadd(
                keys.stream("dead"),
                {PAYLOAD_FIELD: codec_for("dead").encode(letter)},
                maxlen=bus.dead_maxlen,
                approximate=True,
            )
            pipe.hincrby(keys.dead_counts, stream, 1)
            await pipe.execute()

    # Never silently dropped: the caller acks the entry only after this returns, so a Redis at maxmemory
    # (which refuses the write) is waited out, with capped backoff, rather than losing the letter.
    await until_memory(write, f"dead letter of {stream} {entry_id}")
    log.warning("dead-lettered %s entry %s from %s: %s", stream, entry_id, origin, reason)


async def until_memory(write: Callable[[], Awaitable[None]], what: str) -> None:
    """`write`, retried with capped backoff for as long as Redis refuses it for memory (maxmemory with
    noeviction): a record that must precede an ack is waited for, never skipped, and the service goes on."""
    await retry(write, retry_on=(aioredis.OutOfMemoryError,), what=what, max_attempts=None, base=0.5, cap=5.0)


class LostTasks:
    """Tasks whose groups none of whose samples can be trained (a worker's refused task, a reward that raised or
    hung, a group of poison only), to record in `Keys.lost` (task id -> step, once per task) for the policy
    service to send another prompt in their place. A task noted is held until Redis has it: a failed write is
    tried again at the next `record`."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.pending: dict[str, int] = {}

    def note(self, task_id: str, step: int) -> None:
        self.pending[task_id] = step

    async def record(self) -> list[str]:
        """Write the tasks noted (a Redis at maxmemory waited out, as dead letters are); the ids written,
        sorted."""
        if not self.pending:
            return []
        lost = dict(self.pending)

        async def write() -> None:
            async with self.redis.pipeline(transaction=False) as pipe:
                for task_id, step in lost.items():
                    pipe.hsetnx(self.keys.lost, task_id, step)
                await pipe.execute()

        await until_memory(write, f"lost record of {', '.join(sorted(lost))}")
        for task_id in lost:
            self.pending.pop(task_id, None)
        return sorted(lost)

    async def set_aside(self, reader: StreamReader[T], deliveries: list[Delivery[T]]) -> list[Delivery[T]]:
        """`deliveries` less the redelivered entries (a task's, or a sample's of a task) whose task is already
        recorded lost, which `reader` dead-letters unread: whoever recorded it died before the dead letter and
        ack. Its step has another prompt in its place, so handling it too would give the step a group too many.
        A first delivery cannot be one (the record precedes the ack), so only redeliveries cost a round trip."""
        again = sorted({d.message.task_id for d in deliveries if d.deliveries > 1})
        if not again:
            return deliveries
        found = await self.redis.hmget(self.keys.lost, again)
        lost = {task_id for task_id, step in zip(again, found, strict=True) if step is not None}
        for delivery in deliveries:
            if delivery.message.task_id in lost:
                await reader.give_up(delivery, "its task was recorded lost: another prompt takes its place")
        return [d for d in deliveries if d.message.task_id not in lost]


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
        self._claim_cursor = "-"
        self._next_claim = 0.0
        self._next_refresh = 0.0
        self.held: set[str] = set()
        """Entries handed to the caller and not yet acked, abandoned or dead-lettered."""
        self.abandoned: set[str] = set()
        """Entries the caller let go of (their handler failed): redelivered only after the reclaim time."""
        self._next_resync = 0.0
        self._connections = 0
        """`connections_opened` at the last read: when it grows, the resync is due at once."""
        self.resynced = 0
        self._group_ready = False
        self._durable = spec(stream).durable
        self._channel = keys.acked_channel(stream)
        self.dead = 0
        self.acked = 0
        self.reclaimed = 0
        self.refreshed = 0
        self.lost: set[str] = set()
        """Held entries another consumer took over (this one was presumed dead): their ack is still safe."""
        self.on_refused: Callable[[bytes], Awaitable[None]] | None = None
        """Awaited with the payload of each entry this reader dead-letters itself (undecodable, too large,
        delivered too often) once it is in `dead` and before its ack: the caller may still learn what it was
        and record it (the learner completes the group the entry belonged to without it; the worker records
        the task as lost). Should it raise, the entry stays pending and is refused again at its next delivery."""

    @property
    def origin(self) -> str:
        return f"{self.group}/{self.consumer}"

    async def ensure_group(self) -> None:
        """Create the consumer group (reading from the start of the stream) unless it exists."""

        async def create() -> None:
            try:
                await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
            except aioredis.OutOfMemoryError:  # refused before Redis looked: maybe there is nothing to create
                if not await self._group_exists():
                    raise
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        # A Redis at maxmemory refuses XGROUP CREATE even for a group that exists: waited out, never raised.
        await retry(
            create,
            retry_on=(aioredis.OutOfMemoryError,),
            what=f"creating consumer group {self.group} on {self.key} (Redis out of memory)",
            max_attempts=None,
            base=0.5,
            cap=5.0,
        )
        self._group_ready = True

    async def _group_exists(self) -> bool:
        try:
            groups = await self.redis.xinfo_groups(self.key)
        except aioredis.ResponseError:  # no such stream
            return False
        return any(as_text(g["name"]) == self.group for g in groups)

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery[T]]:
        """The next deliveries (possibly none when the block time passes with nothing new).

        `block_ms=0` polls without blocking. (A short BLOCK is no cheaper: Redis notices a blocked
        client's timeout only when its event loop next wakes, up to 1/hz = 100 ms later, which made a
        rollout worker's 1 ms polls cost ~70 ms each.)"""
        if not self._group_ready:
            await self.ensure_group()
        count = count or self.bus.read_count
        block = self.bus.block_ms if block_ms is None else block_ms
        await self.maybe_refresh()
        if found := await self._maybe_resync():
            return found

        if self._history_cursor is not None:
            reply = await self.redis.xreadgroup(
                self.group, self.consumer, {self.key: self._history_cursor}, count=count
            )
            entries = reply[0][1] if reply else []
            if entries:
                self._history_cursor = as_text(entries[-1][0])
                known = self.held | self.abandoned  # being handled, or waiting out the reclaim time
                entries = [e for e in entries if as_text(e[0]) not in known]
                if not entries:
                    return await self.read(count, block_ms)
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

    async def _maybe_resync(self) -> list[Delivery[T]]:
        """Every quarter reclaim time, look for entries of ours in the PEL that we neither hold nor abandoned:
        a Redis restarted from an append-only file that lost its last writes brings back entries whose ack it
        lost. Those are handed out again at once (claimed to ourselves, which counts a delivery for them
        alone), instead of waiting out the reclaim time, so nothing stays pending and a lost task is redone
        promptly. After the client opened a connection (a reconnection: Redis may have restarted) it looks at
        the next read, not a quarter reclaim time later."""
        opened = connections_opened(self.redis)
        if opened != self._connections:  # (re)connected: maybe to a Redis restarted without our last acks
            self._connections = opened
            self._next_resync = 0.0
        now = time.monotonic()
        if now < self._next_resync or self._history_cursor is not None:
            return []
        self._next_resync = now + self.bus.reclaim_idle_ms / 4000
        known = self.held | self.abandoned
        rows = await self.redis.xpending_range(
            self.key, self.group, min="-", max="+", count=len(known) + 1, consumername=self.consumer
        )
        mine = {as_text(r["message_id"]) for r in rows}
        if len(rows) <= len(known):  # the whole of our PEL: forget abandoned entries another consumer took
            self.abandoned &= mine
        stray = sorted(mine - known)
        if not stray:
            return []
        entries = await self.redis.xclaim(self.key, self.group, self.consumer, min_idle_time=0, message_ids=stray)
        self.resynced += len(entries)
        log.warning(
            "%s: %d entries of %s were pending for us though we did not hold them (an ack Redis lost); "
            "handling them again",
            self.origin,
            len(entries),
            self.key,
        )
        return await self._accept(entries, lookup_deliveries=True)

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
        """Claim up to `count` entries idle past the reclaim time whose owner is gone (one page of the PEL
        per call, from a cursor that wraps around)."""
        page = await self.redis.xpending_range(
            self.key, self.group, min=self._claim_cursor, max="+", count=max(count, 64), idle=self.bus.reclaim_idle_ms
        )
        if len(page) < max(count, 64):
            self._claim_cursor = "-"
            self._next_claim = time.monotonic() + self.bus.reclaim_idle_ms / 2000
        else:
            self._claim_cursor = _after(as_text(page[-1]["message_id"]))
        owners = {as_text(row["consumer"]) for row in page}
        gone = {owner for owner in owners if not await self._alive(owner)}
        candidates = [
            entry_id
            for row in page
            if (owner := as_text(row["consumer"])) in gone
            and (entry_id := as_text(row["message_id"])) not in self.held
            # Of our own entries only those we abandoned: one we neither hold nor abandoned is an ack Redis
            # lost, which `_maybe_resync` hands out again within a quarter reclaim time and reports as such.
            and (owner != self.consumer or entry_id in self.abandoned)
        ][:count]
        if not candidates:
            return []
        # XCLAIM re-checks the idle time atomically: an owner that refreshed meanwhile keeps its entry.
        entries = await self.redis.xclaim(
            self.key, self.group, self.consumer, min_idle_time=self.bus.reclaim_idle_ms, message_ids=candidates
        )
        claimed = {as_text(e[0]) for e in entries}
        deleted = [i for i in candidates if i not in claimed]
        if deleted:  # trimmed or deleted while pending, or refreshed by a live owner: nothing to take
            log.debug("%d of %d reclaim candidates on %s were not claimable", len(deleted), len(candidates), self.key)
        entries = [e for e in entries if e[1] is not None]
        if not entries:
            return []
        self.reclaimed += len(entries)
        self.abandoned.difference_update(as_text(e[0]) for e in entries)
        log.warning(
            "%s reclaimed %d entries idle > %d ms from %s",
            self.origin,
            len(entries),
            self.bus.reclaim_idle_ms,
            ", ".join(sorted(gone)),
        )
        return await self._accept(entries, lookup_deliveries=True)

    async def _alive(self, consumer: str) -> bool:
        """Whether `consumer` still holds its entries: this reader itself (its held entries are skipped one
        by one), or a process whose registry heartbeat has not expired."""
        if consumer == self.consumer:
            return False
        return bool(await self.redis.exists(self.keys.worker(consumer)))

    async def maybe_refresh(self) -> None:
        """`refresh()` when a quarter of the reclaim time has passed since the last one (cheap otherwise)."""
        now = time.monotonic()
        if self.held and now >= self._next_refresh:
            await self.refresh()

    async def refresh(self) -> list[str]:
        """Reset the idle time of every held entry this consumer still owns; returns the ids another consumer
        has taken over (removed from `held`; acking them later is harmless)."""
        self._next_refresh = time.monotonic() + self.bus.reclaim_idle_ms / 4000
        held = sorted(self.held)
        lost: list[str] = []
        for start in range(0, len(held), 256):
            chunk = held[start : start + 256]
            reply = await self.redis.eval(_REFRESH_OWNED, 1, self.key, self.group, self.consumer, *chunk)
            lost += [as_text(i) for i in reply]
        self.refreshed += len(held) - len(lost)
        if lost:
            self.held.difference_update(lost)
            self.lost.update(lost)
            log.warning(
                "%s: %d held entries of %s were taken over by another consumer", self.origin, len(lost), self.key
            )
        return lost

    async def own_pending(self) -> list[tuple[str, T]]:
        """Every entry pending for this consumer that decodes, as (entry id, message), read without taking
        anything new or changing what is held (a clean stop's last look at what it leaves behind)."""
        found: list[tuple[str, T]] = []
        cursor = "0"
        while True:
            try:
                reply = await self.redis.xreadgroup(self.group, self.consumer, {self.key: cursor}, count=256)
            except aioredis.ResponseError:
                if await self._group_exists():
                    raise
                return found  # the group was never made (nothing was read on these servers): nothing pending
            entries = reply[0][1] if reply else []
            if not entries:
                return found
            cursor = as_text(entries[-1][0])
            for raw_id, fields in entries:
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, TypeError, KeyError):
                    found.append((as_text(raw_id), self.codec.decode(fields[PAYLOAD_FIELD])))

    def abandon(self, entry_ids: list[str]) -> None:
        """Let go of held entries without acking them (their handler failed): they are redelivered, to this
        consumer or another, once idle past the reclaim time."""
        self.held.difference_update(entry_ids)
        self.abandoned.update(entry_ids)

    async def _delivery_counts(self, first: str, last: str, n: int) -> dict[str, int]:
        rows = await self.redis.xpending_range(
            self.key, self.group, min=first, max=last, count=n, consumername=self.consumer
        )
        return {as_text(r["message_id"]): int(r["times_delivered"]) for r in rows}

    async def _accept(self, entries: list, *, lookup_deliveries: bool) -> list[Delivery[T]]:
        if not entries:
            return []
        counts: dict[str, int] = {}
        if lookup_deliveries:
            counts = await self._delivery_counts(as_text(entries[0][0]), as_text(entries[-1][0]), len(entries))
        found: list[Delivery[T]] = []
        for raw_id, fields in entries:
            entry_id = as_text(raw_id)
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
                    self.held.add(entry_id)
                    continue
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    reason = f"undecodable {self.stream} entry: {exc}"
            await self._dead(entry_id, reason, payload or b"", deliveries, refused=True)
        return found

    def _refusal(self, payload: bytes | None, deliveries: int) -> str | None:
        if payload is None:
            return f"entry has no {PAYLOAD_FIELD.decode()!r} field"
        if len(payload) > self.bus.max_message_bytes:
            return f"entry of {len(payload)} bytes exceeds max_message_bytes={self.bus.max_message_bytes}"
        if deliveries > self.bus.max_deliveries:
            return f"delivered {deliveries} times without an ack (max_deliveries={self.bus.max_deliveries})"
        return None

    async def _dead(self, entry_id: str, reason: str, payload: bytes, deliveries: int, *, refused: bool) -> None:
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
        if refused and self.on_refused is not None and payload:
            await self.on_refused(payload)
        await self.ack([entry_id])

    async def give_up(self, delivery: Delivery[T], reason: str) -> None:
        """Dead-letter an entry whose handling failed for good (a handler's choice: it has recorded what it
        needs, `on_refused` is not called), and ack it."""
        payload = self.codec.encode(delivery.message)
        await self._dead(delivery.entry_id, reason, payload, delivery.deliveries, refused=False)

    async def ack(self, entry_ids: list[str]) -> int:
        """Ack handled entries; on a durable stream also wake producers waiting on backpressure (one round
        trip either way: the durable case is one small Lua script)."""
        if not entry_ids:
            return 0
        self.held.difference_update(entry_ids)
        self.abandoned.difference_update(entry_ids)
        if self._durable:
            acked = await self.redis.eval(_ACK_AND_NOTIFY, 2, self.key, self._channel, self.group, *entry_ids)
        else:
            acked = await self.redis.xack(self.key, self.group, *entry_ids)
        self.acked += int(acked)
        return int(acked)


def _after(entry_id: str) -> str:
    """The smallest stream id greater than `entry_id` (an exclusive range start that every server accepts)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


_REFRESH_OWNED = """
local lost = {}
for i = 3, #ARGV do
  local row = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #row == 1 and row[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

_ACK_AND_NOTIFY = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
if acked > 0 then redis.call('PUBLISH', KEYS[2], acked) end
return acked
"""

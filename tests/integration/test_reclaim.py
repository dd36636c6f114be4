"""Held entries against real servers: whoever holds an entry keeps it, however long, while it is alive.

The evidence is Redis' own PEL (XPENDING: owner, idle time, delivery count), not the reader's counters.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PromptGroup
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis]

IDLE_MS = 200


def prompt(i: int) -> PromptGroup:
    return PromptGroup(task_id=f"task-{i}", prompt_id=f"p{i}", prompt_ids=[1, 2, i], answer=str(i), group_size=2)


def short_reclaim(config: Config) -> Config:
    return msgspec.structs.replace(config, bus=msgspec.structs.replace(config.bus, reclaim_idle_ms=IDLE_MS))


async def pel(redis: aioredis.Redis, key: str) -> dict[str, tuple[str, int]]:
    rows = await redis.xpending_range(key, "rollout", "-", "+", 100)
    return {r["message_id"].decode(): (r["consumer"].decode(), int(r["times_delivered"])) for r in rows}


async def read_for(reader: StreamReader, seconds: float) -> list[str]:
    """Everything `reader` is handed over `seconds` of back-to-back reads (well past the reclaim time)."""
    got: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        got += [d.entry_id for d in await reader.read(block_ms=50)]
    return got


async def test_an_entry_held_past_the_reclaim_time_is_never_handed_out_again(bus_config: Config) -> None:
    config = short_reclaim(bus_config)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "learner-like")
    await reader.ensure_group()
    (entry,) = await producer.send("prompts", [prompt(0)])
    assert [d.entry_id for d in await reader.read(block_ms=100)] == [entry]
    # Held for 8x the reclaim time while reading on (a learner with an open group does exactly this).
    assert await read_for(reader, 8 * IDLE_MS / 1000) == []
    assert await pel(redis, keys.stream("prompts")) == {entry: ("learner-like", 1)}, "delivered once, still pending"
    rows = await redis.xpending_range(keys.stream("prompts"), "rollout", "-", "+", 10)
    assert rows[0]["time_since_delivered"] < 8 * IDLE_MS, "its owner refreshed it"
    assert reader.refreshed > 0
    # Once acked it is gone for good.
    assert await reader.ack([entry]) == 1
    assert await pel(redis, keys.stream("prompts")) == {}
    await redis.aclose()


async def test_a_live_owner_keeps_its_entries_and_a_dead_ones_are_taken_over(bus_config: Config) -> None:
    config = short_reclaim(bus_config)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    owner: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w-owner")
    other: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w-other")
    await owner.ensure_group()
    ids = await producer.send("prompts", [prompt(i) for i in range(3)])
    await redis.hset(keys.worker("w-owner"), "state", "GENERATING")  # its registry heartbeat
    assert [d.entry_id for d in await owner.read(block_ms=100)] == ids
    # The owner is busy (it reads nothing, refreshes nothing) but alive: nobody takes its work.
    assert await read_for(other, 5 * IDLE_MS / 1000) == []
    assert set((await pel(redis, keys.stream("prompts"))).values()) == {("w-owner", 1)}
    # Its heartbeat expires: the other consumer takes every entry over, each delivered a second time.
    await redis.delete(keys.worker("w-owner"))
    taken = await read_for(other, 4 * IDLE_MS / 1000)
    assert sorted(taken) == sorted(ids) and other.reclaimed == 3
    assert await pel(redis, keys.stream("prompts")) == {i: ("w-other", 2) for i in ids}
    # The owner wakes up: its refresh finds the entries taken and does not steal them back.
    assert sorted(await owner.refresh()) == sorted(ids)
    assert owner.held == set() and owner.lost == set(ids)
    assert await pel(redis, keys.stream("prompts")) == {i: ("w-other", 2) for i in ids}
    await redis.aclose()


async def test_an_abandoned_entry_comes_back_to_its_own_consumer_with_its_count(bus_config: Config) -> None:
    config = short_reclaim(bus_config)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w1")
    await reader.ensure_group()
    (entry,) = await producer.send("prompts", [prompt(0)])
    (first,) = await reader.read(block_ms=100)
    reader.abandon([first.entry_id])  # its handler failed
    again: list = []
    for _ in range(100):
        again += await reader.read(block_ms=50)
        if again:
            break
    assert [(d.entry_id, d.deliveries) for d in again] == [(entry, 2)]
    assert await pel(redis, keys.stream("prompts")) == {entry: ("w1", 2)}
    await redis.aclose()


async def test_an_entry_pending_for_us_that_we_do_not_hold_is_read_again_at_once(bus_config: Config) -> None:
    """What a Redis restarted from an append-only file that lost its last writes leaves: an entry this
    consumer handled and acked is pending for it again (the ack was lost), though it holds nothing. Reading
    on, the reader finds it in the PEL and hands it out again without waiting out the reclaim time (an hour
    here), so a worker redoes its task and a learner acks a sample its ledger has."""
    config = msgspec.structs.replace(bus_config, bus=msgspec.structs.replace(bus_config.bus, reclaim_idle_ms=3_600_000))
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w-resync")
    await reader.ensure_group()
    held, lost = await producer.send("prompts", [prompt(0), prompt(1)])
    assert [d.entry_id for d in await reader.read(count=1, block_ms=100)] == [held]
    # The second entry lands in our PEL behind the reader's back, as the restarted Redis has it.
    await redis.xreadgroup("rollout", "w-resync", {keys.stream("prompts"): ">"}, count=1)
    assert set(await pel(redis, keys.stream("prompts"))) == {held, lost}
    reader._next_resync = 0.0  # the quarter reclaim time since the last look has passed
    again = [d.entry_id for d in await reader.read(block_ms=50)]
    assert again == [lost], "the stray entry is handed out again; the held one is not"
    assert reader.resynced == 1 and reader.reclaimed == 0
    assert await pel(redis, keys.stream("prompts")) == {held: ("w-resync", 1), lost: ("w-resync", 2)}
    await redis.aclose()


async def ack_lost(
    reader: StreamReader[PromptGroup], producer: StreamProducer, behind: aioredis.Redis, keys: Keys, consumer: str
) -> str:
    """A task in `consumer`'s pending list that its reader never saw (read with `behind` behind its back,
    after the reader is past its start, where it reads its own pending history): an ack as good as lost."""
    await reader.ensure_group()
    assert await reader.read(block_ms=50) == []
    (lost,) = await producer.send("prompts", [prompt(0)])
    await behind.xreadgroup("rollout", consumer, {keys.stream("prompts"): ">"}, count=1)
    return lost


async def test_a_lost_ack_is_left_to_the_resync_even_once_it_is_idle_past_the_reclaim_time(bus_config: Config) -> None:
    """A stray entry of our own (its ack lost) that has been idle past the reclaim time when the reclaim
    timer comes due first: the reclaim leaves it (it takes only entries of the gone and the ones we
    abandoned), and the resync, due a quarter reclaim time later at most, hands it out again and says why.
    (A fault run once saw it taken by the reclaim instead, which recovered it too but said nothing of a
    lost ack.) The evidence is the PEL's delivery counts."""
    config = short_reclaim(bus_config)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w-stray")
    lost = await ack_lost(reader, producer, redis, keys, "w-stray")
    await asyncio.sleep(2 * IDLE_MS / 1000)  # idle past the reclaim time
    reader._next_resync = float("inf")  # the resync not yet due; the reclaim is (it starts due)
    assert await reader.read(block_ms=50) == [], "the reclaim does not take a lost ack"
    assert reader.reclaimed == 0 and await pel(redis, keys.stream("prompts")) == {lost: ("w-stray", 1)}
    reader._next_resync = 0.0
    assert [d.entry_id for d in await reader.read(block_ms=50)] == [lost]
    assert reader.resynced == 1 and reader.reclaimed == 0
    assert await pel(redis, keys.stream("prompts")) == {lost: ("w-stray", 2)}
    await redis.aclose()


async def test_a_reader_looks_for_lost_acks_as_soon_as_its_client_reconnects(bus_config: Config, backend: str) -> None:
    """A Redis restarted from an append-only file that lost its last writes brings back entries whose ack it
    lost; the reader's client reconnects to it without a failure the reader sees (redis-py retries the
    command on a new connection). The reader notices the new connection and looks at its next read, however
    far off the quarter-reclaim-time look is. Here Redis drops the reader's connection (CLIENT KILL) and the
    lost ack is an entry read into the reader's PEL behind its back; the evidence is the PEL's delivery
    counts."""
    if backend == "embedded":
        pytest.skip("fakeredis has no CLIENT KILL: a real Redis drops the connection")
    keys = Keys(bus_config.run)
    name = f"reader-{keys.prefix.strip(':').replace(':', '-')}"
    redis = connect_redis(bus_config.bus.redis_url or "", name=name)
    admin = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(admin, keys, bus_config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, bus_config.bus, "prompts", "w-reconnect")
    lost = await ack_lost(reader, producer, admin, keys, "w-reconnect")
    reader._next_resync = float("inf")  # the periodic look never comes due in this test
    assert await reader.read(block_ms=50) == [], "without a reconnection the lost ack waits for the periodic look"

    clients = await admin.client_list()
    ids = [c["id"] for c in clients if c.get("name") == name]
    assert ids, "the reader's connection is in Redis' client list"
    for client_id in ids:
        await admin.execute_command("CLIENT", "KILL", "ID", client_id)
    got: list[str] = []
    for _ in range(3):  # the read that reconnects, then the one that looks
        got += [d.entry_id for d in await reader.read(block_ms=50)]
    assert got == [lost], "the lost ack is handed out again right after the reconnection"
    assert await pel(admin, keys.stream("prompts")) == {lost: ("w-reconnect", 2)}
    assert await redis.client_getname() in (name, name.encode()), "the reconnection did the handshake (CLIENT SETNAME)"
    await redis.aclose()
    await admin.aclose()

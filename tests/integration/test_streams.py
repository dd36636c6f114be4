"""The data plane against real servers: delivery, dead letters, dead consumers, backpressure, retention."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PromptGroup, Tensor, WorkerState, WorkerStatus, codec_for
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import PAYLOAD_FIELD, StreamProducer, stream_backlog, trim_acked
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis]


def prompt(i: int) -> PromptGroup:
    return PromptGroup(task_id=f"task-{i}", prompt_id=f"p{i}", prompt_ids=[1, 2, i], answer=str(i), group_size=4)


def with_bus(config: Config, **changes: object) -> Config:
    return msgspec.structs.replace(config, bus=msgspec.structs.replace(config.bus, **changes))


async def dead_letters(redis: aioredis.Redis, keys: Keys) -> list:
    rows = await redis.xrange(keys.stream("dead"))
    return [codec_for("dead").decode(fields[PAYLOAD_FIELD]) for _, fields in rows]


async def test_produce_consume_ack(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, bus_config.bus, "prompts", "w1")
    await reader.ensure_group()
    sent = [prompt(i) for i in range(10)]
    ids = await producer.send("prompts", sent)
    got = []
    while len(got) < 10:
        got += await reader.read()
    assert [d.entry_id for d in got] == ids
    assert [d.message for d in got] == sent
    assert all(d.deliveries == 1 for d in got)
    assert await reader.ack([d.entry_id for d in got]) == 10
    assert await reader.ack([d.entry_id for d in got]) == 0, "an entry is acked once"
    assert (await redis.xpending(keys.stream("prompts"), "rollout"))["pending"] == 0
    await redis.aclose()


async def test_garbage_goes_to_dead_and_the_reader_goes_on(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, bus_config.bus, "prompts", "w1")
    await reader.ensure_group()
    key = keys.stream("prompts")
    await producer.send("prompts", [prompt(0)])
    await redis.xadd(key, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
    await redis.xadd(key, {b"other": b"no payload field"})
    await redis.xadd(key, {PAYLOAD_FIELD: msgspec.msgpack.encode({"kind": "prompt_group", "schema": 99})})
    await producer.send("prompts", [prompt(1)])
    got = []
    for _ in range(5):
        got += await reader.read(block_ms=50)
    assert [d.message.task_id for d in got] == ["task-0", "task-1"]
    dead = await dead_letters(redis, keys)
    assert len(dead) == 3
    reasons = " | ".join(d.reason for d in dead)
    assert "MessagePack data is malformed" in reasons
    assert "entry has no 'm' field" in reasons
    assert "$.schema" in reasons
    assert all(d.stream == "prompts" and d.origin == "rollout/w1" for d in dead)
    assert int(await redis.hget(keys.dead_counts, "prompts")) == 3
    assert (await redis.xpending(key, "rollout"))["pending"] == 2, "dead entries are acked, good ones wait"
    await redis.aclose()


garbage = st.one_of(
    st.binary(max_size=200),
    st.dictionaries(
        st.text(max_size=8), st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.binary(max_size=8))
    ).map(msgspec.msgpack.encode),
    st.fixed_dictionaries(
        {
            "kind": st.just("hidden"),
            "sample_id": st.text(max_size=5),
            "policy_version": st.integers(-3, 3),
            "token_ids": st.lists(st.integers(-2, 5), max_size=4),
            "hidden": st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["float32", "int8", "bogus"]),
                    "shape": st.lists(st.integers(0, 3), max_size=3),
                    "data": st.binary(max_size=40),
                }
            ),
        }
    ).map(msgspec.msgpack.encode),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(garbage, min_size=1, max_size=8))
def test_fuzzed_entries_never_stop_the_reader(bus_config: Config, payloads: list[bytes]) -> None:
    async def scenario() -> None:
        keys = Keys(f"{bus_config.run}-{os.urandom(4).hex()}")
        redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
        reader: StreamReader = StreamReader(redis, keys, bus_config.bus, "hidden", "fuzz")
        await reader.ensure_group()
        for payload in payloads:
            await redis.xadd(keys.stream("hidden"), {PAYLOAD_FIELD: payload})
        decoded = []
        for _ in range(len(payloads) + 1):
            decoded += await reader.read(block_ms=10)
        for delivery in decoded:  # whatever decodes is a valid window
            window = delivery.message
            assert window.hidden.shape[0] == len(window.token_ids)
        assert len(decoded) + reader.dead == len(payloads)
        assert len(await dead_letters(redis, keys)) == reader.dead
        await redis.delete(*[k async for k in redis.scan_iter(match=f"{keys.prefix}*")])
        await redis.aclose()

    asyncio.run(scenario())


async def test_restarted_consumer_resumes_its_own_pending_first(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    first: StreamReader[PromptGroup] = StreamReader(redis, keys, bus_config.bus, "prompts", "w1")
    await first.ensure_group()
    await producer.send("prompts", [prompt(i) for i in range(3)])
    taken = await first.read()
    assert len(taken) == 3  # taken, never acked: the process "restarts"
    await producer.send("prompts", [prompt(3)])
    again: StreamReader[PromptGroup] = StreamReader(redis, keys, bus_config.bus, "prompts", "w1")
    resumed = await again.read()
    assert [d.message.task_id for d in resumed] == ["task-0", "task-1", "task-2"]
    assert all(d.deliveries == 2 for d in resumed)
    new = await again.read()
    assert [d.message.task_id for d in new] == ["task-3"]
    await redis.aclose()


CONSUMER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, msgspec, redis.asyncio as aioredis
    from tlt_stream.bus.consumer import StreamReader
    from tlt_stream.bus.streams import Keys
    from tlt_stream.basics.config import BusConfig

    async def main():
        bus = msgspec.json.decode(sys.argv[2], type=BusConfig)
        redis = aioredis.Redis.from_url(bus.redis_url)
        reader = StreamReader(redis, Keys(sys.argv[1]), bus, "prompts", "doomed")
        taken = []
        while len(taken) < int(sys.argv[3]):
            taken += await reader.read()
        print("TOOK", len(taken), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_entries_of_a_killed_consumer_are_reclaimed_nothing_lost_nothing_acked_twice(
    bus_config: Config,
) -> None:
    config = with_bus(bus_config, reclaim_idle_ms=400)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    survivor: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "survivor")
    await survivor.ensure_group()
    await producer.send("prompts", [prompt(i) for i in range(6)])
    victim = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CONSUMER_SCRIPT,
        config.run,
        msgspec.json.encode(config.bus).decode(),
        "6",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(victim.stdout.readline(), timeout=60)
        assert line.decode().strip() == "TOOK 6"
    finally:
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
    await producer.send("prompts", [prompt(6)])
    handled: list[str] = []
    acked = 0
    for _ in range(40):
        batch = await survivor.read(block_ms=100)
        handled += [d.message.task_id for d in batch]
        acked += await survivor.ack([d.entry_id for d in batch])
        if len(handled) >= 7:
            break
    assert sorted(handled) == sorted(f"task-{i}" for i in range(7))
    assert acked == 7 and survivor.reclaimed == 6
    assert (await redis.xpending(keys.stream("prompts"), "rollout"))["pending"] == 0
    await redis.aclose()


async def test_an_entry_that_keeps_failing_is_dead_lettered_after_max_deliveries(bus_config: Config) -> None:
    config = with_bus(bus_config, reclaim_idle_ms=1, max_deliveries=3)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w1")
    await reader.ensure_group()
    await producer.send("prompts", [prompt(0)])
    seen = []
    for _ in range(10):  # handler "fails": abandons it unacked; reclaim hands it back until it is given up
        await asyncio.sleep(0.01)
        batch = await reader.read(block_ms=20)
        reader.abandon([d.entry_id for d in batch])
        seen += batch
        if reader.dead:
            break
    assert [d.deliveries for d in seen] == [1, 2, 3]
    dead = await dead_letters(redis, keys)
    assert len(dead) == 1 and "delivered 4 times without an ack" in dead[0].reason
    assert codec_for("prompts").decode(dead[0].payload).task_id == "task-0"
    await redis.aclose()


async def test_backpressure_blocks_a_producer_until_the_consumer_acks(bus_config: Config) -> None:
    config = with_bus(bus_config, backlog_limit=5)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    states: list[tuple[str, bool]] = []
    producer = StreamProducer(redis, keys, config.bus, on_backpressure=lambda s, w: states.append((s, w)))
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w1")
    await reader.ensure_group()
    await producer.send("prompts", [prompt(i) for i in range(5)])
    blocked = asyncio.create_task(producer.send("prompts", [prompt(5)]))
    await asyncio.sleep(0.5)
    assert not blocked.done() and producer.waiting == {"prompts"} and states == [("prompts", True)]
    assert await stream_backlog(redis, keys.stream("prompts")) == 5
    taken = await reader.read(count=2)
    await asyncio.sleep(0.3)
    assert not blocked.done(), "delivered but un-acked entries still count"
    await reader.ack([d.entry_id for d in taken])
    await asyncio.wait_for(blocked, timeout=5)
    assert producer.waiting == set() and states == [("prompts", True), ("prompts", False)]
    assert await redis.xlen(keys.stream("prompts")) == 6, "nothing was dropped"
    await redis.aclose()


async def test_retention_durable_trims_only_acked_buffer_is_bounded(bus_config: Config) -> None:
    config = with_bus(bus_config, hidden_maxlen=50)
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w1")
    await reader.ensure_group()
    await producer.send("prompts", [prompt(i) for i in range(10)])
    taken = await reader.read(count=6)
    await reader.ack([d.entry_id for d in taken[:2] + taken[3:]])  # entry 2 stays pending
    assert await trim_acked(redis, keys.stream("prompts")) == 2
    remaining = [
        codec_for("prompts").decode(f[PAYLOAD_FIELD]).task_id for _, f in await redis.xrange(keys.stream("prompts"))
    ]
    assert remaining == [f"task-{i}" for i in range(2, 10)]
    await reader.ack([taken[2].entry_id])
    assert await trim_acked(redis, keys.stream("prompts")) == 4, "up to the first undelivered entry"

    window = Tensor.from_values([[0.0] * 4] * 2, "float32")
    from tlt_stream.basics.messages import HiddenWindow

    for _ in range(4):
        await producer.send(
            "hidden", [HiddenWindow(sample_id="s", policy_version=0, token_ids=[1, 2], hidden=window)] * 100
        )
    assert await redis.xlen(keys.stream("hidden")) == 50, "a small MAXLEN bounds the buffer stream exactly"
    await producer.send_one("stats", WorkerState(worker_id="w", state=WorkerStatus.IDLE))
    await redis.aclose()


async def stream_ids(redis: aioredis.Redis, key: str) -> list[str]:
    return [entry_id.decode() for entry_id, _ in await redis.xrange(key)]


async def test_trim_acked_keeps_what_any_group_has_pending_or_not_yet_delivered(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    key = keys.stream("prompts")
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    ids = await producer.send("prompts", [prompt(i) for i in range(10)])
    assert await trim_acked(redis, key) == 0, "a stream nobody reads yet keeps everything"
    await redis.xgroup_create(key, "rollout", id="0")
    assert await trim_acked(redis, key) == 0, "a group that delivered nothing keeps everything"
    taken = await redis.xreadgroup("rollout", "w1", {key: ">"}, count=6)
    assert await redis.xack(key, "rollout", *[entry_id for entry_id, _ in taken[0][1]]) == 6
    assert (await redis.xpending(key, "rollout"))["pending"] == 0
    assert await trim_acked(redis, key) == 6, "empty PEL: up to the last delivered entry"
    assert await stream_ids(redis, key) == ids[6:], "entries after last-delivered-id stay"

    await redis.xgroup_create(key, "audit", id="0")
    assert await trim_acked(redis, key) == 0, "a second group that delivered nothing holds everything"
    audit = await redis.xreadgroup("audit", "a1", {key: ">"}, count=2)
    await redis.xack(key, "audit", audit[0][1][1][0])  # ids[7] acked, ids[6] pending in `audit`
    rest = await redis.xreadgroup("rollout", "w1", {key: ">"})
    await redis.xack(key, "rollout", *[entry_id for entry_id, _ in rest[0][1]])
    assert await trim_acked(redis, key) == 0, "an entry pending in one group holds it and all after it"
    assert await stream_ids(redis, key) == ids[6:]
    await redis.xack(key, "audit", ids[6])
    assert await trim_acked(redis, key) == 2, "audit's PEL is empty: up to its last delivered entry"
    assert await stream_ids(redis, key) == ids[8:], "entries audit has not read yet stay"
    later = await producer.send("prompts", [prompt(10)])
    assert await trim_acked(redis, key) == 0
    assert await stream_ids(redis, key) == ids[8:] + later
    for group, consumer in (("rollout", "w1"), ("audit", "a1")):
        got = await redis.xreadgroup(group, consumer, {key: ">"})
        await redis.xack(key, group, *[entry_id for entry_id, _ in got[0][1]])
    assert await trim_acked(redis, key) == 3
    assert await redis.xlen(key) == 0
    assert await trim_acked(redis, key) == 0, "an empty stream"
    assert await trim_acked(redis, keys.stream("samples")) == 0, "no stream at all"
    await redis.aclose()


async def test_trim_acked_against_a_model_of_three_groups(bus_config: Config) -> None:
    """Random adds, reads and acks by three groups; after each trim the stream holds exactly the entries from
    the oldest one some group has pending or not yet delivered, and each group's PEL is untouched."""
    import random

    keys = Keys(bus_config.run)
    key = keys.stream("samples")
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    rng = random.Random(7)
    groups = ("learner", "audit", "late")
    entries: list[str] = []
    delivered = {g: 0 for g in groups}  # entries[:n] were delivered to g (XREADGROUP delivers in order)
    pending: dict[str, set[str]] = {g: set() for g in groups}
    await redis.xgroup_create(key, "learner", id="0", mkstream=True)
    await redis.xgroup_create(key, "audit", id="0")
    trimmed = 0
    for step in range(120):
        if step == 30:
            await redis.xgroup_create(key, "late", id="0")
        live = groups if step >= 30 else groups[:2]
        action = rng.random()
        if action < 0.35:
            for _ in range(rng.randint(1, 4)):
                entries.append((await redis.xadd(key, {PAYLOAD_FIELD: b"x"})).decode())
        elif action < 0.65:
            group = rng.choice(live)
            got = await redis.xreadgroup(group, "c", {key: ">"}, count=rng.randint(1, 5))
            for entry_id, _ in got[0][1] if got else []:
                assert entry_id.decode() == entries[delivered[group]]
                pending[group].add(entry_id.decode())
                delivered[group] += 1
        elif action < 0.9:
            group = rng.choice(live)
            if pending[group]:
                acked = rng.sample(sorted(pending[group]), rng.randint(1, len(pending[group])))
                assert await redis.xack(key, group, *acked) == len(acked)
                pending[group] -= set(acked)
        else:
            before = await stream_ids(redis, key)
            removed = await trim_acked(redis, key)
            trimmed += removed
            # What each group still needs starts at its oldest pending entry, else at its first undelivered one.
            needed = [min([entries.index(i) for i in pending[g]] + [delivered[g]]) for g in live]
            expected = entries[min(needed) :]
            assert await stream_ids(redis, key) == expected
            assert removed == len(before) - len(expected)
            for g in live:
                summary = await redis.xpending(key, g)
                assert summary["pending"] == len(pending[g]), "trimming never touches a PEL"
    assert trimmed > 0, "the run exercised trimming"
    await redis.aclose()

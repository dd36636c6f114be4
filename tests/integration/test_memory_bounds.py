"""Redis memory stays bounded, and a full Redis stops no service.

Bounds are read from Redis itself: `MEMORY USAGE` on a real server, entries x entry size on the embedded one
(fakeredis has no MEMORY command). Memory pressure runs against a private redis-server at `maxmemory 2mb`
with `noeviction`, filled by a key the test owns: buffer streams drop and count, durable streams wait and
then go through once the test frees memory, and heartbeats and dispatches outlive the refusals.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from tests.faults.harness import wait_listening
from tests.integration.loop import until_redis
from tests.ports import free_port
from tlt_stream.basics.config import BusConfig, Config
from tlt_stream.basics.messages import HiddenWindow, Sample, Tensor, WorkerState, WorkerStatus, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import PAYLOAD_FIELD, StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.policy import PolicyService

pytestmark = [pytest.mark.redis]

FILLER = "test:filler"
WAIT_S = 20.0
"""Bound on every wait for a state the test then checks in Redis."""


def window(rows: int, width: int) -> HiddenWindow:
    hidden = Tensor(dtype="float32", shape=[rows, width], data=memoryview(bytes(rows * width * 4)))
    return HiddenWindow(sample_id="s/0", policy_version=0, token_ids=[1] * rows, hidden=hidden)


def sample(index: int) -> Sample:
    return Sample(
        sample_id=f"t/{index}",
        task_id="t",
        prompt_id="p",
        index=index,
        group_size=4,
        prompt_ids=[5, 6],
        token_ids=Tensor.from_values([7, 8, 2], "int32"),
        logprobs=Tensor.from_values([-0.1, -0.2, -0.3], "float32"),
        policy_version=0,
        drafter_version=-1,
        reward=1.0,
        finish_reason="eos",
        worker_id="w",
    )


class FixedSource:
    def prompts(self, step: int, count: int) -> list[tuple[str, str, list[int], str]]:
        return [(f"p{step}-{i}", "1+1", [1, 2, 3], "2") for i in range(count)]


@pytest.mark.parametrize(
    ("rows", "max_bytes", "batch"),
    [(50, 2 * 2**20, 2), (1, 64 * 2**10, 10)],
    ids=["200KiB-windows", "4KiB-windows"],
)
async def test_hidden_stays_within_its_byte_bound(
    bus_config: Config, backend: str, rows: int, max_bytes: int, batch: int
) -> None:
    config = msgspec.structs.replace(
        bus_config, bus=msgspec.structs.replace(bus_config.bus, hidden_maxlen=2000, hidden_max_bytes=max_bytes)
    )
    keys = Keys(config.run)
    key = keys.stream("hidden")
    redis = connect_redis(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    message = window(rows, 1024)
    entry_bytes = len(codec_for("hidden").encode(message))
    sent = 0
    while sent < 6 * max_bytes:
        await producer.send("hidden", [message] * batch)
        sent += batch * entry_bytes
        length = await redis.xlen(key)
        if backend == "real":
            held = await redis.memory_usage(key, samples=0)
        else:
            held = length * entry_bytes
        assert held <= max_bytes, f"{length} entries hold {held} bytes, over the bound of {max_bytes}"
    assert length >= max_bytes // (2 * entry_bytes), "the bound in bytes does not starve the buffer"
    await redis.aclose()


async def test_the_policy_service_trims_prompts_every_group_acked(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    key = keys.stream("prompts")
    redis = connect_redis(bus_config.bus.redis_url)
    control = ControlPlane(bus_config, redis, role="policy")
    service = PolicyService(bus_config, redis, control, FixedSource(), prompts_per_step=3, group_size=2)
    reader: StreamReader = StreamReader(redis, keys, bus_config.bus, "prompts", "w1")
    await reader.ensure_group()
    await service.dispatch(0)
    taken = await reader.read(count=3)
    await reader.ack([taken[0].entry_id, taken[2].entry_id])  # taken[1] stays pending
    await service.dispatch(1)
    assert service.trimmed == 1 and await redis.xlen(key) == 5, "only what precedes the pending task goes"
    await reader.ack([taken[1].entry_id])
    await service.dispatch(2)
    assert service.trimmed == 3 and await redis.xlen(key) == 6, "undelivered tasks stay"
    remaining = [codec_for("prompts").decode(f[PAYLOAD_FIELD]).step for _, f in await redis.xrange(key)]
    assert remaining == [1, 1, 1, 2, 2, 2]
    await redis.aclose()


@asynccontextmanager
async def full_redis(root: Path) -> AsyncIterator[aioredis.Redis]:
    """A private redis-server at `maxmemory 2mb` / `noeviction` (not yet filled), stopped afterwards."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    port = free_port()
    log = root / "redis.log"
    with log.open("ab") as out:
        server = await asyncio.create_subprocess_exec(
            "redis-server",
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(root), "--save", "", "--appendonly", "no"),
            *("--maxmemory", "2mb", "--maxmemory-policy", "noeviction"),
            stdout=out,
            stderr=out,
        )
    redis = aioredis.Redis(port=port)
    try:
        await wait_listening(port, server, log, timeout=WAIT_S)
        yield redis
    finally:
        await redis.aclose()
        server.send_signal(signal.SIGTERM)
        await server.wait()


async def fill(redis: aioredis.Redis) -> None:
    """Grow a key of our own until Redis refuses writes for memory."""
    for _ in range(200):
        try:
            await redis.append(FILLER, b"x" * 2**16)
        except OutOfMemoryError:
            return
    raise AssertionError("Redis never refused a write: is maxmemory set?")


async def oom_replies(redis: aioredis.Redis) -> int:
    """How many commands this Redis has refused for memory (its own count, INFO errorstats)."""
    return int((await redis.info("errorstats")).get("errorstat_OOM", {}).get("count", 0))


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    await until_redis(condition, what, WAIT_S)


def private_config(redis: aioredis.Redis, **bus: object) -> Config:
    port = redis.connection_pool.connection_kwargs["port"]
    return Config(
        run="oom", bus=BusConfig(redis_url=f"redis://127.0.0.1:{port}/0", mqtt_url="mqtt://127.0.0.1:1", **bus)
    )


async def test_a_full_redis_drops_buffer_entries_and_holds_durable_ones(tmp_path: Path) -> None:
    async with full_redis(tmp_path) as redis:
        config = private_config(redis)
        keys = Keys(config.run)
        states: list[tuple[str, bool]] = []
        producer = StreamProducer(redis, keys, config.bus, on_backpressure=lambda s, w: states.append((s, w)))
        await fill(redis)
        refused = await oom_replies(redis)

        stats = [WorkerState(worker_id="w", state=WorkerStatus.IDLE)] * 3
        assert await producer.send("stats", stats) == [], "a buffer stream drops, never raises"
        assert await producer.send_one("hidden", window(2, 16)) is None
        assert producer.dropped == {"stats": 3, "hidden": 1}
        assert await redis.xlen(keys.stream("stats")) == 0 and await oom_replies(redis) == refused + 4

        sending = asyncio.create_task(producer.send("samples", [sample(i) for i in range(4)]))

        async def refused_twice() -> bool:  # two tries of the 4 entries, both refused by Redis
            return await oom_replies(redis) >= refused + 4 + 8

        await until(refused_twice, "the samples send to be refused twice")
        assert not sending.done() and producer.waiting == {"samples"} and states == [("samples", True)]
        assert await redis.xlen(keys.stream("samples")) == 0

        await redis.delete(FILLER)
        ids = await asyncio.wait_for(sending, WAIT_S)
        rows = await redis.xrange(keys.stream("samples"))
        assert ids == [entry_id.decode() for entry_id, _ in rows], "every entry stored once, in order"
        assert [codec_for("samples").decode(f[PAYLOAD_FIELD]).index for _, f in rows] == [0, 1, 2, 3]
        assert producer.waiting == set() and states == [("samples", True), ("samples", False)]
        assert "samples" not in producer.dropped
        assert len(await producer.send("stats", stats)) == 3, "with memory back, buffers are written again"


async def test_heartbeats_and_dispatches_outlive_a_full_redis(tmp_path: Path) -> None:
    async with full_redis(tmp_path) as redis:
        config = private_config(redis, heartbeat_s=0.1, heartbeat_ttl_s=30.0)
        keys = Keys(config.run)
        producer = StreamProducer(redis, keys, config.bus)
        registry = WorkerRegistry(redis, keys, config.bus, producer, "w1", role="rollout")
        service = PolicyService(
            config, redis, ControlPlane(config, redis, role="policy"), FixedSource(), prompts_per_step=2, group_size=2
        )
        worker = keys.worker("w1")
        await registry.beat()
        await fill(redis)
        last_beat = await redis.hget(worker, "heartbeat")
        await registry.set_state(WorkerStatus.IDLE)  # its stats entry is dropped, its beat refused: no raise
        assert producer.dropped["stats"] == 1

        refused = await oom_replies(redis)
        dispatching = asyncio.create_task(service.dispatch(0))

        async def dispatch_refused_twice() -> bool:  # each try queues 2 XADDs and an HSET, all refused
            return await oom_replies(redis) >= refused + 6

        await until(dispatch_refused_twice, "the dispatch to be refused twice")
        assert not dispatching.done() and await redis.xlen(keys.stream("prompts")) == 0
        assert await service.next_step() == 0, "a refused transaction moved nothing"

        stop = asyncio.Event()
        beating = asyncio.create_task(registry.heartbeat(stop))
        try:
            await redis.pexpire(worker, 3000)

            async def kept_alive() -> bool:  # the refused heartbeat still extends the hash's TTL
                return await redis.pttl(worker) > 3000

            await until(kept_alive, "the heartbeat to keep its entry alive")
            assert await redis.hget(worker, "heartbeat") == last_beat, "no full beat went through"
            assert not beating.done()

            await redis.delete(FILLER)
            assert len(await asyncio.wait_for(dispatching, WAIT_S)) == 2
            assert await redis.xlen(keys.stream("prompts")) == 2 and await service.next_step() == 1

            async def beats_again() -> bool:
                return await redis.hget(worker, "heartbeat") != last_beat

            await until(beats_again, "the heartbeat to be written again")
        finally:
            stop.set()
            await asyncio.wait_for(beating, WAIT_S)
        assert await redis.hget(worker, "state") == str(WorkerStatus.STOPPED).encode()

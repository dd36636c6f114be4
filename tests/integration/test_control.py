"""The control plane: retained versions reach late subscribers, versions only move forward, Redis mirrors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiomqtt
import msgspec
import pytest
import redis.asyncio as aioredis

from tlt_stream.bus.connect import mqtt_params
from tlt_stream.bus.control import ControlPlane, read_mirror
from tlt_stream.bus.embedded import EmbeddedServers, free_port
from tlt_stream.bus.streams import Keys
from tlt_stream.config import Config
from tlt_stream.messages import CONTROL_CODEC, DrafterVersion, PolicyVersion, SdArmChoice, SdConfigVersion

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

SHA = "ab" * 32


def policy(version: int) -> PolicyVersion:
    return PolicyVersion(version=version, location=f"/ckpt/policy-{version}", sha256=SHA, step=version)


@contextlib.asynccontextmanager
async def running(plane: ControlPlane) -> AsyncIterator[ControlPlane]:
    stop = asyncio.Event()
    task = asyncio.create_task(plane.run(stop))
    try:
        async with asyncio.timeout(15):
            await plane.connected.wait()
        yield plane
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


async def test_late_subscriber_gets_retained_versions(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy", "drafter", "sd_config"])) as pub:
        assert await pub.publish(policy(1))
        assert await pub.publish(policy(2))
        assert await pub.publish(DrafterVersion(version=1, location="/ckpt/drafter-1", sha256=SHA, policy_version=2))
        table = [
            SdArmChoice(max_batch=1, depth=6, topk=4, verify=32),
            SdArmChoice(max_batch=64, depth=0, topk=0, verify=0, enabled=False),
        ]
        assert await pub.publish(SdConfigVersion(version=1, drafter_version=1, table=table))
    # The publisher is gone; a worker joining now still learns the current state from the broker.
    late_redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    await late_redis.delete(Keys(bus_config.run).versions)  # prove it came over MQTT, not the mirror
    async with running(ControlPlane(bus_config, late_redis, role="worker")) as late:
        async with asyncio.timeout(10):
            await late.wait_for("policy", 2)
            await late.wait_for("drafter", 1)
            sd = await late.wait_for("sd_config", 1)
        assert late.current["policy"].location == "/ckpt/policy-2"
        assert late.current["drafter"].policy_version == 2
        assert sd.table == table
    await redis.aclose()
    await late_redis.aclose()


async def test_versions_only_move_forward(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    worker = ControlPlane(bus_config, redis, role="worker")
    async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy"])) as pub, running(worker):
        updates = []

        async def collect() -> None:
            async for message in worker.updates():
                updates.append(message.version)

        collector = asyncio.create_task(collect())
        assert await pub.publish(policy(3))
        assert not await pub.publish(policy(3)), "a duplicate version is refused"
        assert not await pub.publish(policy(2)), "an older version is refused"
        # A stray older retained message sent straight to the broker is ignored by subscribers.
        params = mqtt_params(bus_config.bus.mqtt_url)
        async with aiomqtt.Client(params.host, params.port, protocol=aiomqtt.ProtocolVersion.V311) as raw:
            await raw.publish(pub.topic("policy"), CONTROL_CODEC.encode(policy(1)), qos=1)
            await raw.publish(pub.topic("policy"), b"{not json", qos=1)
        assert await pub.publish(policy(4))
        async with asyncio.timeout(10):
            await worker.wait_for("policy", 4)
        await asyncio.sleep(0.3)
        collector.cancel()
        assert updates == [3, 4]
        assert worker.version("policy") == 4 and worker.ignored >= 1
        mirror = await read_mirror(redis, Keys(bus_config.run))
        assert mirror["policy"].version == 4
    await redis.aclose()


async def test_two_publishers_cannot_move_a_version_backwards(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    a = ControlPlane(bus_config, redis, role="a", owns=["policy"])
    b = ControlPlane(bus_config, redis, role="b", owns=["policy"])
    results = await asyncio.gather(*(p.publish(policy(v)) for v in range(1, 6) for p in (a, b)))
    assert sum(results) <= 5  # each version wins at most once
    assert (await read_mirror(redis, Keys(bus_config.run)))["policy"].version == 5
    await redis.aclose()


async def test_without_a_broker_the_mirror_still_serves(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    await ControlPlane(bus_config, redis, role="policy", owns=["policy"]).publish(policy(7))
    dead_broker = msgspec.structs.replace(
        bus_config, bus=msgspec.structs.replace(bus_config.bus, mqtt_url="mqtt://127.0.0.1:1", reconnect_max_s=0.5)
    )
    worker = ControlPlane(dead_broker, redis, role="worker")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    async with asyncio.timeout(10):
        message = await worker.wait_for("policy", 7)
    assert message.location == "/ckpt/policy-7" and not worker.connected.is_set()
    stop.set()
    await asyncio.wait_for(task, timeout=10)
    await redis.aclose()


async def test_a_version_published_while_the_broker_is_down_goes_out_on_reconnect(bus_config: Config) -> None:
    port = free_port()
    offline = msgspec.structs.replace(
        bus_config,
        bus=msgspec.structs.replace(bus_config.bus, mqtt_url=f"mqtt://127.0.0.1:{port}", reconnect_max_s=0.3),
    )
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    publisher = ControlPlane(offline, redis, role="policy", owns=["policy"])
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    assert await publisher.publish(policy(9)), "accepted into the mirror while MQTT is down"
    broker = EmbeddedServers()
    try:
        broker.start_mqtt(port=port)
        async with asyncio.timeout(15):
            await publisher.connected.wait()
        await redis.delete(Keys(bus_config.run).versions)  # the late worker must learn it from the broker
        async with running(ControlPlane(offline, redis, role="worker")) as late:
            async with asyncio.timeout(10):
                assert (await late.wait_for("policy", 9)).location == "/ckpt/policy-9"
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        broker.close()
        await redis.aclose()


async def test_purge_run_leaves_nothing_of_the_run_and_spares_other_runs(bus_config: Config) -> None:
    from tests.conftest import make_config
    from tlt_stream.bus.connect import purge_run

    other = make_config(bus_config.bus.redis_url, bus_config.bus.mqtt_url)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    try:
        async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy"])) as pub:
            assert await pub.publish(policy(4))
        await redis.xadd(f"tlt:{bus_config.run}:stream:hidden", {"x": b"1"})
        for i in range(600):  # more keys than one unlink batch
            await redis.set(f"tlt:{bus_config.run}:many:{i}", i)
        await redis.set(f"tlt:{other.run}:keep", 1)

        assert await purge_run(bus_config) >= 602
        assert [k async for k in redis.scan_iter(match=f"tlt:{bus_config.run}:*")] == []
        assert await redis.get(f"tlt:{other.run}:keep") == b"1"
        # The retained policy version is gone too: a new subscriber learns nothing.
        late = ControlPlane(bus_config, redis, role="worker")
        async with running(late):
            await asyncio.sleep(0.5)
            assert "policy" not in late.current
    finally:
        await redis.delete(f"tlt:{other.run}:keep")
        await redis.aclose()

"""The control plane: retained versions reach late subscribers, versions only move forward, Redis mirrors, and
an MQTT message the mirror does not confirm (forged on the broker) changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import aiomqtt
import msgspec
import pytest
import redis.asyncio as aioredis

from tests.ports import free_port
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import (
    CONTROL_CODEC,
    ControlMessage,
    DrafterVersion,
    PolicyVersion,
    SdArmChoice,
    SdConfigVersion,
)
from tlt_stream.bus.connect import mqtt_params
from tlt_stream.bus.control import ControlPlane, read_mirror
from tlt_stream.bus.embedded import EmbeddedServers
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

SHA = "ab" * 32
EVIL_SHA = "cd" * 32


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


@contextlib.asynccontextmanager
async def raw_client(config: Config) -> AsyncIterator[aiomqtt.Client]:
    """A plain MQTT client on the broker, bypassing ControlPlane (what a forger or a stray tool would use)."""
    assert config.bus.mqtt_url is not None
    async with mqtt_params(config.bus.mqtt_url).client(identifier=f"raw-{uuid.uuid4().hex[:8]}") as raw:
        yield raw


async def forge(config: Config, message: ControlMessage | bytes, *, retain: bool = True) -> None:
    """Publish straight to the broker on the message's topic (the kind of a raw payload: policy)."""
    payload = message if isinstance(message, bytes) else CONTROL_CODEC.encode(message)
    kind = "policy" if isinstance(message, bytes) else message.kind
    async with raw_client(config) as raw:
        await raw.publish(f"{config.topic_prefix}{kind}", payload, qos=1, retain=retain)


async def retained(config: Config, kind: str, min_version: int = 0) -> ControlMessage:
    """The first message of `kind` at `min_version` or later that the broker delivers to a fresh subscriber
    (its retained one, or a later publish): what the broker holds, whatever any ControlPlane believes.
    Deliveries on other topics are skipped (the embedded broker can hand a new session another one's)."""
    topic = f"{config.topic_prefix}{kind}"
    async with raw_client(config) as raw:
        await raw.subscribe(topic, qos=1)
        async for delivery in raw.messages:
            if str(delivery.topic) != topic:
                continue
            message = CONTROL_CODEC.decode(delivery.payload)  # type: ignore[arg-type]
            if message.version >= min_version:
                return message
    raise AssertionError("the broker closed the subscription")


async def adopted_until(plane: ControlPlane, kind: str, version: int) -> list[ControlMessage]:
    """Every message of `kind` that `plane` adopts from now until it holds `version` (start it as a task
    before the updates happen, and bound it)."""
    adopted: list[ControlMessage] = []
    async for message in plane.updates():
        if message.kind == kind:
            adopted.append(message)
        if plane.version(kind) >= version:
            return adopted
    raise AssertionError("updates() ended")


class Recorder(logging.Handler):
    """Collects the control plane's log records and wakes a waiter when one contains `needle`."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.records: list[logging.LogRecord] = []
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.needle in record.getMessage():
            self.seen.set()


@contextlib.contextmanager
def recording(needle: str) -> Iterator[Recorder]:
    logger = logging.getLogger("tlt_stream.bus.control")
    recorder = Recorder(needle)
    level = logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    try:
        yield recorder
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)


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
    # The publisher is gone; the broker still holds the current state, exactly as the mirror does.
    mirror = await read_mirror(redis, Keys(bus_config.run))
    async with asyncio.timeout(10):
        for kind in ("policy", "drafter", "sd_config"):
            assert await retained(bus_config, kind) == mirror[kind]
    # A worker joining now learns it (each retained message is a notification the mirror confirms).
    late_redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    async with running(ControlPlane(bus_config, late_redis, role="worker")) as late:
        async with asyncio.timeout(10):
            await late.wait_for("policy", 2)
            await late.wait_for("drafter", 1)
            sd = await late.wait_for("sd_config", 1)
        assert late.current["policy"].location == "/ckpt/policy-2"
        assert late.current["drafter"].policy_version == 2
        assert sd.table == table
        assert late.counters() == {"ignored": late.ignored, "forged": 0}
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
        async with raw_client(bus_config) as raw:
            await raw.publish(pub.topic("policy"), CONTROL_CODEC.encode(policy(1)), qos=1)
            await raw.publish(pub.topic("policy"), b"{not json", qos=1)
        assert await pub.publish(policy(4))
        async with asyncio.timeout(10):
            await worker.wait_for("policy", 4)
        await asyncio.sleep(0.3)
        collector.cancel()
        assert updates in ([3, 4], [4])  # 3 is skipped when the mirror already holds 4 as its notification lands
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
            assert (await retained(offline, "policy", 9)).location == "/ckpt/policy-9"  # it reached the broker
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


# ------------------------------------------------------------------------------------------ forged and replayed


async def test_a_forged_future_version_on_the_broker_changes_nothing(bus_config: Config) -> None:
    """The reproduction: version 2**62 published straight to the broker used to win for good, so every
    genuine version after it was ignored. Now the mirror does not confirm it, and genuine versions still land."""
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    worker = ControlPlane(bus_config, redis, role="worker")
    forged = PolicyVersion(version=2**62, location="/evil/policy", sha256=EVIL_SHA, step=0)
    async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy"])) as pub, running(worker):
        assert await pub.publish(policy(1))
        async with asyncio.timeout(10):
            await worker.wait_for("policy", 1)
        await forge(bus_config, forged)  # retained, so it also greets every later subscriber
        late = ControlPlane(bus_config, redis, role="late")
        async with running(late):
            # The broker greets the late subscriber with the retained forgery after its SUBACK; Mosquitto
            # sends it at once, the embedded broker from a task of its own. Publishing version 2 before that
            # greeting lands would replace the retained forgery, and `late` would never be offered it.
            async with asyncio.timeout(10):
                while late.forged < 1:  # noqa: ASYNC110 (a counter, no event to wait on)
                    await asyncio.sleep(0.01)
            assert await pub.publish(policy(2))
            async with asyncio.timeout(10):
                for plane in (worker, late):
                    adopted = await plane.wait_for("policy", 2)
                    assert (adopted.version, adopted.location, adopted.sha256) == (2, "/ckpt/policy-2", SHA)
                    assert plane.forged >= 1 and plane.counters()["forged"] == plane.forged
    assert (await read_mirror(redis, Keys(bus_config.run)))["policy"].version == 2
    await redis.aclose()


async def test_a_forged_location_for_a_genuine_version_is_not_adopted(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    worker = ControlPlane(bus_config, redis, role="worker")
    async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy"])) as pub, running(worker):
        assert await pub.publish(policy(5))
        async with asyncio.timeout(10):
            await worker.wait_for("policy", 5)
        collector = asyncio.create_task(adopted_until(worker, "policy", 6))
        # The version the mirror holds, and the one just after it, each pointing at another checkpoint.
        await forge(bus_config, PolicyVersion(version=5, location="/evil/policy-5", sha256=EVIL_SHA, step=5))
        await forge(bus_config, PolicyVersion(version=6, location="/evil/policy-6", sha256=EVIL_SHA, step=6))
        assert await pub.publish(policy(6))
        adopted = await asyncio.wait_for(collector, timeout=10)
        assert [(m.version, m.location, m.sha256) for m in adopted] == [(6, "/ckpt/policy-6", SHA)]
        assert worker.current["policy"] == adopted[0] and worker.forged == 2
    await redis.aclose()


async def test_a_replayed_genuine_message_changes_nothing(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    worker = ControlPlane(bus_config, redis, role="worker")
    first = policy(1)
    async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy"])) as pub, running(worker):
        assert await pub.publish(first)
        assert await pub.publish(policy(2))
        async with asyncio.timeout(10):
            await worker.wait_for("policy", 2)
        collector = asyncio.create_task(adopted_until(worker, "policy", 3))
        ignored = worker.ignored
        await forge(bus_config, CONTROL_CODEC.encode(first))  # byte for byte what was once genuine
        assert await pub.publish(policy(3))
        adopted = await asyncio.wait_for(collector, timeout=10)
        assert [m.version for m in adopted] == [3]
        assert worker.ignored > ignored and worker.forged == 0
    await redis.aclose()


async def test_a_forged_message_is_counted_each_time_and_logged_once(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    worker = ControlPlane(bus_config, redis, role="worker")
    forged = PolicyVersion(version=2**62, location="/evil/policy", sha256=EVIL_SHA, step=0)
    with recording("forged") as log:
        async with running(ControlPlane(bus_config, redis, role="policy", owns=["policy"])) as pub, running(worker):
            assert await pub.publish(policy(1))
            async with asyncio.timeout(10):
                await worker.wait_for("policy", 1)
            await forge(bus_config, forged, retain=False)
            await forge(bus_config, forged, retain=False)
            assert await pub.publish(policy(2))
            async with asyncio.timeout(10):
                await worker.wait_for("policy", 2)
                # pub adopted 2 on publishing it, maybe before its receive loop got to the second forgery
                while pub.counters()["forged"] < 2:  # noqa: ASYNC110 - a counter, no event to wait on
                    await asyncio.sleep(0.02)
            assert worker.counters()["forged"] == 2 and pub.counters()["forged"] == 2  # pub subscribes too
    warnings = [r.getMessage() for r in log.records if r.levelno == logging.WARNING and "forged" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per plane, not one per message
    assert all(str(2**62) in w and "unconfirmed" in w for w in warnings), warnings
    await redis.aclose()


async def test_a_notification_redis_cannot_confirm_waits_for_the_mirror(bus_config: Config) -> None:
    """With the mirror unreadable a notification is not adopted on its word; once Redis answers, the
    recheck adopts the mirror's version without waiting for another notification."""
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    assert await ControlPlane(bus_config, redis, role="policy").publish(policy(1))
    async with raw_client(bus_config) as raw:  # the retained notification, as `publish` would send it
        mirrored = (await read_mirror(redis, Keys(bus_config.run)))["policy"]
        await raw.publish(f"{bus_config.topic_prefix}policy", CONTROL_CODEC.encode(mirrored), qos=1, retain=True)
    fast = msgspec.structs.replace(bus_config, bus=msgspec.structs.replace(bus_config.bus, reconnect_max_s=0.5))
    unreachable = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    worker = ControlPlane(fast, unreachable, role="worker", mirror_timeout_s=1.0)
    with recording("to confirm policy version 1") as log:
        async with running(worker):
            async with asyncio.timeout(10):
                await log.seen.wait()
            assert worker.version("policy") == -1 and worker.forged == 0
            worker.redis = redis  # Redis is back
            async with asyncio.timeout(10):
                assert (await worker.wait_for("policy", 1)).location == "/ckpt/policy-1"
    await unreachable.aclose()
    await redis.aclose()


async def test_a_forgery_redis_cannot_judge_at_once_is_refused_once_it_answers(bus_config: Config) -> None:
    """A forged version that arrives while the mirror cannot be read was dropped unjudged: the recheck caught
    up from the mirror, but the forgery was never refused nor logged (a loaded service whose mirror read
    timed out said nothing of it). Now it is judged once Redis answers, as when the mirror answered at once."""
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    assert await ControlPlane(bus_config, redis, role="policy").publish(policy(1))
    fast = msgspec.structs.replace(bus_config, bus=msgspec.structs.replace(bus_config.bus, reconnect_max_s=0.5))
    unreachable = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    worker = ControlPlane(fast, unreachable, role="worker", mirror_timeout_s=1.0)
    forged = PolicyVersion(version=2**62, location="/evil/policy", sha256=EVIL_SHA, step=0)
    with recording("to confirm policy version") as unread, recording("forged") as refused:
        async with running(worker):
            await forge(bus_config, forged, retain=False)
            async with asyncio.timeout(10):
                await unread.seen.wait()
            assert worker.forged == 0 and worker.version("policy") == -1
            worker.redis = redis  # Redis is back
            async with asyncio.timeout(10):
                assert (await worker.wait_for("policy", 1)).location == "/ckpt/policy-1"
                while worker.forged < 1:  # noqa: ASYNC110 (a counter, no event to wait on)
                    await asyncio.sleep(0.02)
            assert worker.current["policy"].version == 1 and worker.forged == 1
    warnings = [r.getMessage() for r in refused.records if r.levelno == logging.WARNING]
    warnings = [w for w in warnings if "forged" in w]
    assert len(warnings) == 1 and str(2**62) in warnings[0] and "unconfirmed" in warnings[0], warnings
    await unreachable.aclose()
    await redis.aclose()


async def test_the_mirror_ignores_garbage_and_misfiled_messages(bus_config: Config) -> None:
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    keys = Keys(bus_config.run)
    drafter = DrafterVersion(version=3, location="/ckpt/drafter-3", sha256=SHA, policy_version=1)
    await redis.hset(
        keys.versions,
        mapping={
            "policy": b"\xff not a message",
            "sd_config": CONTROL_CODEC.encode(drafter),  # a drafter message filed under sd_config
            "drafter": CONTROL_CODEC.encode(drafter),
        },
    )
    assert await read_mirror(redis, keys) == {"drafter": drafter}
    worker = ControlPlane(bus_config, redis, role="worker")
    assert await worker.refresh_from_mirror()
    assert worker.current == {"drafter": drafter}
    await redis.aclose()


async def test_an_owner_writes_back_a_version_the_mirror_lost(bus_config: Config) -> None:
    """Redis restarted from an append-only file that lost its last second: the mirror holds an older version
    than its owner published (here: put back by hand, as the file would have it). Receivers adopt only what
    the mirror confirms, so the owner writes its version back, and a worker that joins then gets it."""
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    keys = Keys(bus_config.run)
    with recording("older than ours") as seen:
        async with running(ControlPlane(bus_config, redis, role="learner", owns=["policy"])) as owner:
            published = policy(3)
            assert await owner.publish(published)
            older = CONTROL_CODEC.encode(policy(2))
            await redis.hset(keys.versions, mapping={"policy:version": 2, "policy": older})  # the lost suffix
            async with asyncio.timeout(10):
                await seen.seen.wait()
            await owner.guard_owned()  # idempotent: makes sure the write-back the log line announced is done
            assert (await read_mirror(redis, keys))["policy"] == published
            late = ControlPlane(bus_config, redis, role="worker")
            async with running(late), asyncio.timeout(10):
                assert (await late.wait_for("policy", 3)) == published
    await redis.aclose()


async def test_publishing_the_same_message_again_is_not_refused(bus_config: Config) -> None:
    """redis-py retries a command whose reply was lost, so the compare-and-set may run twice for one publish:
    the second run must not call the version refused (the learner then never announced it on MQTT, and
    workers that follow notifications waited for it). Another message for the same version stays refused."""
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    owner = ControlPlane(bus_config, redis, role="learner", owns=["policy"])
    message = policy(4)
    payload = CONTROL_CODEC.encode(message)
    assert await owner._compare_and_set(message, payload)
    assert await owner._compare_and_set(message, payload), "the retry of an applied call"
    other = policy(4)  # same version, another created_at: a different message
    assert not await owner._compare_and_set(other, CONTROL_CODEC.encode(other))
    assert (await read_mirror(redis, Keys(bus_config.run)))["policy"] == message
    await redis.aclose()


async def test_a_refused_publisher_adopts_the_mirrors_version_and_its_next_one_goes_out(bus_config: Config) -> None:
    """A publisher stopped between its compare-and-set and its MQTT publish: the mirror holds a version MQTT
    never carried. Another publisher of the kind, numbering from what it knows, is refused once, adopts the
    mirror's version, and its next version is accepted and reaches a worker over MQTT. Evidence: the mirror
    read with a plain client, and the worker's adopted versions."""
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    keys = Keys(bus_config.run)
    worker = ControlPlane(bus_config, redis, role="worker")
    async with running(worker), running(ControlPlane(bus_config, redis, role="learner", owns=["policy"])) as other:
        gone = ControlPlane(bus_config, redis, role="learner", owns=["policy"])
        assert await gone._compare_and_set(policy(1), CONTROL_CODEC.encode(policy(1)))  # and then it stopped
        assert other.version("policy") == -1, "nothing on MQTT told it of version 1"
        assert not await other.publish(policy(max(other.version("policy") + 1, 1)))
        assert other.version("policy") == 1, "the refused publisher took the mirror's version"
        following = policy(other.version("policy") + 1)
        assert await other.publish(following)
        assert (await read_mirror(redis, keys))["policy"] == following
        async with asyncio.timeout(10):
            assert (await worker.wait_for("policy", 2)) == following
    await redis.aclose()

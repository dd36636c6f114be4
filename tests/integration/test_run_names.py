"""Run names on shared servers: a name is the prefix of its run's Redis keys (`tlt:{run}:`) and MQTT topics
(`tlt/{run}/`), so a name either keeps its run apart from every other run sharing the servers, or is refused
in one line naming `run`. Names here are odd on purpose (glob and wildcard characters, `/`, unicode, names
that are prefixes of each other)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis

from tests.conftest import REAL_MQTT, REAL_REDIS
from tests.integration.test_control import policy, running
from tlt_stream.basics.config import BusConfig, Config, ConfigError, load_config
from tlt_stream.bus.connect import mqtt_params, purge_run
from tlt_stream.bus.control import ControlPlane, read_mirror
from tlt_stream.bus.streams import Keys, run_of_key
from tlt_stream.commands.doctor_checks import inspect_mqtt, inspect_redis

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


@pytest.fixture
def urls(backend: str, request: pytest.FixtureRequest) -> tuple[str, str]:
    if backend == "real":
        assert REAL_REDIS and REAL_MQTT
        return REAL_REDIS, REAL_MQTT
    servers = request.getfixturevalue("embedded")
    return servers.redis_url, servers.mqtt_url


@pytest.fixture
def real_urls() -> tuple[str, str]:
    if not (REAL_REDIS and REAL_MQTT):
        pytest.skip("real servers not configured (set TLT_TEST_REDIS_URL and TLT_TEST_MQTT_URL)")
    return REAL_REDIS, REAL_MQTT


def config_for(run: str, urls: tuple[str, str]) -> Config:
    """A config for `run` built in code (as tests and tools do), past the `run` pattern that loading applies."""
    bus = msgspec.convert({"redis_url": urls[0], "mqtt_url": urls[1], "block_ms": 200}, BusConfig)
    return Config(run=run, bus=bus)


def base_name() -> str:
    return f"probe-names-{uuid.uuid4().hex[:8]}"


async def retained_topics(mqtt_url: str, topic_filter: str) -> dict[str, bytes]:
    """The retained messages a fresh subscriber of `topic_filter` is greeted with (within a short wait)."""
    found: dict[str, bytes] = {}
    async with mqtt_params(mqtt_url).client(identifier=f"probe-names-{uuid.uuid4().hex[:8]}") as client:
        await client.subscribe(topic_filter, qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.7):
                async for message in client.messages:
                    if message.payload:
                        found[str(message.topic)] = bytes(message.payload)  # type: ignore[arg-type]
    return found


# ------------------------------------------------------------------------------------------ refused names


BAD_NAMES = {
    "colon": "{base}:b",  # run `{base}` would own this run's keys (`tlt:{base}:b:versions`)
    "slash": "{base}/b",  # deploy/mosquitto.acl grants `tlt/+/policy`: the learner's publishes would be dropped
    "plus": "{base}+",
    "hash": "{base}#",
    "newline": "{base}\n",
    "nul": "{base}\x00",
    "surrogate": "{base}\ud800",
    "too-long": "{base}" + "x" * 70_000,
}


@pytest.mark.parametrize("bad", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
async def test_a_name_the_servers_cannot_keep_apart_is_refused_in_one_line(
    bad: str, real_urls: tuple[str, str]
) -> None:
    """Before, each of these was taken: `a:b`'s keys sat under run `a`'s prefix (its scan and purge took
    them), and a wildcard, a control character, a surrogate or an oversized topic left the control plane
    reconnecting for ever (or raising from deep in the MQTT client) instead of saying what was wrong."""
    run = bad.format(base=base_name())
    config = config_for(run, real_urls)
    redis = aioredis.Redis.from_url(real_urls[0])
    try:
        for attempt in (
            lambda: Keys(run),
            lambda: ControlPlane(config, redis, role="policy", owns=["policy"]),
        ):
            with pytest.raises(ValueError) as refused:
                attempt()
            assert str(refused.value).startswith("run ") and "\n" not in str(refused.value)
        for check in (purge_run(config), inspect_mqtt(config, 2.0), inspect_redis(config, 2.0, redis=redis)):
            with pytest.raises(ValueError, match=r"^run "):
                await check
    finally:
        await redis.aclose()


def test_loading_refuses_a_run_name_with_a_trailing_newline() -> None:
    """The `run` pattern ends in `$`, which also matches before a trailing newline: `TLT_RUN` set from a file
    with its newline was taken, and the broker then dropped every connection (a control character in a topic)."""
    for layer in ({"environ": {"TLT_RUN": "probe-names\n"}}, {"extra": {("run",): "probe-names\n"}}):
        with pytest.raises(ConfigError, match=r"^run: "):
            load_config(None, **layer)  # type: ignore[arg-type]
    assert load_config(None, environ={"TLT_RUN": "probe-names"}).run == "probe-names"


def test_a_keys_run_is_read_back_from_the_key_whatever_the_name() -> None:
    """The monitor names the other runs on a server from their keys: `run_of_key` inverts `Keys.prefix` for odd
    names, and a key no run could have written (another tool's, a refused name's) names no run."""
    for run in ("a", "a.b-c_d", "x*", "x[z]", "é", "tlt"):
        keys = Keys(run)
        for key in (keys.versions, keys.stream("samples"), keys.worker("w:1"), keys.dispatch):
            assert run_of_key(key) == run
    for key in ("tlt:", "tlt:a", "other:a:versions", "tlt:a+b:versions", "tlt::versions", "TLT:a:versions"):
        assert run_of_key(key) is None, key


# ------------------------------------------------------------------------------------------ purge


async def test_purge_takes_only_its_own_keys_whatever_glob_characters_the_name_holds(urls: tuple[str, str]) -> None:
    """purge_run scanned `tlt:{run}:*` as written: run `x*` deleted run `xzz`'s keys, and run `x[z]` left
    its own behind while it deleted run `xz`'s."""
    base = base_name()
    own = [f"{base}*", f"{base}[z]", f"{base}?", f"{base}\\", f"{base}[!z]"]
    others = [f"{base}zz", f"{base}z", f"{base}", f"{base}q"]
    redis = aioredis.Redis.from_url(urls[0])
    try:
        for run in own + others:
            await redis.hset(Keys(run).versions, "x", run)
        for run in own:
            assert await purge_run(config_for(run, urls)) == 1, run
            assert not await redis.exists(Keys(run).versions), run
        for run in others:
            assert await redis.hget(Keys(run).versions, "x") == run.encode(), run
    finally:
        for run in own + others:
            await redis.delete(Keys(run).versions)
        await redis.aclose()
        for run in own:
            with contextlib.suppress(Exception):
                await purge_run(config_for(run, urls))


# ------------------------------------------------------------------------------------------ names that work


ODD_BUT_FINE = {
    "dollar": "${base}",
    "braces": "{{{base}}}",
    "space": "{base} b",
    "unicode": "{base}-é✓",
    "star": "{base}*",
}


@pytest.mark.parametrize("odd", list(ODD_BUT_FINE.values()), ids=list(ODD_BUT_FINE))
async def test_an_odd_name_that_is_taken_keeps_its_run_apart(odd: str, urls: tuple[str, str]) -> None:
    """A run whose name the bus takes is isolated from the run named by its prefix (`a` beside `a b`,
    `a` beside `a*`): the prefix run's subscriber, doctor and purge see none of it, and it works itself."""
    base = base_name()
    run = odd.format(base=base)
    config, neighbour = config_for(run, urls), config_for(base, urls)
    redis = aioredis.Redis.from_url(urls[0])
    try:
        async with running(ControlPlane(config, redis, role="policy", owns=["policy"])) as publisher:
            assert await publisher.publish(policy(7))
        late = ControlPlane(config, redis, role="worker")
        async with running(late):
            async with asyncio.timeout(10):
                assert (await late.wait_for("policy", 7)).version == 7
        prefix_run = ControlPlane(neighbour, redis, role="worker")
        async with running(prefix_run):
            await asyncio.sleep(0.5)
        assert prefix_run.current == {} and prefix_run.forged == 0
        assert (await inspect_mqtt(neighbour, 2.0))["retained"] == {}
        assert (await inspect_redis(neighbour, 2.0, redis=redis))["versions"] == {}
        assert await purge_run(neighbour) == 0
        assert (await read_mirror(redis, Keys(run)))["policy"].version == 7
        assert list(await retained_topics(urls[1], f"{config.topic_prefix}policy")) == [f"{config.topic_prefix}policy"]
    finally:
        assert await purge_run(config) == 1
        await redis.aclose()
    assert await retained_topics(urls[1], f"{config.topic_prefix}+") == {}


# ------------------------------------------------------------------------------------------ a finished run


async def test_a_new_run_of_a_finished_runs_name_never_adopts_its_stale_retained_versions(
    real_urls: tuple[str, str],
) -> None:
    """A finished run whose Redis keys were deleted by hand (as `tlt-stream run` suggests for a used name)
    leaves its retained versions on the broker; a new run of the same name is greeted by them but adopts
    only what its own mirror confirms, and its own first versions land although they are older."""
    config = config_for(base_name(), real_urls)
    redis = aioredis.Redis.from_url(real_urls[0])
    try:
        async with running(ControlPlane(config, redis, role="policy", owns=["policy"])) as old:
            assert await old.publish(policy(9))
        await redis.delete(Keys(config.run).versions)  # the old run's keys gone, its retained version not
        assert list(await retained_topics(real_urls[1], f"{config.topic_prefix}+"))

        worker = ControlPlane(config, redis, role="worker")
        async with running(worker):
            async with asyncio.timeout(10):
                while worker.forged < 1:  # noqa: ASYNC110 (a counter, no event to wait on)
                    await asyncio.sleep(0.01)
            assert worker.current == {}
            async with running(ControlPlane(config, redis, role="policy", owns=["policy"])) as new:
                assert await new.publish(policy(1))
            async with asyncio.timeout(10):
                assert (await worker.wait_for("policy", 1)).location == "/ckpt/policy-1"
            assert worker.version("policy") == 1
    finally:
        await purge_run(config)
        await redis.aclose()

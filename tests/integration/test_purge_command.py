"""`tlt-stream purge`: a finished run's keys and retained messages leave the shared servers, so its name can be
used again; nothing is deleted without `--yes`, nor while the run's workers still beat; other runs are spared.
The evidence is read from the servers themselves (a key scan, a fresh subscriber, `run`'s own used-name check)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis

from tests.conftest import make_config
from tests.integration.test_control import policy, running
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import WorkerStatus
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys, run_glob
from tlt_stream.commands.cli import main
from tlt_stream.commands.run.launch import ensure_new_run

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


@pytest.fixture(autouse=True)
def _no_env_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TLT_RUN", "TLT_REDIS_URL", "TLT_MQTT_URL", "TLT_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def purge(config: Config, *flags: str) -> int:
    assert config.bus.redis_url and config.bus.mqtt_url
    argv = ["purge", "--run", config.run, "--redis-url", config.bus.redis_url, "--mqtt-url", config.bus.mqtt_url]
    return main([*argv, *flags])


async def leave_state(config: Config, redis: aioredis.Redis) -> None:
    """What a run leaves behind: a retained policy version (and its mirror), a dispatch cursor, stream entries."""
    async with running(ControlPlane(config, redis, role="policy", owns=["policy"])) as plane:
        assert await plane.publish(policy(3))
    await redis.set(Keys(config.run).dispatch, 7)
    await redis.xadd(Keys(config.run).stream("samples"), {"x": b"1"})


async def keys_of(redis: aioredis.Redis, config: Config) -> list[bytes]:
    return [key async for key in redis.scan_iter(match=run_glob(config.run))]


async def retained_policy(config: Config, redis: aioredis.Redis) -> bool:
    """Whether a fresh subscriber of the run's control plane is greeted with a policy version."""
    late = ControlPlane(config, redis, role="worker")
    async with running(late):
        await asyncio.sleep(0.5)
        return "policy" in late.current


async def test_purge_deletes_only_with_yes_and_then_the_name_can_be_used_again(
    bus_config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bus_config.bus.redis_url and bus_config.bus.mqtt_url
    other = make_config(bus_config.bus.redis_url, bus_config.bus.mqtt_url)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    try:
        await leave_state(bus_config, redis)
        await leave_state(other, redis)
        left = await keys_of(redis, bus_config)
        with pytest.raises(RuntimeError, match="already has state"):
            await ensure_new_run(bus_config)  # what `run` says, naming this command

        assert await asyncio.to_thread(purge, bus_config) == 0  # a dry run
        assert f"{len(left)} Redis key(s)" in capsys.readouterr().out
        assert sorted(await keys_of(redis, bus_config)) == sorted(left)
        assert await retained_policy(bus_config, redis)

        assert await asyncio.to_thread(purge, bus_config, "--yes") == 0
        assert f"deleted {len(left)} Redis key(s)" in capsys.readouterr().out
        assert await keys_of(redis, bus_config) == []
        assert not await retained_policy(bus_config, redis)
        await ensure_new_run(bus_config)  # the name is free again

        assert len(await keys_of(redis, other)) == len(left)  # the other run is untouched
        assert await retained_policy(other, redis)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(purge, other, "--yes", "--force")
        await redis.aclose()


async def test_purge_refuses_a_run_whose_workers_still_beat_unless_forced(
    bus_config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bus_config.bus.redis_url
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    try:
        await leave_state(bus_config, redis)
        worker = WorkerRegistry(redis, Keys(bus_config.run), bus_config.bus, None, "rollout-0", role="rollout")  # type: ignore[arg-type]
        worker.state = WorkerStatus.GENERATING
        await worker.beat()  # what a live worker's heartbeat writes
        left = await keys_of(redis, bus_config)

        assert await asyncio.to_thread(purge, bus_config, "--yes") == 1
        err = capsys.readouterr().err
        assert "still going" in err and "rollout-0" in err and len(err.strip().splitlines()) == 1
        assert sorted(await keys_of(redis, bus_config)) == sorted(left)

        worker.state = WorkerStatus.STOPPED  # a worker that shut down is no obstacle
        await worker.beat()
        assert await asyncio.to_thread(purge, bus_config, "--yes") == 0
        assert await keys_of(redis, bus_config) == []

        await leave_state(bus_config, redis)
        worker.state = WorkerStatus.IDLE
        await worker.beat()
        assert await asyncio.to_thread(purge, bus_config, "--yes", "--force") == 0
        assert await keys_of(redis, bus_config) == []
    finally:
        await redis.aclose()


def test_purge_needs_a_run_name_and_the_servers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", "--yes"]) == 2
    assert "--run NAME" in capsys.readouterr().err
    assert main(["purge", "--run", "some-run", "--yes"]) == 2  # embedded servers: nothing outlives the run
    assert "--redis-url and --mqtt-url" in capsys.readouterr().err

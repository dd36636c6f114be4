"""Worker registry (heartbeats, states, expiry) and `tlt-stream doctor` against live and missing servers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import msgspec
import pytest
import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PolicyVersion, PromptGroup, WorkerStatus, codec_for
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import PAYLOAD_FIELD, StreamProducer
from tlt_stream.bus.registry import WorkerRegistry, list_workers
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis]


async def test_registry_states_heartbeats_and_expiry(bus_config: Config) -> None:
    config = msgspec.structs.replace(
        bus_config, bus=msgspec.structs.replace(bus_config.bus, heartbeat_s=0.1, heartbeat_ttl_s=0.5)
    )
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    registry = WorkerRegistry(redis, keys, config.bus, producer, "w1", role="rollout")
    stop = asyncio.Event()
    beating = asyncio.create_task(registry.heartbeat(stop))
    await registry.set_state(WorkerStatus.LOADING, "startup")
    await registry.set_state(WorkerStatus.GENERATING)
    await registry.set_state(WorkerStatus.GENERATING)  # no change, no timeline entry
    await registry.set_state(WorkerStatus.IDLE, "no prompts")
    registry.update_info(policy_version=3)
    await asyncio.sleep(0.3)
    workers = await list_workers(redis, keys, config.bus)
    assert [(w["worker_id"], w["state"], w["role"], w["policy_version"]) for w in workers] == [
        ("w1", "IDLE", "rollout", "3")
    ]
    stop.set()
    await beating
    timeline = [codec_for("stats").decode(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(keys.stream("stats"))]
    assert [(e.previous, e.state) for e in timeline] == [
        (None, WorkerStatus.LOADING),
        (WorkerStatus.LOADING, WorkerStatus.GENERATING),
        (WorkerStatus.GENERATING, WorkerStatus.IDLE),
        (WorkerStatus.IDLE, WorkerStatus.STOPPED),
    ]
    await asyncio.sleep(0.8)  # no more heartbeats: the worker disappears on its own
    assert await list_workers(redis, keys, config.bus) == []
    assert await redis.zcard(keys.workers) == 0
    await redis.aclose()


def doctor(config: Config, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    args = ["--run", config.run, "--redis-url", config.bus.redis_url, "--mqtt-url", config.bus.mqtt_url]
    return subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", "doctor", "--json", *args, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


async def test_doctor_reports_streams_workers_and_versions(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    await redis.xgroup_create(keys.stream("prompts"), "rollout", id="0", mkstream=True)
    await producer.send(
        "prompts", [PromptGroup(task_id="t", prompt_id="p", prompt_ids=[1], answer="1", group_size=2)] * 3
    )
    await WorkerRegistry(redis, keys, bus_config.bus, producer, "w9", role="rollout").set_state(WorkerStatus.IDLE)
    stop = asyncio.Event()
    plane = ControlPlane(bus_config, redis, role="policy", owns=["policy"])
    task = asyncio.create_task(plane.run(stop))
    await asyncio.wait_for(plane.connected.wait(), 10)
    await plane.publish(PolicyVersion(version=5, location="/c/5", sha256="0" * 64))
    stop.set()
    await task
    result = await asyncio.to_thread(doctor, bus_config)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["redis"]["reachable"] and report["mqtt"]["reachable"]
    assert report["redis"]["streams"]["prompts"]["length"] == 3
    assert report["redis"]["streams"]["prompts"]["groups"]["rollout"]["lag"] == 3
    assert [w["worker_id"] for w in report["redis"]["workers"]] == ["w9"]
    assert report["redis"]["versions"]["policy"]["version"] == 5
    assert report["mqtt"]["retained"][f"tlt/{bus_config.run}/policy"]["version"] == 5
    await redis.aclose()


def test_doctor_fails_clearly_when_servers_are_unreachable() -> None:
    config = Config(
        run="nowhere",
        bus=msgspec.convert(
            {"redis_url": "redis://127.0.0.1:1/0", "mqtt_url": "mqtt://user:topsecret@127.0.0.1:1"},
            type=type(Config().bus),
        ),
    )
    result = doctor(config, "--timeout", "2")
    assert result.returncode == 1
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in result.stderr
    assert "cannot reach MQTT at mqtt://user:***@127.0.0.1:1" in result.stderr
    assert "topsecret" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_doctor_with_nothing_configured_uses_embedded_servers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    result = subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["embedded"] and report["ok"]

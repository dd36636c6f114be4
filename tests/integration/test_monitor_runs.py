"""`tlt-stream monitor` and `doctor` as an operator meets them: a run whose workers are gone (a finished or
stopped run: its rollout reports stay in `stats`, its workers leave the registry), a worker that has not
swapped a drafter in yet, a `--run` that names no run (with the runs that do have keys there), and servers
that cannot be reached (one line on stderr, said once)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import pytest
import redis.asyncio as aioredis
from rich.console import Console

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import LearnerStats, RolloutStats, WorkerStatus
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys, run_glob
from tlt_stream.roles.monitor import prometheus_text, snapshot
from tlt_stream.roles.monitor.dashboard import render

pytestmark = [pytest.mark.redis]


def report(worker: str, *, sd_on: bool, drafter_version: int) -> RolloutStats:
    return RolloutStats(
        worker_id=worker,
        policy_version=6,
        drafter_version=drafter_version,
        batch_size=4,
        tokens=400,
        seconds=1.0,
        target_forwards=50,
        sd_on=sd_on,
    )


def shown(snap: dict) -> str:
    console = Console(width=400, record=True)
    console.print(render(snap))
    return console.export_text()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    return subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "COLUMNS": "400"},
        check=False,
    )


async def test_a_finished_run_counts_no_gone_worker_as_running_sd(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    # The run's last reports: w-gone (SD on) has left the registry; w-live is registered and has drafted with
    # the world's drafter (version 0) without ever swapping one in, so its registry record names none.
    await producer.send("stats", [report("w-gone", sd_on=True, drafter_version=3)])
    await producer.send("stats", [report("w-live", sd_on=False, drafter_version=0)])
    await producer.send("stats", [LearnerStats(step=6, policy_version=6, groups=4, samples=16, metrics={})])
    registry = WorkerRegistry(redis, keys, bus_config.bus, producer, "w-live", role="rollout")
    await registry.set_state(WorkerStatus.IDLE)
    try:
        snap = await snapshot(bus_config)
    finally:
        await redis.aclose()

    rollout = snap["rollout"]
    assert {w: r["alive"] for w, r in rollout["workers"].items()} == {"w-gone": False, "w-live": True}
    assert rollout["sd_on_workers"] == 0 and rollout["live_workers"] == 1
    [live] = snap["workers"]
    assert (live["worker_id"], live["drafter_version"]) == ("w-live", 0)
    assert "SD on in 0/1 live workers" in shown(snap)

    metrics = prometheus_text(snap)
    run = f'run="{bus_config.run}"'
    assert f'tlt_worker_sd_on{{{run},worker="w-live"}} 0.0' in metrics
    assert f'tlt_worker_drafter_version{{{run},worker="w-live"}} 0.0' in metrics
    assert "w-gone" not in metrics
    assert f"tlt_rollout_sd_on_workers{{{run}}} 0.0" in metrics


async def test_a_run_with_no_worker_left_says_so(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    await StreamProducer(redis, keys, bus_config.bus).send("stats", [report("w1", sd_on=True, drafter_version=0)])
    try:
        snap = await snapshot(bus_config)
    finally:
        await redis.aclose()
    text = shown(snap)
    assert "workers: none alive (the run has finished or stopped" in text, text
    assert "SD on in 0/0 live workers" in text and snap["run_found"] is True


def test_a_run_name_with_nothing_in_redis_names_the_runs_that_have_keys(bus_config: Config) -> None:
    other = f"t{uuid.uuid4().hex[:10]}"

    async def setup() -> None:
        redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
        await redis.hset(Keys(other).versions, "policy", b"x")
        await redis.aclose()

    async def cleanup() -> None:
        redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
        for key in [k async for k in redis.scan_iter(match=run_glob(other))]:
            await redis.delete(key)
        await redis.aclose()

    asyncio.run(setup())
    urls = ["--redis-url", bus_config.bus.redis_url or "", "--run", bus_config.run]
    try:
        snap = json.loads(cli("monitor", "--once", "--json", *urls).stdout)
        human = cli("monitor", "--once", *urls)
        doctor = cli("doctor", *urls, "--mqtt-url", bus_config.bus.mqtt_url or "")
    finally:
        asyncio.run(cleanup())
    assert snap["run_found"] is False and other in snap["other_runs"] and bus_config.run not in snap["other_runs"]
    for result in (human, doctor):
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stdout.split())
        assert f"nothing in Redis for run '{bus_config.run}' yet (check --run / TLT_RUN)" in text, text
        assert "runs with keys on this server: " in text and other in text, text


@pytest.mark.parametrize("command", ["doctor", "monitor"])
def test_an_unreachable_redis_is_said_once_in_one_line_without_its_password(command: str) -> None:
    args = ["--redis-url", "redis://:Zx9secret@127.0.0.1:1/0", "--timeout", "2"]
    if command == "doctor":
        args += ["--mqtt-url", "mqtt://127.0.0.1:1"]
    result = cli(command, *args, *(["--once"] if command == "monitor" else []))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if "cannot reach Redis" in line] == lines[:1], result.stderr
    assert lines[0].startswith(f"tlt-stream {command}: cannot reach Redis at redis://:***@127.0.0.1:1/0")
    assert "cannot reach" not in result.stdout and "WARNING" not in result.stderr
    assert len(lines) == (2 if command == "doctor" else 1), result.stderr  # doctor: the broker's line too
    assert "Zx9secret" not in result.stdout + result.stderr

"""compose.yaml started without Docker: every service a process, exactly as its entrypoint, command and
environment say, on loopback against the real Redis and Mosquitto; a few learner steps, then SIGTERM.

Only what a container would change is translated: the server host names become the test servers' addresses,
the `data` volume a temporary directory, `python` and `tlt-stream` this environment's, the monitor's exposed
port a free local one. The tiny world is the tests' random policy plus a random drafter (what `bootstrap`
leaves in /data/world, without its minutes of training); small settings come from a configuration file of the
test's own, named by TLT_CONFIG_FILE as a user's `.env` would name it. Two rollout processes stand
in for `--scale rollout=2`.

It runs twice: against CI's servers (no credentials; the compose URLs' are dropped), and against the secured
servers compose ships, started here from deploy/ (`deployed_server`) with a `.env` from deploy/make-env.sh,
every service logging in as its own user: no command of any role may be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import pytest
import redis.asyncio as aioredis

from tests.compose_file import (
    ROOT,
    argv,
    deployed_server,
    duration_s,
    environment,
    make_env,
    missing_binaries,
    mounted_config,
    services,
)
from tests.ports import free_port
from tests.worlds import build_world
from tlt_stream.basics.config import BusConfig, Config
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.registry import list_workers
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.checkpoint import latest_checkpoint
from tlt_stream.rl.records import load_metrics

pytestmark = [pytest.mark.redis, pytest.mark.mqtt, pytest.mark.slow]

SMALL = """
preset = "tiny-world"
[policy]
steps = 1000  # nothing ends by itself: every service is stopped by SIGTERM
prompts_per_step = 2
group_size = 2
[rollout]
max_len = 64
max_batch = 8
threads = 1
[learner]
threads = 1
"""
STEPS = 2
ROLES = ("policy", "rollout", "learner", "monitor")
REPLICAS = {"rollout": 2}


@dataclass
class Started:
    name: str
    process: asyncio.subprocess.Process
    grace_s: float
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def on_loopback(url: str, real: str, *, credentials: bool) -> str:
    """`url`, whose host is a compose service, pointed at the real server (its path, the Redis db, is kept):
    with compose's credentials when `credentials`, else with the real URL's (none for CI's servers)."""
    parts, server = urlsplit(url), urlsplit(real)
    assert parts.hostname in ("redis", "mosquitto"), url
    netloc = server.netloc
    if credentials:
        assert parts.username and parts.password, url
        netloc = f"{parts.username}:{parts.password}@{server.hostname}:{server.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def localize(text: str, data: Path, ports: dict[str, str]) -> str:
    if text == "python":
        return sys.executable
    if text == "tlt-stream":
        return str(Path(sys.executable).parent / "tlt-stream")
    text = re.sub(r"(^|=)/data(?=/|$)", lambda m: m[1] + str(data), text)
    for exposed, local in ports.items():
        text = re.sub(rf"(?<![0-9]){exposed}(?![0-9])", local, text)
    return text


def process_env(service: dict[str, Any], config: Config, credentials: bool, data: Path) -> dict[str, str]:
    assert config.bus.redis_url and config.bus.mqtt_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    compose = {k: localize(v, data, {}) for k, v in environment(service).items()}
    compose["TLT_CONFIG"] = str(mounted_config(service))  # the file compose mounts there
    compose["TLT_REDIS_URL"] = on_loopback(compose["TLT_REDIS_URL"], config.bus.redis_url, credentials=credentials)
    compose["TLT_MQTT_URL"] = on_loopback(compose["TLT_MQTT_URL"], config.bus.mqtt_url, credentials=credentials)
    return {**env, **compose, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}  # the image's /app and ENV


async def start(
    name: str, service: dict[str, Any], config: Config, tmp_path: Path, ports: dict[str, str], credentials: bool
) -> Started:
    line = [localize(part, tmp_path / "data", ports) for part in argv(service)]
    log = tmp_path / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *line,
            env=process_env(service, config, credentials, tmp_path / "data"),
            stdout=out,
            stderr=out,
            cwd=tmp_path,
            start_new_session=True,
        )
    return Started(name, process, duration_s(service["stop_grace_period"]), log)


async def wait_for_steps(run_dir: Path, running: list[Started], steps: int) -> list[dict]:
    while len(rows := load_metrics(run_dir)) < steps:
        for s in running:
            assert s.process.returncode is None, f"{s.name} exited with {s.process.returncode}:\n{s.tail()}"
        await asyncio.sleep(0.5)
    return rows


async def healthy(service: dict[str, Any], data: Path, ports: dict[str, str]) -> bool:
    kind, *command = service["healthcheck"]["test"]
    assert kind == "CMD", kind
    for _ in range(20):
        check = await asyncio.create_subprocess_exec(
            *(localize(part, data, ports) for part in command),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        if await check.wait() == 0:
            return True
        await asyncio.sleep(0.5)
    return False


async def stop(running: list[Started]) -> dict[str, int | None]:
    """SIGTERM every live process (as `docker compose down` does), SIGKILL what outlives its grace period."""
    for s in running:
        if s.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                s.process.terminate()
    codes: dict[str, int | None] = {}
    for s in running:
        try:
            codes[s.name] = await asyncio.wait_for(s.process.wait(), timeout=s.grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.process.pid, 9)
            await s.process.wait()
            codes[s.name] = None
    return codes


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_every_service_started_as_compose_says_trains_and_stops_cleanly_on_sigterm(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    await run_the_stack(bus_config, {}, tmp_path, init_policy, credentials=False)


async def test_the_stack_trains_on_the_secured_servers_compose_ships_with_no_command_refused(
    tmp_path: Path, init_policy: Path
) -> None:
    from tlt_stream.commands.doctor_checks import inspect_mqtt

    if why := missing_binaries("redis-server", "sha256sum", "mosquitto", "mosquitto_passwd"):
        pytest.skip(why)
    dotenv = make_env(tmp_path / ".env")
    with (
        deployed_server("redis", tmp_path / "redis", dotenv) as redis_port,
        deployed_server("mosquitto", tmp_path / "mosquitto", dotenv) as mqtt_port,
    ):
        # the test reads the run as the monitor does
        redis_url = f"redis://monitor:{dotenv['TLT_REDIS_PASSWORD_MONITOR']}@127.0.0.1:{redis_port}/0"
        mqtt_url = f"mqtt://monitor:{dotenv['TLT_MQTT_PASSWORD_MONITOR']}@127.0.0.1:{mqtt_port}"
        bus = msgspec.convert({"redis_url": redis_url, "mqtt_url": mqtt_url}, BusConfig)
        config = Config(run=f"t{uuid.uuid4().hex[:10]}", bus=bus)
        logs = await run_the_stack(config, dotenv, tmp_path, init_policy, credentials=True)
        retained = (await inspect_mqtt(config, timeout=10))["retained"]
    assert retained[f"tlt/{config.run}/policy"]["version"] >= STEPS, "the learner's versions go out on MQTT"
    for name, text in logs.items():
        for refusal in ("NOPERM", "no permissions", "can't run this command", "Not authorized", "WRONGPASS"):
            assert refusal not in text, f"{name} was refused ({refusal}):\n{text[-3000:]}"


async def run_the_stack(
    config: Config, dotenv: dict[str, str], tmp_path: Path, init_policy: Path, *, credentials: bool
) -> dict[str, str]:
    """Every role started as compose says against `config`'s servers, trained STEPS steps, then stopped;
    returns each process's whole log."""
    data = tmp_path / "data"
    build_world(init_policy, data / "world")
    small = tmp_path / "small.toml"  # the run's name, and /data where this test keeps it
    small.write_text(f'run = "{config.run}"\n{SMALL}\n[bus]\nstore_root = "{data}"\n')
    spec = services({**dotenv, "TLT_CONFIG_FILE": str(small)})
    run_dir = data / "runs" / config.run
    ports = {port: str(free_port()) for port in spec["monitor"].get("expose", [])}
    running: list[Started] = []
    try:
        for role in ROLES:
            for replica in range(REPLICAS.get(role, 1)):
                name = f"{role}-{replica}" if role in REPLICAS else role
                running.append(await start(name, spec[role], config, tmp_path, ports, credentials))
        async with asyncio.timeout(150):
            rows = await wait_for_steps(run_dir, running, STEPS)
        assert [r["version"] for r in rows[:STEPS]] == list(range(1, STEPS + 1))
        assert config.bus.redis_url
        redis = aioredis.Redis.from_url(config.bus.redis_url)
        try:
            assert (await read_mirror(redis, Keys(config.run)))["policy"].version >= STEPS
            workers = await list_workers(redis, Keys(config.run), config.bus)
        finally:
            await redis.aclose()
        rollout_ids = {w["worker_id"] for w in workers if w.get("role") == "rollout"}
        host = socket.gethostname()
        expected = {f"rollout-{host}-{s.process.pid}" for s in running if s.name.startswith("rollout-")}
        assert rollout_ids == expected, "each replica takes its id from its hostname and pid"
        assert await healthy(spec["monitor"], data, ports), next(s for s in running if s.name == "monitor").tail()
    finally:
        codes = await stop(running)
    logs = {s.name: s.tail() for s in running}
    assert codes == dict.fromkeys(logs, 0), "\n\n".join(f"== {n} (exit {codes[n]})\n{t}" for n, t in logs.items())
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.step >= STEPS
    final = load_metrics(run_dir)
    assert [r["version"] for r in final] == list(range(1, len(final) + 1))
    return {s.name: s.log.read_text(errors="replace") for s in running}

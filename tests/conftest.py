"""Shared fixtures: bus backends (real servers when configured, embedded ones always) and per-test isolation.

Integration tests take the `bus_config` fixture, which runs each test once per backend:
- `embedded`: the in-process fakeredis server and amqtt broker (always available);
- `real`: the servers named by `TLT_TEST_REDIS_URL` and `TLT_TEST_MQTT_URL` (CI sets them); skipped when unset.
Every test gets its own run name, so its Redis keys (`tlt:{run}:*`) and MQTT topics (`tlt/{run}/*`) are
its own; what it wrote on the real servers is removed afterwards.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tlt_stream.basics.config import BusConfig, Config
from tlt_stream.bus.embedded import EmbeddedServers

REAL_REDIS = os.environ.get("TLT_TEST_REDIS_URL")
REAL_MQTT = os.environ.get("TLT_TEST_MQTT_URL")

# One thread per process under pytest-xdist (`make test` runs two workers on CI's two cores), two otherwise.
torch_threads = int(os.environ.get("TLT_TEST_TORCH_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"))


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch

        torch.set_num_threads(torch_threads)
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture(scope="session")
def embedded() -> Iterator[EmbeddedServers]:
    servers = EmbeddedServers()
    servers.start_redis()
    servers.start_mqtt()
    yield servers
    servers.close()


@pytest.fixture(params=["embedded", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "real" and not (REAL_REDIS and REAL_MQTT):
        pytest.skip("real servers not configured (set TLT_TEST_REDIS_URL and TLT_TEST_MQTT_URL)")
    return request.param


@pytest.fixture
def one_backend(backend: str) -> str:
    """For slow end-to-end tests of whole processes: run once, on the real servers when they are configured
    (the embedded ones otherwise); the bus layer itself is tested on both."""
    if backend == "embedded" and REAL_REDIS and REAL_MQTT:
        pytest.skip("runs once, against the real servers")
    return backend


def make_config(redis_url: str, mqtt_url: str, **bus_overrides: object) -> Config:
    run = f"t{uuid.uuid4().hex[:10]}"
    bus = msgspec.convert({"redis_url": redis_url, "mqtt_url": mqtt_url, "block_ms": 200, **bus_overrides}, BusConfig)
    return Config(run=run, bus=bus)


@pytest.fixture
def bus_config(backend: str, request: pytest.FixtureRequest) -> Iterator[Config]:
    """A Config pointing at one backend, with a fresh run name; cleaned up afterwards."""
    if backend == "real":
        assert REAL_REDIS and REAL_MQTT
        config = make_config(REAL_REDIS, REAL_MQTT)
    else:
        servers: EmbeddedServers = request.getfixturevalue("embedded")
        assert servers.redis_url and servers.mqtt_url
        config = make_config(servers.redis_url, servers.mqtt_url)
    yield config
    asyncio.run(_cleanup(config))


async def _cleanup(config: Config) -> None:
    import aiomqtt

    from tlt_stream.bus.connect import purge_run

    try:
        await purge_run(config)
    except aiomqtt.MqttError:
        pass


@pytest.fixture
def init_policy(tmp_path: Path) -> Path:
    """A tiny random Llama policy with the character tokenizer, saved as a Hugging Face checkpoint."""
    from tests.worlds import tiny_policy

    return tiny_policy(tmp_path / "init")

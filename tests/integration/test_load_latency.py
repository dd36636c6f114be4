"""Publish-to-loaded latency per policy version (issue 25 point 3): a rollout worker measures it from the
announcement's `published_at`, reports it through its registry entry and its stats, and the real monitor
(`snapshot`, the dashboard, Prometheus) shows it per version."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.test_rl_loop import learner_and_worker_planes
from tests.unit.test_weight_sync import versions
from tlt_stream.config import Config
from tlt_stream.monitor import snapshot
from tlt_stream.monitor.dashboard import render
from tlt_stream.monitor.prometheus import prometheus_text
from tlt_stream.roles.rollout_worker import RolloutSettings, RolloutWorker

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

LATE_S = 30.0
"""Version 1 is announced as published this long ago: its latency is at least that, whatever the machine."""


async def test_each_versions_publish_to_loaded_latency_reaches_the_monitor(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import msgspec
    from rich.console import Console

    announced = versions(tmp_path, init_policy, monkeypatch)[:2]
    async with learner_and_worker_planes(bus_config) as planes:
        worker = RolloutWorker(
            bus_config, planes.redis, planes.worker, worker_id="w0", reward=lambda text, answer: 0.0,
            settings=RolloutSettings(max_batch=2, max_len=64),
        )  # fmt: skip
        loaded: dict[int, tuple[float, float]] = {}
        for message in announced:
            published_at = time.time() - (LATE_S if message.version == 1 else 0.0)
            await planes.learner.publish(msgspec.structs.replace(message, published_at=published_at))
            async with asyncio.timeout(20):
                await planes.worker.wait_for("policy", message.version)
            before = time.time()
            await worker._maybe_load()
            loaded[message.version] = (before - published_at, time.time() - published_at)
            assert worker.version == message.version
            await worker.registry.beat()
            await worker.producer.send_one("stats", worker._rollout_stats())  # as after a step's tasks

        snap = await snapshot(bus_config)
    latency = snap["rollout"]["load_latency"]
    assert list(latency) == ["1", "0"], "newest version first"
    for version, (low, high) in loaded.items():
        figures = latency[str(version)]
        assert figures["workers"] == 1 and figures["max_s"] == figures["mean_s"]
        assert low <= figures["max_s"] <= high
    assert latency["1"]["max_s"] >= LATE_S
    info = snap["workers"][0]["info"]
    assert float(info["load_latency_s"]) == pytest.approx(latency["1"]["max_s"], abs=1e-3)

    console = Console(width=200, record=True)
    console.print(render(snap))
    shown = console.export_text()
    assert f"v1 max {latency['1']['max_s']:.2f}s" in shown and "v0 max" in shown
    assert f'tlt_policy_load_latency_seconds{{run="{bus_config.run}"}} {latency["1"]["max_s"]}' in (
        prometheus_text(snap)
    )

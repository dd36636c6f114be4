"""Publish-to-loaded latency per policy version (issue 25 point 3): a rollout worker measures it from the
announcement's `published_at`, reports it through its registry entry and its stats, and the real monitor
(`snapshot`, the dashboard, Prometheus) shows it per version."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.loop import stats_of
from tests.integration.test_rl_loop import learner_and_worker_planes
from tests.unit.test_weight_sync import versions
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import RolloutStats
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.monitor import snapshot
from tlt_stream.roles.monitor.dashboard import render
from tlt_stream.roles.monitor.prometheus import prometheus_text
from tlt_stream.roles.rollout_worker import RolloutWorker

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

LATE_S = 30.0
"""Version 1 is announced as published this long ago: its latency is at least that, whatever the machine."""


def new_worker(bus_config: Config, planes: Any) -> RolloutWorker:
    config = override(bus_config, {"rollout.max_batch": 2, "rollout.max_len": 64})
    return RolloutWorker(config, planes.redis, planes.worker, worker_id="w0", reward=lambda text, answer: 0.0)


async def announce_and_load(worker: RolloutWorker, planes: Any, message: Any) -> None:
    """Publish `message` as the learner does, wait until the worker's plane has it, and load it."""
    import asyncio

    await planes.learner.publish(message)
    async with asyncio.timeout(20):
        await planes.worker.wait_for("policy", message.version)
    await worker.load_announced()
    assert worker.version == message.version


async def test_each_versions_publish_to_loaded_latency_reaches_the_monitor(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    import msgspec
    from rich.console import Console

    announced = versions(tmp_path, init_policy, monkeypatch)[:2]
    async with learner_and_worker_planes(bus_config) as planes:
        worker = new_worker(bus_config, planes)
        loaded: dict[int, tuple[float, float]] = {}
        for message in announced:
            published_at = time.time() - (LATE_S if message.version == 1 else 0.0)
            before = time.time()
            await announce_and_load(worker, planes, msgspec.structs.replace(message, published_at=published_at))
            loaded[message.version] = (before - published_at, time.time() - published_at)
            await worker.registry.beat()
            await worker.producer.send_one("stats", worker.reports.rollout_stats())  # as after a step's tasks

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


async def test_hops_before_a_load_are_reported_under_the_version_they_ran_with(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seconds spent with a draft of version 1 in flight while the worker holds version 0 belong to step 1
    (the tail of step 0 filled with step 1's work), even when no report is sent before version 1 loads: the
    worker reports its hops under the version it holds before loading the next. Read back from the `stats`
    stream by the real monitor."""
    from types import SimpleNamespace

    announced = versions(tmp_path, init_policy, monkeypatch)[:2]
    async with learner_and_worker_planes(bus_config) as planes:
        worker = new_worker(bus_config, planes)
        await announce_and_load(worker, planes, announced[0])
        # A group of step 1 dispatched ahead (it needs version 1) is in flight: its hops run ahead.
        draft = SimpleNamespace(group=SimpleNamespace(min_policy_version=1))
        worker.flight.started["s000001-0000"] = draft  # type: ignore[assignment]
        worker.reports.count_hop(tokens=12, forwards=3, seconds=0.75)
        worker.reports.count_hop(tokens=8, forwards=2, seconds=0.5)
        await announce_and_load(worker, planes, announced[1])  # no report was sent since the hops
        worker.reports.count_hop(tokens=4, forwards=1, seconds=0.25)  # under version 1, nothing ahead of it
        del worker.flight.started["s000001-0000"]
        await worker.reports.send()

        reports = await stats_of(planes.redis, Keys(bus_config.run), RolloutStats)
        snap = await snapshot(bus_config)
    assert [(r.policy_version, r.tokens, r.ahead_seconds) for r in reports] == [(0, 20, 1.25), (1, 4, 0.0)]
    partial = snap["rollout"]["partial"]
    assert list(partial) == ["1"] and partial["1"]["ahead_seconds"] == pytest.approx(1.25), partial


async def test_loading_versions_leaves_no_thread_behind(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker loads (and builds its engine for) each version off the event loop on a thread of its own that
    ends with the load (`model/threads.py`): a pooled executor thread would outlive it with the OpenMP team its
    torch operators made, and slow every decode step after. Counted as the process's OS threads (/proc), which
    an OpenMP team's threads are, at 2 torch threads so that a load makes a team at all."""
    import asyncio
    import os

    import torch

    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    announced = versions(tmp_path, init_policy, monkeypatch)[:2]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async with learner_and_worker_planes(bus_config) as planes:
            # an engine big enough that building it runs parallel regions (its KV cache zeroed on 2 threads)
            config = override(bus_config, {"rollout.max_batch": 128, "rollout.max_len": 256})
            reward = lambda text, answer: 0.0  # noqa: E731
            worker = RolloutWorker(config, planes.redis, planes.worker, worker_id="w0", reward=reward)
            before = os_threads()
            for message in announced:
                await announce_and_load(worker, planes, message)
            for _ in range(100):  # a load's thread settles the await, then ends with its team
                if os_threads() <= before:
                    break
                await asyncio.sleep(0.05)
            assert os_threads() <= before, f"the loads left {os_threads() - before} OS threads alive"
            assert worker.version == announced[-1].version
        assert torch.get_num_threads() == 2, "the compute thread's own count is untouched"
    finally:
        torch.set_num_threads(threads_before)

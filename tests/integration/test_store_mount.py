"""A checkpoint store mounted at another path on the worker's node than on the learner's (issue 25 point 3):
with `bus.relative_locations` the learner announces locations relative to its store root and the worker
resolves them under its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from tests.integration.test_rl_loop import learner_and_worker_planes
from tlt_stream.basics.config import BusConfig, Config, override
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.store.digest import directory_sha256
from tlt_stream.tasks.repeated_add import reward

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


def with_store(config: Config, root: Path) -> Config:
    bus = msgspec.structs.replace(config.bus, store_root=str(root), relative_locations=True)
    return msgspec.structs.replace(config, bus=bus)


async def test_a_worker_loads_a_version_from_the_store_mounted_elsewhere(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    learner_mount, worker_mount = tmp_path / "learner-node" / "store", tmp_path / "worker-node" / "mnt"
    learner_config = with_store(bus_config, learner_mount)
    async with learner_and_worker_planes(learner_config) as planes:
        learner = LearnerService(
            learner_config, planes.redis, planes.learner, run_dir=learner_mount / "run", init_policy=init_policy
        )
        announced = await learner.start()
        assert announced.location == "run/checkpoints/step-00000000/policy", "relative to the learner's root"
        worker_mount.parent.mkdir()
        learner_mount.rename(worker_mount)  # the same store, now at another path; the learner's path is gone
        assert not (learner_mount / announced.location).exists()
        worker = RolloutWorker(
            override(with_store(bus_config, worker_mount), {"rollout.max_batch": 2, "rollout.max_len": 64}),
            planes.redis,
            planes.worker,
            worker_id="w0",
            reward=reward,
        )
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            async with asyncio.timeout(60):
                while worker.version < 0:  # noqa: ASYNC110 - the worker exposes no event for "loaded"
                    await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(running, timeout=30)
        assert worker.loader.policy is not None and worker.loader.policy.sha256 == announced.sha256
        assert Path(worker.loader.policy.location) == worker_mount / announced.location
        assert directory_sha256(worker.loader.policy.location, scheme=announced.digest) == announced.sha256


async def test_a_relative_location_without_a_store_root_is_refused(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    store = tmp_path / "store"
    learner_config = with_store(bus_config, store)
    async with learner_and_worker_planes(learner_config) as planes:
        learner = LearnerService(
            learner_config, planes.redis, planes.learner, run_dir=store / "run", init_policy=init_policy
        )
        announced = await learner.start()
        worker = RolloutWorker(bus_config, planes.redis, planes.worker, worker_id="w0", reward=reward)
        async with asyncio.timeout(20):
            await planes.worker.wait_for("policy", 0)
        await worker.load_announced()
        assert worker.version == -1 and worker.loader.versions.refused == {0}
        assert "bus.store_root is not set" in worker.registry.info["refused_policy"]
    assert announced.version == 0


def test_relative_locations_need_a_store_root() -> None:
    with pytest.raises(ValueError, match="store_root"):
        BusConfig(relative_locations=True)

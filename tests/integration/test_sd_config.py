"""The global SD table: workers' arm reports in `stats` -> one published sd_config -> workers exploit it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tlt_stream.basics.config import Config, SdConfig, override
from tlt_stream.basics.messages import SdArmReport
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane, read_mirror
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.drafter.model import Drafter
from tlt_stream.model import load_model
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.roles.sd_config import SdConfigPublisher
from tlt_stream.rollout.adaptive import AdaptiveSd
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer
from tlt_stream.tasks.repeated_add import reward

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


def report(worker: str, bucket: int, label: str, tokens: int, seconds: float, drafter: int = 0) -> SdArmReport:
    arm = Arm.from_label(label)
    return SdArmReport(
        worker_id=worker,
        drafter_version=drafter,
        bucket=bucket,
        depth=arm.depth,
        topk=arm.topk,
        verify=arm.verify,
        tokens=tokens,
        seconds=seconds,
        proposer=arm.kind,
    )


async def test_two_workers_reports_become_one_table_that_a_late_worker_adopts(
    bus_config: Config, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    policy = ControlPlane(bus_config, redis, role="policy", owns=["sd_config"])
    late = ControlPlane(bus_config, redis, role="rollout")
    stop = asyncio.Event()
    planes = [asyncio.create_task(p.run(stop)) for p in (policy, late)]
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(policy.connected.wait(), late.connected.wait())
        producer = StreamProducer(redis, keys, bus_config.bus)
        # Bucket 1 (batch 2): worker a saw d4k1v4 fast, worker b saw plain slower -> d4k1v4.
        # Bucket 6 (batch 64): both saw plain beat d4k1v4 -> plain. A stale-drafter report is ignored.
        await producer.send(
            "stats",
            [
                report("a", 1, "d4k1v4", 900, 1.0),
                report("b", 1, "plain", 500, 1.0),
                report("b", 1, "d4k1v4", 800, 1.0),
                report("a", 6, "plain", 4000, 1.0),
                report("b", 6, "d4k1v4", 3000, 1.0),
                report("a", 6, "d6k1v6", 99999, 1.0, drafter=-1),
            ],
        )
        publisher = SdConfigPublisher(redis, keys, policy, edges=bus_config.sd.edges)
        assert await publisher.poll()
        assert not await publisher.poll(), "an unchanged table is not republished"
        mirror = (await read_mirror(redis, keys))["sd_config"]
        assert mirror.version == 1 and mirror.drafter_version == 0
        by_batch = {c.max_batch: c for c in mirror.table}
        assert (by_batch[2].enabled, by_batch[2].depth, by_batch[2].proposer) == (True, 4, "drafter")
        assert by_batch[64].enabled is False
        # New measurements change bucket 1's winner: a new version, forward only.
        await producer.send("stats", [report("b", 1, "plain", 5000, 1.0)])
        assert await publisher.poll()
        assert (await read_mirror(redis, keys))["sd_config"].version == 2

        # A worker that joins now starts from the table: its first choice in bucket 6 is the table's.
        async with asyncio.timeout(20):
            await late.wait_for("sd_config", 2)
        worker = RolloutWorker(
            override(bus_config, {"rollout.max_batch": 2, "rollout.max_len": 32}),
            redis,
            late,
            worker_id="late",
            reward=reward,
        )
        model = load_model(init_policy)
        engine = GenerationEngine(model, 2, 32, proposer=EagleProposer(Drafter(model.spec).bind(model)))
        worker.loader.adaptive = AdaptiveSd(engine, SdConfig(epsilon=0.0), drafter_version=0)
        worker.drafters.adopt_sd_config(engine, worker.loader.adaptive)
        assert worker.drafters.sd_config == 2
        assert worker.loader.adaptive.tuner.greedy(64) == Arm.plain()
        assert worker.loader.adaptive.tuner.greedy(2) == Arm.plain(), "bucket 1 now favours plain"
    finally:
        stop.set()
        await asyncio.gather(*planes, return_exceptions=True)
        await redis.aclose()


async def test_a_table_over_configured_edges_reaches_the_workers_buckets_unchanged(
    bus_config: Config, init_policy: Path
) -> None:
    """Workers bucket with `sd.edges`; the publisher reads their reports' bucket indices with the same edges
    and names each row by its bucket's upper edge, which the workers bucket again. With edges (3, 12) a table
    written over the default edges would name bucket 1 by batch 2, which these workers file under bucket 0."""
    edges = (3, 12)
    config = override(bus_config, {"sd.edges": edges, "rollout.max_batch": 2, "rollout.max_len": 32})
    keys = Keys(config.run)
    redis = connect_redis(config.bus.redis_url)
    policy = ControlPlane(config, redis, role="policy", owns=["sd_config"])
    late = ControlPlane(config, redis, role="rollout")
    stop = asyncio.Event()
    planes = [asyncio.create_task(p.run(stop)) for p in (policy, late)]
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(policy.connected.wait(), late.connected.wait())
        # Bucket 0 (batch <= 3): plain beats d4k1v4; bucket 1 (batch 4-12): d4k1v4 beats plain.
        await StreamProducer(redis, keys, config.bus).send(
            "stats",
            [
                report("a", 0, "plain", 900, 1.0),
                report("a", 0, "d4k1v4", 500, 1.0),
                report("a", 1, "plain", 500, 1.0),
                report("a", 1, "d4k1v4", 900, 1.0),
            ],
        )
        assert await SdConfigPublisher(redis, keys, policy, edges=edges).poll()
        table = (await read_mirror(redis, keys))["sd_config"].table
        assert {(c.max_batch, c.enabled) for c in table} == {(3, False), (12, True)}
        async with asyncio.timeout(20):
            await late.wait_for("sd_config", 1)
        worker = RolloutWorker(config, redis, late, worker_id="late", reward=reward)
        model = load_model(init_policy)
        engine = GenerationEngine(model, 2, 32, proposer=EagleProposer(Drafter(model.spec).bind(model)))
        worker.loader.adaptive = AdaptiveSd(engine, SdConfig(epsilon=0.0, edges=edges), drafter_version=0)
        worker.drafters.adopt_sd_config(engine, worker.loader.adaptive)
        tuner = worker.loader.adaptive.tuner
        assert worker.drafters.sd_config == 1
        assert [tuner.greedy(batch) for batch in (2, 3, 4, 12)] == [Arm.plain()] * 2 + [Arm.from_label("d4k1v4")] * 2
    finally:
        stop.set()
        await asyncio.gather(*planes, return_exceptions=True)
        await redis.aclose()

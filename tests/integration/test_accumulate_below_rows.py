"""learner.accumulate_below_rows over real streams and a real worker record: complete groups wait while the
rollout workers report at least that many rows in flight, are added when the rows drop below it, and are all
added once the step has its groups; the checkpoints hold the same groups, in the same order, and the batch
learner's parameters.

The rows come from where the learner reads them in a run: the worker's registry record in Redis, written by
the rollout worker's own `Generation.report_rows` from its `InFlight` tasks (a group's rows counted until they
finish), with the registry's heartbeat running. Each decision the learner takes (the groups waiting, those
added, whether the rollout was busy) is recorded by wrapping its `_rollout_busy` as it runs.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from tests.faults.audit import read_checkpoints
from tests.integration.test_accumulated_learner import (
    GROUP,
    PER_STEP,
    STEPS,
    assert_the_batch_update,
    learner_of,
    step_groups,
    synchronous_config,
    synchronous_run,
    until,
)
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import PromptGroup, WorkerStatus
from tlt_stream.bus.connect import connect_redis, purge_run
from tlt_stream.bus.consumer import Delivery
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.registry import WorkerRegistry, rollout_rows
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.worker.generation import Generation
from tlt_stream.roles.worker.tasks import GroupTask, InFlight

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

BELOW = 8
WORKER_GROUP = 8


def started(flight: InFlight, task_id: str) -> GroupTask:
    """A group of WORKER_GROUP rows started in the worker's engine, none finished."""
    group = PromptGroup(task_id=task_id, prompt_id=task_id, prompt_ids=[5], answer="", group_size=WORKER_GROUP)
    task = GroupTask(delivery=Delivery(f"0-{len(flight.started) + 1}", group, 1), policy_version=0, started=0.0)
    flight.started[task_id] = task
    return task


async def test_groups_wait_while_the_rollout_reports_rows_and_the_update_is_the_batch_learners(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    base = synchronous_config(bus_config)
    batch = override(base, {"run": f"{bus_config.run}-batch"})
    try:
        await synchronous_run(batch, tmp_path / batch.run, init_policy, accumulate=False, accumulates=False)
    finally:
        await purge_run(batch)

    config = override(base, {"learner.accumulate": True, "learner.accumulate_below_rows": BELOW})
    keys = Keys(config.run)
    redis = connect_redis(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    registry = WorkerRegistry(redis, keys, config.bus, producer, "w0", role="rollout")
    flight = InFlight()
    generation = Generation(
        config,
        None,  # type: ignore[arg-type]  (report_rows reads the flight and writes the registry only)
        producer,
        (flight, None, None, None, None),  # type: ignore[arg-type]
        worker_id="w0",
        reward=lambda _text, _answer: 0.0,
        reward_pool=None,
        registry=registry,
    )
    beating = asyncio.Event()
    heartbeat = asyncio.create_task(registry.heartbeat(beating))
    await registry.set_state(WorkerStatus.GENERATING)
    rng = random.Random(7)  # synchronous_run's samples
    decisions: list[tuple[int, int, bool]] = []
    """(groups waiting, groups added to the step, rollout busy), each time the learner read the rows."""
    try:
        async with learner_of(config, tmp_path / config.run, init_policy) as learner:
            await learner.start()
            accumulator = learner.updates.accumulator
            assert accumulator is not None
            busy = learner.updates._rollout_busy

            async def recorded() -> bool:
                answer = await busy()
                decisions.append((len(learner.intake.ready), len(accumulator.groups), answer))
                return answer

            learner.updates._rollout_busy = recorded  # type: ignore[method-assign]
            running = asyncio.create_task(learner.run(asyncio.Event(), max_updates=STEPS))

            async def seen(decision: tuple[int, int, bool], since: int = 0) -> None:
                await until(lambda: decision in decisions[since:] or running.done())
                assert not running.done(), running.exception()

            # Step 1: two groups in flight at the worker (16 rows >= 8): the first two complete groups wait.
            tasks = [started(flight, "w-a"), started(flight, "w-b")]
            await generation.report_rows()
            assert await rollout_rows(redis, keys, config.bus) == 2 * WORKER_GROUP
            groups = step_groups(0, rng)
            for group in groups[:2]:
                await producer.send("samples", group)
            await seen((2, 0, True))
            assert not accumulator.groups and learner.version == 0, "held while the rollout is busy"
            first = len(decisions)
            # The first worker group is sent and half the second's rows finish: 4 rows (< 8) left, so the
            # waiting groups are added, the step not applied.
            del flight.started["w-a"]
            for index in range(4):
                tasks[1].finished[index] = (None, "", 0.0)
            await generation.report_rows()
            await seen((2, 0, False), since=first)
            await until(lambda: len(accumulator.groups) == 2 or running.done())
            assert learner.version == 0 and [g.task_id for g in accumulator.groups] == ["s0-g0", "s0-g1"]
            await producer.send("samples", groups[2])
            await until(lambda: learner.version == 1 or running.done())

            # Step 2: the rollout stays busy (12 rows): the groups wait until the step has them all.
            started(flight, "w-c")
            await generation.report_rows()
            assert await rollout_rows(redis, keys, config.bus) == 4 + WORKER_GROUP
            first = len(decisions)
            groups = step_groups(1, rng)
            for group in groups[:2]:
                await producer.send("samples", group)
            await seen((2, 0, True), since=first)
            await producer.send("samples", groups[2])
            await until(lambda: learner.version == 2 or running.done())
            assert all(answer for _, _, answer in decisions[first:]), "never added while busy"

            # Step 3: the worker stopped (its rows count 0): each group is added as it completes.
            await registry.set_state(WorkerStatus.STOPPED)
            assert await rollout_rows(redis, keys, config.bus) == 0
            groups = step_groups(2, rng)
            await producer.send("samples", groups[0])
            await until(lambda: len(accumulator.groups) == 1 or running.done())
            for group in groups[1:]:
                await producer.send("samples", group)
            async with asyncio.timeout(120):
                await running
            assert learner.version == STEPS
    finally:
        beating.set()
        await heartbeat
        await redis.aclose()
        await purge_run(config)

    rows = [json.loads(line) for line in (tmp_path / config.run / "metrics.jsonl").read_text().splitlines()]
    assert [row["held_groups"] for row in rows] == [2, 2, 0], "each step says how many of its groups waited"
    held, ran = (read_checkpoints(tmp_path / run / "checkpoints")[0] for run in (config.run, batch.run))
    assert [p.trained_groups for p in held] == [p.trained_groups for p in ran], "the same groups, in order"
    for point in held[1:]:
        assert point.trained_groups == tuple(f"s{point.step - 1}-g{g}" for g in range(PER_STEP))
        assert {f"{t}/{i}" for t in point.trained_groups for i in range(GROUP)} <= point.ledger
    assert_the_batch_update(ran, held, "held groups")

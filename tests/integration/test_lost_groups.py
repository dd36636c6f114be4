"""A group lost to dead letters (a reward that raised on it) is replaced by another prompt, so its step still
gets the groups it needs: an on-policy run used to wait for ever for it. Evidence from Redis and the learner's
ledger: the lost task's dead letter, the `lost` and `replaced` records, the replacement's samples trained and
none of the lost task's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.loop import keep_for_audit, prompt_tasks, until_first_done, until_redis
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.policy import LOST_TRIES, PolicyService, RepeatedAddSource
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.tasks.repeated_add import reward
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

STEPS, PROMPTS, GROUP, SEED = 2, 2, 2, 1


def _source() -> RepeatedAddSource:
    return RepeatedAddSource(build_tokenizer(), seed=SEED)


async def test_a_lost_task_is_replaced_by_another_prompt_once_and_given_up_after_its_tries(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)

    def service(max_staleness: int = 1) -> PolicyService:
        control = ControlPlane(bus_config, redis, role="policy")
        return PolicyService(
            bus_config,
            redis,
            control,
            _source(),
            prompts_per_step=PROMPTS,
            group_size=GROUP,
            max_staleness=max_staleness,
        )

    first = service()
    await first.dispatch(0)
    original = {t.task_id: t for t in await prompt_tasks(redis, keys)}
    await redis.hsetnx(keys.lost, "s000000-0001", 0)  # what a worker writes before dead-lettering the task
    assert await first.replace_dropped() == 1
    instead = (await prompt_tasks(redis, keys))[-1]
    expected = _source().prompts(0, 2 * PROMPTS)[PROMPTS + 1]  # task 1's in the step's next block of prompts
    assert instead.task_id == "s000000-0001.n" and instead.step == 0 and instead.group_size == GROUP
    assert (instead.prompt_id, instead.prompt_ids, instead.answer) == (expected[0], expected[2], expected[3])
    assert instead.prompt_id != original["s000000-0001"].prompt_id, "another prompt, not the one that failed"
    assert await service().replace_dropped() == 0, "a restarted policy service sends none twice"

    await redis.hsetnx(keys.dropped, "s000000-0001.n", 0)  # the replacement went stale: sent again as it was
    assert await service().replace_dropped() == 1
    again = (await prompt_tasks(redis, keys))[-1]
    assert again.task_id == "s000000-0001.n.r" and again.prompt_ids == instead.prompt_ids

    chain = "s000000-0001.n.r"
    for _ in range(LOST_TRIES - 2):  # lost again and again, each time replaced with yet another prompt
        await redis.hsetnx(keys.lost, chain, 0)
        assert await service().replace_dropped() == 1
        chain = (await prompt_tasks(redis, keys))[-1].task_id
    await redis.hsetnx(keys.lost, chain, 0)  # its LOST_TRIES-th loss: not replaced again
    sent = len(await prompt_tasks(redis, keys))
    assert await service().replace_dropped() == 0 and len(await prompt_tasks(redis, keys)) == sent
    assert (await redis.hget(keys.replaced, chain)) == b""

    await redis.hsetnx(keys.lost, "poison-long", 0)  # a task no policy service sent (written into prompts by hand)
    await redis.hsetnx(keys.lost, "s000000-0007", 0)  # not one of step 0's PROMPTS tasks
    assert await service().replace_dropped() == 0 and len(await prompt_tasks(redis, keys)) == sent
    assert await redis.hmget(keys.replaced, ["poison-long", "s000000-0007"]) == [b"", b""]

    # Two lost tasks of one step get two other prompts; on-policy, a group an update left over is not sent again
    # (the step's spare), a lost one is.
    await redis.hsetnx(keys.dropped, "s000000-0000", 0)
    assert await service(max_staleness=0).replace_dropped() == 0
    await redis.hsetnx(keys.lost, "s000000-0000", 0)
    assert await service(max_staleness=0).replace_dropped() == 1
    task0, task1 = (await prompt_tasks(redis, keys))[-1], instead
    assert task0.task_id == "s000000-0000.n" and task0.prompt_id != task1.prompt_id
    assert task0.prompt_id == _source().prompts(0, 2 * PROMPTS)[PROMPTS][0]
    await redis.aclose()


async def test_an_on_policy_run_replaces_a_group_its_reward_failed_on_and_finishes(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    doomed = _source().prompts(1, PROMPTS)[1][3]  # the answer of step 1's second prompt: its reward raises
    replacement = _source().prompts(1, 2 * PROMPTS)[PROMPTS + 1][3]
    others = {p[3] for p in _source().prompts(0, PROMPTS)} | {_source().prompts(1, PROMPTS)[0][3]}
    assert replacement != doomed and doomed not in others, "the seed's prompts: only the doomed one fails"

    def scored(response: str, answer: str) -> float:
        if answer == doomed:
            raise ValueError("this answer breaks the reward")
        return reward(response, answer)

    redis = connect_redis(bus_config.bus.redis_url, block_ms=bus_config.bus.block_ms)
    await keep_for_audit(redis, keys)
    planes = {
        role: ControlPlane(bus_config, redis, role=role, owns=["policy"] if role == "learner" else [])
        for role in ("learner", "policy", "rollout")
    }
    stop = asyncio.Event()
    running = [asyncio.create_task(plane.run(stop)) for plane in planes.values()]
    services: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(plane.connected.wait() for plane in planes.values()))
        config = override(bus_config, {"learner.groups_per_step": PROMPTS, "policy.max_staleness": 0})
        learner = LearnerService(config, redis, planes["learner"], run_dir=tmp_path / "run", init_policy=init_policy)
        dispatcher = PolicyService(
            config, redis, planes["policy"], _source(), prompts_per_step=PROMPTS, group_size=GROUP, total_steps=STEPS
        )
        shape = {"rollout.max_batch": 4, "rollout.max_len": 96, "rollout.max_response_len": 24}
        worker = RolloutWorker(override(config, shape), redis, planes["rollout"], worker_id="w0", reward=scored)
        await learner.start()
        services = [
            asyncio.create_task(learner.run(stop, max_updates=STEPS)),
            asyncio.create_task(dispatcher.run(stop)),
            asyncio.create_task(worker.run(stop)),
        ]
        await until_first_done(services, 120)
        assert learner.version == STEPS
        trained = learner.intake.assembler.ledger
        lost = "s000001-0001"
        expected = {f"s{s:06d}-{i:04d}/{g}" for s in range(STEPS) for i in range(PROMPTS) for g in range(GROUP)}
        expected = {i for i in expected if not i.startswith(lost)} | {f"{lost}.n/{g}" for g in range(GROUP)}
        assert trained == expected
        dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
        assert [codec_for("prompts").decode(d.payload).task_id for d in dead] == [lost]
        assert "the reward raised: ValueError: this answer breaks the reward" in dead[0].reason
        assert await redis.hgetall(keys.lost) == {lost.encode(): b"1"}
        assert await redis.hgetall(keys.replaced) == {lost.encode(): f"{lost}.n".encode()}
        samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
        assert sorted(s.sample_id for s in samples) == sorted(expected)
        assert [t.answer for t in await prompt_tasks(redis, keys) if t.task_id == f"{lost}.n"] == [replacement]
        assert all(s.policy_version == s.step for s in samples), "still on-policy"
    finally:
        stop.set()
        await asyncio.gather(*services, return_exceptions=True)
        await asyncio.gather(*running, return_exceptions=True)
        await redis.aclose()


class _Killed(BaseException):
    """The worker process dies here (nothing in the worker catches it)."""


async def test_a_task_recorded_lost_whose_worker_died_before_its_dead_letter_is_not_generated_again(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """A worker records a task lost (its reward raised) and dies before the dead letter and the ack. The task
    is redelivered to another worker, whose reward works: the policy service has sent another prompt in its
    place, so generating this one too would give its step a group too many. It goes to `dead` unread instead.
    Evidence from Redis: the PEL, the `dead` and `samples` streams, and the `lost` record written once."""
    from tlt_stream.basics.messages import PromptGroup
    from tlt_stream.bus.producer import StreamProducer

    config = override(bus_config, {"bus.reclaim_idle_ms": 300, "rollout.max_batch": 4, "rollout.max_len": 96})
    keys = Keys(config.run)
    redis = connect_redis(config.bus.redis_url, block_ms=config.bus.block_ms)
    await keep_for_audit(redis, keys)
    good = build_tokenizer().encode("Start at 1 and add 2, 1 times.\n")
    doomed = PromptGroup(task_id="doomed", prompt_id="p", prompt_ids=good, answer="3", group_size=GROUP, step=2)
    plane = ControlPlane(config, redis, role="rollout")
    publisher = ControlPlane(config, redis, role="learner", owns=["policy"])
    stop = asyncio.Event()
    running = [asyncio.create_task(p.run(stop)) for p in (plane, publisher)]
    second: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(plane.connected.wait(), publisher.connected.wait())
        learner = LearnerService(config, redis, publisher, run_dir=tmp_path / "run", init_policy=init_policy)
        await learner.start()  # publishes version 0, which the workers load

        def broken(text: str, answer: str) -> float:
            raise ValueError("this reward is broken")

        first = RolloutWorker(config, redis, plane, worker_id="w0", reward=broken)

        async def die(delivery: object, reason: str) -> None:
            raise _Killed

        first.intake.reader.give_up = die  # type: ignore[method-assign]
        await StreamProducer(redis, keys, config.bus).send("prompts", [doomed])
        with pytest.raises(_Killed):
            async with asyncio.timeout(60):
                await first.run(stop)
        assert await redis.hgetall(keys.lost) == {b"doomed": b"2"}, "recorded before the dead letter"
        pel = await redis.xpending_range(keys.stream("prompts"), "rollout", "-", "+", 10)
        assert [(r["consumer"], r["times_delivered"]) for r in pel] == [(b"w0", 1)], "pending, never acked"
        await redis.delete(keys.worker("w0"))  # its heartbeat expires: the process is gone

        after = RolloutWorker(config, redis, plane, worker_id="w1", reward=reward)
        second = asyncio.create_task(after.run(stop))

        async def settled() -> bool:
            return second.done() or not (await redis.xpending(keys.stream("prompts"), "rollout"))["pending"]

        await until_redis(settled, "the redelivered task handled")
        assert not second.done(), "the second worker works on"
        pel = await redis.xpending(keys.stream("prompts"), "rollout")
        assert pel["pending"] == 0
        dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
        assert [(codec_for("prompts").decode(d.payload).task_id, d.origin, d.deliveries) for d in dead] == [
            ("doomed", "rollout/w1", 2)
        ]
        assert "recorded lost" in dead[0].reason
        assert await redis.xlen(keys.stream("samples")) == 0, "nothing of the lost task generated"
        assert await redis.hgetall(keys.lost) == {b"doomed": b"2"}
    finally:
        stop.set()
        if second is not None:
            await asyncio.gather(second, return_exceptions=True)
        await asyncio.gather(*running, return_exceptions=True)
        await redis.aclose()


async def test_a_task_the_reader_refuses_is_recorded_lost_before_its_ack(bus_config: Config) -> None:
    """An entry the reader dead-letters itself (here: it does not decode) is recorded lost before it is acked:
    a worker that dies at the ack leaves the record in Redis (and the entry pending), never an acked entry
    whose step waits for ever for its group."""
    import msgspec

    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url, block_ms=bus_config.bus.block_ms)
    plane = ControlPlane(bus_config, redis, role="rollout")
    try:
        worker = RolloutWorker(bus_config, redis, plane, worker_id="w0", reward=reward)
        await worker.intake.reader.ensure_group()
        refused = msgspec.msgpack.encode({"task_id": "refused", "step": 5, "group_size": -1, "prompt_ids": [1]})
        await redis.xadd(keys.stream("prompts"), {b"m": refused})

        async def die(entry_ids: list[str]) -> int:
            raise _Killed

        worker.intake.reader.ack = die  # type: ignore[method-assign]
        with pytest.raises(_Killed):
            await worker.intake.read(4, 100)
        assert await redis.hgetall(keys.lost) == {b"refused": b"5"}
        assert (await redis.xpending(keys.stream("prompts"), "rollout"))["pending"] == 1, "never acked"
        assert await redis.xlen(keys.stream("dead")) == 1
    finally:
        await redis.aclose()

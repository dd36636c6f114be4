"""The adaptive drafter in the RL loop: idle workers train it, publish it behind the guard rail, and every
worker hot-swaps it; the training state survives preemption and a change of lease holder."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.integration.loop import keep_for_audit
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import DrafterStats, HiddenWindow, SdArmReport, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.rl.samples import hidden_window
from tlt_stream.roles.drafter_trainer import IdleDrafterTrainer
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.policy import PolicyService, RepeatedAddSource
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.tasks.repeated_add import reward
from tlt_stream.tasks.tokenizer import build_tokenizer

from .loop import planes, stats_of

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

PROMPTS, GROUP = 2, 2


@pytest.fixture
def init_drafter(init_policy: Path, tmp_path: Path) -> Path:
    torch.manual_seed(1)
    return save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter0")


def training_settings(tmp_path: Path, **more: object) -> dict[str, object]:
    """Online drafter training as these tests run it (dotted keys of the drafter section)."""
    return {
        "drafter.state_dir": str(tmp_path / "states"),
        "drafter.slice_seconds": 0.3,
        "drafter.min_windows": 2,
        "drafter.holdout_percent": 25,
        "drafter.tolerance": 10.0,  # random drafters: acceptance is noise, adopt every slice
        "drafter.judge_every_steps": 1,  # judge every slice (test_slices_are_judged_every_k_steps: the spacing)
        "drafter.lease_ttl_ms": 5000,
        "drafter.batch_pairs": 64,
        "drafter.row_tokens": 64,
        **{f"drafter.{key}": value for key, value in more.items()},
    }


def worker_config(config: Config, init_drafter: Path, training: dict[str, object], **rollout: object) -> Config:
    """A worker that drafts with `init_drafter`, streams every sample's windows and trains as `training` says."""
    values = {"rollout.hidden_share": 1.0, "sd.drafter": str(init_drafter), **training}
    return override(config, values | {f"rollout.{key}": value for key, value in rollout.items()})


async def test_idle_workers_train_publish_and_swap_the_drafter_while_every_group_trains_once(
    bus_config: Config, tmp_path: Path, init_policy: Path, init_drafter: Path
) -> None:
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    await keep_for_audit(redis, keys)  # the learner trims what it checkpointed
    roles = {"learner": ["policy"], "policy": [], "rollout": ["drafter"]}
    async with planes(bus_config, roles) as control:
        learner = LearnerService(
            override(bus_config, {"learner.groups_per_step": PROMPTS}),
            redis,
            control["learner"],
            run_dir=tmp_path / "run",
            init_policy=init_policy,
        )
        # Every sample's windows (training starts within a few groups); SD on once <= 3 of the 4 rows remain.
        sd = {"sd.crossover": 4, "sd.margin": 0}
        worker = RolloutWorker(
            worker_config(bus_config, init_drafter, training_settings(tmp_path) | sd, max_batch=4, max_len=64),
            redis,
            control["rollout"],
            worker_id="w0",
            reward=reward,
        )

        def dispatcher(total: int) -> PolicyService:
            return PolicyService(
                bus_config,
                redis,
                control["policy"],
                RepeatedAddSource(build_tokenizer(), seed=3),
                prompts_per_step=PROMPTS,
                group_size=GROUP,
                total_steps=total,
            )

        stop = asyncio.Event()
        await learner.start()
        generating = asyncio.create_task(worker.run(stop))
        try:
            # Two RL steps; then the worker is idle, takes the lease and trains until a drafter is published.
            async with asyncio.timeout(120):
                await asyncio.gather(learner.run(asyncio.Event(), max_updates=2), dispatcher(2).run(asyncio.Event()))
                while control["policy"].version("drafter") < 1:
                    assert not generating.done(), generating.exception()
                    await asyncio.sleep(0.2)
            # A third step: its prompts preempt training; the worker swaps the new drafter in and generates.
            async with asyncio.timeout(120):
                await asyncio.gather(learner.run(asyncio.Event(), max_updates=1), dispatcher(3).run(asyncio.Event()))
            # The preempted slice's state was committed at once and is judged in the next idle period.
            async with asyncio.timeout(60):
                while not any(s.end == "preempted" for s in await stats_of(redis, keys, DrafterStats)):
                    assert not generating.done(), generating.exception()
                    await asyncio.sleep(0.2)
        finally:
            stop.set()
            async with asyncio.timeout(30):
                await asyncio.gather(generating, return_exceptions=True)

        assembler = learner.intake.assembler
        assert learner.version == 3 and assembler.duplicates == 0 and assembler.dropped_groups == 0
        assert len(assembler.ledger) == 3 * PROMPTS * GROUP, "every dispatched group trained exactly once"
        published = (await read_mirror(redis, keys))["drafter"]
        assert published.version >= 1 and published.location.startswith(str(tmp_path / "states"))
        assert worker.drafters.swaps >= 1
        samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
        assert {s.drafter_version for s in samples if s.step < 2} == {0}, "steps 0-1 ran on the warm-up drafter"
        assert all(s.drafter_version >= 1 for s in samples if s.step == 2), "step 2 ran on an online drafter"
        slices: list[DrafterStats] = await stats_of(redis, keys, DrafterStats)
        assert slices and all(s.worker_id == "w0" and s.steps > 0 for s in slices)
        assert [s.step for s in slices] == sorted(s.step for s in slices), "the step count only grows"
        assert any(s.adopted and s.drafter_version >= 1 for s in slices)
        assert any(s.end == "preempted" and s.preempt_latency_s > 0 for s in slices), "step 2's prompts preempted"
        arms: list[SdArmReport] = await stats_of(redis, keys, SdArmReport)
        assert {r.proposer for r in arms} == {"plain", "drafter"}, "adaptive SD measured both sides of the switch"
        assert {r.drafter_version for r in arms if r.proposer == "drafter"} >= {0}
        assert worker.idle_trainer is not None and worker.idle_trainer.training_seconds > 0
        assert worker.idle_trainer.training_seconds <= worker.idle_trainer.idle_seconds
    await redis.aclose()


def sd_engine(init_policy: Path, init_drafter: Path) -> Any:
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import build_proposer

    model = load_model(init_policy)
    return GenerationEngine(model, 2, 64, proposer=build_proposer(str(init_drafter), model), arm=Arm.drafter(2, 1, 2))


def hidden_windows(engine: Any) -> list[HiddenWindow]:
    """Hidden-state windows for training, from real generations of the policy."""
    results = engine.generate([[5, 6, 7, 8]] * 2 + [[9, 10, 11]] * 2, 24, 1.0, seed=0, return_hidden=True)
    return [hidden_window(r, f"t/{i}", 0) for i, r in enumerate(results * 4)]


async def idle_until(trainer: IdleDrafterTrainer, engine: Any, done: Callable[[], bool]) -> None:
    """Let `trainer` spend idle time until `done()`, then stop it as a worker stopping would."""
    stop = asyncio.Event()
    task = asyncio.create_task(trainer.run_idle(engine, 0, [], stop))
    async with asyncio.timeout(300):  # a hang guard: a slow machine commits and judges slices slowly
        while not done():
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_a_new_lease_holder_continues_from_the_committed_state(
    bus_config: Config, tmp_path: Path, init_policy: Path, init_drafter: Path
) -> None:
    """Worker a trains and commits under the lease; worker b takes the lease next and resumes at a's step
    with a's optimizer moments, not from scratch."""
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    config = worker_config(bus_config, init_drafter, training_settings(tmp_path), max_batch=2, max_len=64)
    async with planes(bus_config, {"a": ["drafter"], "b": ["drafter"]}) as control:
        workers = {
            name: RolloutWorker(config, redis, control[name], worker_id=name, reward=reward) for name in ("a", "b")
        }
        engine = sd_engine(init_policy, init_drafter)
        windows = hidden_windows(engine)
        await StreamProducer(redis, keys, bus_config.bus).send("hidden", windows)

        async def idle_until_a_slice(name: str) -> None:
            trainer = workers[name].idle_trainer
            assert trainer is not None
            before = trainer.slices
            await idle_until(trainer, engine, lambda: trainer.slices > before)

        await idle_until_a_slice("a")
        a = workers["a"].idle_trainer
        assert a is not None and a.trainer.step_count > 0
        committed = a.trainer.step_count
        moments = {k: v.clone() for k, v in a.trainer.optimizer.state_dict()["state"][0].items()}
        # b takes the lease next (with fresh windows: a consumed the first ones); it must start from a's
        # committed state, then train on from there.
        await StreamProducer(redis, keys, bus_config.bus).send("hidden", windows)
        b = workers["b"].idle_trainer
        assert b is not None and b.trainer is None
        b.own = msgspec.structs.replace(b.own, slice_seconds=0.01)
        await idle_until_a_slice("b")
        slices: list[DrafterStats] = await stats_of(redis, keys, DrafterStats)
        by_b = [s for s in slices if s.worker_id == "b"]
        assert by_b and by_b[0].step == committed + by_b[0].steps, "b resumed at a's step count"
        assert by_b[0].fence > [s for s in slices if s.worker_id == "a"][-1].fence
        # b's AdamW moments continue a's: their step counter carries a's steps plus b's own.
        restored = b.trainer.optimizer.state_dict()["state"][0]
        assert float(moments["step"]) == committed and float(restored["step"]) == b.trainer.step_count
    await redis.aclose()


async def test_slices_are_judged_every_k_steps_and_each_is_reported_once(
    bus_config: Config, tmp_path: Path, init_policy: Path, init_drafter: Path
) -> None:
    """With judge_every_steps = k, every committed slice is reported once, and a drafter is judged (and
    published) only once k steps have passed since the last judgement; the others report no verdict."""
    k = 5
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    # A slice of 5 ms holds one step or a few, always fewer than k: a slow machine gives one step per slice
    # (a slice runs at least one), a fast one a few. Slices of k or more steps would all be judged.
    training = training_settings(tmp_path, judge_every_steps=k, slice_seconds=0.005)
    config = worker_config(bus_config, init_drafter, training, max_batch=2, max_len=64)
    async with planes(bus_config, {"w": ["drafter"]}) as control:
        worker = RolloutWorker(config, redis, control["w"], worker_id="w", reward=reward)
        trainer = worker.idle_trainer
        assert trainer is not None
        engine = sd_engine(init_policy, init_drafter)
        await StreamProducer(redis, keys, bus_config.bus).send("hidden", hidden_windows(engine))
        steps = lambda: trainer.trainer.step_count if trainer.trainer is not None else 0  # noqa: E731
        await idle_until(trainer, engine, lambda: steps() >= 3 * k and trainer.slices > 4)
        slices: list[DrafterStats] = await stats_of(redis, keys, DrafterStats)
        assert trainer.trainer is not None and sum(s.steps for s in slices) == trainer.trainer.step_count
        assert len(slices) == trainer.slices and len(slices) > 4, "one report per committed slice"
        judged_at = 0
        if slices[-1].end == "preempted":
            # Preempted by the stop: due or not, it is reported without a verdict (no next idle period to judge
            # it in).
            assert not slices.pop().judged
        elif slices[-1].judged and not slices[-1].adopted:
            # Judged while the worker was stopping (the stop came during the judgement): not published.
            assert slices.pop().drafter_version == -1
        for s in slices:
            assert s.judged == (s.step - judged_at >= k), (s.step, judged_at)
            if s.judged:
                judged_at = s.step
                assert s.judge_s > 0 and s.adopted and s.drafter_version >= 1  # tolerance 10: every judgement adopts
            else:
                assert (s.judge_s, s.accept_new, s.adopted, s.drafter_version) == (0.0, 0.0, False, -1)
        judged = [s for s in slices if s.judged]
        assert len(judged) >= 2 and len(judged) < len(slices)
        assert [s.drafter_version for s in judged] == list(range(1, len(judged) + 1))
        assert control["w"].version("drafter") in (len(judged), len(judged) - 1)  # the last may be in flight
    await redis.aclose()


async def test_no_drafter_is_published_before_a_window_is_held_out_to_judge_it_on(
    bus_config: Config, tmp_path: Path, init_policy: Path, init_drafter: Path
) -> None:
    """With holdout_percent 1, none of the windows t/0..t/15 is held out (by their ids' hash): slices are
    reported unjudged and nothing is published, however lenient the tolerance. Once a held-out window (h/6)
    arrives, the next slice is judged on it and published."""
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    training = training_settings(tmp_path, holdout_percent=1, slice_seconds=0.01)
    config = worker_config(bus_config, init_drafter, training, max_batch=2, max_len=64)
    async with planes(bus_config, {"w": ["drafter"]}) as control:
        worker = RolloutWorker(config, redis, control["w"], worker_id="w", reward=reward)
        trainer = worker.idle_trainer
        assert trainer is not None
        engine = sd_engine(init_policy, init_drafter)
        windows = hidden_windows(engine)
        await StreamProducer(redis, keys, bus_config.bus).send("hidden", windows)
        await idle_until(trainer, engine, lambda: trainer.slices >= 3)
        slices: list[DrafterStats] = await stats_of(redis, keys, DrafterStats)
        assert not trainer.holdout and slices and not any(s.judged for s in slices)
        assert control["w"].version("drafter") == -1
        held = msgspec.structs.replace(windows[0], sample_id="h/6")
        await StreamProducer(redis, keys, bus_config.bus).send("hidden", [held])
        await idle_until(trainer, engine, lambda: control["w"].version("drafter") >= 1)
        assert len(trainer.holdout) == 1
        judged = [s for s in await stats_of(redis, keys, DrafterStats) if s.judged]
        assert judged and judged[0].adopted and judged[0].drafter_version == 1
    await redis.aclose()


async def test_a_stopping_worker_neither_judges_nor_publishes_its_pending_slice(
    bus_config: Config, tmp_path: Path, init_policy: Path, init_drafter: Path
) -> None:
    """A slice preempted by new work is judged at the start of the next idle period. When that period is the
    worker stopping, the slice is reported unjudged and nothing is published: the worker's control plane is
    closing, and a version published then would reach the Redis mirror but not MQTT."""
    from tlt_stream.basics.messages import PromptGroup

    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    config = worker_config(bus_config, init_drafter, training_settings(tmp_path, slice_seconds=60.0), max_batch=2)
    async with planes(bus_config, {"w": ["drafter"]}) as control:
        worker = RolloutWorker(config, redis, control["w"], worker_id="w", reward=reward)
        trainer = worker.idle_trainer
        assert trainer is not None
        engine = sd_engine(init_policy, init_drafter)
        producer = StreamProducer(redis, keys, bus_config.bus)
        await producer.send("hidden", hidden_windows(engine))
        waiting: list[Any] = []
        idle = asyncio.create_task(trainer.run_idle(engine, 0, waiting, asyncio.Event()))
        async with asyncio.timeout(120):
            while trainer.trainer is None or trainer.trainer.step_count < 1:
                assert not idle.done(), idle.exception()
                await asyncio.sleep(0.05)
        task = PromptGroup(task_id="t0", prompt_id="t0", prompt_ids=[5, 6], answer="", group_size=2)
        await producer.send("prompts", [task])
        await asyncio.wait_for(idle, 60)  # preempted by the task: the slice is committed, its judgement due
        assert waiting and not await stats_of(redis, keys, DrafterStats)
        stop = asyncio.Event()
        stop.set()
        await asyncio.wait_for(trainer.run_idle(engine, 0, [], stop), 60)
        (pending,) = await stats_of(redis, keys, DrafterStats)
        assert pending.end == "preempted" and pending.steps >= 1 and not pending.judged
        assert control["w"].version("drafter") == -1 and "drafter" not in await read_mirror(redis, keys)
    await redis.aclose()


async def test_a_held_out_window_with_nothing_to_judge_on_neither_stops_the_trainer_nor_publishes(
    bus_config: Config, tmp_path: Path, init_policy: Path, init_drafter: Path
) -> None:
    """A window picked for the held-out set (h/6, by its id's hash) that is all prompt gives the judgement no
    position to measure: `held_out_acceptance` raised, and the idle trainer's task died with it. Such a
    window is trained on instead; the trainer goes on, and nothing is published unjudged."""
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    training = training_settings(tmp_path, holdout_percent=1, slice_seconds=0.01)
    config = worker_config(bus_config, init_drafter, training, max_batch=2, max_len=64)
    async with planes(bus_config, {"w": ["drafter"]}) as control:
        worker = RolloutWorker(config, redis, control["w"], worker_id="w", reward=reward)
        trainer = worker.idle_trainer
        assert trainer is not None
        engine = sd_engine(init_policy, init_drafter)
        windows = hidden_windows(engine)
        prompt_only = msgspec.structs.replace(windows[0], sample_id="h/6", prompt_len=len(windows[0].token_ids))
        await StreamProducer(redis, keys, bus_config.bus).send("hidden", [*windows, prompt_only])
        await idle_until(trainer, engine, lambda: trainer.slices >= 4)  # asserts the task is alive throughout
        assert not trainer.holdout
        assert control["w"].version("drafter") == -1
        slices: list[DrafterStats] = await stats_of(redis, keys, DrafterStats)
        assert len(slices) >= 4 and not any(s.judged for s in slices)
    await redis.aclose()

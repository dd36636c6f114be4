"""The three services together on the tiny task: versions advance, every group is trained on exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from tests.integration.loop import keep_for_audit
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import WorkerStatus, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.policy import PolicyService, RepeatedAddSource
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.roles.worker.tasks import streams_hidden
from tlt_stream.tasks.repeated_add import reward
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

STEPS, PROMPTS, GROUP = 3, 2, 2


@dataclass
class Planes:
    redis: aioredis.Redis
    learner: ControlPlane
    worker: ControlPlane
    stop: asyncio.Event


@contextlib.asynccontextmanager
async def learner_and_worker_planes(config: Config) -> AsyncIterator[Planes]:
    """A learner's control plane (owning `policy`) and a rollout worker's, connected; stopped on exit. The client's
    reply timeout outlasts the config's blocking reads, as a service's does."""
    redis = connect_redis(config.bus.redis_url, block_ms=config.bus.block_ms)
    planes = Planes(
        redis,
        ControlPlane(config, redis, role="learner", owns=["policy"]),
        ControlPlane(config, redis, role="rollout"),
        asyncio.Event(),
    )
    running = [asyncio.create_task(p.run(planes.stop)) for p in (planes.learner, planes.worker)]
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(planes.learner.connected.wait(), planes.worker.connected.wait())
        yield planes
    finally:
        planes.stop.set()
        await asyncio.gather(*running)
        await redis.aclose()


def awaiting(task: asyncio.Task[object]) -> str:
    """Where a pending task waits, innermost first: its chain of awaited coroutines (a task's own `get_stack`
    gives a suspended coroutine's outermost frame only)."""
    where, coro = [], task.get_coro()
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        where.append(f"{Path(coro.cr_frame.f_code.co_filename).name}:{coro.cr_frame.f_lineno}")
        coro = getattr(coro, "cr_await", None)
    return " < ".join(reversed(where)) or repr(task)


def policy_service(config: Config, planes: Planes, prompts_per_step: int = 2) -> PolicyService:
    """A policy service on the learner's plane, `prompts_per_step` groups of 2 a step."""
    return PolicyService(
        config,
        planes.redis,
        planes.learner,
        RepeatedAddSource(build_tokenizer()),
        prompts_per_step=prompts_per_step,
        group_size=2,
    )


async def test_on_policy_loop_trains_every_dispatched_group_once(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    await keep_for_audit(redis, keys)  # the learner trims what it checkpointed
    planes = {
        role: ControlPlane(bus_config, redis, role=role, owns=["policy"] if role == "learner" else [])
        for role in ("learner", "policy", "rollout")
    }
    stop = asyncio.Event()
    tasks = [asyncio.create_task(plane.run(stop)) for plane in planes.values()]
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(plane.connected.wait() for plane in planes.values()))
        learner = LearnerService(
            override(bus_config, {"learner.groups_per_step": PROMPTS, "policy.max_staleness": 0}),
            redis,
            planes["learner"],
            run_dir=tmp_path / "run",
            init_policy=init_policy,
        )
        dispatcher = PolicyService(
            bus_config,
            redis,
            planes["policy"],
            RepeatedAddSource(build_tokenizer(), seed=1),
            prompts_per_step=PROMPTS,
            group_size=GROUP,
            total_steps=STEPS,
        )
        shape = {"rollout.max_batch": 4, "rollout.max_len": 96, "rollout.max_response_len": 24}
        worker = RolloutWorker(
            override(bus_config, shape | {"rollout.hidden_share": 0.5}),
            redis,
            planes["rollout"],
            worker_id="w0",
            reward=reward,
        )
        await learner.start()
        services = [
            asyncio.create_task(learner.run(stop, max_updates=STEPS)),
            asyncio.create_task(dispatcher.run(stop)),
            asyncio.create_task(worker.run(stop)),
        ]
        async with asyncio.timeout(120):
            while not services[0].done():
                running = [task for task in services if not task.done()]
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # a service that failed fails the test with its own error
        assert services[2].done() is False, "the worker keeps serving"
        assert learner.version == STEPS
        expected = {f"s{s:06d}-{i:04d}/{g}" for s in range(STEPS) for i in range(PROMPTS) for g in range(GROUP)}
        assert learner.intake.assembler.ledger == expected
        assert learner.intake.assembler.duplicates == 0 and learner.intake.assembler.dropped_groups == 0
        samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
        assert len(samples) == len(expected)
        assert all(s.policy_version == s.step for s in samples), "on-policy: step s is generated by version s"
        lengths = {(s.token_ids.shape[0], s.finish_reason) for s in samples}
        assert all(n <= 24 for n, _ in lengths) and (24, "length") in lengths, "max_response_len cuts responses"
        # The hidden-state windows of the chosen half of the samples went to `hidden`, from the same policy
        # version, aligned with them.
        windows = {
            w.sample_id: w
            for w in (codec_for("hidden").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("hidden")))
        }
        chosen = {s.sample_id for s in samples if s.token_ids.shape[0] and streams_hidden(s.sample_id, 0.5)}
        assert set(windows) == chosen and 0 < len(chosen) < len(samples)
        for s in samples:
            if s.sample_id in windows:
                window = windows[s.sample_id]
                assert window.policy_version == s.policy_version and window.prompt_len == len(s.prompt_ids)
                assert window.token_ids == (s.prompt_ids + s.token_ids.to_torch().tolist())[:-1]
        assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
        # A task is acked right after its samples are sent; a worker that stops finishes that round trip.
        stop.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*services)
        assert (await redis.xpending(keys.stream("prompts"), "rollout"))["pending"] == 0
        assert await dispatcher.next_step() == STEPS
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for service in locals().get("services", []):
            await asyncio.gather(service, return_exceptions=True)
        await redis.aclose()


async def test_the_three_services_run_as_separate_processes(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    import os
    import signal
    import sys

    services = Path(__file__).parents[2] / "services"
    env = {**os.environ, "TLT_REDIS_URL": bus_config.bus.redis_url, "TLT_MQTT_URL": bus_config.bus.mqtt_url}
    common = ("--run", bus_config.run)

    async def start(script: str, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, str(services / script), *common, *args, env=env, stderr=asyncio.subprocess.PIPE
        )

    learner = await start(
        "learner.py", "--run-dir", str(tmp_path / "run"), "--policy", str(init_policy), "--groups-per-step", "2",
        "--max-updates", "2",
    )  # fmt: skip
    policy = await start("policy.py", "--prompts-per-step", "2", "--group-size", "2", "--steps", "2")
    worker = await start("rollout_worker.py", "--max-batch", "4", "--max-len", "96", "--worker-id", "w-proc")
    try:
        async with asyncio.timeout(180):
            _, learner_err = await learner.communicate()
        assert learner.returncode == 0, learner_err.decode()[-2000:]
        assert "stopped at policy version 2" in learner_err.decode()
        for process in (policy, worker):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            outputs = [await p.communicate() for p in (policy, worker)]
        assert policy.returncode == 0 and worker.returncode == 0, [err.decode()[-1000:] for _, err in outputs]
        assert "w-proc: stopped after 4 tasks (8 samples)" in outputs[1][1].decode()
    finally:
        for process in (learner, policy, worker):
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_a_worker_refuses_a_corrupted_policy_and_keeps_generating_with_the_old_one(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    from tlt_stream.basics.messages import PolicyVersion, WorkerState

    keys = Keys(bus_config.run)
    async with learner_and_worker_planes(bus_config) as planes:
        redis, learner_plane, worker_plane, stop = planes.redis, planes.learner, planes.worker, planes.stop
        settings = {"rollout.max_batch": 4, "rollout.max_len": 96}
        worker = RolloutWorker(override(bus_config, settings), redis, worker_plane, worker_id="w0", reward=reward)
        running = None
        try:
            learner = LearnerService(
                bus_config, redis, learner_plane, run_dir=tmp_path / "run", init_policy=init_policy
            )
            good = await learner.start()
            running = asyncio.create_task(worker.run(stop, max_tasks=1))
            async with asyncio.timeout(30):
                while worker.version < 0:  # noqa: ASYNC110 - the worker exposes no event for "loaded"; poll it briefly
                    await asyncio.sleep(0.05)
            assert await learner_plane.publish(
                PolicyVersion(version=1, location=good.location, sha256="0" * 64, step=1)  # bytes do not match
            )
            async with asyncio.timeout(20):
                await worker_plane.wait_for("policy", 1)
            dispatcher = PolicyService(
                bus_config,
                redis,
                learner_plane,
                RepeatedAddSource(build_tokenizer()),
                prompts_per_step=1,
                group_size=2,
                max_staleness=1,
            )
            await dispatcher.dispatch(0)
            async with asyncio.timeout(60):
                await running
            assert worker.version == 0 and worker.loader.versions.refused == {1}
            timeline = [codec_for("stats").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("stats"))]
            reasons = [m.reason for m in timeline if isinstance(m, WorkerState)]
            assert any("refused policy version 1, kept 0" in r and "sha256" in r for r in reasons), reasons
            samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
            assert [s.policy_version for s in samples] == [0, 0]
        finally:
            stop.set()
            if running is not None:
                await asyncio.wait_for(running, timeout=30)


async def test_a_policy_version_pruned_while_a_worker_loads_it_is_skipped_for_the_next(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner keeps only its newest checkpoints: a slow worker can find the version it is loading gone.
    It must refuse that version and load the next one, not die."""
    import shutil

    import tlt_stream.store.weights as weights_module
    from tlt_stream.basics.messages import PolicyVersion
    from tlt_stream.store.digest import directory_sha256

    copies = {v: shutil.copytree(init_policy, tmp_path / f"v{v}") for v in (0, 1, 2)}
    real_read = weights_module.read_weights

    def pruned_then_read(location: str, sha256: str, **kwargs: object) -> object:
        if location == str(copies[1]):  # the learner prunes it just as the worker comes to read it
            shutil.rmtree(location)
        return real_read(location, sha256, **kwargs)

    monkeypatch.setattr(weights_module, "read_weights", pruned_then_read)
    async with learner_and_worker_planes(bus_config) as planes:
        settings = {"rollout.max_batch": 2, "rollout.max_len": 64}
        worker = RolloutWorker(
            override(bus_config, settings), planes.redis, planes.worker, worker_id="w0", reward=reward
        )
        for version in (0, 1, 2):
            path = copies[version]
            await planes.learner.publish(
                PolicyVersion(version=version, location=str(path), sha256=directory_sha256(path))
            )
            async with asyncio.timeout(20):
                await planes.worker.wait_for("policy", version)
            await worker.load_announced()
            if version == 1:
                assert worker.version == 0, "kept the version it had"
                assert worker.loader.versions.unavailable == 1 and not worker.loader.versions.refused
        assert worker.version == 2 and not worker.loader.versions.refused and worker.loader.versions.unavailable is None


async def test_a_policy_version_unreadable_for_a_while_is_loaded_once_it_is_back(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """A checkpoint whose storage is away when the worker tries it (the newest version, which on-policy tasks
    need) is tried again after a backoff, not refused for good: refusing it would stall the run."""
    import shutil

    from tlt_stream.basics.messages import PolicyVersion
    from tlt_stream.store.digest import directory_sha256

    v0, v1 = (shutil.copytree(init_policy, tmp_path / f"v{v}") for v in (0, 1))
    sha1 = directory_sha256(v1)
    away = v1.rename(tmp_path / "v1.away")
    async with learner_and_worker_planes(bus_config) as planes:
        settings = {"rollout.max_batch": 2, "rollout.max_len": 64}
        worker = RolloutWorker(
            override(bus_config, settings), planes.redis, planes.worker, worker_id="w0", reward=reward
        )
        for version, path, sha in ((0, v0, directory_sha256(v0)), (1, v1, sha1)):
            await planes.learner.publish(PolicyVersion(version=version, location=str(path), sha256=sha))
            async with asyncio.timeout(20):
                await planes.worker.wait_for("policy", version)
            await worker.load_announced()
        assert worker.version == 0 and not worker.loader.versions.refused
        assert worker.loader.versions.unavailable == 1
        assert worker.loader.awaiting_retry() and worker.loader.loadable() is None, "backing off, not retrying at once"
        away.rename(v1)
        async with asyncio.timeout(20):
            await worker.loader.wait_to_retry(asyncio.Event())  # returns at the next try's time
        await worker.load_announced()
        assert worker.version == 1 and worker.loader.versions.unavailable is None and not worker.loader.versions.refused


async def test_a_worker_waiting_for_prompts_says_idle_not_generating(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Waiting on `prompts` with nothing to generate is idle time (what drafter training runs in and the
    state timeline shows), also while the blocking read is in progress: here a read blocks for a minute."""
    config = msgspec.structs.replace(bus_config, bus=msgspec.structs.replace(bus_config.bus, block_ms=60_000))
    async with learner_and_worker_planes(config) as planes:
        redis = planes.redis
        settings = {"rollout.max_batch": 4, "rollout.max_len": 96}
        worker = RolloutWorker(override(config, settings), redis, planes.worker, worker_id="w0", reward=reward)
        learner = LearnerService(config, redis, planes.learner, run_dir=tmp_path / "run", init_policy=init_policy)
        await learner.start()
        running = asyncio.create_task(worker.run(planes.stop))
        try:
            await policy_service(config, planes, prompts_per_step=1).dispatch(0)
            async with asyncio.timeout(30):
                while worker.generation.tasks_done < 1:
                    assert not running.done(), running.exception()
                    await asyncio.sleep(0.05)
            async with asyncio.timeout(30):  # half the read's block: a worker that waits as GENERATING fails here
                while worker.registry.state != WorkerStatus.IDLE:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert not running.done()
        finally:
            running.cancel()  # blocked in a one-minute read: nothing in flight to finish
            # Python 3.11's wait_for in redis-py's send may drop a cancel that lands as the read's command is
            # sent; the read then runs its minute and the retry loop around it cancels the worker after it.
            await asyncio.wait([running], timeout=config.bus.block_ms / 1000 + 30)
            assert running.done(), f"the worker did not stop when cancelled; it waits at {awaiting(running)}"


async def test_a_dispatch_whose_reply_was_lost_after_it_committed_is_not_sent_again(
    bus_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis killed after it ran the transaction but before its reply arrived: redis-py raises the same
    WatchError, the retry finds the cursor already past the step, marked by this dispatch, and returns the
    entries written (the old code took it for another policy service and died; the fault suite caught it)."""
    from redis.asyncio.client import Pipeline
    from redis.exceptions import WatchError

    real_execute, calls, written = Pipeline.execute, [], []

    async def reply_lost_once(self: Pipeline, *args: object, **kwargs: object) -> object:
        calls.append(1)
        replies = await real_execute(self, *args, **kwargs)
        if len(calls) == 1:
            written.extend(r.decode() for r in replies[:-1])
            raise WatchError("A ConnectionError occurred while watching one or more keys")
        return replies

    monkeypatch.setattr(Pipeline, "execute", reply_lost_once)
    async with learner_and_worker_planes(bus_config) as planes:
        dispatcher = policy_service(bus_config, planes)
        ids = await dispatcher.dispatch(0)
        assert len(calls) == 1 and len(written) == 2 and ids == written
        assert await planes.redis.xlen(Keys(bus_config.run).stream("prompts")) == 2  # sent once
        assert await dispatcher.next_step() == 1
        await dispatcher.dispatch(1)  # the next step goes out as usual
        assert await planes.redis.xlen(Keys(bus_config.run).stream("prompts")) == 4
        other = policy_service(bus_config, planes)
        with pytest.raises(RuntimeError, match="raced another policy service"):
            await other.dispatch(1)  # a step someone else sent is still a race


async def test_a_dispatch_interrupted_while_watching_the_cursor_is_retried_once(
    bus_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py reports a connection lost during WATCH as a WatchError: the policy service must try the
    step's transaction again (it wrote nothing), not die, and the step must reach `prompts` once."""
    from redis.asyncio.client import Pipeline
    from redis.exceptions import WatchError

    real_execute, calls = Pipeline.execute, []

    async def interrupted_once(self: Pipeline, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            await self.reset()
            raise WatchError("A ConnectionError occurred while watching one or more keys")
        return await real_execute(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "execute", interrupted_once)
    async with learner_and_worker_planes(bus_config) as planes:
        dispatcher = policy_service(bus_config, planes)
        ids = await dispatcher.dispatch(0)
        assert len(calls) == 2 and len(ids) == 2
        assert await planes.redis.xlen(Keys(bus_config.run).stream("prompts")) == 2
        assert await dispatcher.next_step() == 1


async def test_poison_tasks_are_dead_lettered_and_the_worker_generates_on(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Tasks that decode but cannot be generated (a prompt over max_len, a token outside the vocabulary, a
    policy version nobody published) go to `dead` with their reasons; the good task behind them is done."""
    import json

    from tlt_stream.basics.messages import PromptGroup
    from tlt_stream.bus.producer import StreamProducer

    keys = Keys(bus_config.run)
    vocab = json.loads((init_policy / "config.json").read_text())["vocab_size"]
    async with learner_and_worker_planes(bus_config) as planes:
        redis = planes.redis
        settings = {"rollout.max_batch": 4, "rollout.max_len": 96}

        def fragile(text: str, answer: str) -> float:  # a user's reward that cannot parse one answer
            return float(int(answer)) * reward(text, answer)

        worker = RolloutWorker(override(bus_config, settings), redis, planes.worker, worker_id="w0", reward=fragile)
        learner = LearnerService(bus_config, redis, planes.learner, run_dir=tmp_path / "run", init_policy=init_policy)
        await learner.start()

        def task(name: str, ids: list[int], min_version: int = 0, answer: str = "1") -> PromptGroup:
            return PromptGroup(
                task_id=name,
                prompt_id=name,
                prompt_ids=ids,
                answer=answer,
                group_size=2,
                min_policy_version=min_version,
            )

        good = build_tokenizer().encode("Start at 1 and add 2, 1 times.\n")
        poison = [task("long", [5] * 96), task("vocab", [5, vocab + 1]), task("future", good, min_version=2**40)]
        poison.append(task("reward", good, answer="not a number"))
        # An entry the reader itself refuses (a group size out of range: it does not decode), which still names
        # its task and step.
        refused = msgspec.msgpack.encode({"task_id": "refused", "step": 3, "group_size": -1, "prompt_ids": good})
        await redis.xadd(keys.stream("prompts"), {b"m": refused})
        await StreamProducer(redis, keys, bus_config.bus).send("prompts", [*poison, task("good", good)])
        async with asyncio.timeout(60):
            while not (worker.generation.tasks_done == 1 and worker.intake.invalid_tasks == 4):
                await worker.run(planes.stop, max_tasks=1)
    samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "samples")]
    assert sorted(s.sample_id for s in samples) == ["good/0", "good/1"], "nothing of the reward's task was sent"
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "dead")]
    assert [d.payload for d in dead if d.payload == refused] == [refused], "refused by the reader, as it came"
    by_task = {codec_for("prompts").decode(d.payload).task_id: d for d in dead if d.payload != refused}
    assert set(by_task) == {"long", "vocab", "future", "reward"} and all(d.origin == "rollout/w0" for d in dead)
    assert "max_len=96" in by_task["long"].reason and "vocabulary" in by_task["vocab"].reason
    assert "newer than the newest published" in by_task["future"].reason
    assert "the reward raised: ValueError" in by_task["reward"].reason
    # Each task lost, recorded (before its ack, whoever dead-lettered it) for the policy service
    # to replace: tests/integration/test_lost_groups.py.
    redis = connect_redis(bus_config.bus.redis_url)
    lost = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.lost)).items()}
    await redis.aclose()
    assert lost == {"long": 0, "vocab": 0, "future": 0, "reward": 0, "refused": 3}


async def redis_entries(config: Config, keys: Keys, stream: str) -> list:
    redis = connect_redis(config.bus.redis_url)
    try:
        return await redis.xrange(keys.stream(stream))
    finally:
        await redis.aclose()


async def test_a_task_generating_past_the_reclaim_time_stays_with_its_live_worker(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Two workers, tasks that generate for many reclaim periods: no task is taken over by the other worker
    while its owner heartbeats, none is redelivered or dead-lettered, and every sample is generated once
    (read from Redis: the PEL's delivery counts while it runs, the `samples` and `dead` streams after)."""
    from tlt_stream.basics.messages import PromptGroup
    from tlt_stream.bus.producer import StreamProducer

    config = msgspec.structs.replace(bus_config, bus=msgspec.structs.replace(bus_config.bus, reclaim_idle_ms=50))
    keys = Keys(config.run)
    tokenizer = build_tokenizer()
    async with learner_and_worker_planes(config) as planes:
        redis = planes.redis
        await keep_for_audit(redis, keys)
        second = ControlPlane(config, redis, role="rollout")
        plane_task = asyncio.create_task(second.run(planes.stop))
        # the policy's 256 positions
        settings = {"rollout.max_batch": 2, "rollout.max_len": 256, "rollout.temperature": 1.0}
        workers = [
            RolloutWorker(override(config, settings), redis, plane, worker_id=f"w{i}", reward=reward)
            for i, plane in enumerate((planes.worker, second))
        ]
        learner = LearnerService(config, redis, planes.learner, run_dir=tmp_path / "run", init_policy=init_policy)
        await learner.start()
        prompt = tokenizer.encode("Start at 3 and add 4, 20 times.\n")
        tasks = [
            PromptGroup(task_id=f"t{i}", prompt_id=f"p{i}", prompt_ids=prompt, answer="83", group_size=2)
            for i in range(4)
        ]
        await workers[0].reader.ensure_group()
        await StreamProducer(redis, keys, config.bus).send("prompts", tasks)
        running = [asyncio.create_task(w.run(planes.stop)) for w in workers]
        most_delivered = 0
        try:
            async with asyncio.timeout(240):
                while sum(w.generation.tasks_done for w in workers) < len(tasks):
                    for task in running:
                        assert not task.done(), task.exception()
                    rows = await redis.xpending_range(keys.stream("prompts"), "rollout", "-", "+", 10)
                    most_delivered = max([most_delivered, *(int(r["times_delivered"]) for r in rows)])
                    await asyncio.sleep(0.05)
        finally:
            planes.stop.set()
            await asyncio.gather(*running, plane_task, return_exceptions=True)
    samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis_entries(config, keys, "samples")]
    assert sorted(s.sample_id for s in samples) == sorted(f"t{i}/{g}" for i in range(4) for g in range(2))
    assert max(s.gen_seconds for s in samples) > 3 * 0.050, "the tasks really outlived the reclaim time"
    assert most_delivered == 1, "no task was delivered twice while its worker was alive"
    assert await redis_entries(config, keys, "dead") == []
    assert all(w.reader.reclaimed == 0 for w in workers) and sum(w.reader.refreshed for w in workers) > 0

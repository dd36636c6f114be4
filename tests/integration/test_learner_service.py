"""The learner service over real streams: updates are checkpointed, acked and published; nothing twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests.integration.loop import until_redis
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import Sample, Tensor, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane, read_mirror
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.learner import LearnerService
from tlt_stream.store.digest import directory_sha256

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


def sample(task: str, index: int, reward: float, version: int = 0) -> Sample:
    tokens = [10 + index, 11, 12, 2]
    return Sample(
        sample_id=f"{task}/{index}",
        task_id=task,
        prompt_id=task,
        index=index,
        group_size=2,
        prompt_ids=[5, 6, 7],
        token_ids=Tensor.from_values(tokens, "int32"),
        logprobs=Tensor.from_values([-4.6] * len(tokens), "float32"),
        policy_version=version,
        drafter_version=-1,
        reward=reward,
        finish_reason="eos",
        worker_id="w0",
    )


@contextlib.asynccontextmanager
async def service(
    config: Config, run_dir: Path, init_policy: Path, more: dict[str, object] | None = None
) -> AsyncIterator[LearnerService]:
    """A learner on groups of 2 with staleness 1 at lr 1e-2, and the settings `more` (dotted keys)."""
    redis = connect_redis(config.bus.redis_url)
    control = ControlPlane(config, redis, role="learner", owns=["policy"])
    stop = asyncio.Event()
    plane = asyncio.create_task(control.run(stop))
    values = {"learner.groups_per_step": 2, "policy.max_staleness": 1, "learner.lr": 1e-2, **(more or {})}
    try:
        async with asyncio.timeout(20):
            await control.connected.wait()
        yield LearnerService(override(config, values), redis, control, run_dir=run_dir, init_policy=init_policy)
    finally:
        stop.set()
        await asyncio.wait_for(plane, timeout=15)
        await redis.aclose()


async def one_update(config: Config, run_dir: Path, init_policy: Path) -> tuple[list[str], set[str]]:
    """A learner of the run applies one update: the groups its checkpoint says it trained, and its ledger (read
    back from the checkpoint on disk, not from the service)."""
    from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint

    async with service(config, run_dir, init_policy) as learner:
        await learner.start()
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
    found = latest_checkpoint(run_dir / "checkpoints")
    assert found is not None and found.step == 1
    ledger, meta = restore_checkpoint(found, restore_rng=False)
    return sorted(meta["extra"]["trained_groups"]), set(ledger)


async def test_updates_are_checkpointed_acked_published_and_never_applied_twice(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    run_dir = tmp_path / "run"
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    async with service(bus_config, run_dir, init_policy) as learner:
        assert (await learner.start()).version == 0
        messages = [sample(t, i, float(i == 0)) for t in ("a", "b", "c", "d") for i in (0, 1)]
        await producer.send("samples", [*messages[:3], messages[0], *messages[3:]])  # "a/0" delivered twice
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=2)
        assert learner.version == 2
        assert learner.intake.assembler.ledger == {m.sample_id for m in messages}
        assert learner.intake.assembler.duplicates == 1
        mirror = await read_mirror(redis, keys)
        published = mirror["policy"]
        assert published.version == 2
        assert published.sha256 == directory_sha256(published.location, scheme=published.digest)
        pending = await redis.xpending(keys.stream("samples"), "learner")
        assert pending["pending"] == 0, "every entry the updates used (and the duplicate) is acked"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["version"] for line in lines] == [1, 2] and lines[0]["groups"] == 2.0
    stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("stats"))]
    assert [s.policy_version for s in stats if s.kind == "learner"] == [1, 2]

    # A restarted learner resumes at version 2 with the same ledger; a late redelivery changes nothing.
    async with service(bus_config, run_dir, init_policy) as again:
        assert (await again.start()).version == 2
        assert again.intake.assembler.ledger == {m.sample_id for m in messages}
        await producer.send("samples", [messages[5]])
        async with asyncio.timeout(30):
            while again.intake.assembler.duplicates < 1:
                stop = asyncio.Event()
                task = asyncio.create_task(again.run(stop))
                await asyncio.sleep(0.5)
                stop.set()
                await task
        assert again.version == 2
        assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    await redis.aclose()


async def test_each_update_records_what_the_planner_replays(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """metrics.jsonl keeps every trained sample's length and reward in its groups' order, so `tlt-stream plan`
    and `bench/plan_check.py` can replay the run group by group (`plan.lengths.replay_groups`): a group with a
    signal trains all its tokens, one whose rewards are all equal none."""
    from tlt_stream.plan.lengths import replay_groups

    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, Keys(bus_config.run), bus_config.bus)
    sent = {"s000001-0001": (1.0, 0.0), "s000001-0000": (0.5, 0.5)}  # dispatched second, first (one degenerate)
    await producer.send("samples", [sample(t, i, r) for t, rewards in sent.items() for i, r in enumerate(rewards)])
    async with service(bus_config, run_dir, init_policy) as learner:
        await learner.start()
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
    (line,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert line["rewards"] == [r for t in line["trained_groups"] for r in sent[t]]
    assert line["response_lens"] == [4, 4, 4, 4] and line["trained_tokens"] == 8.0
    assert replay_groups([line]) == (((4, 4), 0.0), ((4, 4), 1.0))  # in dispatch order: -0000 first
    await redis.aclose()


async def test_a_policy_published_in_bf16_is_what_workers_get_and_a_restart_resumes_the_fp32_masters(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, Keys(bus_config.run), bus_config.bus)
    async with service(bus_config, run_dir, init_policy, {"rollout.dtype": "bfloat16"}) as learner:
        await learner.start()
        await producer.send("samples", [sample(t, i, float(i == 0)) for t in ("a", "b") for i in (0, 1)])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
        assert learner.checkpoints.core is not None
        masters = {k: v.clone() for k, v in learner.checkpoints.core.model.state_dict().items()}
        published = (await read_mirror(redis, Keys(bus_config.run)))["policy"]
    await redis.aclose()
    assert published.version == 1
    weights = load_file(Path(published.location) / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert any(not torch.equal(masters[k].to(torch.bfloat16).float(), masters[k]) for k in weights), (
        "the update left weights that bf16 cannot hold: the masters carry more than the published copy"
    )
    async with service(bus_config, run_dir, init_policy, {"rollout.dtype": "bfloat16"}) as again:
        assert (await again.start()).version == 1
        assert again.checkpoints.core is not None
        resumed = again.checkpoints.core.model.state_dict()
        assert all(torch.equal(resumed[k], v) for k, v in masters.items()), "resumed from fp32 masters, exactly"


async def test_each_updates_figures_and_samples_reach_tensorboard_and_offline_wandb(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    from tests.tracking_files import tensorboard_scalars, tensorboard_texts, wandb_history
    from tlt_stream.basics.config import override

    config = override(bus_config, {"learner.log_to": ("tensorboard", "wandb")})
    run_dir = tmp_path / "run"
    redis = connect_redis(config.bus.redis_url)
    producer = StreamProducer(redis, Keys(config.run), config.bus)
    async with service(config, run_dir, init_policy) as learner:
        await learner.start()
        await producer.send("samples", [sample(t, i, float(i == 0)) for t in ("a", "b", "c", "d") for i in (0, 1)])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=2)
        learner.close_trackers()
    await redis.aclose()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    board = tensorboard_scalars(run_dir / "tensorboard" / "learner")
    history = wandb_history(run_dir)
    for key in ("reward_mean", "loss", "grad_norm", "logprob_mismatch_mean"):
        expected = {row["version"]: row[key] for row in rows}
        assert board[key] == pytest.approx(expected, rel=1e-6), key  # TensorBoard keeps float32
        assert {v: history[v][key] for v in expected} == expected, key
    logged = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    texts = tensorboard_texts(run_dir / "tensorboard" / "learner")
    assert set(texts) == {1, 2} and all(row["sample_id"] in texts[row["version"]] for row in logged)
    assert all(history[v]["samples/nrows"] == 2 for v in (1, 2)), "learner.log_samples rows per step"


async def test_the_learner_entrypoint_runs_as_its_own_process(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    import os
    import sys

    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    await producer.send("samples", [sample("a", 0, 1.0), sample("a", 1, 0.0)])
    env = {**os.environ, "TLT_REDIS_URL": bus_config.bus.redis_url, "TLT_MQTT_URL": bus_config.bus.mqtt_url}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).parents[2] / "services" / "learner.py"),
        *("--run", bus_config.run, "--run-dir", str(tmp_path / "run"), "--policy", str(init_policy)),
        *("--groups-per-step", "1", "--max-updates", "1"),
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert "stopped at policy version 1" in stderr.decode()
    assert (await read_mirror(redis, keys))["policy"].version == 1
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    await redis.aclose()


async def test_a_learner_process_killed_between_updates_resumes_with_the_same_ledger(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """SIGKILL after update 1 while group "b" is half read (pending); a restart applies "b" once, as update 2."""
    import os
    import signal
    import sys

    from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint

    keys = Keys(bus_config.run)
    stream = keys.stream("samples")
    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    env = {**os.environ, "TLT_REDIS_URL": bus_config.bus.redis_url, "TLT_MQTT_URL": bus_config.bus.mqtt_url}
    processes: list[asyncio.subprocess.Process] = []
    logs: list[Path] = []

    async def start(*extra: str) -> asyncio.subprocess.Process:
        logs.append(tmp_path / f"learner-{len(logs)}.log")
        with logs[-1].open("wb") as log_file:  # a file, not a pipe: nobody drains the killed process's stderr
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(Path(__file__).parents[2] / "services" / "learner.py"),
                *("--run", bus_config.run, "--run-dir", str(run_dir), "--policy", str(init_policy)),
                *("--groups-per-step", "1", *extra),
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log_file,
            )
        processes.append(process)
        return process

    def metrics_versions() -> list[int]:
        path = run_dir / "metrics.jsonl"
        complete = path.read_text().split("\n")[:-1] if path.exists() else []  # a torn last line is not a line
        return [json.loads(line)["version"] for line in complete]

    async def mirrored_version() -> int:
        policy = (await read_mirror(redis, keys)).get("policy")
        return policy.version if policy is not None else -1

    async def pending_ids() -> list[str]:
        rows = await redis.xpending_range(stream, "learner", min="-", max="+", count=100)
        return [r["message_id"].decode() if isinstance(r["message_id"], bytes) else r["message_id"] for r in rows]

    async def until(process: asyncio.subprocess.Process, what: str, condition: Callable[[], Awaitable[bool]]) -> None:
        while not await condition():
            assert process.returncode is None, (
                f"learner exited ({process.returncode}) before {what}: " + logs[-1].read_text()[-2000:]
            )
            await asyncio.sleep(0.1)

    def checkpointed() -> tuple[int, set[str]]:
        found = latest_checkpoint(run_dir / "checkpoints")
        assert found is not None
        ledger, _ = restore_checkpoint(found, restore_rng=False)  # verifies the policy sha256 too
        return found.step, ledger

    a0, a1 = sample("a", 0, 1.0), sample("a", 1, 0.0)
    b0, b1 = sample("b", 0, 1.0, version=1), sample("b", 1, 0.0, version=1)  # generated on policy version 1
    try:
        update_1 = await producer.send("samples", [a0, a1])
        first = await start()

        # metrics.jsonl is the update's last write: all of update 1 is done; its entries stay pending until the
        # next checkpoint (acked one checkpoint behind, so a damaged newest checkpoint loses nothing).
        async def updated_once() -> bool:
            return metrics_versions() == [1] and await mirrored_version() == 1 and await pending_ids() == update_1

        async with asyncio.timeout(90):
            await until(first, "update 1", updated_once)

        # A redelivered "a/0", then half of group "b": the learner acks the duplicate and holds "b/0" un-acked.
        _, b0_entry = await producer.send("samples", [a0, b0])

        async def holding_b0() -> bool:  # delivered in order, so "a/0" was read (and acked) before "b/0"
            return await pending_ids() == [*update_1, b0_entry]

        async with asyncio.timeout(30):
            await until(first, "it read b/0", holding_b0)
        first.kill()
        assert await first.wait() == -signal.SIGKILL
        assert checkpointed() == (1, {"a/0", "a/1"})
        assert await pending_ids() == [*update_1, b0_entry], "the dead consumer still holds b/0"

        # Another late copy of an applied sample, the rest of "b"; the restart exits on its own after one update.
        await producer.send("samples", [a1, b1])
        second = await start("--max-updates", "1")
        async with asyncio.timeout(120):
            returncode = await second.wait()
        log_text = logs[-1].read_text()
        assert returncode == 0, log_text[-2000:]
        assert "stopped at policy version 2" in log_text

        assert checkpointed() == (2, {"a/0", "a/1", "b/0", "b/1"}), "nothing lost, nothing counted twice"
        assert metrics_versions() == [1, 2], "each version applied (and logged) exactly once"
        stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("stats"))]
        assert [s.policy_version for s in stats if s.kind == "learner"] == [1, 2]
        assert (await redis.xpending(stream, "learner"))["pending"] == 0, "b/0's redelivery and both copies acked"
        published = (await read_mirror(redis, keys))["policy"]
        assert published.version == 2
        assert published.sha256 == directory_sha256(published.location, scheme=published.digest)
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
        await redis.aclose()


async def test_a_sample_held_past_the_reclaim_time_survives_a_restart(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """A group stays open for many reclaim periods (the long tail); the learner is stopped (SIGTERM sets this
    stop event) and started again. Before held entries were tracked, its own reclaim handed the waiting
    sample back, it was taken for a duplicate and acked, and the restarted learner waited forever."""
    import msgspec

    config = msgspec.structs.replace(bus_config, bus=msgspec.structs.replace(bus_config.bus, reclaim_idle_ms=300))
    keys = Keys(config.run)
    stream = keys.stream("samples")
    run_dir = tmp_path / "run"
    redis = connect_redis(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)
    (a0_entry,) = await producer.send("samples", [sample("a", 0, 1.0)])
    async with service(config, run_dir, init_policy) as learner:
        await learner.start()
        stop = asyncio.Event()
        running = asyncio.create_task(learner.run(stop))
        await asyncio.sleep(3.0)  # ten reclaim periods with "a/0" alone in an open group
        stop.set()
        await asyncio.wait_for(running, timeout=30)
        assert learner.intake.assembler.redelivered == 0, "its own held entry was never handed back"
    rows = await redis.xpending_range(stream, "learner", min="-", max="+", count=10)
    assert [(r["message_id"].decode(), r["times_delivered"]) for r in rows] == [(a0_entry, 1)], "still pending"

    await producer.send("samples", [sample("a", 1, 0.0), sample("b", 0, 1.0), sample("b", 1, 0.0)])
    assert await one_update(config, run_dir, init_policy) == (["a", "b"], {"a/0", "a/1", "b/0", "b/1"})
    assert (await redis.xpending(stream, "learner"))["pending"] == 0
    await redis.aclose()


async def test_poison_samples_are_dead_lettered_and_the_learner_trains_on(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Samples that decode but must not be trained on: each goes to `dead` with its reason, read back from
    Redis, and the good groups are trained on as if the poison had never come."""
    import math

    import msgspec

    from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint

    keys = Keys(bus_config.run)
    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    vocab = json.loads((init_policy / "config.json").read_text())["vocab_size"]
    good = [sample(t, i, float(i == 0)) for t in ("a", "b") for i in (0, 1)]
    poison = {
        "reward": msgspec.structs.replace(sample("p", 0, 1.0), reward=math.nan),
        "vocabulary": msgspec.structs.replace(
            sample("q", 0, 1.0),
            token_ids=Tensor.from_values([3, vocab + 5], "int32"),
            logprobs=Tensor.from_values([-1.0, -1.0], "float32"),
        ),
        "newer": sample("r", 0, 1.0, version=7),
        "group": msgspec.structs.replace(sample("a", 1, 0.0), sample_id="a/1", group_size=3),
    }
    # "a/1" with the wrong group size arrives after "a/0" and before the real "a/1".
    await producer.send("samples", [good[0], poison["group"], poison["reward"], poison["vocabulary"], poison["newer"]])
    await producer.send("samples", good[1:])
    async with service(bus_config, run_dir, init_policy) as learner:
        await learner.start()
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
    reasons = sorted(d.reason for d in dead)
    assert len(dead) == 4 and all(d.stream == "samples" and d.origin == "learner/learner" for d in dead)
    assert any("not finite" in r for r in reasons) and any("outside the policy's vocabulary" in r for r in reasons)
    assert any("newer than the newest published" in r for r in reasons) and any("task a said 2" in r for r in reasons)
    assert int(await redis.hget(keys.dead_counts, "samples")) == 4
    found = latest_checkpoint(run_dir / "checkpoints")
    assert found is not None and found.step == 1
    ledger, _ = restore_checkpoint(found, restore_rng=False)
    assert ledger == {"a/0", "a/1", "b/0", "b/1"}
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    await redis.aclose()


async def test_a_bit_flipped_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    from tlt_stream.rl.checkpoint import complete_checkpoints, latest_checkpoint, restore_checkpoint

    run_dir = tmp_path / "run"
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    async with service(bus_config, run_dir, init_policy) as learner:
        await learner.start()
        await producer.send("samples", [sample(t, i, float(i == 0)) for t in ("a", "b", "c", "d") for i in (0, 1)])
        stop = asyncio.Event()  # stopped as SIGTERM stops it, not by finishing its updates
        running = asyncio.create_task(learner.run(stop))
        async with asyncio.timeout(60):
            while learner.version < 2:  # noqa: ASYNC110 (the service's state, polled)
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(running, timeout=30)
    newest = latest_checkpoint(run_dir / "checkpoints")
    assert newest is not None and newest.step == 2
    weights = newest.policy_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of one weight
    weights.write_bytes(bytes(data))
    async with service(bus_config, run_dir, init_policy) as restarted:
        await restarted.start()
        assert restarted.version == 1 and restarted.intake.assembler.ledger == {"a/0", "a/1", "b/0", "b/1"}
        assert [p.name.startswith("corrupt-step-00000002") for p in (run_dir / "checkpoints").iterdir()].count(
            True
        ) == 1
        # The discarded update's samples were still pending (acked only after the next checkpoint): trained again.
        async with asyncio.timeout(60):
            await restarted.run(asyncio.Event(), max_updates=1)
    found = latest_checkpoint(run_dir / "checkpoints")
    assert found is not None and found.step == 2
    ledger, meta = restore_checkpoint(found, restore_rng=False)
    assert ledger == {f"{t}/{i}" for t in "abcd" for i in (0, 1)} and sorted(meta["extra"]["trained_groups"]) == [
        "c",
        "d",
    ]
    assert [c.step for c in complete_checkpoints(run_dir / "checkpoints")] == [0, 1, 2]
    assert found.policy_sha256 == newest.policy_sha256, "the update redone from the same state is the same update"
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    await redis.aclose()


@pytest.mark.parametrize("bad", ["poison", "undecodable"])
async def test_a_group_with_a_bad_member_is_trained_without_it(
    bad: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """On-policy, a group that never completes stalls the run. Its member c/1 is bad: poison (a NaN reward,
    valid on the wire), or undecodable (a field out of its range: a worker once streamed a negative
    `accept_length`), which the reader itself dead-letters. Either way it is dead-lettered, its group is
    trained on its other member, and nothing stays pending (read back from the checkpoint, `dead` and the
    PEL). An entry that is not msgpack at all names no member: it goes to `dead` and changes nothing."""
    import math

    import msgspec

    keys = Keys(bus_config.run)
    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    field = {"reward": math.nan} if bad == "poison" else {"accept_length": -2.5}  # encoding does not validate
    member = msgspec.structs.replace(sample("c", 1, 0.0), **field)
    # Group d's members are both bad: nothing of it can train, and it is recorded as lost (`Keys.lost`) for the
    # policy service to send another prompt in its place (tests/integration/test_lost_groups.py).
    lost = [msgspec.structs.replace(sample("d", i, 0.0), **field) for i in range(2)]
    await producer.send("samples", [sample("a", 0, 1.0), sample("c", 0, 1.0), member, *lost, sample("a", 1, 0.0)])
    if bad == "undecodable":
        await redis.xadd(keys.stream("samples"), {b"m": b"\xc1 not msgpack"})
    assert await one_update(bus_config, run_dir, init_policy) == (["a", "c"], {"a/0", "a/1", "c/0"})
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
    assert dead[0].payload == codec_for("samples").encode(member), "the entry as it came, in `dead`"
    reason = "invalid sample" if bad == "poison" else "undecodable samples entry"
    assert len(dead) == (3 if bad == "poison" else 4) and all(reason in d.reason for d in dead)
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    assert await redis.hgetall(keys.lost) == {b"d": str(lost[0].step).encode()}
    await redis.aclose()


@pytest.mark.parametrize("bad", ["poison", "undecodable"])
async def test_a_learner_restarted_after_a_members_dead_letter_still_completes_its_group(
    bad: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """A learner dead-letters c/1 and d/0 (bad: poison or undecodable) and is stopped before their groups
    complete; their entries are acked and never come back. The next learner of the run still counts them:
    c is trained on c/0 alone and d, whose d/1 is bad too, is recorded as lost. Without that, group c waited
    for ever and d was never replaced. Evidence: the checkpoint's ledger, `dead`, `lost`, the PEL."""
    import math

    import msgspec

    keys = Keys(bus_config.run)
    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    field = {"reward": math.nan} if bad == "poison" else {"accept_length": -2.5}  # encoding does not validate
    c1, d0, d1 = (msgspec.structs.replace(sample(t, i, 0.0), **field) for t, i in (("c", 1), ("d", 0), ("d", 1)))
    await producer.send("samples", [c1, d0])
    async with service(bus_config, run_dir, init_policy) as first:
        await first.start()
        stop = asyncio.Event()
        running = asyncio.create_task(first.run(stop))

        async def both_dead() -> bool:
            return await redis.xlen(keys.stream("dead")) == 2

        await until_redis(both_dead, "c/1 and d/0 dead-lettered")
        stop.set()
        await running
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0, "acked: never delivered again"
    assert await redis.hgetall(keys.lost) == {}
    await producer.send("samples", [sample("c", 0, 1.0), sample("a", 0, 1.0), d1, sample("a", 1, 0.0)])
    assert await one_update(bus_config, run_dir, init_policy) == (["a", "c"], {"a/0", "a/1", "c/0"})
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
    assert [d.payload for d in dead] == [codec_for("samples").encode(m) for m in (c1, d0, d1)], "each once"
    assert await redis.hgetall(keys.lost) == {b"d": str(d0.step).encode()}
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    assert await redis.hgetall(keys.dead_members) == {}, "forgotten once their groups' fates are durable"
    await redis.aclose()


async def test_a_group_an_update_leaves_behind_is_recorded_for_the_policy_service_to_send_again(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """A group still incomplete when two updates have passed it by (its first sample made by version 0, the
    learner at 2, staleness 1) is dropped by the update, not by an arriving sample; it is recorded in Redis
    all the same, so the policy service sends it again (tests/integration/test_dropped_groups.py). So is one
    whose only member so far was dead-lettered (y: poison)."""
    import math

    import msgspec

    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    async with service(bus_config, tmp_path / "run", init_policy) as learner:
        await learner.start()
        waiting = sample("x", 0, 1.0)  # its sibling never comes
        poison = msgspec.structs.replace(sample("y", 0, 1.0), reward=math.nan, step=3)  # y/1 never comes either
        await producer.send("samples", [waiting, poison])
        await producer.send("samples", [*(sample(t, i, float(i == 0)) for t in ("a", "b") for i in (0, 1))])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
        await producer.send("samples", [sample(t, i, float(i == 0), version=1) for t in ("c", "d") for i in (0, 1)])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
        assert learner.version == 2 and learner.intake.assembler.dropped_groups == 2
    assert await redis.hgetall(keys.dropped) == {b"x": str(waiting.step).encode(), b"y": b"3"}
    assert await redis.xlen(keys.stream("dead")) == 1 and await redis.hgetall(keys.dead_members) == {}
    await redis.aclose()


async def test_groups_dropped_as_too_stale_are_counted_with_their_response_lengths(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Streaming (max_staleness 1) drops a group two versions old; the next update's metrics say how many and
    how long their responses were, so a bias against long responses (the slow ones go stale) is visible."""
    import msgspec

    def long_sample(task: str, index: int, reward: float, version: int, n: int) -> Sample:
        tokens = [20 + index] * (n - 1) + [2]
        return msgspec.structs.replace(
            sample(task, index, reward, version),
            token_ids=Tensor.from_values(tokens, "int32"),
            logprobs=Tensor.from_values([-4.6] * n, "float32"),
        )

    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, Keys(bus_config.run), bus_config.bus)
    async with service(bus_config, run_dir, init_policy) as learner:
        await learner.start()
        await producer.send("samples", [sample(t, i, float(i == 0)) for t in ("a", "b") for i in (0, 1)])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
        await producer.send("samples", [sample(t, i, float(i == 0), version=1) for t in ("c", "d") for i in (0, 1)])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
        assert learner.version == 2
        stale = [long_sample("old", i, float(i == 0), version=0, n=9 + 2 * i) for i in (0, 1)]  # lengths 9, 11
        fresh = [sample(t, i, float(i == 0), version=2) for t in ("e", "f") for i in (0, 1)]
        await producer.send("samples", [*stale, *fresh])
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((learner.checkpoints.checkpoint.path / "meta.json").read_text())
    assert meta["extra"]["trained_groups"] == ["e", "f"], "the stale group was not trained"
    assert [line["stale_dropped_groups"] for line in lines] == [0.0, 0.0, 1.0]
    assert lines[2]["stale_dropped_len_mean"] == 10.0 and "stale_dropped_len_mean" not in lines[1]
    # Recorded in Redis for the policy service to send again (tests/integration/test_dropped_groups.py).
    assert await redis.hgetall(Keys(bus_config.run).dropped) == {b"old": b"0"}
    await redis.aclose()


async def test_groups_an_update_keeps_failing_on_are_dead_lettered_and_recorded_as_lost(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update that raises on its groups `bus.max_deliveries` times dead-letters them (one group must not stop
    the run); each is recorded as lost first (`Keys.lost`), so the policy service sends other prompts in their
    place and the step is not left waiting for them. Evidence: the dead letters and the record, in Redis."""
    from tlt_stream.rl.learner import LearnerCore

    def broken(self, groups):  # a fault of the update itself, before its optimizer step
        raise RuntimeError("the update cannot take these groups")

    monkeypatch.setattr(LearnerCore, "step", broken)
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    await producer.send("samples", [sample("a", 0, 1.0), sample("a", 1, 0.0), sample("c", 0, 1.0), sample("c", 1, 0.0)])
    more = {"bus.max_deliveries": 1, "learner.accumulate": False}
    async with service(bus_config, tmp_path / "run", init_policy, more) as learner:
        await learner.start()
        stop = asyncio.Event()
        running = asyncio.create_task(learner.run(stop, max_updates=1))  # never reached: every update fails
        async with asyncio.timeout(60):
            while await redis.xlen(keys.stream("dead")) < 4:  # noqa: ASYNC110 (a stream, not an event)
                await asyncio.sleep(0.1)
        stop.set()
        await running
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
    assert all("the update failed 1 times on this group" in d.reason for d in dead) and len(dead) == 4
    assert {k.decode() for k in await redis.hkeys(keys.lost)} == {"a", "c"}
    await redis.aclose()


class _Killed(BaseException):
    """The learner process dies here (nothing in the service catches it)."""


async def test_a_learner_killed_while_dead_lettering_a_lost_group_does_not_train_the_rest_of_it(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Updates keep failing on group a: it is recorded lost (its step gets another prompt) and its members go to
    `dead` one by one. The learner dies after a/0's dead letter, before a/1's. The next learner (its updates
    work) finds a/1 pending: it goes to `dead` unread, since training it too would give the step a group too
    many. Evidence: `dead`, `lost`, the PEL and the new learner's checkpoint."""
    from tlt_stream.rl.learner import LearnerCore

    real_step = LearnerCore.step

    def broken(self, groups):  # a fault of the update itself, before its optimizer step
        raise RuntimeError("the update cannot take these groups")

    keys = Keys(bus_config.run)
    run_dir = tmp_path / "run"
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    await producer.send("samples", [sample("a", 0, 1.0), sample("a", 1, 0.0), sample("c", 0, 1.0), sample("c", 1, 0.0)])
    more = {"bus.max_deliveries": 1, "learner.accumulate": False}
    monkeypatch.setattr(LearnerCore, "step", broken)
    async with service(bus_config, run_dir, init_policy, more) as first:
        await first.start()
        give_up = first.intake.reader.give_up
        calls: list[str] = []

        async def dies_at_the_second(delivery, reason):  # type: ignore[no-untyped-def]
            calls.append(delivery.message.sample_id)
            if len(calls) == 2:
                raise _Killed
            await give_up(delivery, reason)

        first.intake.reader.give_up = dies_at_the_second  # type: ignore[method-assign]
        with pytest.raises(BaseException) as died:
            async with asyncio.timeout(60):
                await first.run(asyncio.Event(), max_updates=1)
        assert died.group_contains(_Killed) if isinstance(died.value, BaseExceptionGroup) else died.type is _Killed
    lost_task = calls[0].split("/")[0]
    assert calls == [f"{lost_task}/0", f"{lost_task}/1"]
    assert {k.decode() for k in await redis.hkeys(keys.lost)} == {lost_task}, "recorded before the dead letters"
    monkeypatch.setattr(LearnerCore, "step", real_step)  # the next learner's updates work
    other = "c" if lost_task == "a" else "a"
    await producer.send("samples", [sample("e", 0, 1.0), sample("e", 1, 0.0)])
    assert await one_update(override(bus_config, {"learner.accumulate": False}), run_dir, init_policy) == (
        sorted([other, "e"]),
        {f"{other}/0", f"{other}/1", "e/0", "e/1"},
    )
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("dead"))]
    by_sample = {codec_for("samples").decode(d.payload).sample_id: d.reason for d in dead}
    assert set(by_sample) == {f"{lost_task}/0", f"{lost_task}/1"}
    assert "the update failed 1 times" in by_sample[f"{lost_task}/0"]
    assert "recorded lost" in by_sample[f"{lost_task}/1"]
    assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    await redis.aclose()


async def test_a_refused_entry_claiming_an_endless_group_is_not_kept(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """A samples entry the reader refuses (it does not decode) that claims a group of 2**40 members is not kept
    as a dead member: a restarted learner would count through its siblings before reading anything."""
    import msgspec

    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    bogus = {"sample_id": "z/0", "task_id": "z", "index": 0, "group_size": 2**40, "policy_version": 0, "step": 0}
    await redis.xadd(keys.stream("samples"), {b"m": msgspec.msgpack.encode(bogus)})
    await StreamProducer(redis, keys, bus_config.bus).send("samples", [sample("a", 0, 1.0), sample("a", 1, 0.0)])
    async with service(bus_config, tmp_path / "run", init_policy, {"learner.groups_per_step": 1}) as learner:
        await learner.start()
        async with asyncio.timeout(60):
            await learner.run(asyncio.Event(), max_updates=1)
    assert await redis.xlen(keys.stream("dead")) == 1
    assert await redis.hgetall(keys.dead_members) == {}
    await redis.aclose()

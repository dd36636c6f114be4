"""`tlt-stream learner` under torchrun with 2 gloo ranks, over real streams: the same ledger and weights as one
process, and a rank killed mid-update loses nothing and repeats nothing (sample ids counted in Redis and in
the checkpoint ledger)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest
import redis.asyncio as aioredis
import torch
from safetensors.torch import load_file

from tests.integration.test_learner_service import sample
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint
from tlt_stream.store.digest import directory_sha256

pytestmark = [
    pytest.mark.redis,
    pytest.mark.mqtt,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TLT_TEST_DISTRIBUTED") != "1",
        reason="torchrun services over real streams take minutes on 2 cores, past CI's 20-minute budget: "
        "TLT_TEST_DISTRIBUTED=1 runs them (the 2-rank equality itself, tests/unit/test_sharded_learner.py, runs in CI)",
    ),
]

ROOT = Path(__file__).parents[2]


async def learner(
    config: Config, run_dir: Path, init_policy: Path, log: Path, *extra: str, ranks: int
) -> asyncio.subprocess.Process:
    """The learner as a user starts it: `torchrun --nproc-per-node N services/learner.py ...` (N > 1), or
    plainly; its log in a file, since nobody drains a killed process's pipe."""
    env = {**os.environ, "TLT_REDIS_URL": config.bus.redis_url, "TLT_MQTT_URL": config.bus.mqtt_url}
    env.update(TLT_RUN=config.run, OMP_NUM_THREADS="1")  # torchrun's parser would take --run for its --run-path
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(
            *launch,
            str(ROOT / "services" / "learner.py"),
            *("--run-dir", str(run_dir), "--policy", str(init_policy)),
            *("--groups-per-step", "1", "--lr", "1e-2", *extra),
            env=env,
            cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=out,
        )


def checkpointed(run_dir: Path) -> tuple[int, set[str]]:
    found = latest_checkpoint(run_dir / "checkpoints")
    assert found is not None
    ledger, _ = restore_checkpoint(found, restore_rng=False)  # verifies the policy's sha256 too
    return found.step, ledger


def metrics_versions(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line)["version"] for line in complete]


async def test_two_ranks_under_torchrun_train_what_one_process_trains(
    one_backend: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    import msgspec

    from tlt_stream.bus.connect import purge_run

    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    messages = [sample(t, i, float(i == 0)) for t in ("a", "b") for i in (0, 1)]
    runs = {}
    try:
        for ranks in (1, 2):
            config = msgspec.structs.replace(bus_config, run=f"{bus_config.run}x{ranks}")  # its own streams
            keys = Keys(config.run)
            await StreamProducer(redis, keys, config.bus).send("samples", messages)
            run_dir = tmp_path / f"ranks-{ranks}"
            log = tmp_path / f"ranks-{ranks}.log"
            process = await learner(
                config, run_dir, init_policy, log, "--max-updates", "2", "--max-staleness", "1", ranks=ranks
            )
            async with asyncio.timeout(240):
                code = await process.wait()
            assert code == 0, log.read_text()[-3000:]
            assert checkpointed(run_dir) == (2, {m.sample_id for m in messages})
            assert metrics_versions(run_dir) == [1, 2]
            assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
            published = (await read_mirror(redis, keys))["policy"]
            assert published.version == 2
            assert published.sha256 == directory_sha256(published.location, scheme=published.digest)
            runs[ranks] = load_file(Path(published.location) / "model.safetensors")
            await purge_run(config)
    finally:
        await redis.aclose()
    one, two = runs[1], runs[2]
    assert set(one) == set(two)
    moved = max(float((one[k] - load_file(init_policy / "model.safetensors")[k]).abs().max()) for k in one)
    assert moved > 1e-3, "the updates moved the weights"
    for key in one:
        assert torch.allclose(one[key], two[key], rtol=1e-5, atol=1e-6), key


async def test_a_rank_killed_mid_update_loses_and_repeats_nothing(
    one_backend: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Update 1 lands; rank 1 is frozen, group "b" arrives and rank 0 starts update 2, which cannot finish
    without rank 1; rank 1 is killed. torchrun ends the run; a restart applies "b" once, as update 2."""
    keys = Keys(bus_config.run)
    stream = keys.stream("samples")
    run_dir = tmp_path / "run"
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    processes: list[asyncio.subprocess.Process] = []

    async def pending_ids() -> list[str]:
        rows = await redis.xpending_range(stream, "learner", min="-", max="+", count=100)
        return [r["message_id"].decode() if isinstance(r["message_id"], bytes) else r["message_id"] for r in rows]

    async def until(what: str, condition: Callable[[], Awaitable[bool]]) -> None:
        while not await condition():
            assert processes[-1].returncode is None, f"the learner exited before {what}: see {log}"
            await asyncio.sleep(0.1)

    def rank_process(rank: int) -> psutil.Process:
        for child in psutil.Process(processes[-1].pid).children(recursive=True):
            if child.environ().get("RANK") == str(rank) and "learner.py" in " ".join(child.cmdline()):
                return child
        raise AssertionError(f"no rank {rank} under torchrun")

    a0, a1 = sample("a", 0, 1.0), sample("a", 1, 0.0)
    b0, b1 = sample("b", 0, 1.0, version=1), sample("b", 1, 0.0, version=1)
    try:
        update_1 = await producer.send("samples", [a0, a1])
        log = tmp_path / "first.log"
        processes.append(await learner(bus_config, run_dir, init_policy, log, ranks=2))

        async def updated_once() -> bool:
            return metrics_versions(run_dir) == [1] and await pending_ids() == update_1

        async with asyncio.timeout(180):
            await until("update 1", updated_once)
        follower = rank_process(1)
        follower.suspend()  # SIGSTOP: update 2's first collective cannot complete
        update_2 = await producer.send("samples", [b0, b1])

        async def holding_b() -> bool:
            return await pending_ids() == [*update_1, *update_2]

        async with asyncio.timeout(60):
            await until("it read group b", holding_b)
        await asyncio.sleep(1.0)  # rank 0 is in update 2, waiting on the frozen rank
        assert checkpointed(run_dir) == (1, {"a/0", "a/1"})
        follower.kill()
        async with asyncio.timeout(120):
            code = await processes[-1].wait()
        assert code != 0
        assert checkpointed(run_dir) == (1, {"a/0", "a/1"}), "update 2 was not committed"
        assert await pending_ids() == [*update_1, *update_2], "nothing acked past the checkpoint"

        log = tmp_path / "second.log"
        processes.append(await learner(bus_config, run_dir, init_policy, log, "--max-updates", "1", ranks=2))
        async with asyncio.timeout(240):
            code = await processes[-1].wait()
        assert code == 0, log.read_text()[-3000:]
        assert "stopped at policy version 2" in log.read_text()
        assert checkpointed(run_dir) == (2, {"a/0", "a/1", "b/0", "b/1"}), "nothing lost, nothing counted twice"
        assert metrics_versions(run_dir) == [1, 2], "each version applied (and logged) exactly once"
        assert (await redis.xpending(stream, "learner"))["pending"] == 0
        stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("stats"))]
        assert [(s.policy_version, s.samples) for s in stats if s.kind == "learner"] == [(1, 2), (2, 2)]
        assert (await read_mirror(redis, keys))["policy"].version == 2
    finally:
        for process in processes:
            if process.returncode is None:
                process.send_signal(signal.SIGKILL)
                await process.wait()
        await redis.aclose()


async def test_two_ranks_accumulating_under_torchrun_train_every_group_once_to_one_batch_process(
    one_backend: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """learner.accumulate on 2 gloo ranks against a one-process batch learner, on the same synchronous run:
    3 groups a step of 3 samples with varied lengths (so rank 0 deals uneven shares and a rank tops its share
    up with idle rounds), one degenerate group (nothing to deal); step 1's groups sent one at a time, step 2's
    at once. The ranks end cleanly (a round one rank missed would hang the other until the collective
    timeout, then fail the run), every group is trained once (sample ids sent, in the checkpoints' ledgers,
    none pending or dead in Redis), in its step, and the weights agree within the bound of
    tests/integration/test_accumulated_learner.py."""
    import random

    import msgspec

    from tests.faults.audit import read_checkpoints
    from tests.integration.test_accumulated_learner import LR, PER_STEP, assert_the_batch_update, step_groups
    from tlt_stream.bus.connect import purge_run

    steps = 2
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    runs = {}
    try:
        for ranks, accumulate in ((1, False), (2, True)):
            config = msgspec.structs.replace(bus_config, run=f"{bus_config.run}x{ranks}")  # its own streams
            keys = Keys(config.run)
            producer = StreamProducer(redis, keys, config.bus)
            run_dir = tmp_path / f"ranks-{ranks}"
            log = tmp_path / f"ranks-{ranks}.log"
            flags = ["--max-updates", str(steps), "--max-staleness", "0", "--groups-per-step", str(PER_STEP)]
            flags += ["--lr", str(LR), "--set", "learner.micro_batch_tokens=24"]
            flags += ["--set", f"learner.accumulate={str(accumulate).lower()}"]
            process = await learner(config, run_dir, init_policy, log, *flags, ranks=ranks)
            rng = random.Random(7)
            sent: set[str] = set()
            try:
                for step in range(steps):
                    async with asyncio.timeout(240):
                        while (published := (await read_mirror(redis, keys)).get("policy")) is None or (
                            published.version < step
                        ):
                            assert process.returncode is None, log.read_text()[-3000:]
                            await asyncio.sleep(0.2)
                    for group in step_groups(step, rng):
                        await producer.send("samples", group)
                        sent |= {s.sample_id for s in group}
                        if step == 0:
                            await asyncio.sleep(1.0)  # arrivals spread out: the ranks add groups one at a time
                async with asyncio.timeout(240):
                    code = await process.wait()
            finally:
                if process.returncode is None:
                    process.send_signal(signal.SIGKILL)
                    await process.wait()
            assert code == 0, log.read_text()[-3000:]
            points, set_aside = read_checkpoints(run_dir / "checkpoints")
            assert not set_aside and [p.step for p in points] == list(range(steps + 1))
            assert points[-1].ledger == sent, "every sample sent is in the ledger"
            for point in points[1:]:
                assert point.trained_groups == tuple(f"s{point.step - 1}-g{g}" for g in range(PER_STEP))
            trained = [g for p in points for g in p.trained_groups]
            assert len(trained) == len(set(trained)) == steps * PER_STEP, "every group trained once"
            assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
            assert await redis.xlen(keys.stream("dead")) == 0
            assert metrics_versions(run_dir) == list(range(1, steps + 1))
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert all(("accumulate_seconds" in row) == accumulate for row in rows), "the steps were accumulated"
            runs[ranks] = points
            await purge_run(config)
    finally:
        await redis.aclose()
    assert_the_batch_update(runs[1], runs[2], "2 ranks accumulating")

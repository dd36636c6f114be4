"""An outage longer than the retry budget: the service exits non-zero with one clear line, and once Redis is
back a restart resumes from its checkpoint and its pending entries.

Runs the learner as its own process against a private redis-server (append-only, fsync always) that the
test kills, with `bus.redis_retries` small so the budget runs out in seconds rather than minutes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.faults.harness import wait_listening
from tests.ports import free_port
from tlt_stream.basics.config import BusConfig
from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]

ROOT = Path(__file__).resolve().parents[2]


async def start_redis(port: int, data: Path) -> asyncio.subprocess.Process:
    log = data / "redis.log"
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)),
            *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
            stdout=out,
            stderr=out,
        )
    await wait_listening(port, process, log, timeout=10.0)
    return process


def learner_env(url: str, run: str, **settings: str) -> dict[str, str]:
    """The environment of a learner process on `url` (no MQTT URL: it starts an embedded broker of its own),
    none of the caller's TLT_ settings, `settings` as TLT_ variables."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TLT_")},
        "TLT_REDIS_URL": url,
        "TLT_RUN": run,
        **settings,
        "PYTHONPATH": str(ROOT),
    }


def sample(task: str, index: int) -> Sample:
    return Sample(
        sample_id=f"{task}/{index}",
        task_id=task,
        prompt_id=task,
        index=index,
        group_size=2,
        prompt_ids=[5, 6, 7],
        token_ids=Tensor.from_values([10 + index, 11, 2], "int32"),
        logprobs=Tensor.from_values([-4.6] * 3, "float32"),
        policy_version=0,
        drafter_version=-1,
        reward=float(index),
        finish_reason="eos",
        worker_id="w0",
    )


async def test_an_outage_past_the_retry_budget_exits_with_one_line_and_a_restart_resumes(
    tmp_path: Path, init_policy: Path
) -> None:
    from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    (tmp_path / "redis").mkdir()
    server = await start_redis(port, tmp_path / "redis")
    run_dir = tmp_path / "run"
    settings = {"TLT_BUS__REDIS_RETRIES": "2", "TLT_BUS__HEARTBEAT_S": "0.5", "TLT_BUS__HEARTBEAT_TTL_S": "2"}
    env = learner_env(url, "outage", **settings)
    argv = [sys.executable, "-m", "services.learner", "--run-dir", str(run_dir), "--policy", str(init_policy)]
    argv += ["--groups-per-step", "1"]

    async def learner(*extra: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv, *extra, env=env, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )

    redis = aioredis.Redis.from_url(url)
    keys = Keys("outage")
    first = await learner()
    try:
        async with asyncio.timeout(120):
            while latest_checkpoint(run_dir / "checkpoints") is None or not await redis.exists(keys.versions):
                assert first.returncode is None
                await asyncio.sleep(0.2)
        first_checkpoint = (latest_checkpoint(run_dir / "checkpoints").path / "meta.json").read_bytes()
        await redis.aclose()
        server.kill()  # longer than the budget: it never comes back while the learner waits
        await server.wait()
        async with asyncio.timeout(120):
            _, stderr = await first.communicate()
        text = stderr.decode()
        assert first.returncode == 3, text[-3000:]
        assert "unreachable past the retry budget" in text.strip().splitlines()[-1], text[-3000:]
        assert "Traceback" not in text, text[-3000:]

        server = await start_redis(port, tmp_path / "redis")  # back, with its append-only file
        redis = aioredis.Redis.from_url(url)
        await StreamProducer(redis, keys, BusConfig(redis_url=url)).send("samples", [sample("a", 0), sample("a", 1)])
        second = await learner("--max-updates", "1")
        async with asyncio.timeout(180):
            _, stderr = await second.communicate()
        text = stderr.decode()
        assert second.returncode == 0, text[-3000:]
        assert (run_dir / "checkpoints" / "step-00000000" / "meta.json").read_bytes() == first_checkpoint, (
            "the restart resumed from the checkpoint the first one wrote (a fresh start would rewrite it)"
        )
        found = latest_checkpoint(run_dir / "checkpoints")
        assert found is not None and found.step == 1
        assert restore_checkpoint(found, restore_rng=False)[0] == {"a/0", "a/1"}
        assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
    finally:
        for process in (first, server):
            if process.returncode is None:
                process.kill()
                await process.wait()
        await redis.aclose()


async def test_a_service_stopped_during_an_outage_exits_at_once_with_one_line(
    tmp_path: Path, init_policy: Path
) -> None:
    """SIGTERM while Redis is gone: the learner does not ride the outage out first (retries here are all but
    endless), it exits 0 with one line saying what was not drained, and nothing it had trained is lost."""
    from tlt_stream.rl.checkpoint import latest_checkpoint

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    (tmp_path / "redis").mkdir()
    server = await start_redis(port, tmp_path / "redis")
    run_dir = tmp_path / "run"
    env = learner_env(url, "stop-in-outage", TLT_BUS__REDIS_RETRIES="100000")
    argv = [sys.executable, "-m", "services.learner", "--run-dir", str(run_dir), "--policy", str(init_policy)]
    learner = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    redis = aioredis.Redis.from_url(url)
    seen: list[str] = []
    try:
        async with asyncio.timeout(120):
            while latest_checkpoint(run_dir / "checkpoints") is None or not await redis.exists(
                Keys("stop-in-outage").versions
            ):
                assert learner.returncode is None
                await asyncio.sleep(0.2)
        await redis.aclose()
        server.kill()
        await server.wait()
        assert learner.stderr is not None
        async with asyncio.timeout(120):  # the learner riding the outage out, as its log says
            while not any("unreachable (attempt" in line for line in seen):
                line = await learner.stderr.readline()
                assert line, "".join(seen)[-3000:]
                seen.append(line.decode(errors="replace"))
        learner.terminate()
        async with asyncio.timeout(90):  # a bound against a hang: unstopped, the retries last for days
            rest, _ = await asyncio.gather(learner.stderr.read(), learner.wait())
        text = "".join(seen) + rest.decode(errors="replace")
        assert learner.returncode == 0, text[-3000:]
        assert "stopped while Redis" in text.strip().splitlines()[-1], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        found = latest_checkpoint(run_dir / "checkpoints")
        assert found is not None and found.step == 0, "the checkpoint it started from is intact"
    finally:
        for process in (learner, server):
            if process.returncode is None:
                process.kill()
                await process.wait()
        await redis.aclose()

"""`tlt-stream run` end to end: every service as its own process, a finished run dir, no orphan processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.streams import Keys
from tlt_stream.commands.run.launch import RunPlan, service_commands, service_config, thread_split, write_service_config
from tlt_stream.plan.acceptance import from_run, measured_table
from tlt_stream.rollout.arms import Arm

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


def world_from(init_policy: Path, tmp_path: Path) -> Path:
    """A world with the tiny policy and a random drafter for it: `run` defaults to adaptive SD with the
    drafter trained online, so the whole system runs."""
    import torch

    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    world = tmp_path / "world"
    shutil.copytree(init_policy, world / "policy")
    torch.manual_seed(0)
    save_drafter(Drafter(load_model(world / "policy").spec), world / "drafter")
    return world


def run_command(config: Config, world: Path, out: Path, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--run", config.run),
        *("--world", str(world), "--out", str(out), "--prompts-per-step", "2", "--group-size", "2"),
        *("--max-len", "64", "--eval", "4", *extra),
    ]


async def arm_reports_in(redis: aioredis.Redis, keys: Keys) -> list[dict]:
    """The SD arm reports the run's `stats` stream holds, as read from Redis."""
    import msgspec

    from tlt_stream.basics.messages import SdArmReport, codec_for

    codec = codec_for("stats")
    entries = await redis.xrange(keys.stream("stats"))
    messages = [codec.decode(fields[b"m"]) for _, fields in entries]
    return [msgspec.to_builtins(m) for m in messages if isinstance(m, SdArmReport)]


def env_for(config: Config) -> dict[str, str]:
    assert config.bus.redis_url and config.bus.mqtt_url
    return {**os.environ, "TLT_REDIS_URL": config.bus.redis_url, "TLT_MQTT_URL": config.bus.mqtt_url}


def service_pids(run: str, *, launcher: bool = False) -> list[int]:
    """PIDs of live processes started for run `run` (their command lines carry `--run RUN`): its services,
    and with `launcher` the `tlt-stream run` process too."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            line = b" ".join(argv)
            if (b"services." in line or (launcher and b"tlt_stream.commands.cli" in line)) and run.encode() in argv:
                found.append(int(entry.name))
    return found


@pytest.fixture
def reaped(bus_config: Config) -> Iterator[Config]:
    """The run's processes are killed when the test ends, whatever happened: a test that failed or timed out
    with `tlt-stream run` live left its launcher and services running for hours, loading every later test."""
    yield bus_config
    for pid in service_pids(bus_config.run, launcher=True):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_run_trains_for_the_steps_asked_and_leaves_a_complete_run_dir(
    one_backend: str, reaped: Config, tmp_path: Path, init_policy: Path
) -> None:
    bus_config = reaped
    world, out = world_from(init_policy, tmp_path), tmp_path / "run"
    process = await asyncio.create_subprocess_exec(
        *run_command(bus_config, world, out, "--steps", "2"), env=env_for(bus_config), stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(240):
        _, stderr = await process.communicate()
    log = stderr.decode()
    assert process.returncode == 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    for key in ("reward_mean", "accuracy", "response_len_p90", "rollout_seconds", "tail_seconds", "learn_seconds",
                "wait_seconds", "rollout_tokens_per_s", "staleness_hist"):  # fmt: skip
        assert key in rows[-1], key
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2] and all(0 <= e["accuracy"] <= 1 for e in evals)
    for name in ("report.html", "reward.png", "lengths.png", "time.png", "speculation.png", "workers.png"):
        assert (out / "report" / name).stat().st_size > 0, name
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    states = {e["state"] for e in timeline if e["kind"] == "worker_state"}
    assert {"GENERATING", "STOPPED"} <= states, states
    assert any(e["kind"] == "rollout" for e in timeline)
    assert {p.name for p in (out / "logs").iterdir()} == {"policy.log", "rollout-0.log", "learner.log"}
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    try:
        assert (await read_mirror(redis, Keys(bus_config.run)))["policy"].version == 2
        in_redis = await arm_reports_in(redis, Keys(bus_config.run))
    finally:
        await redis.aclose()
    assert service_pids(bus_config.run) == [], "every service process was stopped"
    # The run directory keeps each SD arm's acceptance per batch bucket for `tlt-stream plan --from-run`: the
    # same table as the workers' reports still in Redis give, plain decoding one token per row and round.
    recorded = measured_table(e for e in timeline if e["kind"] == "sd_arm")
    assert recorded == measured_table(in_redis) and recorded.get("plain"), recorded
    assert set(recorded["plain"].values()) == {1.0}
    sd_arms = {label: buckets for label, buckets in recorded.items() if label != "plain"}
    assert sd_arms, f"an SD arm ran in a run with adaptive SD: {recorded}"
    planned = from_run(out, fallback=1.5)
    assert planned is not None
    for label, buckets in sd_arms.items():
        arm = Arm.from_label(label)
        for bucket, tokens in buckets.items():
            assert 1.0 <= tokens <= arm.depth + 1 and planned.mean(arm, bucket) == max(1.0, tokens), label
    # The run name is a namespace with a dispatch cursor and versions: a new run may not reuse it.
    again = await asyncio.create_subprocess_exec(
        *run_command(bus_config, world, tmp_path / "again", "--steps", "2"),
        env=env_for(bus_config),
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, stderr = await again.communicate()
    assert again.returncode == 1 and "already has state in Redis" in stderr.decode(), stderr.decode()[-2000:]
    assert service_pids(bus_config.run) == []


async def test_ctrl_c_stops_every_service_and_keeps_the_checkpoints(
    one_backend: str, reaped: Config, tmp_path: Path, init_policy: Path
) -> None:
    bus_config = reaped
    world, out = world_from(init_policy, tmp_path), tmp_path / "run"
    process = await asyncio.create_subprocess_exec(
        *run_command(bus_config, world, out, "--steps", "1000"), env=env_for(bus_config), stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(180):
            while not (out / "metrics.jsonl").exists():  # noqa: ASYNC110 (a file, not an event)
                await asyncio.sleep(0.5)
        # The live run as the monitor sees it, from Redis alone.
        monitor = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "tlt_stream.commands.cli", "monitor", "--once", "--json", "--run", bus_config.run),
            env=env_for(bus_config),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(60):
            stdout, monitor_err = await monitor.communicate()
        assert monitor.returncode == 0, monitor_err.decode()[-2000:]
        snap = json.loads(stdout)
        # samples is trimmed after each checkpoint, so its length may be 0: its learner group shows it is read.
        assert snap["reachable"] and snap["streams"]["samples"]["groups"]["learner"]["consumers"] == 1
        assert snap["streams"]["prompts"]["groups"]["rollout"]["consumers"] == 1
        assert [w["worker_id"] for w in snap["workers"] if w["role"] == "rollout"] == ["rollout-0"]
        assert snap["versions"]["policy"]["version"] >= 1 and snap["learner"]["step"] >= 1
        assert snap["rollout"]["reports"] > 0 and snap["rollout"]["tokens"] > 0
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(90):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode == 130, stderr.decode()[-3000:]
    assert "every service was shut down" in stderr.decode()
    assert service_pids(bus_config.run) == []
    from tlt_stream.rl.checkpoint import latest_checkpoint

    found = latest_checkpoint(out / "checkpoints")
    assert found is not None and found.step >= 1

    # Resumed on fresh servers (the run's keys gone, as after an embedded Redis): it continues from the
    # checkpoint, dispatching from that step on, and trains every step once.
    from tlt_stream.bus.connect import purge_run

    await purge_run(bus_config)
    until = found.step + 1
    resumed = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--resume", str(out), "--steps", str(until)),
        env=env_for(bus_config),
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(180):
        _, stderr = await resumed.communicate()
    log = stderr.decode()
    assert resumed.returncode == 0, log[-3000:]
    assert f"resuming {out} at policy version {found.step}" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, until + 1)), "every step trained once, none again"
    dispatching = [
        line for line in (out / "logs" / "policy.log").read_text().splitlines() if "dispatching from" in line
    ]
    assert dispatching[-1].endswith(f"dispatching from step {found.step}"), dispatching
    final = latest_checkpoint(out / "checkpoints")
    assert final is not None and final.step == until


async def test_a_launcher_killed_outright_takes_its_services_with_it(
    one_backend: str, reaped: Config, tmp_path: Path, init_policy: Path
) -> None:
    """SIGKILL (the OOM killer, a scheduler's kill -9) gives `tlt-stream run` no chance to stop its services:
    they notice it is gone and stop themselves, instead of generating for a run nobody watches (with the
    embedded servers gone too, they used to retry for hours). A resume to a version already reached says so."""
    bus_config = reaped
    world, out = world_from(init_policy, tmp_path), tmp_path / "run"
    process = await asyncio.create_subprocess_exec(
        *run_command(bus_config, world, out, "--steps", "1000"),
        env=env_for(bus_config),
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with asyncio.timeout(180):
            while not (out / "metrics.jsonl").exists():  # noqa: ASYNC110 (a file, not an event)
                await asyncio.sleep(0.5)
        services = service_pids(bus_config.run)
        assert len(services) == 3, services  # policy, one rollout worker, learner
        process.kill()
        await process.wait()
        async with asyncio.timeout(120):  # a bound against a hang: unwatched, they would run on for good
            while service_pids(bus_config.run):  # noqa: ASYNC110 (processes, not an event)
                await asyncio.sleep(0.2)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    for log in sorted((out / "logs").glob("*.log")):
        assert f"the launcher (pid {process.pid}) is gone" in log.read_text(), log.name
    from tlt_stream.rl.checkpoint import latest_checkpoint

    found = latest_checkpoint(out / "checkpoints")
    assert found is not None and found.step >= 1
    again = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--resume", str(out), "--steps", str(found.step)),
        env=env_for(bus_config),
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, stderr = await again.communicate()
    assert again.returncode == 0, stderr.decode()[-3000:]
    assert f"already at policy version {found.step} of {found.step}: nothing left to train" in stderr.decode()
    assert service_pids(bus_config.run) == [], "nothing was started"
    # One step more, on the same servers, which hold the run's state: it goes on from there (a resumed run is
    # not refused as a new run in a used namespace), from another working directory.
    more = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--resume", str(out.resolve())),
        *("--steps", str(found.step + 1)),
        env=env_for(bus_config),
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
    )
    async with asyncio.timeout(240):
        _, stderr = await more.communicate()
    assert more.returncode == 0, stderr.decode()[-3000:]
    final = latest_checkpoint(out / "checkpoints")
    assert final is not None and final.step == found.step + 1


def test_the_plan_gives_each_process_its_threads_and_every_service_one_configuration_file(tmp_path: Path) -> None:
    from tlt_stream.basics.config import load_config, override

    (tmp_path / "policy").mkdir()
    config = override(Config(run="r1"), {"policy.steps": 5, "launch.workers": 2, "policy.max_staleness": 1})
    config = override(config, {"launch.sd": "off"})
    plan = RunPlan(world=tmp_path, run_dir=tmp_path / "run", config=config, cores=8)
    path = write_service_config(plan, config)
    commands = {c.name: c.argv for c in service_commands(plan, config)}
    assert list(commands) == ["policy", "rollout-0", "rollout-1", "learner"]
    assert all(argv[argv.index("--config") + 1] == str(path) for argv in commands.values())
    assert commands["learner"][commands["learner"].index("--threads") + 1] == "2"
    assert commands["rollout-1"][commands["rollout-1"].index("--threads") + 1] == "3"
    assert all(argv[argv.index("--run") + 1] == "r1" for argv in commands.values())
    seen = load_config(path, environ={})  # what every service reads
    assert (seen.run, seen.until_version, seen.groups_per_step, seen.policy.max_staleness) == ("r1", 5, 16, 1)
    assert seen.learner.run_dir == str(plan.run_dir) and seen.learner.policy == str(tmp_path / "policy")
    assert seen.sd.drafter is None and not seen.rollout.stream_hidden, "no drafter training: nobody reads `hidden`"
    assert seen.bus.store_root == str(plan.run_dir.resolve()) and seen.bus.redis_url is None, "no URL on disk"
    (tmp_path / "drafter").mkdir()
    eagle = override(config, {"launch.sd": "eagle", "rollout.hidden_share": 0.5})
    seen = service_config(RunPlan(world=tmp_path, run_dir=tmp_path / "run", config=eagle), eagle)
    assert (
        seen.rollout.stream_hidden and seen.rollout.hidden_share == 0.5 and seen.sd.drafter == str(tmp_path / "drafter")
    )
    assert seen.drafter.state_dir == str(tmp_path / "run" / "drafter-states")
    assert thread_split(2, 1, 0) == (2, 2), "on-policy: rollout and learning alternate, each gets the machine"
    assert thread_split(2, 1, 1) == (1, 1)
    with pytest.raises(FileNotFoundError, match="bootstrap"):
        RunPlan(world=tmp_path / "nowhere", run_dir=tmp_path / "run")


def test_a_world_without_a_drafter_is_refused_with_one_line(tmp_path: Path, init_policy: Path) -> None:
    import subprocess

    world = tmp_path / "world"
    shutil.copytree(init_policy, world / "policy")
    result = subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", "run", "--world", str(world), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no drafter for --sd eagle" in result.stderr and "Traceback" not in result.stderr


def test_the_run_directorys_configuration_names_every_path_absolute(tmp_path: Path, monkeypatch) -> None:
    """`--resume RUN_DIR` reads RUN_DIR/config.toml from wherever it is started: paths given relative to where
    the run began (the world, the dataset, a reward file, a tokenizer) are written absolute, and a reward named
    by module stays as it is."""
    from tlt_stream.basics.config import load_config, override

    monkeypatch.chdir(tmp_path)
    (tmp_path / "w" / "policy").mkdir(parents=True)
    values = {
        "launch.world": "w", "launch.sd": "off", "data.dataset": "d/train.jsonl", "data.eval_dataset": "d/test.jsonl",
        "data.tokenizer": "tok", "rollout.reward": "rewards/mine.py:score",
    }  # fmt: skip
    config = override(Config(run="r2"), values)
    path = write_service_config(RunPlan(world=Path("w"), run_dir=Path("runs/r2"), config=config), config)
    path = path.resolve()
    monkeypatch.chdir("/")
    seen = load_config(path, environ={})
    assert seen.launch.world == str(tmp_path / "w") and seen.learner.policy == str(tmp_path / "w" / "policy")
    assert seen.learner.run_dir == str(tmp_path / "runs" / "r2")
    assert (seen.data.dataset, seen.data.eval_dataset) == (
        str(tmp_path / "d/train.jsonl"),
        str(tmp_path / "d/test.jsonl"),
    )
    assert seen.data.tokenizer == str(tmp_path / "tok")
    assert seen.rollout.reward == f"{tmp_path / 'rewards/mine.py'}:score"
    modular = override(config, {"rollout.reward": "mypackage.rewards:score"})
    assert service_config(
        RunPlan(world=tmp_path / "w", run_dir=tmp_path / "r", config=modular), modular
    ).rollout.reward == ("mypackage.rewards:score")

"""`tlt-stream monitor` against a run's Redis: every figure of `--once --json`, the human table, and the
Prometheus endpoint of `python -m services.monitor`, which stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tlt_stream.basics.config import BusConfig, Config
from tlt_stream.basics.messages import (
    DrafterStats,
    DrafterVersion,
    HiddenWindow,
    LearnerStats,
    PolicyVersion,
    PromptGroup,
    RolloutStats,
    Sample,
    SdArmChoice,
    SdArmReport,
    SdConfigVersion,
    Tensor,
    WorkerStatus,
)
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import PAYLOAD_FIELD, StreamProducer
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.monitor import snapshot, summary_line

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

LEARNER_METRICS = {
    "reward_mean": 0.5,
    "accuracy": 0.375,
    "staleness_max": 1.0,
    "staleness_mean": 0.25,
    "staleness_0": 6.0,
    "staleness_1": 2.0,
    "rollout_tokens_per_s": 123.5,
    "accept_length_mean": 2.5,
    "loss": 0.125,
    "stale_dropped_groups": 1.0,
    "stale_dropped_len_mean": 70.0,
    "response_len_mean": 30.0,
}
OLDER_UPDATE = {
    "reward_mean": 0.1,
    "stale_dropped_groups": 2.0,
    "stale_dropped_len_mean": 40.0,
    "response_len_mean": 20.0,
}
ROW_FORWARD_TOKENS = 600 / (100 * 8 + 200 * 4 + 60 * 2)
"""Tokens per row per target forward of the three rollout reports below: forwards times each one's batch."""


def prompt(i: int) -> PromptGroup:
    return PromptGroup(task_id=f"t{i}", prompt_id=f"p{i}", prompt_ids=[1, 2], answer="3", group_size=2, step=1)


def sample(i: int) -> Sample:
    tokens = [4, 5, 6]
    return Sample(
        sample_id=f"t0/{i}",
        task_id="t0",
        prompt_id="p0",
        index=i,
        group_size=4,
        prompt_ids=[1, 2],
        token_ids=Tensor.from_values(tokens, "int32"),
        logprobs=Tensor.from_values([-0.5] * len(tokens), "float32"),
        policy_version=3,
        drafter_version=2,
        reward=1.0,
        finish_reason="eos",
        worker_id="w1",
    )


def hidden(i: int) -> HiddenWindow:
    return HiddenWindow(
        sample_id=f"t0/{i}",
        policy_version=3,
        token_ids=[1, 2, 4],
        hidden=Tensor.from_values([[0.0] * 4] * 3, "float32"),
        prompt_len=2,
    )


def rollout(
    worker: str, tokens: int, seconds: float, forwards: int, sd_on: bool, batch: int, **partial: float
) -> RolloutStats:
    return RolloutStats(
        worker_id=worker,
        policy_version=3,
        drafter_version=2,
        batch_size=batch,
        tokens=tokens,
        seconds=seconds,
        target_forwards=forwards,
        sd_on=sd_on,
        **partial,
    )


@contextlib.asynccontextmanager
async def live_run(config: Config) -> AsyncIterator[float]:
    """A run caught mid-step: backlogs on every consumer stream, a dead letter, two workers (heartbeating
    while the block runs), versions and stats from workers, the learner and the drafter trainer. Yields the
    time the stats began."""
    keys = Keys(config.run)
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    producer = StreamProducer(redis, keys, config.bus)

    rollout_reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w1")
    await rollout_reader.ensure_group()
    await redis.xadd(keys.stream("prompts"), {PAYLOAD_FIELD: b"\xc1 not msgpack"})
    await producer.send("prompts", [prompt(i) for i in range(5)])
    taken = await rollout_reader.read(count=3, block_ms=0)  # the garbage is dead-lettered, 2 tasks pending
    await redis.hsetnx(keys.lost, "t9", 0)  # a task a worker dead-lettered as lost (its reward raised)
    assert [d.message.task_id for d in taken] == ["t0", "t1"]

    learner_reader: StreamReader[Sample] = StreamReader(redis, keys, config.bus, "samples", "learner-1")
    await producer.send("samples", [sample(i) for i in range(4)])
    got = await learner_reader.read(count=2, block_ms=0)
    await learner_reader.ack([got[0].entry_id])  # 1 pending, 2 undelivered

    drafter_reader: StreamReader[HiddenWindow] = StreamReader(redis, keys, config.bus, "hidden", "w2")
    ids = await producer.send("hidden", [hidden(i) for i in range(3)])
    assert len(await drafter_reader.read(count=1, block_ms=0)) == 1
    await redis.xdel(keys.stream("hidden"), ids[2])  # Redis can no longer tell the lag: the monitor counts

    registries = []
    for worker, state in (("w1", WorkerStatus.GENERATING), ("w2", WorkerStatus.TRAINING_DRAFTER)):
        registry = WorkerRegistry(redis, keys, config.bus, producer, worker, role="rollout")
        registry.update_info(policy_version=3, drafter_version=2, sd_config_version=1)
        await registry.set_state(WorkerStatus.LOADING)
        await registry.set_state(state)
        registries.append(registry)

    stop = asyncio.Event()
    plane = ControlPlane(config, redis, role="test", owns=["policy", "drafter", "sd_config"])
    task = asyncio.create_task(plane.run(stop))
    await asyncio.wait_for(plane.connected.wait(), 10)
    await plane.publish(PolicyVersion(version=3, location="/ckpt/3", sha256="a" * 64, step=3))
    await plane.publish(DrafterVersion(version=2, location="/drafter/2", sha256="b" * 64, policy_version=3))
    table = [SdArmChoice(max_batch=4, depth=4, topk=1, verify=4)]
    await plane.publish(SdConfigVersion(version=1, drafter_version=2, table=table))
    stop.set()
    await task

    await redis.hset(keys.dropped, mapping={"t7": 1, "t8": 1, "t9": 2})  # the run's groups dropped as too stale
    began = time.time()
    await producer.send("stats", [rollout("w1", 100, 1.0, 100, sd_on=False, batch=8, ahead_seconds=0.75)])
    await producer.send(
        "stats", [rollout("w2", 200, 2.0, 200, sd_on=False, batch=4, kept_tokens=30, discarded_tokens=10)]
    )
    await producer.send(
        "stats",
        [
            SdArmReport(worker_id="w1", drafter_version=2, bucket=4, depth=4, topk=1, verify=4, tokens=50, seconds=0.2),
            LearnerStats(step=1, policy_version=1, groups=4, samples=32, metrics=OLDER_UPDATE),
            LearnerStats(step=2, policy_version=2, groups=8, samples=64, metrics=LEARNER_METRICS),
            DrafterStats(
                worker_id="w2", fence=3, policy_version=3, step=40, steps=10, seconds=2.0, loss=0.75,
                end="preempted", windows=12, judged=True, judge_s=0.5, accept_new=2.25, accept_current=2.0,
                adopted=True, drafter_version=2,
            ),
            DrafterStats(  # a newer slice, too few steps after the judgement to be judged itself
                worker_id="w2", fence=3, policy_version=3, step=43, steps=3, seconds=0.5, loss=0.5, end="preempted",
            ),
            rollout("w1", 300, 1.5, 60, sd_on=True, batch=2, kept_tokens=6, discarded_tokens=2, ahead_seconds=0.5),
        ],
    )  # fmt: skip
    await redis.xadd(keys.stream("stats"), {PAYLOAD_FIELD: b"\xc1"})
    await asyncio.sleep(0.3)  # the pending entries have been idle this long at least
    stopped = asyncio.Event()
    heartbeats = [asyncio.create_task(r.heartbeat(stopped)) for r in registries]
    try:
        yield began
    finally:
        stopped.set()
        await asyncio.gather(*heartbeats)
        await redis.aclose()


def cli(config: Config, *args: str, module: str = "tlt_stream.commands.cli") -> list[str]:
    return [sys.executable, "-m", module, *args, "--run", config.run]


def env_for(config: Config) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    assert config.bus.redis_url and config.bus.mqtt_url
    return {**env, "TLT_REDIS_URL": config.bus.redis_url, "TLT_MQTT_URL": config.bus.mqtt_url, "COLUMNS": "200"}


def monitor_once(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli(config, "monitor", "--once", *args), env=env_for(config), capture_output=True, text=True, timeout=60
    )


async def test_monitor_once_json_shows_every_figure(bus_config: Config) -> None:
    async with live_run(bus_config) as began:
        await check_once(bus_config, began)


async def check_once(bus_config: Config, began: float) -> None:
    result = await asyncio.to_thread(monitor_once, bus_config, "--json")
    finished = time.time()
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["run"] == bus_config.run and snap["reachable"]

    streams = snap["streams"]
    assert {name: s["length"] for name, s in streams.items()} == {
        "prompts": 6,
        "samples": 4,
        "hidden": 2,
        "stats": 13,  # 4 worker states, 2 + 6 entries, 1 undecodable
        "dead": 1,
    }
    prompts = streams["prompts"]["groups"]["rollout"]
    assert (prompts["pending"], prompts["lag"], prompts["lag_source"], prompts["consumers"]) == (2, 3, "redis", 1)
    assert prompts["pending_per_consumer"] == {"w1": 2}
    assert prompts["oldest_pending_consumer"] == "w1" and prompts["oldest_pending_deliveries"] == 1
    assert 0.3 <= prompts["oldest_pending_idle_s"] <= prompts["oldest_pending_age_s"] < 60
    samples = streams["samples"]["groups"]["learner"]
    assert (samples["pending"], samples["lag"], samples["oldest_pending_consumer"]) == (1, 2, "learner-1")
    drafter_group = streams["hidden"]["groups"]["drafter"]
    assert (drafter_group["pending"], drafter_group["lag"], drafter_group["lag_source"]) == (1, 1, "counted")
    assert streams["stats"]["groups"] == {} and streams["dead"]["groups"] == {}

    dead = snap["dead"]
    assert dead["counts"] == {"prompts": 1} and dead["total"] == 1 and dead["lost_groups"] == 1
    from rich.console import Console

    from tlt_stream.roles.monitor.dashboard import render

    console = Console(width=240, record=True)
    console.print(render(snap))
    shown = console.export_text()
    assert "dead letters: 1 (prompts 1); 1 group(s) lost to them, each replaced by another prompt" in shown
    [letter] = dead["recent"]
    assert letter["stream"] == "prompts" and letter["origin"] == "rollout/w1"
    assert letter["reason"].startswith("undecodable prompts entry")

    workers = {w["worker_id"]: w for w in snap["workers"]}
    assert {k: w["state"] for k, w in workers.items()} == {"w1": "GENERATING", "w2": "TRAINING_DRAFTER"}
    assert snap["worker_states"] == {"GENERATING": 1, "TRAINING_DRAFTER": 1}
    for w in workers.values():
        assert (w["role"], w["policy_version"], w["drafter_version"]) == ("rollout", 3, 2)
        assert w["info"]["sd_config_version"] == "1" and 0 <= w["state_seconds"] < 60

    versions = snap["versions"]
    assert (versions["policy"]["version"], versions["policy"]["location"]) == (3, "/ckpt/3")
    assert (versions["drafter"]["version"], versions["drafter"]["policy_version"]) == (2, 3)
    assert versions["sd_config"]["version"] == 1 and versions["sd_config"]["table"][0]["depth"] == 4

    rollout_ = snap["rollout"]
    assert (rollout_["reports"], rollout_["tokens"], rollout_["window_s"]) == (3, 600, 60.0)
    assert rollout_["generation_tokens_per_s"] == pytest.approx(600 / 4.5)
    assert rollout_["tokens_per_forward"] == pytest.approx(ROW_FORWARD_TOKENS)
    # A run younger than the window: from the start of its first report (w2's, 2 s before it was added).
    assert 2.0 <= rollout_["span_s"] <= finished - began + 2.5
    assert rollout_["tokens_per_s"] == pytest.approx(600 / rollout_["span_s"])
    assert rollout_["sd_on_workers"] == 1
    assert rollout_["workers"]["w1"]["sd_on"] is True and rollout_["workers"]["w2"]["sd_on"] is False
    assert rollout_["workers"]["w1"]["batch_size"] == 2
    assert rollout_["workers"]["w1"]["tokens_per_s"] == pytest.approx(200.0)
    assert rollout_["workers"]["w1"]["tokens_per_forward"] == pytest.approx(300 / (60 * 2))

    # Partial rollouts per step verified into: the three reports are stamped v3, so their re-verified tokens
    # count for step 3 and their seconds with drafts in flight for step 4.
    assert rollout_["partial"] == {
        "4": {"ahead_tokens": 0, "kept_tokens": 0, "discarded_tokens": 0, "kept_share": None, "ahead_seconds": 1.25},
        "3": {"ahead_tokens": 48, "kept_tokens": 36, "discarded_tokens": 12, "kept_share": 0.75, "ahead_seconds": 0.0},
    }
    drops = snap["stale_drops"]
    assert (drops["run_groups"], drops["groups"], drops["updates_read"]) == (3, 3, 2)
    assert drops["dropped_len_mean"] == pytest.approx((2 * 40 + 1 * 70) / 3)
    assert drops["trained_len_mean"] == pytest.approx((32 * 20 + 64 * 30) / 96)
    assert drops["per_update"] == {
        "2": {"groups": 1, "dropped_len_mean": 70.0, "trained_len_mean": 30.0},
        "1": {"groups": 2, "dropped_len_mean": 40.0, "trained_len_mean": 20.0},
    }

    learner = snap["learner"]
    assert (learner["step"], learner["policy_version"], learner["groups"], learner["samples"]) == (2, 2, 8, 64)
    assert (learner["reward_mean"], learner["accuracy"]) == (0.5, 0.375)
    assert (learner["staleness_max"], learner["staleness_mean"]) == (1.0, 0.25)
    assert (learner["rollout_tokens_per_s"], learner["accept_length_mean"]) == (123.5, 2.5)
    assert learner["metrics"] == LEARNER_METRICS and 0 <= learner["age_s"] < 60

    drafter = snap["drafter"]
    assert (drafter["worker_id"], drafter["step"], drafter["loss"], drafter["end"]) == ("w2", 43, 0.5, "preempted")
    assert (drafter["accept_current"], drafter["accept_new"], drafter["adopted"]) == (2.0, 2.25, True)
    assert (drafter["judged_step"], drafter["judge_s"]) == (40, 0.5), "the verdict is the newest judged slice's"
    assert (drafter["drafter_version"], drafter["fence"], drafter["slices_read"]) == (2, 3, 2)
    assert {k: snap["stats_read"][k] for k in ("entries", "undecodable", "truncated")} == {
        "entries": 13,
        "undecodable": 1,
        "truncated": False,
    }

    human = await asyncio.to_thread(monitor_once, bus_config)
    assert human.returncode == 0, human.stderr
    for text in ("policy v3, drafter v2, sd_config v1", "TRAINING_DRAFTER", "learner: step 2", "loss 0.5"):
        assert text in human.stdout, (text, human.stdout)
    assert "judged at step 40: held-out acceptance 2.00 -> 2.25, adopted as v2" in human.stdout, human.stdout
    assert "undecodable prompts entry" in human.stdout and "SD on in 1/2 live workers" in human.stdout
    shown = " ".join(human.stdout.split())  # the terminal wraps long lines
    assert "v3 48 ahead, kept 36 (75%), discarded 12, tail filled 0.0 worker-s" in shown, shown
    assert "groups dropped as too stale: 3 in the run, 3 in the 2 updates read" in shown, shown

    # Bounded reading of `stats`: a cut read says so and measures throughput only over what it saw.
    cut = await snapshot(bus_config, stats_limit=3)  # the garbage, w1's SD report and the newest drafter slice
    assert cut["stats_read"]["truncated"] and cut["stats_read"]["entries"] == 3
    assert (cut["rollout"]["reports"], cut["rollout"]["tokens"], list(cut["rollout"]["workers"])) == (1, 300, ["w1"])
    assert cut["rollout"]["span_s"] == pytest.approx(cut["stats_read"]["covers_s"])
    assert cut["learner"] is None and cut["drafter"]["step"] == 43 and cut["drafter"]["judged_step"] is None
    assert cut["stale_drops"]["groups"] == 0 and cut["stale_drops"]["run_groups"] == 3, "the hash covers the run"
    assert list(cut["rollout"]["partial"]) == ["4", "3"]
    line = summary_line(await snapshot(bus_config))
    for text in ("step 2 reward 0.5", "SD on in 1", "GENERATING 1 TRAINING_DRAFTER 1", "prompts 2 pending 3 lag"):
        assert text in line, (text, line)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_prometheus_endpoint_serves_the_figures_and_stops_on_sigterm(bus_config: Config) -> None:
    async with live_run(bus_config):
        await check_prometheus(bus_config)


async def check_prometheus(bus_config: Config) -> None:
    args = cli(bus_config, "--prometheus", "0", "--interval", "0.2", module="services.monitor")
    process = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, read and reaped in threads below
        args, env=env_for(bus_config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.to_thread(process.stderr.readline)  # type: ignore[union-attr]
        match = re.search(r"Prometheus metrics on (http://\S+/metrics)", line)
        assert match, line
        samples: dict[tuple[str, frozenset], float] = {}
        for _ in range(100):
            try:
                samples = await asyncio.to_thread(scrape, match[1])
                break
            except urllib.error.HTTPError as exc:  # 503 until the first snapshot
                assert exc.code == 503
                await asyncio.sleep(0.1)
        run = ("run", bus_config.run)

        def value(name: str, /, **labels: str) -> float:
            return samples[(name, frozenset({run, *labels.items()}))]

        assert value("tlt_up") == 1
        assert value("tlt_stream_length", stream="prompts") == 6 and value("tlt_stream_length", stream="dead") == 1
        assert value("tlt_group_pending", stream="prompts", group="rollout") == 2
        assert value("tlt_group_lag", stream="prompts", group="rollout") == 3
        assert value("tlt_group_lag", stream="hidden", group="drafter") == 1
        assert value("tlt_group_pending", stream="samples", group="learner") == 1
        assert value("tlt_group_oldest_pending_idle_seconds", stream="prompts", group="rollout") >= 0.3
        assert value("tlt_dead_letters_total", stream="prompts") == 1
        assert value("tlt_workers", state="GENERATING") == 1 and value("tlt_workers", state="IDLE") == 0
        assert value("tlt_worker_state", worker="w2", role="rollout", state="TRAINING_DRAFTER") == 1
        assert value("tlt_worker_policy_version", worker="w1") == 3
        assert value("tlt_worker_sd_on", worker="w1") == 1 and value("tlt_worker_sd_on", worker="w2") == 0
        assert [value("tlt_version", kind=k) for k in ("policy", "drafter", "sd_config")] == [3, 2, 1]
        assert value("tlt_rollout_tokens_per_forward") == pytest.approx(ROW_FORWARD_TOKENS)
        assert value("tlt_rollout_generation_tokens_per_second") == pytest.approx(600 / 4.5)
        assert value("tlt_rollout_tokens_per_second") > 0 and value("tlt_rollout_sd_on_workers") == 1
        assert value("tlt_learner_step") == 2
        assert value("tlt_learner_metric", name="reward_mean") == 0.5
        assert value("tlt_learner_metric", name="accept_length_mean") == 2.5
        assert value("tlt_learner_metric", name="staleness_max") == 1.0
        assert value("tlt_drafter_train_loss") == 0.5
        assert value("tlt_drafter_train_acceptance", drafter="new") == 2.25
        assert value("tlt_stats_undecodable") == 1
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(process.communicate, timeout=20)
    assert process.returncode == 0, err
    assert "Traceback" not in err and out == ""


def test_monitor_once_fails_clearly_without_redis() -> None:
    config = Config(
        run="nowhere", bus=msgspec.convert({"redis_url": "redis://127.0.0.1:1/0", "mqtt_url": "mqtt://x:1"}, BusConfig)
    )
    result = monitor_once(config, "--json", "--timeout", "2")
    assert result.returncode == 1
    assert json.loads(result.stdout)["reachable"] is False
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in result.stderr and "Traceback" not in result.stderr
    env = {k: v for k, v in env_for(config).items() if k != "TLT_REDIS_URL"}
    missing = subprocess.run(cli(config, "monitor", "--once"), env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--redis-url or TLT_REDIS_URL" in missing.stderr


async def test_monitor_streams_json_lines_and_stops_on_ctrl_c(bus_config: Config) -> None:
    async with live_run(bus_config):
        await check_json_lines(bus_config)


async def check_json_lines(bus_config: Config) -> None:
    args = cli(bus_config, "monitor", "--json", "--interval", "0.2")
    process = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, read and reaped in threads below
        args, env=env_for(bus_config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = [json.loads(await asyncio.to_thread(process.stdout.readline)) for _ in range(2)]  # type: ignore[union-attr]
        assert [snap["learner"]["step"] for snap in lines] == [2, 2]
        assert lines[1]["time"] > lines[0]["time"]
    finally:
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.to_thread(process.communicate, timeout=20)
    assert process.returncode == 0, err
    assert "Traceback" not in err

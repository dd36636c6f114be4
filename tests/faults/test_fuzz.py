"""Every stream fuzzed with malformed and hostile entries: each lands in `dead` with a reason, the reader
never stops, and whatever does decode is a valid message. Bad checkpoints are refused with one clear line.

Hostile mutations of a valid entry (unknown schema version, unknown kind, a missing or unknown field,
tensor bytes that do not match dtype and shape, an entry over `max_message_bytes`) must all be refused;
random mutations (a field given another type, random bytes) must be refused or decode to something valid.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import HiddenWindow, PromptGroup, Sample, Tensor, WorkerState, WorkerStatus, codec_for
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import PAYLOAD_FIELD
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis]

MAX_BYTES = 64 * 1024
"""A small `max_message_bytes` so an oversized entry stays cheap to build."""


def valid(stream: str) -> dict[str, Any]:
    """One valid entry of `stream` as a decoded msgpack map (what a mutation starts from)."""
    message: Any
    if stream == "prompts":
        message = PromptGroup(task_id="s000000-0000", prompt_id="p", prompt_ids=[5, 6], answer="7", group_size=2)
    elif stream == "samples":
        message = Sample(
            sample_id="s000000-0000/0",
            task_id="s000000-0000",
            prompt_id="p",
            index=0,
            group_size=2,
            prompt_ids=[5, 6],
            token_ids=Tensor.from_values([7, 8], "int32"),
            logprobs=Tensor.from_values([-0.5, -0.25], "float32"),
            policy_version=0,
            drafter_version=-1,
            reward=1.0,
            finish_reason="eos",
            worker_id="w",
        )
    elif stream == "hidden":
        message = HiddenWindow(
            sample_id="s/0", policy_version=0, token_ids=[1, 2], hidden=Tensor.from_values([[0.0] * 4] * 2, "float32")
        )
    else:
        message = WorkerState(worker_id="w", state=WorkerStatus.IDLE)
    return msgspec.msgpack.decode(codec_for(stream).encode(message))  # bytes stay bytes


def _tensor_field(entry: dict[str, Any]) -> str | None:
    return next((k for k, v in entry.items() if isinstance(v, dict) and {"dtype", "shape", "data"} <= set(v)), None)


HOSTILE = ["schema", "kind", "missing", "unknown_field", "tensor_bytes", "tensor_dtype", "oversize"]
"""Mutations every stream must refuse (tensor ones only where the entry has a tensor)."""


@st.composite
def mutated(draw: st.DrawFn, stream: str) -> tuple[str, bytes]:
    entry = valid(stream)
    kinds = [*HOSTILE, "wrong_type", "random_bytes", "truncated"]
    kind = draw(st.sampled_from(kinds))
    tensor = _tensor_field(entry)
    if kind.startswith("tensor") and tensor is None:
        kind = "schema"
    fields = sorted(k for k in entry if k not in ("kind", "schema", "created_at"))
    if kind == "schema":
        entry["schema"] = draw(st.one_of(st.integers(2, 2**31), st.integers(-5, 0), st.text(max_size=3)))
    elif kind == "kind":
        entry["kind"] = draw(st.text(max_size=12).filter(lambda t: t != entry["kind"]))
    elif kind == "missing":
        message_type = {"prompts": PromptGroup, "samples": Sample, "hidden": HiddenWindow}.get(stream, WorkerState)
        required = [f.encode_name for f in msgspec.inspect.type_info(message_type).fields if f.required]
        del entry[draw(st.sampled_from(required))]
    elif kind == "unknown_field":
        entry[draw(st.text(min_size=1, max_size=8).filter(lambda t: t not in entry))] = draw(
            st.integers(-(2**63), 2**63 - 1)
        )
    elif kind == "tensor_bytes":
        data = entry[tensor]["data"]
        cut = draw(st.integers(0, len(data) - 1))
        entry[tensor]["data"] = data[:cut] + draw(st.binary(max_size=3).filter(lambda b: len(b) != len(data) - cut))
    elif kind == "tensor_dtype":
        entry[tensor]["dtype"] = draw(st.sampled_from(["float128", "object", "", "int4", "pickle"]))
    elif kind == "oversize":
        entry[draw(st.sampled_from(fields))] = "x" * (MAX_BYTES + draw(st.integers(1, 1000)))
    elif kind == "wrong_type":
        entry[draw(st.sampled_from(fields))] = draw(
            st.one_of(
                st.none(),
                st.integers(-(2**63), 2**63 - 1),
                st.floats(),
                st.text(max_size=4),
                st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
            )
        )
    if kind == "random_bytes":
        return kind, draw(st.binary(max_size=200))
    payload = msgspec.msgpack.encode(entry)
    if kind == "truncated":
        return kind, payload[: draw(st.integers(0, len(payload) - 1))]
    return kind, payload


def _record(stream: str, tried: int, dead: int) -> None:
    if os.environ.get("TLT_FAULTS_REPORT"):
        with open(os.environ["TLT_FAULTS_REPORT"], "a") as out:
            out.write(json.dumps({"fuzz": stream, "tried": tried, "dead": dead}) + "\n")


@pytest.mark.parametrize("stream", ["prompts", "samples", "hidden"])
def test_every_consumed_stream_dead_letters_hostile_entries_and_keeps_reading(bus_config: Config, stream: str) -> None:
    bus = msgspec.structs.replace(bus_config.bus, max_message_bytes=MAX_BYTES)

    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cases=st.lists(mutated(stream), min_size=1, max_size=6))
    def fuzz(cases: list[tuple[str, bytes]]) -> None:
        async def scenario() -> None:
            keys = Keys(f"{bus_config.run}-{os.urandom(4).hex()}")
            redis = aioredis.Redis.from_url(bus.redis_url)
            reader: StreamReader = StreamReader(redis, keys, bus, stream, "fuzz")
            await reader.ensure_group()
            good = msgspec.msgpack.encode(valid(stream))
            for _, payload in cases:
                await redis.xadd(keys.stream(stream), {PAYLOAD_FIELD: payload})
            await redis.xadd(keys.stream(stream), {PAYLOAD_FIELD: good})  # the reader goes on after the garbage
            decoded = []
            for _ in range(len(cases) + 2):
                decoded += await reader.read(block_ms=10)
            assert len(decoded) + reader.dead == len(cases) + 1
            assert decoded and decoded[-1].message == codec_for(stream).decode(good)
            letters = [codec_for("dead").decode(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(keys.stream("dead"))]
            assert len(letters) == reader.dead and all(letter.reason for letter in letters)
            hostile = sum(1 for kind, _ in cases if kind in HOSTILE)
            assert reader.dead >= hostile, [kind for kind, _ in cases]
            _record(stream, len(cases), reader.dead)
            await redis.delete(*[k async for k in redis.scan_iter(match=f"{keys.prefix}*")])
            await redis.aclose()

        asyncio.run(scenario())

    fuzz()


def test_the_stats_log_skips_and_counts_hostile_entries(bus_config: Config) -> None:
    """`stats` has no consumer group (the monitor and the run's timeline read it with XRANGE): garbage there
    is skipped and counted as undecodable, never fatal, and the valid entries around it still show."""
    from tlt_stream.roles.monitor import _read_stats

    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cases=st.lists(mutated("stats"), min_size=1, max_size=6))
    def fuzz(cases: list[tuple[str, bytes]]) -> None:
        async def scenario() -> None:
            keys = Keys(f"{bus_config.run}-{os.urandom(4).hex()}")
            redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
            good = msgspec.msgpack.encode(valid("stats"))
            await redis.xadd(keys.stream("stats"), {PAYLOAD_FIELD: good})
            for _, payload in cases:
                await redis.xadd(keys.stream("stats"), {PAYLOAD_FIELD: payload})
            await redis.xadd(keys.stream("stats"), {PAYLOAD_FIELD: good})
            entries, undecodable, _, _ = await _read_stats(redis, keys.stream("stats"), 0.0, 1e9, 1000)
            assert len(entries) + undecodable == len(cases) + 2 and len(entries) >= 2
            hostile = sum(1 for kind, _ in cases if kind in HOSTILE and kind != "oversize")  # no size cap here
            assert undecodable >= hostile, [kind for kind, _ in cases]
            _record("stats", len(cases), undecodable)
            await redis.delete(*[k async for k in redis.scan_iter(match=f"{keys.prefix}*")])
            await redis.aclose()

        asyncio.run(scenario())

    fuzz()


# ------------------------------------------------------------------------------------------- bad checkpoints


def _one_line_refusal(argv: list[str], env: dict[str, str]) -> str:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), **env}
    done = subprocess.run([sys.executable, *argv], capture_output=True, timeout=120, env=env, cwd=root)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2, done.stderr.decode()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.mqtt
def test_a_pickle_where_safetensors_belong_is_refused_never_unpickled(
    tmp_path: Path, init_policy: Path, bus_config: Config, one_backend: str
) -> None:
    """A policy directory whose weights are a pickle (`pytorch_model.bin`), here one that would create a
    file if it were ever unpickled: every loader refuses it and the file is never created."""
    import pickle
    import shutil

    from tlt_stream.model import CheckpointError, load_model

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    policy = tmp_path / "policy"
    shutil.copytree(init_policy, policy)
    for weights in policy.glob("*.safetensors"):
        weights.unlink()
    (policy / "pytorch_model.bin").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(policy)
    line = _one_line_refusal(
        ["-m", "services.learner", "--run-dir", str(tmp_path / "run"), "--policy", str(policy), "--device", "cpu"],
        {"TLT_REDIS_URL": bus_config.bus.redis_url or "", "TLT_MQTT_URL": bus_config.bus.mqtt_url or ""},
    )
    assert "safetensors" in line or "pytorch_model.bin" in line, line
    assert not marker.exists()


def test_a_learner_checkpoint_with_a_pickled_optimizer_is_refused(tmp_path: Path, init_policy: Path) -> None:
    import pickle

    import torch
    from transformers import AutoModelForCausalLM

    from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint, save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(init_policy)
    optimizer = torch.optim.AdamW(model.parameters())
    info = save_checkpoint(tmp_path / "ckpt", step=0, model=model, optimizer=optimizer, ledger=[])
    assert not list(info.path.glob("*.pt")), "checkpoints hold no pickle"
    (info.path / "optimizer.safetensors").unlink()
    (info.path / "optimizer.pt").write_bytes(pickle.dumps({"state": {}}))
    found = latest_checkpoint(tmp_path / "ckpt")
    assert found is not None
    with pytest.raises(ValueError, match=r"a pickle; tlt-stream loads only safetensors"):
        restore_checkpoint(found, optimizer=optimizer)


@pytest.mark.parametrize(
    "damage,expected",
    [
        ("missing_dir", "does not exist"),
        ("wrong_shape", "shape"),
        ("bad_config", "config"),
    ],
)
def test_bad_policy_checkpoints_are_refused_in_one_line(
    tmp_path: Path, init_policy: Path, damage: str, expected: str
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    policy = tmp_path / "policy"
    if damage != "missing_dir":
        shutil.copytree(init_policy, policy)
    if damage == "wrong_shape":
        weights = policy / "model.safetensors"
        tensors = load_file(weights)
        name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
        tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, weights, metadata={"format": "pt"})
    elif damage == "bad_config":
        (policy / "config.json").write_text("{not json")
    line = _one_line_refusal(
        ["-m", "tlt_stream.commands.cli", "eval", "--model", str(policy), "--n", "2"],
        {},
    )
    assert expected in line.lower(), line


# ------------------------------------------------------------------------------------------ control messages


def test_control_messages_over_the_size_limit_are_refused_before_decoding() -> None:
    """A valid policy version padded past `CONTROL_MAX_BYTES` on its topic is refused (never decoded); the
    same message at its normal size parses (adopting it is then the Redis mirror's word: test_control.py);
    garbage of any size never raises."""
    import aiomqtt

    from tlt_stream.basics.config import BusConfig
    from tlt_stream.basics.messages import CONTROL_CODEC, PolicyVersion
    from tlt_stream.bus.control import CONTROL_MAX_BYTES, ControlPlane

    config = Config(run="fuzz", bus=BusConfig(redis_url="redis://127.0.0.1:1/0", mqtt_url="mqtt://127.0.0.1:1"))
    plane = ControlPlane(config, None, role="test")  # type: ignore[arg-type] - Redis is never touched here
    topic = plane.topic("policy")

    def deliver(payload: bytes):
        return plane._parse(aiomqtt.Message(topic, payload, qos=1, retain=True, mid=1, properties=None))

    padded = PolicyVersion(version=2, location="/x" + " " * CONTROL_MAX_BYTES, sha256="0" * 64, step=2)
    assert len(CONTROL_CODEC.encode(padded)) > CONTROL_MAX_BYTES
    assert deliver(CONTROL_CODEC.encode(padded)) is None
    for garbage in (b"\xff" * 10, b"{}", b"[1,2]", b'{"kind":"policy"}', b"x" * (CONTROL_MAX_BYTES + 1)):
        assert deliver(garbage) is None
    genuine = PolicyVersion(version=1, location="/ckpt", sha256="0" * 64, step=1)
    assert deliver(CONTROL_CODEC.encode(genuine)) == genuine
    assert plane.version("policy") == -1, "parsing adopts nothing"

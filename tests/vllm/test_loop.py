"""The RL loop with vLLM rollout workers: `tlt-stream run --set rollout.backend=vllm` on a world vLLM's CPU
attention takes (head_dim 32), the policy service, a vLLM rollout worker and the learner as processes of their
own on the test's Redis and MQTT, audited afterwards from outside the services: the `samples` stream (kept
whole by an `audit` consumer group created before the run) and every checkpoint's ledger."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from tests.integration.loop import keep_for_audit
from tests.vllm.conftest import hf_policy, requires_vllm
from tlt_stream.bus.streams import Keys
from tlt_stream.config import Config
from tlt_stream.messages import codec_for

pytestmark = [*requires_vllm, pytest.mark.redis, pytest.mark.mqtt]

STEPS, PROMPTS, GROUP = 3, 2, 4


def world(root: Path) -> Path:
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    hf_policy(root / "policy", seed=0)
    torch.manual_seed(1)
    save_drafter(Drafter(load_model(root / "policy").spec), root / "drafter")
    return root


def run_pids(run: str) -> list[int]:
    """Live processes of this run (their command lines carry its name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if run.encode() in argv:
                found.append(int(entry.name))
    return found


async def test_the_loop_on_vllm_trains_every_sample_once_with_versions_loaded_in_place(
    one_backend: str, bus_config: Config, tmp_path: Path
) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    await keep_for_audit(redis, keys)
    out = tmp_path / "run"
    command = [
        *(sys.executable, "-m", "tlt_stream.cli", "run", "--run", bus_config.run),
        *("--world", str(world(tmp_path / "w"))),
        *("--out", str(out), "--steps", str(STEPS), "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP)),
        *("--max-len", "96", "--eval", "0", "--fixed-sd", "--set", "rollout.backend=vllm"),
    ]
    env = {**os.environ, "TLT_REDIS_URL": bus_config.bus.redis_url, "TLT_MQTT_URL": bus_config.bus.mqtt_url}
    process = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(600):
            _, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()[-3000:]
        codec = codec_for("samples")
        samples = [codec.decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
    finally:
        for pid in run_pids(bus_config.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await redis.aclose()
    worker_log = (out / "logs" / "rollout-0.log").read_text()
    assert worker_log.count("Initializing a V1 LLM engine") == 1, "one vLLM engine for the worker's life"
    assert "Injected <class 'tlt_stream.rollout.vllm.extension.TltWorkerExtension'>" in worker_log

    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) == STEPS * PROMPTS * GROUP, Counter(ids).most_common(3)
    ledgers = []
    for step in range(1, STEPS + 1):
        ledgers.append(set(json.loads((out / "checkpoints" / f"step-{step:08d}" / "ledger.json").read_text())))
    trained = [ledgers[0], *(b - a for a, b in itertools.pairwise(ledgers))]
    assert all(a <= b for a, b in itertools.pairwise(ledgers)), "a ledger lost a sample"
    assert sorted(i for update in trained for i in update) == sorted(ids), "every sample trained exactly once"
    version_of = {s.sample_id: s.policy_version for s in samples}
    for step, update in enumerate(trained, start=1):  # on-policy: update k trains samples of version k - 1
        assert {version_of[i] for i in update} == {step - 1}, (step, Counter(version_of[i] for i in update))
    assert {s.policy_version for s in samples} == set(range(STEPS)), "each version generated in the one engine"
    assert all(s.token_ids.to_torch().numel() == s.logprobs.to_torch().numel() > 0 for s in samples)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a few MB each; the audit is done

"""The RL loop with vLLM rollout workers: `tlt-stream run --set rollout.backend=vllm` on a world vLLM's CPU
attention takes (head_dim 32), the policy service, a vLLM rollout worker and the learner as processes of their
own on the test's Redis and MQTT, audited afterwards from outside the services: Redis's count of entries ever
added to the `prompts` and `samples` streams, the sample ids (the policy service names each task by its step),
every checkpoint's ledger, and vLLM's own log lines in the worker's log."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from tests.vllm.conftest import hf_policy, requires_vllm
from tlt_stream.basics.config import Config
from tlt_stream.bus.streams import Keys

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
    out = tmp_path / "run"
    command = [
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--run", bus_config.run),
        *("--world", str(world(tmp_path / "w"))),
        *("--out", str(out), "--steps", str(STEPS), "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP)),
        *("--max-len", "96", "--eval", "0", "--fixed-sd", "--set", "rollout.backend=vllm"),
    ]
    env = {**os.environ, "TLT_REDIS_URL": bus_config.bus.redis_url, "TLT_MQTT_URL": bus_config.bus.mqtt_url}
    process = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.PIPE)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    try:
        async with asyncio.timeout(600):
            _, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()[-3000:]
        added = {}
        for name in ("prompts", "samples"):
            info = {
                str(k, "utf-8") if isinstance(k, bytes) else k: v
                for k, v in (await redis.xinfo_stream(keys.stream(name))).items()
            }
            added[name] = int(info["entries-added"])
    finally:
        for pid in run_pids(bus_config.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await redis.aclose()
    worker_log = (out / "logs" / "rollout-0.log").read_text()
    assert worker_log.count("Initializing a V1 LLM engine") == 1, "one vLLM engine for the worker's life"
    assert "Injected <class 'tlt_stream.rollout.vllm.extension.TltWorkerExtension'>" in worker_log

    assert added == {"prompts": STEPS * PROMPTS, "samples": STEPS * PROMPTS * GROUP}, added  # none sent twice
    ledgers = [
        set(json.loads((out / "checkpoints" / f"step-{step:08d}" / "ledger.json").read_text()))
        for step in range(1, STEPS + 1)
    ]
    assert all(a <= b for a, b in itertools.pairwise(ledgers)), "a ledger lost a sample"
    trained = [ledgers[0], *(b - a for a, b in itertools.pairwise(ledgers))]
    assert sum(len(update) for update in trained) == len(ledgers[-1]) == added["samples"], "each trained once"
    for step, update in enumerate(trained, start=1):  # on-policy: update k trains the groups dispatched at k - 1
        groups = Counter(sample_id.split("/")[0] for sample_id in update)
        assert len(groups) == PROMPTS and set(groups.values()) == {GROUP}, groups
        assert all(group.startswith(f"s{step - 1:06d}-") for group in groups), (step, groups)

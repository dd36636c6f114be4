"""The RL loop on vLLM with lossless partial rollouts: `tlt-stream run --set rollout.backend=vllm --set
policy.partial_rollouts=true` (policy service, a vLLM rollout worker and the learner as processes of their own),
audited afterwards from outside the services: Redis's count of entries ever added to `prompts` and `samples`,
the tasks in `prompts` (later steps went out as drafts of the version before), every sample in `samples`
(stamped with its step's version, its behaviour log-probs recomputed by transformers from the checkpoint of that
version: a draft that skipped re-verification would carry the older policy's), and the checkpoint ledgers."""

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

from tests.integration.partial_oracle import hf_logprobs
from tests.vllm.conftest import requires_vllm
from tests.vllm.test_loop import run_pids, world
from tlt_stream.basics.config import DEFAULTS, Config
from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.streams import Keys

pytestmark = [*requires_vllm, pytest.mark.redis, pytest.mark.mqtt]

STEPS, PROMPTS, GROUP, AHEAD = 3, 2, 4, 6


async def entries(redis: aioredis.Redis, keys: Keys, name: str) -> tuple[int, list]:
    """(entries ever added, the messages still there) of a stream."""
    stream = keys.stream(name)
    info = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (await redis.xinfo_stream(stream)).items()}
    messages = [codec_for(name).decode(fields[b"m"]) for _, fields in await redis.xrange(stream)]
    return int(info["entries-added"]), messages


async def audit_groups(redis: aioredis.Redis, keys: Keys, finished: asyncio.Future) -> None:
    """The audit's own consumer groups on `prompts` and `samples` (entries a group never read are never
    trimmed), made as soon as the run's first prompts are out (the run refuses a run name that already has
    state): nothing is acked, so nothing trimmed, before a worker's vLLM engine has started, seconds later."""
    # another process creates the key, and Redis sends no event for it: poll
    while not await redis.exists(keys.stream("prompts")) and not finished.done():  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    for name in ("prompts", "samples"):
        await redis.xgroup_create(keys.stream(name), "audit", id="0", mkstream=True)


async def test_the_loop_on_vllm_with_partial_rollouts_trains_exact_on_policy_samples_once(
    one_backend: str, bus_config: Config, tmp_path: Path
) -> None:
    keys = Keys(bus_config.run)
    out = tmp_path / "run"
    root = world(tmp_path / "w")
    # A reward that differs within a group (this random policy never solves the task: with the task's reward every
    # advantage is 0, no update moves the policy, and nothing would tell a stale draft from a re-verified one).
    reward = tmp_path / "reward.py"
    reward.write_text("def varied(response, answer):\n    return float(sum(map(ord, response)) % 2)\n")
    command = [
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--run", bus_config.run),
        *("--world", str(root), "--out", str(out), "--steps", str(STEPS)),
        *("--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP), "--max-len", "96", "--eval", "0"),
        *("--fixed-sd", "--set", "rollout.backend=vllm", "--set", "policy.partial_rollouts=true"),
        *(
            "--set",
            f"policy.ahead_tokens={AHEAD}",
            "--set",
            "learner.lr=2e-3",
            "--set",
            f"rollout.reward={reward}:varied",
        ),
    ]
    env = {**os.environ, "TLT_REDIS_URL": bus_config.bus.redis_url, "TLT_MQTT_URL": bus_config.bus.mqtt_url}
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    process = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(600):
            finished = asyncio.ensure_future(process.communicate())
            await audit_groups(redis, keys, finished)
            _, stderr = await finished
        assert process.returncode == 0, stderr.decode()[-3000:]
        added_prompts, prompts = await entries(redis, keys, "prompts")
        added_samples, samples = await entries(redis, keys, "samples")
    finally:
        for pid in run_pids(bus_config.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await redis.aclose()
    worker_log = (out / "logs" / "rollout-0.log").read_text()
    assert worker_log.count("Initializing a V1 LLM engine") == 1, "one vLLM engine for the worker's life"

    assert (added_prompts, added_samples) == (STEPS * PROMPTS, STEPS * PROMPTS * GROUP)  # none sent twice
    drafts = [t for t in prompts if t.draft_version is not None]
    assert {t.step for t in drafts} >= {1, 2}, "steps 1.. went out as drafts of the version before"
    ledgers = [
        set(json.loads((out / "checkpoints" / f"step-{step:08d}" / "ledger.json").read_text()))
        for step in range(1, STEPS + 1)
    ]
    assert all(a <= b for a, b in itertools.pairwise(ledgers)), "a ledger lost a sample"
    trained = [ledgers[0], *(b - a for a, b in itertools.pairwise(ledgers))]
    assert sum(len(update) for update in trained) == len(ledgers[-1]) == added_samples, "each trained once"
    for step, update in enumerate(trained, start=1):  # on-policy: update k trains the groups dispatched at k - 1
        groups = Counter(sample_id.split("/")[0] for sample_id in update)
        assert len(groups) == PROMPTS and set(groups.values()) == {GROUP}, groups
        assert all(group.startswith(f"s{step - 1:06d}-") for group in groups), (step, groups)

    # Staleness 0: each sample stamped with its step's version, with that version's log-probs (transformers).
    locations = {0: root / "policy", **{v: out / "checkpoints" / f"step-{v:08d}" / "policy" for v in range(1, STEPS)}}
    assert len(samples) == added_samples and all(s.policy_version == s.step for s in samples)
    assert len(prompts) == added_prompts
    temperature = DEFAULTS.rollout.temperature
    moved = []
    for s in samples:
        response = s.token_ids.to_torch().tolist()
        expected = hf_logprobs(locations[s.policy_version], s.prompt_ids, response, temperature)
        torch.testing.assert_close(s.logprobs.to_torch(), expected, atol=2e-4, rtol=1e-4)
        if s.policy_version > 0:
            older = hf_logprobs(locations[s.policy_version - 1], s.prompt_ids, response, temperature)
            moved.append(float((older - expected).abs().max()))
    print(
        f"largest log-prob change from the version before, per sample of versions 1..: {[round(m, 3) for m in moved]}"
    )
    assert moved and min(moved) > 1e-2, f"versions too alike for the check to see a stale draft: {moved}"

"""Lossless partial rollouts in the pipeline (issue 24): an on-policy run whose next step starts early, as
drafts of the version before, and is re-verified when its version arrives.

Evidence the code under test did not write: the sample ids in Redis and in the learner's ledger, every
sample's behaviour logprobs recomputed with Hugging Face transformers from the checkpoint of the version it
is stamped with (a draft that skipped re-verification would carry the older policy's logprobs), the tasks
in `prompts` (later steps went out as drafts), and the engine's own `load_policy` calls as the test saw
them (re-verifying loads with rows in flight: the path really ran).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from tests.integration.loop import keep_for_audit
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.streams import Keys
from tlt_stream.config import Config
from tlt_stream.messages import codec_for
from tlt_stream.rl.checkpoint import complete_checkpoints
from tlt_stream.rl.learner import LearnerSettings
from tlt_stream.roles.learner import LearnerRunSettings, LearnerService
from tlt_stream.roles.policy import PolicyService, RepeatedAddSource
from tlt_stream.roles.rollout_worker import RolloutSettings, RolloutWorker
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

STEPS, PROMPTS, GROUP, AHEAD = 3, 2, 2, 6


def varied_reward(response: str, answer: str) -> float:
    """A reward that differs within a group (the test policy never solves the task: with the task's reward
    every advantage is 0 and no update changes the policy, so nothing would tell versions apart)."""
    return float(len(response) % 2)


def hf_logprobs(location: Path, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the response tokens under the checkpoint at `location` (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(location, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [n, V]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


async def test_an_on_policy_run_with_partial_rollouts_trains_only_exact_on_policy_samples(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, one_backend: str
) -> None:
    loads: list[tuple[bool, int]] = []  # (reverify, rows holding tokens) per load, as the test saw the calls
    original = GenerationEngine.load_policy

    def spy(engine: GenerationEngine, path: object, *, reverify: bool = False, **verified: object) -> None:
        loads.append((reverify, engine.num_parked + engine.num_running))
        original(engine, path, reverify=reverify, **verified)

    monkeypatch.setattr(GenerationEngine, "load_policy", spy)
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    await keep_for_audit(redis, keys)
    planes = {
        role: ControlPlane(bus_config, redis, role=role, owns=["policy"] if role == "learner" else [])
        for role in ("learner", "policy", "rollout")
    }
    stop = asyncio.Event()
    tasks = [asyncio.create_task(plane.run(stop)) for plane in planes.values()]
    services: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(plane.connected.wait() for plane in planes.values()))
        learner = LearnerService(
            bus_config,
            redis,
            planes["learner"],
            run_dir=tmp_path / "run",
            init_policy=init_policy,
            # Updates large enough that consecutive versions' logprobs differ far beyond the tolerance below (the
            # defaults barely move the test policy: a draft kept with its old logprobs would pass unnoticed).
            settings=LearnerRunSettings(
                groups_per_step=PROMPTS,
                max_staleness=0,
                keep_checkpoints=STEPS + 2,
                learner=LearnerSettings(lr=1e-2, warmup_steps=0),
            ),
        )
        dispatcher = PolicyService(
            bus_config,
            redis,
            planes["policy"],
            RepeatedAddSource(build_tokenizer(), seed=3),
            prompts_per_step=PROMPTS,
            group_size=GROUP,
            total_steps=STEPS,
            partial_rollouts=True,
        )
        settings = RolloutSettings(
            max_batch=8, max_len=96, max_response_len=24, partial_rollouts=True, ahead_tokens=AHEAD
        )
        worker = RolloutWorker(
            bus_config, redis, planes["rollout"], worker_id="w0", reward=varied_reward, settings=settings
        )
        await learner.start()

        services = [
            asyncio.create_task(learner.run(stop, max_updates=STEPS)),
            asyncio.create_task(dispatcher.run(stop)),
            asyncio.create_task(worker.run(stop)),
        ]
        async with asyncio.timeout(180):
            while not services[0].done():
                running = [task for task in services if not task.done()]
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
        assert learner.version == STEPS
        expected = {f"s{s:06d}-{i:04d}/{g}" for s in range(STEPS) for i in range(PROMPTS) for g in range(GROUP)}
        assert learner.assembler.ledger == expected, "every dispatched sample trained exactly once"
        assert learner.assembler.dropped_groups == 0, "nothing was too stale: the run stayed on-policy"

        prompts = [codec_for("prompts").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("prompts"))]
        drafts = {t.task_id: t for t in prompts if t.draft_version is not None}
        assert {t.step for t in drafts.values()} >= {1, 2}, "steps 1.. went out as drafts of the version before"
        assert all(t.draft_version == t.min_policy_version - 1 for t in drafts.values())

        samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
        assert {s.sample_id for s in samples} == expected and len(samples) == len(expected)
        assert all(s.policy_version == s.step for s in samples), "each sample stamped with its step's version"
        # The stamp is true: every response's logprobs are its stamped version's, recomputed by transformers.
        locations = {info.step: info.policy_dir for info in complete_checkpoints(learner.checkpoints)}
        moved: list[float] = []
        for s in samples:
            response = s.token_ids.to_torch().tolist()
            if not response:
                continue
            expected_lp = hf_logprobs(locations[s.policy_version], s.prompt_ids, response, settings.temperature)
            torch.testing.assert_close(s.logprobs.to_torch(), expected_lp, atol=2e-4, rtol=1e-4)
            if s.policy_version > 0:  # the check has power: the version before would have given other logprobs
                older = hf_logprobs(locations[s.policy_version - 1], s.prompt_ids, response, settings.temperature)
                moved.append(float((older - expected_lp).abs().max()))
        assert moved and min(moved) > 1e-2, f"versions too alike for the check to see a stale draft: {moved}"
        # Drafts really ran ahead: versions 1.. were loaded re-verifying rows already holding tokens.
        assert any(reverify and rows > 0 for reverify, rows in loads), loads
        assert worker.engine.tokens_kept + worker.engine.tokens_discarded >= AHEAD
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for service in services:
            await asyncio.gather(service, return_exceptions=True)
        await redis.aclose()

"""Lossless partial rollouts in the pipeline (issue 24): an on-policy run whose next step starts early, as
drafts of the version before, and is re-verified when its version arrives; and a streaming run whose rows
in flight are re-verified at every new version.

Evidence the code under test did not write: the sample ids in Redis and in the learner's ledger, the groups
each update trained as the test saw the calls, every sample's behaviour logprobs recomputed with Hugging Face
transformers from the checkpoint of the version it is stamped with (a draft that skipped re-verification
would carry the older policy's logprobs), the exact first-token distribution of each version at the run's
prompts from transformers' logits (a draft re-verified by any rule but the lossless one follows another
distribution there, whatever logprobs it carries), the tasks in `prompts` (later steps went out as drafts),
and the engine's own `load_policy` calls as the test saw them (re-verifying loads with rows in flight: the
path really ran).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tlt_stream.roles.worker.generation as worker_generation
from tests.integration.loop import keep_for_audit, until_first_done
from tests.integration.partial_oracle import first_token_distributions, hf_logprobs, noncentrality, power
from tests.stats import chi2_threshold, chi_square
from tlt_stream.basics.config import DEFAULTS, Config, override
from tlt_stream.basics.messages import PromptGroup, Sample, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.checkpoint import complete_checkpoints
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.learner_parts.update import Updates
from tlt_stream.roles.policy import PolicyService, RepeatedAddSource
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.roles.worker.generation import Generation
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


def rollout_settings(max_batch: int, max_len: int, **policy: object) -> dict[str, Any]:
    """A worker with partial rollouts on: its batch shape and the policy section's partial-rollout keys
    (`max_response_len` is the rollout section's)."""
    values: dict[str, Any] = {"rollout.max_batch": max_batch, "rollout.max_len": max_len}
    values["policy.partial_rollouts"] = True
    if "max_response_len" in policy:
        values["rollout.max_response_len"] = policy.pop("max_response_len")
    return values | {f"policy.{key}": value for key, value in policy.items()}


def varied_reward(response: str, answer: str) -> float:
    """A reward that differs within a group (the test policy never solves the task: with the task's reward
    every advantage is 0 and no update changes the policy, so nothing would tell versions apart)."""
    return float(len(response) % 2)


@dataclass
class PipelineRun:
    """What a run left, as the test saw it."""

    learner: LearnerService
    worker: RolloutWorker
    prompts: list[PromptGroup]
    samples: list[Sample]
    """Every entry of `samples`, in stream order."""
    locations: dict[int, Path]
    """Policy version -> its checkpoint's policy directory."""
    loads: list[tuple[bool, int]]
    """(reverify, rows holding tokens) per `load_policy` call."""
    trained: list[tuple[int, list[Sample]]]
    """(learner version before the update, its samples) per update applied."""
    reverified: dict[str, int]
    """Sample id -> times a newly loaded policy re-verified its response."""
    dropped: set[str]
    """Task ids the learner dropped as too stale (`Keys.dropped`)."""


async def run_pipeline(
    config: Config,
    run_dir: Path,
    init_policy: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    steps: int,
    prompts: int,
    group: int,
    max_staleness: int,
    lr: float,
    rollout: dict[str, Any],
    reward: Callable[[str, str], float] = varied_reward,
    seconds: float = 180,
) -> PipelineRun:
    """A learner, a policy service and one worker (its settings `rollout`, dotted keys), with partial rollouts,
    until `steps` updates are done."""
    loads: list[tuple[bool, int]] = []
    trained: list[tuple[int, list[Sample]]] = []
    reverified: dict[str, int] = {}
    original_load, original_update = GenerationEngine.load_policy, Updates.update
    original_sample = worker_generation.make_sample

    def load_spy(engine: GenerationEngine, path: object, *, reverify: bool = False, **verified: object) -> None:
        loads.append((reverify, engine.num_parked + engine.num_running))
        original_load(engine, path, reverify=reverify, **verified)

    async def update_spy(updates: Updates, groups: list[ReadyGroup]) -> dict[str, float]:
        version = updates.checkpoints.version
        metrics = await original_update(updates, groups)
        trained.append((version, [s for g in groups for s in g.samples]))
        return metrics

    def sample_spy(result: Any, group: PromptGroup, index: int, **fields: Any) -> Sample:
        sample = original_sample(result, group, index, **fields)
        reverified[sample.sample_id] = result.reverifications
        return sample

    monkeypatch.setattr(GenerationEngine, "load_policy", load_spy)
    monkeypatch.setattr(Updates, "update", update_spy)
    monkeypatch.setattr(worker_generation, "make_sample", sample_spy)
    keys = Keys(config.run)
    redis = connect_redis(config.bus.redis_url)
    await keep_for_audit(redis, keys)
    planes = {
        role: ControlPlane(config, redis, role=role, owns=["policy"] if role == "learner" else [])
        for role in ("learner", "policy", "rollout")
    }
    stop = asyncio.Event()
    tasks = [asyncio.create_task(plane.run(stop)) for plane in planes.values()]
    services: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(plane.connected.wait() for plane in planes.values()))
        learning = {
            "learner.groups_per_step": prompts,
            "policy.prompts_per_step": prompts,  # what the policy service below dispatches
            "policy.max_staleness": max_staleness,
            "learner.keep_checkpoints": steps + 2,
            "learner.lr": lr,
            "learner.warmup_steps": 0,
        }
        learner = LearnerService(
            override(config, learning), redis, planes["learner"], run_dir=run_dir, init_policy=init_policy
        )
        dispatcher = PolicyService(
            config,
            redis,
            planes["policy"],
            RepeatedAddSource(build_tokenizer(), seed=3),
            prompts_per_step=prompts,
            group_size=group,
            max_staleness=max_staleness,
            total_steps=steps,
            partial_rollouts=True,
        )
        worker = RolloutWorker(override(config, rollout), redis, planes["rollout"], worker_id="w0", reward=reward)
        await learner.start()
        services = [
            asyncio.create_task(learner.run(stop, max_updates=steps)),
            asyncio.create_task(dispatcher.run(stop)),
            asyncio.create_task(worker.run(stop)),
        ]
        await until_first_done(services, seconds)
        return PipelineRun(
            learner=learner,
            worker=worker,
            prompts=[codec_for("prompts").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("prompts"))],
            samples=[codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))],
            locations={info.step: info.policy_dir for info in complete_checkpoints(learner.checkpoints.root)},
            loads=loads,
            trained=trained,
            reverified=reverified,
            dropped={k.decode() for k in await redis.hkeys(keys.dropped)},
        )
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for service in services:
            await asyncio.gather(service, return_exceptions=True)
        await redis.aclose()


def assert_stamps_are_true(run: PipelineRun, temperature: float) -> None:
    """Every response's logprobs are its stamped version's, recomputed by transformers; and the check has
    power: the version before would have given other logprobs."""
    moved: list[float] = []
    for s in run.samples:
        response = s.token_ids.to_torch().tolist()
        if not response:
            continue
        expected = hf_logprobs(run.locations[s.policy_version], s.prompt_ids, response, temperature)
        torch.testing.assert_close(s.logprobs.to_torch(), expected, atol=2e-4, rtol=1e-4)
        if s.policy_version > 0:
            older = hf_logprobs(run.locations[s.policy_version - 1], s.prompt_ids, response, temperature)
            moved.append(float((older - expected).abs().max()))
    assert moved and min(moved) > 1e-2, f"versions too alike for the check to see a stale draft: {moved}"


STEPS, PROMPTS, GROUP, AHEAD = 3, 2, 2, 6


async def test_an_on_policy_run_with_partial_rollouts_trains_only_exact_on_policy_samples(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, one_backend: str
) -> None:
    settings = rollout_settings(8, 96, max_response_len=24, ahead_tokens=AHEAD)
    # Updates large enough that consecutive versions' logprobs differ far beyond the tolerance of the stamp
    # check (the defaults barely move the test policy: a draft kept with its old logprobs would pass unnoticed).
    run = await run_pipeline(
        bus_config,
        tmp_path / "run",
        init_policy,
        monkeypatch,
        steps=STEPS,
        prompts=PROMPTS,
        group=GROUP,
        max_staleness=0,
        lr=1e-2,
        rollout=settings,
    )
    assert run.learner.version == STEPS
    expected = {f"s{s:06d}-{i:04d}/{g}" for s in range(STEPS) for i in range(PROMPTS) for g in range(GROUP)}
    assert run.learner.intake.assembler.ledger == expected, "every dispatched sample trained exactly once"
    assert run.learner.intake.assembler.dropped_groups == 0, "nothing was too stale: the run stayed on-policy"
    assert all(v == s.policy_version for v, samples in run.trained for s in samples), "staleness 0 throughout"

    drafts = {t.task_id: t for t in run.prompts if t.draft_version is not None}
    assert {t.step for t in drafts.values()} >= {1, 2}, "steps 1.. went out as drafts of the version before"
    assert all(t.draft_version == t.min_policy_version - 1 for t in drafts.values())

    assert {s.sample_id for s in run.samples} == expected and len(run.samples) == len(expected)
    assert all(s.policy_version == s.step for s in run.samples), "each sample stamped with its step's version"
    assert_stamps_are_true(run, DEFAULTS.rollout.temperature)
    # Drafts really ran ahead: versions 1.. were loaded re-verifying rows already holding tokens.
    assert any(reverify and rows > 0 for reverify, rows in run.loads), run.loads
    assert run.worker.loader.engine.tokens_kept + run.worker.loader.engine.tokens_discarded >= AHEAD


def first_token_reward(response: str, answer: str) -> float:
    """1 when the response starts with a digit: a reward on the first token, so each update moves that
    token's distribution (at the distribution test's learning rate, far: all that test needs)."""
    return float(response[:1].isdigit())


async def test_drafts_reverified_in_an_on_policy_run_follow_their_stamped_versions_first_token_distribution(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, one_backend: str
) -> None:
    """Lossless: a sample stamped with version v is distributed as a fresh sample of checkpoint v. Its first
    token given the prompt follows softmax(logits / T) of that checkpoint exactly (transformers). A drafted
    response's first token was sampled under v - 1, so a re-verification that keeps old tokens it should
    reject leaves it (partly) at v - 1's distribution, while its logprobs may still be v's, which the stamp
    check cannot see. Per version v >= 1: Pearson's chi-square of the first
    tokens against v's exact distribution pooled over the run's prompts (`partial_oracle`), false-alarm rate
    1e-4 (2e-4 over both versions, Bonferroni). The test has power: had every drafted response kept its first
    token from v - 1, the same statistic would pass the threshold with probability >= 0.999 (non-centrality
    of that alternative on the run's own prompts and drafted rows)."""
    steps, prompts, group = 3, 32, 16
    settings = rollout_settings(2 * prompts * group, 96, max_response_len=2, ahead_tokens=1)
    run = await run_pipeline(
        bus_config,
        tmp_path / "run",
        init_policy,
        monkeypatch,
        steps=steps,
        prompts=prompts,
        group=group,
        max_staleness=0,
        lr=0.3,
        rollout=settings,
        reward=first_token_reward,
    )
    assert run.learner.version == steps and run.learner.intake.assembler.dropped_groups == 0
    assert all(v == s.policy_version for v, samples in run.trained for s in samples), "staleness 0 throughout"
    trained = [s for _, samples in run.trained for s in samples]
    assert sorted(s.sample_id for s in trained) == sorted(s.sample_id for s in run.samples)
    for version in range(1, steps):
        mine = [s for s in trained if s.policy_version == version]
        drafted = [run.reverified[s.sample_id] > 0 for s in mine]
        assert len(mine) == prompts * group and sum(drafted) >= len(mine) // 2, (version, sum(drafted))
        at = [s.prompt_ids for s in mine]
        p = first_token_distributions(run.locations[version], at, DEFAULTS.rollout.temperature)  # [N, V]
        q = first_token_distributions(run.locations[version - 1], at, DEFAULTS.rollout.temperature)
        stale = torch.where(torch.tensor(drafted)[:, None], q, p)  # drafts that kept their first token from q
        n = len(mine)
        expected, alternative = dict(enumerate(p.mean(dim=0).tolist())), dict(enumerate(stale.mean(dim=0).tolist()))
        observed = Counter(int(s.token_ids.to_torch()[0]) for s in mine)  # an EOS is a token of the response
        stat, df = chi_square(observed, expected, n)
        assert stat < chi2_threshold(df), (version, stat, df, chi2_threshold(df), observed.most_common(8))
        lam, _ = noncentrality(alternative, expected, n)
        assert power(lam, df, chi2_threshold(df)) >= 0.999, f"version {version} too like {version - 1}: {lam=}"


async def test_a_streaming_run_with_partial_rollouts_reverifies_rows_in_flight_and_trains_each_sample_once(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, one_backend: str
) -> None:
    """Streaming (`max_staleness 1`): nothing is dispatched early; a worker re-verifies the rows in flight at
    every new version instead of draining, and stamps each sample with the version it was last verified
    under. Every dispatched task is trained once, whole, or dropped as too stale and sent again (its copy is
    then trained, or dropped and sent again in turn); no trained sample is more than one version stale; and
    every sample carries the logprobs of the version it is stamped with."""
    steps, prompts, group = 4, 2, 4
    settings = rollout_settings(group, 96, max_response_len=48)
    # Rows must be in flight when a version arrives, whatever the machine's speed: once the worker decodes
    # only step 1's rows (started under version 0), hold its decoding after their second hop until version 1
    # is announced to it; its loop then loads version 1 over those rows before decoding them further.
    original_hop = Generation.hop
    hops: Counter[str] = Counter()

    async def gated_hop(generation: Generation) -> None:
        started, loader = generation.flight.started, generation.loader
        step_1_only = started and all(not task_id.startswith("s000000") for task_id in started)
        if "held" not in hops and loader.version == 0 and step_1_only:
            hops["step 1"] += 1
            if hops["step 1"] > 2 and loader.engine.num_running:
                async with asyncio.timeout(60):
                    while loader.loadable() is None:  # noqa: ASYNC110 (an MQTT delivery: no event to await)
                        await asyncio.sleep(0.01)
                hops["held"] += 1
                return  # the loop loads version 1 next, over the rows in flight
        await original_hop(generation)

    monkeypatch.setattr(Generation, "hop", gated_hop)
    run = await run_pipeline(
        bus_config,
        tmp_path / "run",
        init_policy,
        monkeypatch,
        steps=steps,
        prompts=prompts,
        group=group,
        max_staleness=1,
        lr=1e-2,
        rollout=settings,
    )
    assert run.learner.version == steps
    assert all(t.draft_version is None for t in run.prompts), "streaming dispatches nothing as a draft"
    trained = [s for _, samples in run.trained for s in samples]
    trained_ids = [s.sample_id for s in trained]
    assert len(trained_ids) == len(set(trained_ids)) == steps * prompts * group, "each trained once"
    assert all(0 <= v - s.policy_version <= 1 for v, samples in run.trained for s in samples), "staleness <= 1"

    dispatched = {t.task_id for t in run.prompts}
    assert {f"{task}.r" for task in run.dropped} <= dispatched, "every dropped group was sent again"
    ends = set()
    for task in (f"s{s:06d}-{i:04d}" for s in range(steps) for i in range(prompts)):
        while task in run.dropped:
            task += ".r"
        ends.add(task)
    assert set(trained_ids) == {f"{task}/{g}" for task in ends for g in range(group)}, "whole groups, none lost"
    in_redis = [s.sample_id for s in run.samples]
    assert len(in_redis) == len(set(in_redis)) and set(trained_ids) <= set(in_redis)
    assert {s.task_id for s in run.samples} <= ends | run.dropped, "nothing else was generated"
    assert {i.rsplit("/", 1)[0] for i in run.learner.intake.assembler.ledger - set(trained_ids)} <= run.dropped

    assert_stamps_are_true(run, DEFAULTS.rollout.temperature)
    # Re-verification really ran: versions 1.. were loaded over rows holding tokens, and trained samples of a
    # newer version than they started under carry what it kept.
    assert hops["held"] == 1, hops
    assert hops["held"] == 1, hops
    assert any(reverify and rows > 0 for reverify, rows in run.loads), run.loads
    assert any(run.reverified[i] > 0 for i in trained_ids), run.reverified
    assert run.worker.loader.engine.tokens_kept + run.worker.loader.engine.tokens_discarded > 0

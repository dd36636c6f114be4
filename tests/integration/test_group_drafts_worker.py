"""Group/history drafts across workers: a worker indexes another worker's finished responses, read from the
`samples` stream as they are produced, and drafts a later row of the same prompt from them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_rl_loop import learner_and_worker_planes, redis_entries
from tests.settings import replaced
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PromptGroup, Sample, Tensor, codec_for
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.rewards import resolve_reward
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


def group_arm(label: str) -> dict[str, Any]:
    """Group drafts alone (beside prompt lookup, which they include) with the fixed arm `label`."""
    return {"sd.drafter": "ngram", "sd.group": True, "sd.adaptive": False, "sd.arm": label}


async def worker_on_version_0(
    config: Config, planes: Any, worker: dict[str, Any], tmp_path: Path, init_policy: Path
) -> RolloutWorker:
    """A worker "w0" on the tiny task with the settings `worker` (dotted keys), and a learner that publishes
    version 0 (it consumes nothing here)."""
    learner = LearnerService(config, planes.redis, planes.learner, run_dir=tmp_path / "run", init_policy=init_policy)
    await learner.start()
    reward = resolve_reward("repeated_add")
    return RolloutWorker(replaced(config, worker), planes.redis, planes.worker, worker_id="w0", reward=reward)


async def test_another_workers_finished_response_drafts_this_workers_row_of_the_same_prompt(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    tokenizer = build_tokenizer()
    prompt = tokenizer.encode("Start at 1 and add 2, 3 times.\n")
    elsewhere = tokenizer.encode("1, 3, 5, 7. The answer is 7.")  # what "the other worker" wrote
    settings = {"rollout.max_batch": 4, "rollout.max_len": 96, **group_arm("group-d6v6")}
    async with learner_and_worker_planes(bus_config) as planes:
        worker = await worker_on_version_0(bus_config, planes, settings, tmp_path, init_policy)
        producer = StreamProducer(planes.redis, keys, bus_config.bus)
        running = asyncio.create_task(worker.run(planes.stop, max_tasks=1))
        async with asyncio.timeout(60):
            await worker.follower.following.wait()  # the follower reads from the stream's end on
            other = Sample(
                sample_id="elsewhere/0", task_id="elsewhere", prompt_id="p", index=0, group_size=1,
                prompt_ids=prompt, token_ids=Tensor.from_values(elsewhere, "int32"),
                logprobs=Tensor.from_values([-1.0] * len(elsewhere), "float32"), policy_version=0,
                drafter_version=-1, reward=1.0, finish_reason="eos", worker_id="w1",
            )  # fmt: skip
            await producer.send("samples", [other])
            while worker.follower.remembered < 1:  # noqa: ASYNC110 (a counter of the worker's, polled)
                await asyncio.sleep(0.05)
            task = PromptGroup(task_id="t0", prompt_id="p", prompt_ids=prompt, answer="7", group_size=2)
            await producer.send("prompts", [task])
            await running
    group = worker.follower._group_source()
    index = group.indexes[tuple(prompt)]
    assert any(index.tokens(doc)[-len(elsewhere) :] == elsewhere for doc in index.documents if doc != "prompt"), (
        "the other worker's response is indexed under the prompt"
    )
    assert worker.loader.engine.drafted_by["group"] > 0, "the worker's rows were drafted by the group source"
    stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "stats")]
    reported = sum(s.drafted.get("group", 0) for s in stats if getattr(s, "drafted", None) is not None)
    assert reported == worker.loader.engine.drafted_by["group"], "the stats stream carries every drafted group node"
    samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "samples")]
    assert sorted(s.sample_id for s in samples if s.worker_id == "w0") == ["t0/0", "t0/1"]


async def test_a_policy_swap_is_judged_by_the_acceptance_measured_before_and_after_it(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    """Greedy rows of one prompt under policy A, then under policy B (other weights): the worker judges the
    swap from the engine's real counts, once, with a baseline from before it. (B's greedy text is a loop its
    own rows draft well: no collapse here; the collapse rule itself is tested in tests/unit/test_collapse.py.)"""
    from tests.worlds import tiny_policy
    from tlt_stream.basics.messages import PolicyVersion, RolloutStats
    from tlt_stream.store.digest import directory_sha256

    other = tiny_policy(tmp_path / "other", seed=7)
    keys = Keys(bus_config.run)
    prompt = build_tokenizer().encode("Start at 4 and add 3, 2 times.\n")
    settings = {
        "rollout.max_batch": 4, "rollout.max_len": 96, "rollout.temperature": 0.0, **group_arm("group-d8v8"),
        "sd.collapse_min_drafted": 48,
    }  # fmt: skip
    async with learner_and_worker_planes(bus_config) as planes:
        worker = await worker_on_version_0(bus_config, planes, settings, tmp_path, init_policy)
        producer = StreamProducer(planes.redis, keys, bus_config.bus)

        async def task(name: str) -> None:
            await producer.send(
                "prompts", [PromptGroup(task_id=name, prompt_id="p", prompt_ids=prompt, answer="10", group_size=2)]
            )
            await worker.run(planes.stop, max_tasks=1)

        async with asyncio.timeout(120):
            await task("a1")
            await task("a2")  # drafted from a1's responses: greedy, the same text
            await planes.learner.publish(
                PolicyVersion(version=1, location=str(other), sha256=directory_sha256(other), step=1)
            )
            while worker.version != 1:  # the worker loads between tasks
                await worker.load_announced()
                await asyncio.sleep(0.05)
            await task("b1")
    verdicts = [v for v in worker.drafters.watch.verdicts if v.kind == "policy" and v.version == 1]
    assert len(verdicts) == 1 and verdicts[0].before is not None, worker.drafters.watch.verdicts
    stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "stats")]
    rollout = [s for s in stats if isinstance(s, RolloutStats)]
    drafted = sum(s.drafted.get("group", 0) for s in rollout)
    accepted = sum(s.accepted.get("group", 0) for s in rollout)
    assert drafted == worker.loader.engine.drafted_by["group"] and accepted == worker.loader.engine.accepted_by["group"]
    assert verdicts[0].collapsed == (verdicts[0].after < 0.5 * verdicts[0].before)
    assert worker.drafters.collapses == int(verdicts[0].collapsed) == rollout[-1].collapses

"""Group/history drafts across workers: a worker indexes another worker's finished responses, read from the
`samples` stream as they are produced, and drafts a later row of the same prompt from them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.test_rl_loop import learner_and_worker_planes, redis_entries
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.config import Config
from tlt_stream.messages import PromptGroup, Sample, Tensor, codec_for
from tlt_stream.rl.rewards import resolve_reward
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.rollout_worker import RolloutSettings, RolloutWorker
from tlt_stream.rollout.arms import Arm
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


async def test_another_workers_finished_response_drafts_this_workers_row_of_the_same_prompt(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    tokenizer = build_tokenizer()
    prompt = tokenizer.encode("Start at 1 and add 2, 3 times.\n")
    elsewhere = tokenizer.encode("1, 3, 5, 7. The answer is 7.")  # what "the other worker" wrote
    settings = RolloutSettings(max_batch=4, max_len=96, drafter="ngram", sd_arm=Arm.group_source(6, 6), group=True)
    async with learner_and_worker_planes(bus_config) as planes:
        worker = RolloutWorker(
            bus_config, planes.redis, planes.worker, worker_id="w0", reward=resolve_reward("repeated_add"),
            settings=settings,
        )  # fmt: skip
        learner = LearnerService(
            bus_config, planes.redis, planes.learner, run_dir=tmp_path / "run", init_policy=init_policy
        )
        await learner.start()  # publishes version 0; it consumes nothing here
        producer = StreamProducer(planes.redis, keys, bus_config.bus)
        running = asyncio.create_task(worker.run(planes.stop, max_tasks=1))
        async with asyncio.timeout(60):
            await worker.following.wait()  # the follower reads from the stream's end on
            other = Sample(
                sample_id="elsewhere/0", task_id="elsewhere", prompt_id="p", index=0, group_size=1,
                prompt_ids=prompt, token_ids=Tensor.from_values(elsewhere, "int32"),
                logprobs=Tensor.from_values([-1.0] * len(elsewhere), "float32"), policy_version=0,
                drafter_version=-1, reward=1.0, finish_reason="eos", worker_id="w1",
            )  # fmt: skip
            await producer.send("samples", [other])
            while worker.remembered < 1:  # noqa: ASYNC110 (a counter of the worker's, polled)
                await asyncio.sleep(0.05)
            task = PromptGroup(task_id="t0", prompt_id="p", prompt_ids=prompt, answer="7", group_size=2)
            await producer.send("prompts", [task])
            await running
    group = worker._group_source()
    trie = group.tries[tuple(prompt)]
    assert any(trie.tokens(doc)[-len(elsewhere) :] == elsewhere for doc in trie.documents if doc != "prompt"), (
        "the other worker's response is indexed under the prompt"
    )
    assert worker.engine.drafted_by["group"] > 0, "the worker's rows were drafted by the group source"
    stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "stats")]
    reported = sum(s.drafted.get("group", 0) for s in stats if getattr(s, "drafted", None) is not None)
    assert reported == worker.engine.drafted_by["group"], "the stats stream carries every drafted group node"
    samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "samples")]
    assert sorted(s.sample_id for s in samples if s.worker_id == "w0") == ["t0/0", "t0/1"]

"""A worker scoring with a reward pool: a reward that raises on one group and hangs on another costs those two
groups (to `dead` whole, never scored 0) and nothing else; generation goes on while groups are scored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.test_rl_loop import learner_and_worker_planes, redis_entries
from tlt_stream.basics.config import Config, override
from tlt_stream.basics.messages import PromptGroup, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.reward_pool import RewardPool
from tlt_stream.rl.rewards import resolve_reward
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

REWARD = """
import time

def score(response, answer):
    if answer == "raise":
        raise ValueError("cannot score this one")
    if answer == "hang":
        time.sleep(3600)
    return float(len(response) % 2)
"""


async def test_a_raising_and_a_hanging_reward_cost_their_groups_whole_and_nothing_else(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    (tmp_path / "user_reward.py").write_text(REWARD)
    name = f"{tmp_path / 'user_reward.py'}:score"
    keys = Keys(bus_config.run)
    prompt = build_tokenizer().encode("Start at 1 and add 2, 1 times.\n")
    answers = {"good-0": "1", "raise": "raise", "hang": "hang", "good-1": "2"}
    tasks = [PromptGroup(task_id=t, prompt_id=t, prompt_ids=prompt, answer=a, group_size=2) for t, a in answers.items()]
    pool = RewardPool(name, workers=1, timeout_s=3.0)
    try:
        async with learner_and_worker_planes(bus_config) as planes:
            worker = RolloutWorker(
                override(bus_config, {"rollout.max_batch": 8, "rollout.max_len": 96}), planes.redis, planes.worker,
                worker_id="w0", reward=resolve_reward(name), reward_pool=pool,
            )  # fmt: skip
            learner = LearnerService(
                bus_config, planes.redis, planes.learner, run_dir=tmp_path / "run", init_policy=init_policy
            )
            await learner.start()
            await StreamProducer(planes.redis, keys, bus_config.bus).send("prompts", tasks)
            # Groups finish (and are scored) in whatever order generation and the pool give: run the worker
            # until every task is sent or dead, whichever the last one is (run(max_tasks) counts sent ones only).
            running = asyncio.create_task(worker.run(planes.stop))
            async with asyncio.timeout(90):
                while worker.generation.tasks_done + worker.intake.invalid_tasks < len(tasks):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            planes.stop.set()
            await running
    finally:
        pool.close()
    samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "samples")]
    assert sorted(s.sample_id for s in samples) == ["good-0/0", "good-0/1", "good-1/0", "good-1/1"]
    assert all(s.reward == len(s.token_ids.to_torch()) % 2 or s.reward in (0.0, 1.0) for s in samples)
    dead = [codec_for("dead").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "dead")]
    reasons = {codec_for("prompts").decode(d.payload).task_id: d.reason for d in dead}
    assert set(reasons) == {"raise", "hang"}, reasons
    assert "the reward raised: ValueError: cannot score this one" in reasons["raise"]
    assert "ran past its timeout of 3 s" in reasons["hang"]
    assert worker.generation.reward_failures == 2 and worker.intake.invalid_tasks == 2 and pool.timeouts == 1
    redis = connect_redis(bus_config.bus.redis_url)  # recorded for the policy service to replace
    assert await redis.hgetall(keys.lost) == {b"raise": b"0", b"hang": b"0"}
    await redis.aclose()

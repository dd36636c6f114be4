"""Streaming: a group the learner drops as too stale is sent again, once, with the same prompt, so the run
still gets the groups its steps need (it used to wait for ever at its last step). Evidence from Redis: the
`prompts` entries themselves, before and after a restart of the policy service."""

from __future__ import annotations

import pytest

from tests.integration.loop import prompt_tasks
from tlt_stream.basics.config import Config
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.policy import PolicyService, RepeatedAddSource
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis]


async def test_a_dropped_group_is_sent_again_once_with_its_prompt_even_across_a_restart(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)

    def service() -> PolicyService:
        control = ControlPlane(bus_config, redis, role="policy")
        source = RepeatedAddSource(build_tokenizer(), seed=3)
        return PolicyService(
            bus_config, redis, control, source, prompts_per_step=2, group_size=2, max_staleness=1, total_steps=3
        )

    first = service()
    await first.dispatch(0)
    await first.dispatch(1)
    assert await first.replace_dropped() == 0, "nothing dropped, nothing sent"
    original = {t.task_id: t for t in await prompt_tasks(redis, keys)}
    await redis.hsetnx(keys.dropped, "s000001-0001", 1)  # what the learner writes when it drops the group

    assert await first.replace_dropped() == 1
    again = (await prompt_tasks(redis, keys))[-1]
    old = original["s000001-0001"]
    assert again.task_id == "s000001-0001.r" and again.step == 1 and again.group_size == 2
    assert (again.prompt_id, again.prompt_ids, again.answer) == (old.prompt_id, old.prompt_ids, old.answer)
    assert again.draft_version is None and again.min_policy_version == 0  # the newest version there is

    assert await first.replace_dropped() == 0
    assert await service().replace_dropped() == 0, "a restarted policy service sends nothing twice"
    assert len(await prompt_tasks(redis, keys)) == 5

    await redis.hsetnx(keys.dropped, "s000001-0001.r", 1)  # the copy went stale as well
    assert await service().replace_dropped() == 1
    last = (await prompt_tasks(redis, keys))[-1]
    assert last.task_id == "s000001-0001.r.r" and last.prompt_ids == old.prompt_ids
    assert {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.replaced)).items()} == {
        "s000001-0001": "s000001-0001.r",
        "s000001-0001.r": "s000001-0001.r.r",
    }
    await redis.aclose()

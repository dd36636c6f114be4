"""Where a rollout worker's generating time goes beside its engine hops: each stats report carries the
seconds its loop spent outside the hops, per part (`RolloutStats.loop_s`). Checked against the wall clock
this test keeps around the worker: hops and loop parts together never exceed it (no part counts a hop, none
is counted twice), and the parts every pass runs were measured."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.integration.test_group_drafts_worker import worker_on_version_0
from tests.integration.test_rl_loop import learner_and_worker_planes, redis_entries
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PromptGroup, RolloutStats, codec_for
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.worker.reports import LOOP_PARTS
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


async def test_the_loops_time_beside_the_hops_is_reported_by_part_within_the_wall_clock(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    prompt = build_tokenizer().encode("Start at 4 and add 3, 2 times.\n")
    settings = {"rollout.max_batch": 4, "rollout.max_len": 48, "rollout.steps_per_hop": 2}
    async with learner_and_worker_planes(bus_config) as planes:
        worker = await worker_on_version_0(bus_config, planes, settings, tmp_path, init_policy)
        producer = StreamProducer(planes.redis, keys, bus_config.bus)
        groups = [
            PromptGroup(task_id=f"t{i}", prompt_id="p", prompt_ids=prompt, answer="10", group_size=4) for i in range(3)
        ]
        await producer.send("prompts", groups)
        await worker.load_announced()  # version 0 loaded before the clock starts: a load is not loop time
        started = time.perf_counter()
        async with asyncio.timeout(120):
            await worker.run(planes.stop, max_tasks=len(groups))
        wall = time.perf_counter() - started
        stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "stats")]
    reports = [s for s in stats if isinstance(s, RolloutStats)]
    assert reports, stats
    loop: dict[str, float] = {}
    for report in reports:
        assert set(report.loop_s) <= set(LOOP_PARTS), report.loop_s
        for part, seconds in report.loop_s.items():
            loop[part] = loop.get(part, 0.0) + seconds
    hops = sum(r.seconds for r in reports)
    assert hops > 0 and sum(r.tokens for r in reports) > 0
    for part in ("refresh", "drafter", "admit", "rows", "scored", "tasks", "output", "judge"):  # every pass with a hop
        assert loop.get(part, 0.0) > 0, (part, loop)
    assert hops + sum(loop.values()) <= wall, (hops, loop, wall)

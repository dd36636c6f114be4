"""The learner's share of the cores while it accumulates: a group added while its step waits for more groups
runs beside the rollout's tail on learner.accumulate_threads; once the step's groups are all in (the rollout
is then idle, on-policy), they and the optimizer step run on all of the learner's threads."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace as NS

import pytest
import torch

from tests.unit.test_accumulate import random_groups, tiny_model
from tlt_stream.basics.config import Config, override
from tlt_stream.rl.accumulate import StepAccumulator
from tlt_stream.rl.learner import LearnerCore, LearnerSettings
from tlt_stream.roles.learner_parts.update import Updates


async def _renew() -> None:
    return None


@pytest.mark.parametrize(("tail", "expected"), [(1, [1, 3, 3]), (0, [3, 3, 3])])
def test_groups_added_mid_step_use_the_tail_threads_and_the_completing_group_all(
    tail: int, expected: list[int]
) -> None:
    config = override(Config(), {"learner.groups_per_step": 3, "learner.accumulate": True,
                                 "learner.accumulate_threads": tail})  # fmt: skip
    core = LearnerCore(tiny_model(0), LearnerSettings(lr=1e-3))
    intake = NS(ready=[])
    updates = Updates(config, NS(core=core), intake, NS(renew=_renew), None)  # type: ignore[arg-type]
    updates.attach()
    assert isinstance(updates.accumulator, StepAccumulator)
    seen: list[int] = []
    add = updates.accumulator.add
    updates.accumulator.add = lambda group: (seen.append(torch.get_num_threads()), add(group))[1]  # type: ignore[method-assign]
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        groups = random_groups(random.Random(0), 3, "g")
        intake.ready.append(groups[0])
        assert asyncio.run(updates.next_step()) is None
        intake.ready.extend(groups[1:])
        assert [g.task_id for g in asyncio.run(updates.next_step()) or []] == ["g0", "g1", "g2"]
        assert torch.get_num_threads() == 3, "the learner's threads are back after each group"
    finally:
        torch.set_num_threads(before)
    assert seen == expected

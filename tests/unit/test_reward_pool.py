"""Rewards scored in worker processes: a group scored whole, a reward that raises or hangs a failure of the
group (never a 0), a hung process killed and the pool usable again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tlt_stream.rl.reward_pool import RewardFailed, RewardPool, pool_size

REWARD = """
import time

def score(response, answer):
    if answer == "raise":
        raise ValueError(f"cannot parse {answer!r}")
    if answer == "hang":
        time.sleep(3600)
    return float(len(response) % 2)
"""


@pytest.fixture
def reward_file(tmp_path: Path) -> str:
    (tmp_path / "user_reward.py").write_text(REWARD)
    return f"{tmp_path / 'user_reward.py'}:score"


def test_the_cheap_builtins_score_inline_and_the_others_in_a_pool() -> None:
    assert pool_size("repeated_add", None) == pool_size("exact", None) == 0
    assert pool_size("math", None) == pool_size("pkg.mod:fn", None) == 1
    assert pool_size("exact", 3) == 3 and pool_size("pkg.mod:fn", 0) == 0


async def test_a_group_is_scored_whole_and_a_failure_fails_the_group(reward_file: str) -> None:
    pool = RewardPool(reward_file, workers=1, timeout_s=20)
    try:
        assert await pool.score(["a", "ab", "abc"], "7") == [1.0, 0.0, 1.0]
        with pytest.raises(RewardFailed) as failed:
            await pool.score(["a", "ab"], "raise")
        assert failed.value.reason == "the reward raised: ValueError: cannot parse 'raise'"
        assert "Traceback" in failed.value.detail and "user_reward.py" in failed.value.detail
        assert await pool.score(["ab"], "7") == [0.0], "a raising reward leaves the pool as it was"
    finally:
        pool.close()


async def test_a_hung_reward_times_out_its_process_is_killed_and_the_pool_scores_on(reward_file: str) -> None:
    pool = RewardPool(reward_file, workers=1, timeout_s=2.0)
    try:
        await pool.score(["a"], "7")  # the process is up: the timeout below measures the reward alone
        hung = list(pool._executor._processes.values())
        with pytest.raises(RewardFailed, match=r"ran past its timeout of 2 s"):
            await pool.score(["a"], "hang")
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in hung):
            assert time.monotonic() < deadline, "the hung reward's process is still running"
            await asyncio.sleep(0.05)
        assert pool.timeouts == 1
        assert await pool.score(["abc"], "7") == [1.0], "fresh processes score the next group"
    finally:
        pool.close()


def test_a_bad_reward_name_fails_where_the_pool_is_made() -> None:
    from tlt_stream.rl.rewards import RewardError

    with pytest.raises(RewardError, match="unknown reward"):
        RewardPool("nope", workers=1, timeout_s=1)

"""What decoding cannot check, as pure functions: each poison gets its reason, a good message gets None."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from tlt_stream.basics.messages import PromptGroup, Sample, Tensor
from tlt_stream.rl.validate import location_problem, prompt_problem, sample_problem


def sample(**changes: object) -> Sample:
    good = Sample(
        sample_id="t/0",
        task_id="t",
        prompt_id="p",
        index=0,
        group_size=2,
        prompt_ids=[1, 2],
        token_ids=Tensor.from_values([3, 4], "int32"),
        logprobs=Tensor.from_values([-0.5, -0.5], "float32"),
        policy_version=1,
        drafter_version=-1,
        reward=1.0,
        finish_reason="eos",
        worker_id="w",
    )
    return msgspec.structs.replace(good, **changes)


def check(s: Sample) -> str | None:
    return sample_problem(s, vocab_size=10, max_positions=6, newest_version=1)


def test_a_good_sample_passes_and_each_poison_is_named() -> None:
    assert check(sample()) is None
    assert "not finite" in (check(sample(reward=math.nan)) or "")
    assert "not finite" in (check(sample(reward=math.inf)) or "")
    assert "vocabulary of 10" in (check(sample(prompt_ids=[1, 10])) or "")
    assert "vocabulary of 10" in (
        check(sample(token_ids=Tensor.from_values([3, 99], "int32"), logprobs=Tensor.from_values([-1, -1], "float32")))
        or ""
    )
    assert "6 positions" in (check(sample(prompt_ids=[1, 2, 3, 4, 5])) or "")
    assert "newer than the newest published" in (check(sample(policy_version=2)) or "")
    assert "deterministic" in (check(sample(sample_id="t/1")) or "")
    assert "no prompt token" in (check(sample(prompt_ids=[])) or "")


def test_a_prompt_must_leave_room_fit_the_vocabulary_and_wait_for_a_published_version() -> None:
    def task(**changes: object) -> PromptGroup:
        good = PromptGroup(task_id="t", prompt_id="p", prompt_ids=[1, 2, 3], answer="", group_size=2)
        return msgspec.structs.replace(good, **changes)

    def check_task(t: PromptGroup) -> str | None:
        return prompt_problem(t, vocab_size=10, max_len=4, newest_version=3)

    assert check_task(task()) is None
    assert "max_len=4" in (check_task(task(prompt_ids=[1, 2, 3, 4])) or "")
    assert "vocabulary" in (check_task(task(prompt_ids=[11])) or "")
    assert check_task(task(min_policy_version=3)) is None
    assert "newer than the newest published" in (check_task(task(min_policy_version=4)) or "")


def test_checkpoint_locations_stay_inside_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "run" / "step-1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (store / "escape").symlink_to(tmp_path / "elsewhere")
    assert location_problem(str(store / "run" / "step-1"), str(store)) is None
    assert location_problem("/etc", None) is None, "no store configured: not confined"
    for outside in ("/etc", str(store / ".." / "elsewhere"), str(store / "escape"), str(tmp_path)):
        assert "outside the checkpoint store" in (location_problem(outside, str(store)) or ""), outside

"""Group assembly: whole groups in any arrival order, duplicates applied once, stale groups dropped visibly."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.messages import Sample, Tensor
from tlt_stream.rl.groups import GroupAssembler


def sample(task: str, index: int, size: int = 4, version: int = 0) -> Sample:
    return Sample(
        sample_id=f"{task}/{index}",
        task_id=task,
        prompt_id=f"p-{task}",
        index=index,
        group_size=size,
        prompt_ids=[5, 6],
        token_ids=Tensor.from_values([7, 8, 2], "int32"),
        logprobs=Tensor.from_values([-0.1, -0.2, -0.3], "float32"),
        policy_version=version,
        drafter_version=-1,
        reward=float(index % 2),
        finish_reason="eos",
        worker_id="w",
    )


def test_a_group_is_ready_when_all_its_indices_are_in_whatever_the_order() -> None:
    assembler = GroupAssembler(max_staleness=0)
    statuses = [assembler.offer(sample("a", i), f"1-{i}", 0).status for i in (2, 0, 3)]
    assert statuses == ["waiting"] * 3 and assembler.waiting_samples == 3
    offer = assembler.offer(sample("a", 1), "1-1", 0)
    assert offer.status == "ready" and offer.group is not None
    assert [s.index for s in offer.group.samples] == [0, 1, 2, 3]
    assert offer.group.entry_ids == ["1-0", "1-1", "1-2", "1-3"]
    assert assembler.open_groups == 0 and assembler.waiting_samples == 0


def test_redelivered_samples_count_once_before_and_after_their_update() -> None:
    assembler = GroupAssembler(max_staleness=1)
    assembler.offer(sample("a", 0, size=2), "1-0", 0)
    assert assembler.offer(sample("a", 0, size=2), "9-0", 0).status == "duplicate"  # still waiting
    group = assembler.offer(sample("a", 1, size=2), "1-1", 0).group
    assert group is not None
    assert assembler.offer(sample("a", 0, size=2), "9-2", 0).status == "duplicate"  # handed out, not yet applied
    assembler.consume(group)
    assert assembler.offer(sample("a", 1, size=2), "9-1", 0).status == "duplicate"  # already applied
    assert assembler.duplicates == 3 and assembler.open_groups == 0


def test_a_restarted_learner_skips_what_its_checkpointed_ledger_holds() -> None:
    assembler = GroupAssembler(max_staleness=0, consumed=["a/0", "a/1"])
    assert [assembler.offer(sample("a", i, size=2), f"1-{i}", 3).status for i in (0, 1)] == ["duplicate"] * 2
    assert assembler.open_groups == 0


def test_stale_groups_are_dropped_visibly_with_their_late_members() -> None:
    assembler = GroupAssembler(max_staleness=1)
    assert assembler.offer(sample("old", 0, size=3, version=2), "1-0", 3).status == "waiting"
    assert assembler.offer(sample("new", 0, size=1, version=3), "1-1", 3).status == "ready"
    dropped = assembler.evict_stale(learner_version=4)  # "old" (v2) is now 2 versions behind
    assert [g.task_id for g in dropped] == ["old"] and dropped[0].entry_ids == ["1-0"]
    late = assembler.offer(sample("old", 1, size=3, version=2), "1-2", 4)
    assert late.status == "stale" and late.group is not None and late.group.entry_ids == ["1-2"]
    assert (assembler.dropped_groups, assembler.dropped_samples) == (1, 2)
    assert {"old/0", "old/1"} <= assembler.ledger
    assert assembler.offer(sample("old", 1, size=3, version=2), "9-9", 4).status == "duplicate"


def test_a_sample_too_old_on_arrival_drops_its_group_at_once() -> None:
    assembler = GroupAssembler(max_staleness=0)
    assert assembler.offer(sample("a", 0, size=2, version=1), "1-0", 1).status == "waiting"
    offer = assembler.offer(sample("a", 1, size=2, version=0), "1-1", 1)
    assert offer.status == "stale" and offer.group is not None and offer.group.entry_ids == ["1-0", "1-1"]
    assert assembler.dropped_groups == 1 and assembler.open_groups == 0


def test_inconsistent_group_sizes_and_bad_windows_are_errors() -> None:
    assembler = GroupAssembler(max_staleness=0)
    assembler.offer(sample("a", 0, size=4), "1-0", 0)
    with pytest.raises(ValueError, match="task a said 4"):
        assembler.offer(sample("a", 1, size=3), "1-1", 0)
    with pytest.raises(ValueError, match="max_staleness"):
        GroupAssembler(max_staleness=-1)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    copies=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_any_interleaving_with_redeliveries_yields_every_group_exactly_once(
    sizes: list[int], copies: int, seed: int
) -> None:
    arrivals = [(f"t{t}", i, size) for t, size in enumerate(sizes) for i in range(size) for _ in range(copies)]
    random.Random(seed).shuffle(arrivals)
    assembler = GroupAssembler(max_staleness=0)
    ready = []
    acked = []
    for n, (task, index, size) in enumerate(arrivals):
        offer = assembler.offer(sample(task, index, size), f"{n}-0", 0)
        if offer.status == "ready":
            assert offer.group is not None
            ready.append(offer.group.task_id)
            assembler.consume(offer.group)
            acked += offer.group.entry_ids
        elif offer.status == "duplicate":
            acked.append(f"{n}-0")
    assert sorted(ready) == sorted(f"t{t}" for t in range(len(sizes)))
    assert sorted(acked) == sorted(f"{n}-0" for n in range(len(arrivals))), "every entry is acked exactly once"
    assert assembler.duplicates == len(arrivals) - sum(sizes)

"""Group assembly: whole groups in any arrival order, duplicates applied once, stale groups dropped visibly."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.basics.messages import Sample, Tensor
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


def test_a_sample_that_contradicts_its_siblings_group_size_is_invalid_and_the_group_goes_on() -> None:
    assembler = GroupAssembler(max_staleness=0)
    assembler.offer(sample("a", 0, size=2), "1-0", 0)
    offer = assembler.offer(sample("a", 1, size=3), "1-1", 0)
    assert offer.status == "invalid" and "task a said 2" in offer.reason
    assert assembler.offer(sample("a", 1, size=2), "1-2", 0).status == "ready"
    with pytest.raises(ValueError, match="max_staleness"):
        GroupAssembler(max_staleness=-1)


def test_the_same_entry_delivered_again_while_its_group_is_open_is_held_not_acked() -> None:
    """The learner's reclaim once handed its own pending entry back to it after `reclaim_idle_ms`; taken for
    a duplicate, it was acked while its sample existed only in memory, and a restart lost it."""
    assembler = GroupAssembler(max_staleness=0)
    assert assembler.offer(sample("a", 0, size=2), "1-0", 0).status == "waiting"
    assert assembler.offer(sample("a", 0, size=2), "1-0", 0).status == "held"
    group = assembler.offer(sample("a", 1, size=2), "1-1", 0).group
    assert group is not None
    assert assembler.offer(sample("a", 1, size=2), "1-1", 0).status == "held"  # handed out, not applied
    assembler.consume(group)
    assert assembler.offer(sample("a", 1, size=2), "1-1", 0).status == "held"  # applied, not yet acked
    assembler.release(group.entry_ids)
    assert assembler.offer(sample("a", 1, size=2), "1-1", 0).status == "duplicate"  # an ack Redis lost
    assert assembler.holding == 0


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    copies=st.integers(1, 3),
    redeliveries=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_any_interleaving_with_redeliveries_yields_every_group_exactly_once(
    sizes: list[int], copies: int, redeliveries: int, seed: int
) -> None:
    """Copies of a sample in new entries (a task regenerated by another worker) and the *same* entry
    delivered again while un-acked (XAUTOCLAIM, a history read after a restart), in any order. At every
    moment each sample not yet applied keeps at least one un-acked entry, so a crash could lose nothing."""
    rng = random.Random(seed)
    entries = [
        (f"{t}.{i}.{c}-0", f"t{t}", i, size) for t, size in enumerate(sizes) for i in range(size) for c in range(copies)
    ]
    arrivals = [e for e in entries for _ in range(1 + rng.randint(0, redeliveries))]
    rng.shuffle(arrivals)
    assembler = GroupAssembler(max_staleness=0)
    ready: list[str] = []
    acked: set[str] = set()
    applied: set[str] = set()
    for entry_id, task, index, size in arrivals:
        if entry_id in acked:
            continue  # Redis does not deliver an acked entry again
        offer = assembler.offer(sample(task, index, size), entry_id, 0)
        if offer.status == "ready":
            assert offer.group is not None
            ready.append(offer.group.task_id)
            assembler.consume(offer.group)  # the update is checkpointed, then its entries are acked
            applied.update(offer.group.sample_ids)
            acked.update(offer.group.entry_ids)
            assembler.release(offer.group.entry_ids)
        elif offer.status == "duplicate":
            acked.add(entry_id)
        else:
            assert offer.status in ("waiting", "held"), offer
        for _, t, i, _ in entries:
            sid = f"{t}/{i}"
            if sid not in applied and all(x in acked for x, tt, ii, _ in entries if (tt, ii) == (t, i)):
                raise AssertionError(f"every entry of {sid} was acked before it was applied: lost on a crash")
    delivered = {a[0] for a in arrivals}
    assert sorted(ready) == sorted({f"t{t}" for t in range(len(sizes))} & {a[1] for a in arrivals})
    assert acked == delivered, "every delivered entry is acked once its effect is durable"


def test_a_group_completes_without_its_dead_lettered_members() -> None:
    """A poison member must not keep its siblings waiting forever (an on-policy run would stall on it)."""
    assembler = GroupAssembler(max_staleness=0)
    assert assembler.offer(sample("a", 0, size=3), "1-0", 0).status == "waiting"
    assert assembler.mark_dead(sample("a", 1, size=3)).status == "waiting"
    offer = assembler.offer(sample("a", 2, size=3), "1-2", 0)
    assert offer.status == "ready" and offer.group is not None
    assert offer.group.sample_ids == ["a/0", "a/2"] and offer.group.dead_ids == ["a/1"]
    assembler.consume(offer.group)
    assert {"a/0", "a/2"} <= assembler.ledger and "a/1" not in assembler.ledger, "the ledger holds what trained"
    assert assembler.offer(sample("a", 1, size=3), "9-1", 0).status == "duplicate", "a late copy reopens nothing"
    # A group of poison only is forgotten, counted, and said lost (its step needs another group); a bogus copy
    # (another group size) marks nothing.
    assert assembler.mark_dead(sample("b", 0, size=2)).status == "waiting"
    assert assembler.mark_dead(sample("b", 1, size=2)).status == "lost"
    assert assembler.mark_dead(sample("b", 1, size=2)).status == "waiting", "said once"
    assert assembler.dead_groups == 1 and assembler.open_groups == 0 and not {"b/0", "b/1"} & assembler.ledger
    assembler.offer(sample("c", 0, size=2), "2-0", 0)
    assert assembler.mark_dead(sample("c", 1, size=5)).status == "waiting"
    assert assembler.offer(sample("c", 1, size=2), "2-1", 0).status == "ready"


def test_after_a_restart_a_dead_copy_of_a_trained_groups_member_opens_nothing() -> None:
    """A restarted learner knows a trained group by its ledger only (which leaves dead members out): a poison copy
    of the member that died before the update (a worker regenerated the task) must not open a group of dead
    members only, which would go stale and be recorded for the policy service to send the prompt again."""
    assembler = GroupAssembler(max_staleness=1, consumed={"a/0", "a/2"})  # a/1 died before a was trained
    assert not assembler.counts_dead(sample("a", 1, size=3))
    assert assembler.mark_dead(sample("a", 1, size=3)).status == "waiting"
    assert assembler.open_groups == 0 and assembler.evict_stale(5) == []
    assert assembler.counts_dead(sample("b", 1, size=3)), "a group the ledger does not hold counts it"
    member = SimpleNamespace(sample_id="b/3", task_id="b", index=3, group_size=3, policy_version=0, step=0)
    assert not assembler.counts_dead(member), "a kept record naming an index outside its group"  # type: ignore[arg-type]


def test_a_sample_whose_entry_redis_lost_takes_its_next_copy_as_its_entry() -> None:
    """Redis restarted from an append-only file that lost its last writes: the entries of samples held in an
    open group and in a group handed out are gone. Acking their regenerated copies as duplicates would leave
    those samples in memory only (a learner crash before the next checkpoint would lose them for good), so
    each copy becomes its sample's entry: held, and acked with the group."""
    assembler = GroupAssembler(max_staleness=0)
    assert assembler.offer(sample("a", 0, size=2), "1-0", 0).status == "waiting"
    ready = assembler.offer(sample("b", 0, size=1), "1-1", 0).group
    assert ready is not None and ready.entry_ids == ["1-1"]
    assert sorted(assembler.vanished(["1-0", "1-1", "9-9"])) == ["a/0", "b/0"]
    assert assembler.holding == 0
    assert assembler.offer(sample("a", 0, size=2), "2-0", 0).status == "held"  # the copy: not acked
    assert assembler.offer(sample("b", 0, size=1), "2-1", 0).status == "held"
    assert ready.entry_ids == ["2-1"], "the group handed out is acked through its new entry"
    assert assembler.offer(sample("a", 0, size=2), "2-2", 0).status == "duplicate"  # a third copy: backed now
    group = assembler.offer(sample("a", 1, size=2), "2-3", 0).group
    assert group is not None and group.entry_ids == ["2-0", "2-3"]
    assert assembler.holding == 3 and assembler.rebacked == 2

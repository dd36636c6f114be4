"""Assembling GRPO groups from the `samples` stream, exactly once, with a visible staleness rule.

Samples arrive one by one, from many workers, in any order, and after a crash some arrive twice (the
stream redelivers what was read but not acked). GRPO needs whole groups: the G responses to one prompt
task. The assembler keeps incomplete groups by task id and hands out a group when all G distinct indices
are in. Exactly-once effect rests on two rules the learner follows:

- a sample id in the *ledger* (the ids every applied update consumed, saved with each checkpoint), in a
  group handed out but not yet applied, or already waiting in an open group is a duplicate: it is acked
  and otherwise ignored;
- stream entries are acked only after the update that used them is checkpointed, so a crash between
  reading and checkpointing loses nothing (redelivery) and one between checkpointing and acking
  double-counts nothing (the ledger).

Staleness: a group is usable while `learner_version - oldest policy_version in it <= max_staleness`
(`0`: on-policy, a synchronous system's semantics). A group that falls outside the window, complete or
not, is dropped *visibly*: returned to the caller, who acks its entries, counts it and records its ids
in the ledger so a late copy of one of its samples is not reassembled into a partial group forever.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from tlt_stream.messages import Sample

__all__ = ["GroupAssembler", "Offer", "ReadyGroup"]


@dataclass
class ReadyGroup:
    """All G samples of one prompt task (sorted by index) and the stream entries that carried them."""

    task_id: str
    samples: list[Sample]
    entry_ids: list[str]

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]

    @property
    def oldest_version(self) -> int:
        return min(s.policy_version for s in self.samples)

    def staleness(self, learner_version: int) -> int:
        return learner_version - self.oldest_version


@dataclass
class _Open:
    group_size: int
    by_index: dict[int, tuple[Sample, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Offer:
    """What became of one offered sample.

    `status` is "duplicate" (ack the entry now, nothing else), "waiting" (keep the entry un-acked; its
    group is incomplete), "ready" (`group` is complete and within the window: train on it, then ack its
    entries) or "stale" (`group` fell outside the window, or is a late member of a group that did: ack its
    entries; the assembler has counted the drop).
    """

    status: Literal["duplicate", "waiting", "ready", "stale"]
    group: ReadyGroup | None = None


class GroupAssembler:
    """Incomplete groups by task id, the ledger of consumed sample ids, and the staleness window."""

    def __init__(self, max_staleness: int, consumed: Iterable[str] = ()) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.ledger: set[str] = set(consumed)
        self._open: dict[str, _Open] = {}
        self._dropped_tasks: set[str] = set()
        self._issued: set[str] = set()  # ids of groups handed out as ready, not yet consumed
        self.duplicates = 0
        self.dropped_groups = 0
        self.dropped_samples = 0

    @property
    def waiting_samples(self) -> int:
        return sum(len(g.by_index) for g in self._open.values())

    @property
    def open_groups(self) -> int:
        return len(self._open)

    def offer(self, sample: Sample, entry_id: str, learner_version: int) -> Offer:
        """Take one sample read from the stream at `entry_id`; see `Offer` for what the caller does next."""
        if sample.sample_id in self.ledger or sample.sample_id in self._issued:
            self.duplicates += 1
            return Offer("duplicate")
        if sample.task_id in self._dropped_tasks:  # a late member of a group already dropped as stale
            late = ReadyGroup(sample.task_id, [sample], [entry_id])
            self.dropped_samples += 1
            self.consume(late)
            return Offer("stale", late)
        group = self._open.get(sample.task_id)
        if group is None:
            group = self._open[sample.task_id] = _Open(sample.group_size)
        elif group.group_size != sample.group_size:
            raise ValueError(
                f"sample {sample.sample_id} says its group has {sample.group_size} samples, "
                f"earlier samples of task {sample.task_id} said {group.group_size}"
            )
        if sample.index in group.by_index:
            self.duplicates += 1
            return Offer("duplicate")
        group.by_index[sample.index] = (sample, entry_id)
        if learner_version - sample.policy_version > self.max_staleness:
            return Offer("stale", self._drop(sample.task_id))
        if len(group.by_index) < group.group_size:
            return Offer("waiting")
        del self._open[sample.task_id]
        ready = _ready(sample.task_id, group)
        self._issued.update(ready.sample_ids)
        return Offer("ready", ready)

    def evict_stale(self, learner_version: int) -> list[ReadyGroup]:
        """Drop the open groups that can no longer be used now that the learner is at `learner_version`."""
        stale = [
            task_id
            for task_id, group in self._open.items()
            if learner_version - min(s.policy_version for s, _ in group.by_index.values()) > self.max_staleness
        ]
        return [self._drop(task_id) for task_id in stale]

    def drop(self, group: ReadyGroup) -> None:
        """Drop a group as stale: counted, its ids join the ledger, and later members of its task are dropped too."""
        self._dropped_tasks.add(group.task_id)
        self.dropped_groups += 1
        self.dropped_samples += len(group.samples)
        self.consume(group)

    def consume(self, group: ReadyGroup) -> None:
        """Record that an update applied `group` (or that it was dropped): its ids join the ledger."""
        self.ledger.update(group.sample_ids)
        self._issued.difference_update(group.sample_ids)

    def _drop(self, task_id: str) -> ReadyGroup:
        group = _ready(task_id, self._open.pop(task_id))
        self.drop(group)
        return group


def _ready(task_id: str, group: _Open) -> ReadyGroup:
    ordered = [group.by_index[i] for i in sorted(group.by_index)]
    return ReadyGroup(task_id, [s for s, _ in ordered], [e for _, e in ordered])

"""What the learner takes from `samples`: each delivery checked and handed to the group assembler, poison
dead-lettered, stale groups dropped visibly, entries acked once nothing can need them again.

A sample that would fail the same way on every restart (a token outside the vocabulary, longer than the
policy's context, a policy version newer than any published, or contradicting its group's siblings) goes to
`dead` at once, and its group is trained without it. So does an entry the reader dead-letters before any
sample comes out of it (undecodable: a field out of its range; too large; delivered too often), when its
payload still names its group and place in it (`_refused`). Each such member is kept in Redis
(`Keys.dead_members`) before its entry is acked, so a restarted learner counts it again and its group still
completes. A group too stale for the window is dropped and
recorded in Redis (`Keys.dropped`) for the policy service to send its task again, and its responses' lengths
are remembered for the next update's metrics (whether streaming drops the long ones shows there). A group
whose members were all dead-lettered is recorded as lost (`Keys.lost`), for the policy service to send another
prompt in its place. A sample
whose group is incomplete or waits for an update keeps its entry pending until a checkpoint covers it
(`updates.py`): a crash before that loses nothing. Held entries that Redis lost are replaced by their next
copies, and entries every consumer group has acked are trimmed.
"""

from __future__ import annotations

import logging
from typing import Annotated

import msgspec
import redis.asyncio as aioredis

from tlt_stream.basics.messages import MAX_GROUP_SIZE, Sample
from tlt_stream.bus.consumer import Delivery, LostTasks, StreamReader, until_memory
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import trim_acked
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.groups import GroupAssembler, ReadyGroup
from tlt_stream.rl.validate import sample_problem
from tlt_stream.roles.learner_parts.checkpoints import Checkpoints

__all__ = ["SampleIntake"]

log = logging.getLogger("tlt_stream.roles.learner")


class _Member(msgspec.Struct):
    """What a samples entry that failed to decode may still say: which group member it was (every other
    field ignored, so a field out of its range elsewhere does not hide it)."""

    sample_id: str
    task_id: str
    index: Annotated[int, msgspec.Meta(ge=0)]
    group_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)]
    policy_version: int = 0
    step: int = 0


_MEMBER = msgspec.msgpack.Decoder(_Member)
_MEMBER_ENCODER = msgspec.msgpack.Encoder()


class SampleIntake:
    """Deliveries into complete groups (`ready`), and the acks, dead letters and drops on the way."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        reader: StreamReader[Sample],
        control: ControlPlane,
        checkpoints: Checkpoints,
        *,
        max_staleness: int,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.reader = reader
        self.control = control
        self.checkpoints = checkpoints
        """The version trained so far and the policy's limits (vocabulary, positions) samples must fit."""
        self.max_staleness = max_staleness
        self.assembler = GroupAssembler(max_staleness)
        """Replaced, with the ledger it resumes from, by `resume`."""
        self.ready: list[ReadyGroup] = []
        """Complete groups within the window, in the order they completed, waiting for an update."""
        self._dropped_tasks: set[str] = set()
        self._dropped_lengths: list[int] = []
        """Groups dropped as too stale since the last update, and their samples' response lengths."""
        self.invalid = 0
        self.trimmed = 0
        self.reader.on_refused = self._refused
        self.lost = LostTasks(redis, keys)
        """Groups left with nothing to train, recorded in Redis by `record_lost`."""
        self._lost_members: dict[str, list[str]] = {}
        """Task id of a group of dead members only -> their sample ids, forgotten once it is recorded lost."""

    def resume(self, ledger: set[str]) -> None:
        """Start from the ledger of the checkpoint resumed: its samples are recognised as trained."""
        self.assembler = GroupAssembler(self.max_staleness, ledger)

    async def take_all(self, deliveries: list[Delivery[Sample]]) -> list[str]:
        """`take` each delivery of a read; returns the entries to ack now. A redelivered sample of a task already
        recorded lost (a learner died while dead-lettering its group: its step has another prompt in its place)
        goes to `dead` unread, as the rest of its group went."""
        to_ack: list[str] = []
        for delivery in await self.lost.set_aside(self.reader, deliveries):
            to_ack += await self.take(delivery)
        return to_ack

    async def take(self, delivery: Delivery[Sample]) -> list[str]:
        """Hand one delivery to the assembler; returns the entries to ack now (duplicates, stale drops)."""
        sample = delivery.message
        # Newest published: ours, or the mirror's when we fell back past a damaged checkpoint and are redoing
        # the update whose version the workers already generate with.
        mine = self.checkpoints
        newest = max(mine.version, self.control.version("policy"))
        problem = sample_problem(
            sample, vocab_size=mine.vocab_size, max_positions=mine.max_positions, newest_version=newest
        )
        offer = None
        if problem is None:
            offer = self.assembler.offer(sample, delivery.entry_id, mine.version)
            if offer.status == "invalid":
                problem = offer.reason
        if problem is not None:  # poison: the same entry would fail the same way on every restart
            self.invalid += 1
            if offer is None:  # its group is trained without it (or, if it contradicted its siblings, ignores it)
                await self._count_dead(sample)  # before the dead letter: a crash between them loses no record
            await self.reader.give_up(delivery, f"invalid sample: {problem}")
            return []
        assert offer is not None
        if offer.status == "duplicate":
            return [delivery.entry_id]
        if offer.status == "stale":
            assert offer.group is not None
            if offer.group.task_id not in self._dropped_tasks:
                log.warning("dropped stale group %s", offer.group.task_id)
            await self.note_dropped([offer.group])
            return offer.group.entry_ids
        if offer.status == "ready":
            assert offer.group is not None
            self.ready.append(offer.group)
        return []  # waiting or held: the entry stays pending until its update is checkpointed

    async def _refused(self, payload: bytes) -> None:
        """An entry the reader dead-lettered before any sample came out of it (awaited before its ack): if its
        payload still names a group member, the group completes without it, as with poison (an on-policy step
        would otherwise wait for it forever)."""
        try:
            member = _MEMBER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("a dead-lettered samples entry names no group member: its group waits for another copy")
            return
        if member.index >= member.group_size:
            return
        self.invalid += 1
        await self._count_dead(member)  # type: ignore[arg-type]  (the fields mark_dead reads)

    async def _count_dead(self, sample: Sample) -> None:
        """A member about to be dead-lettered: its group completes without it, and it is kept in Redis for a
        restarted learner (which will never see its entry again) to count it too."""
        if self.assembler.counts_dead(sample):  # a bogus copy the assembler ignores is not kept
            member = _Member(
                sample.sample_id, sample.task_id, sample.index, sample.group_size, sample.policy_version, sample.step
            )

            # Kept before it is counted: once counted, a lost group's records may be forgotten at any await.
            async def keep() -> None:
                await self.redis.hset(self.keys.dead_members, sample.sample_id, _MEMBER_ENCODER.encode(member))

            await until_memory(keep, f"dead member {sample.sample_id}")
        self._mark_dead(sample)
        await self.record_lost()

    async def restore_dead(self) -> int:
        """At start, after `resume`: count again the members an earlier learner of the run dead-lettered, whose
        groups were neither checkpointed nor dropped nor lost (a group whose other members the ledger holds was
        trained: its records are stale). Returns how many were counted."""
        kept = await self.redis.hgetall(self.keys.dead_members)
        counted, stale = 0, []
        for key, value in sorted(kept.items()):
            try:
                member = _MEMBER.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                stale.append(key)
                continue
            if not self.assembler.counts_dead(member):  # type: ignore[arg-type]  (its group trained, or bogus)
                stale.append(key)
                continue
            self._mark_dead(member)  # type: ignore[arg-type]  (the fields mark_dead reads)
            counted += 1
        if stale:
            await self.redis.hdel(self.keys.dead_members, *stale)
        await self.record_lost()
        if counted:
            log.info("counted %d dead-lettered group members an earlier learner kept", counted)
        return counted

    async def forget_dead(self, sample_ids: list[str]) -> None:
        """Members whose group's fate is durable now (trained and checkpointed, dropped or lost, recorded)."""
        if sample_ids:
            await self.redis.hdel(self.keys.dead_members, *sample_ids)

    async def record_lost(self) -> None:
        """Record the groups left with nothing to train (`Keys.lost`, once per task) for the policy service to
        send another prompt in their place: a step waits for the groups it needs, and nothing else would
        replace these. Their members' records are forgotten after."""
        if lost := await self.lost.record():
            log.warning("group(s) %s lost every member to dead letters: another prompt is asked for each", lost)
            await self.forget_dead([d for task in lost for d in self._lost_members.pop(task, [])])

    def _mark_dead(self, sample: Sample) -> None:
        """A dead-lettered member: its group completes without it (ready if members are left, else lost)."""
        offer = self.assembler.mark_dead(sample)
        if offer.status == "lost":
            assert offer.group is not None
            self.lost.note(sample.task_id, sample.step)
            self._lost_members[sample.task_id] = offer.group.dead_ids
        if offer.status == "ready":
            assert offer.group is not None
            log.warning("group %s is trained without its dead-lettered members", offer.group.task_id)
            self.ready.append(offer.group)

    async def ack(self, entry_ids: list[str]) -> None:
        await self.reader.ack(entry_ids)
        self.assembler.release(entry_ids)

    def entries_vanished(self) -> None:
        """Held entries that are no longer ours in Redis (one learner per run: Redis lost them). The samples
        they carried exist only in memory until a checkpoint covers them; the assembler makes the next copy
        of each (a worker redoes the task whose ack Redis lost too) their entry, rather than a duplicate."""
        gone = sorted(self.reader.lost)
        self.reader.lost.clear()
        unbacked = self.assembler.vanished(gone)
        if unbacked:
            log.warning(
                "%d held samples lost their stream entries (Redis lost its newest writes); their next copies "
                "take their place (e.g. %s)",
                len(unbacked),
                unbacked[0],
            )

    async def dead_group(self, group: ReadyGroup, reason: str) -> None:
        """Dead-letter every entry of `group`; its sample ids join the ledger (later copies are recognised). It
        is recorded as lost first, for the policy service to send another prompt in its place."""
        if group.samples:
            self.lost.note(group.task_id, group.samples[0].step)
            await self.record_lost()
        for sample, entry_id in zip(group.samples, group.entry_ids, strict=True):
            await self.reader.give_up(Delivery(entry_id, sample, 0), reason)
        self.assembler.drop(group)
        self.assembler.release(group.entry_ids)
        await self.forget_dead(group.dead_ids)

    async def note_dropped(self, groups: list[ReadyGroup]) -> None:
        """Groups dropped as too stale (a group goes at its first stale member, its late members after it, or
        when an update leaves it behind), before their entries are acked. Recorded in Redis (`Keys.dropped`,
        once per task) for the policy service to send each task again: nothing else would replace it, and a
        streaming run would wait for ever for the groups its steps need. Their samples are remembered too:
        whether streaming drops the long responses (a bias against them) shows in the step's metrics."""
        if not groups:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for group in groups:
                self._dropped_tasks.add(group.task_id)
                self._dropped_lengths += [s.response_len for s in group.samples]
                pipe.hsetnx(self.keys.dropped, group.task_id, group.step)  # dead members only: sent again too
            if dead := [d for group in groups for d in group.dead_ids]:
                pipe.hdel(self.keys.dead_members, *dead)  # after the drop's record, in order
            await pipe.execute()

    def dropped_since_last(self) -> dict[str, float]:
        """Groups dropped as too stale since the last update, and their responses' mean length (absent: none)."""
        tasks, lengths = self._dropped_tasks, self._dropped_lengths
        self._dropped_tasks, self._dropped_lengths = set(), []
        out = {"stale_dropped_groups": float(len(tasks))}
        if lengths:
            out["stale_dropped_len_mean"] = sum(lengths) / len(lengths)
        return out

    async def ack_trained_leftovers(self) -> None:
        """Done: ack whatever is still pending for us and already in the ledger (duplicates, or entries whose
        ack a Redis restarted from a short append-only file lost and brought back). Entries whose samples are
        not in the ledger stay pending for the next learner of the run."""
        pending = await self.reader.own_pending()
        to_ack = [entry_id for entry_id, sample in pending if sample.sample_id in self.assembler.ledger]
        if to_ack:
            log.info("acked %d leftover entries whose samples the ledger already holds", len(to_ack))
            await self.reader.ack(to_ack)

    async def trim(self) -> None:
        """Drop the `samples` entries every consumer group has acked: the checkpoint just written covers them
        (a reader that needs them later, an audit say, keeps them by having its own group)."""
        try:
            self.trimmed += await trim_acked(self.redis, self.keys.stream("samples"))
        except aioredis.RedisError as exc:  # only memory is at stake; the next update trims again
            log.warning("could not trim the samples stream (%s); trying again after the next update", exc)

"""Accumulated steps take exactly the groups batch updates take, through failures, poison and stale drops.

`Loop` is the learner service's loop without the bus: samples offered to a real `GroupAssembler`, complete
groups queued in the order they complete, a failed update's groups put back first and dead-lettered after
`max_deliveries` failures, groups the new version leaves outside the window dropped (`roles/learner.py`
`_consume`; `roles/learner_parts/update.py` `_try_update`, `_update`; `intake.py` `_take`, `_mark_dead`).
It runs once with `LearnerCore.step` every `groups_per_step` groups and once with a `StepAccumulator` fed
each group as it completes, over the same samples in the same order; the applied updates (their groups and
the parameters after each), the dead-lettered groups and the dropped ones must be the same.
"""

from __future__ import annotations

import copy
import random

import msgspec
import torch

from tests.unit.test_accumulate import VOCAB, assert_same_update, params, random_groups, tiny_model
from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.rl.accumulate import StepAccumulator
from tlt_stream.rl.groups import GroupAssembler, ReadyGroup
from tlt_stream.rl.learner import LearnerCore, LearnerSettings


class Loop:
    def __init__(self, core: LearnerCore, groups_per_step: int, max_staleness: int, *, accumulate: bool) -> None:
        self.core, self.n, self.max_deliveries = core, groups_per_step, 2
        self.assembler = GroupAssembler(max_staleness)
        self.step = StepAccumulator(core, groups_per_step) if accumulate else None
        self.version = 0
        self.ready: list[ReadyGroup] = []
        self.failures: dict[str, int] = {}
        self.applied: list[list[str]] = []
        self.after: list[LearnerCore] = []
        self.dead: list[str] = []
        self.dropped: list[str] = []
        self.trained_sizes: dict[str, int] = {}

    def offer(self, sample: Sample) -> None:
        offer = self.assembler.offer(sample, f"entry-{sample.sample_id}", self.version)
        if offer.status == "ready":
            assert offer.group is not None
            self.ready.append(offer.group)
        elif offer.status == "stale":
            assert offer.group is not None
            self.dropped.append(offer.group.task_id)
        self._pump()

    def poison(self, sample: Sample) -> None:
        offer = self.assembler.mark_dead(sample)
        if offer.status == "ready":
            assert offer.group is not None
            self.ready.append(offer.group)
        self._pump()

    def _pump(self) -> None:
        while True:
            if self.step is not None:
                if not self.step.take(self.ready):
                    return
                groups = self.step.groups
            else:
                if len(self.ready) < self.n:
                    return
                groups = self.ready[: self.n]
                del self.ready[: self.n]
            try:
                metrics = self.step.finish() if self.step is not None else self.core.step(groups)
            except Exception:
                keep = []
                for group in groups:
                    tries = self.failures[group.task_id] = self.failures.get(group.task_id, 0) + 1
                    if tries < self.max_deliveries:
                        keep.append(group)
                    else:
                        self.dead.append(group.task_id)
                        self.assembler.drop(group)
                self.ready[:0] = keep
                continue
            assert metrics["updated"] == 1.0
            for group in groups:
                self.assembler.consume(group)
                self.failures.pop(group.task_id, None)
                self.trained_sizes[group.task_id] = len(group.samples)
            self.version += 1
            self.applied.append([g.task_id for g in groups])
            self.after.append(copy.deepcopy(self.core))
            expired = self.assembler.evict_stale(self.version)
            keep = []
            for group in self.ready:
                if group.staleness(self.version) > self.assembler.max_staleness:
                    self.assembler.drop(group)
                    expired.append(group)
                else:
                    keep.append(group)
            self.ready = keep
            self.dropped += [g.task_id for g in expired]


def signal_groups(rng: random.Random, names: str, version: int) -> dict[str, ReadyGroup]:
    """Groups named by the letters of `names`, each of 2-6 samples with rewards 0, 1, 0, ... (never degenerate)
    and responses of 1-12 tokens, stamped with policy `version`."""
    out = {}
    for name in names:
        while True:
            (group,) = random_groups(rng, 1, name, version=version)
            samples = [
                msgspec.structs.replace(s, task_id=name, prompt_id=name, sample_id=f"{name}/{i}", reward=float(i % 2))
                for i, s in enumerate(group.samples)
            ]
            if len(samples) > 1 and all(s.response_len for s in samples):
                out[name] = ReadyGroup(name, samples, [])
                break
    return out


def interleaved(rng: random.Random, groups: list[ReadyGroup], *, last: str | None = None) -> list[Sample]:
    """The groups' samples shuffled together, each group completing when its last sample comes (`last`'s
    last sample kept to the very end)."""
    samples = [s for g in groups for s in g.samples if g.task_id != last]
    rng.shuffle(samples)
    if last is not None:
        tail = next(g for g in groups if g.task_id == last).samples
        samples += tail
    return samples


def test_accumulated_steps_take_the_batch_updates_groups_through_failure_poison_and_staleness() -> None:
    torch.set_num_threads(1)
    rng = random.Random(21)
    base = tiny_model(21)
    v0 = signal_groups(rng, "ABCDEORS", 0)
    v1 = signal_groups(rng, "FGHI", 1)
    v2 = signal_groups(rng, "JKL", 2)
    # BAD: a token outside the vocabulary breaks the forward of any update it is in, every time.
    bad = signal_groups(rng, "Z", 0)["Z"]
    broken = msgspec.structs.replace(
        bad.samples[0],
        token_ids=Tensor.from_values([VOCAB + 3], "int32"),
        logprobs=Tensor.from_values([-1.0], "float32"),
    )
    bad = ReadyGroup("Z", [broken, *bad.samples[1:]], [])
    poisoned = v0["B"].samples[-1]  # dead-lettered: B completes and trains without it
    early_o = v0["O"].samples[0]  # O's first sample comes at version 0, the rest only at version 2: evicted
    events: list[tuple[str, Sample]] = []
    # Version 0: A, B (one member poison), C: the first step. D, E, then Z: D and E are accumulated before Z
    # arrives; the step fails twice (max_deliveries 2) and D, E, Z are dead-lettered, as in the batch update.
    events += [("poison" if s is poisoned else "offer", s) for s in interleaved(rng, [v0["A"], v0["B"], v0["C"]])]
    events += [("offer", early_o)]
    events += [("offer", s) for s in interleaved(rng, [v0["D"], v0["E"], bad], last="Z")]
    # Still version 1 after the first update: R (version 0, staleness 1: usable) completes after F, G, H, so
    # it waits behind their step and the move to version 2 leaves it out of the window: dropped.
    events += [("offer", s) for s in interleaved(rng, [v1["F"], v1["G"], v1["H"]], last="H")]
    events += [("offer", s) for s in interleaved(rng, [v0["R"]])]
    # Version 2: S (version 0) is stale on arrival; O's late members are dropped; I, J, K make a step.
    events += [("offer", s) for s in interleaved(rng, [v0["S"], v1["I"], v2["J"], v2["K"]])]
    events += [("offer", s) for s in v0["O"].samples[1:]]
    events += [("offer", s) for s in interleaved(rng, [v2["L"]])]

    loops = {}
    for accumulate in (False, True):
        core = LearnerCore(copy.deepcopy(base), LearnerSettings(lr=1.0, micro_batch_tokens=20, max_grad_norm=0.5))
        core.optimizer = torch.optim.SGD(core.model.parameters(), lr=1.0)
        loop = loops[accumulate] = Loop(core, 3, 1, accumulate=accumulate)
        for kind, sample in events:
            getattr(loop, kind)(sample)
    batch, accumulated = loops[False], loops[True]
    assert [sorted(u) for u in batch.applied] == [["A", "B", "C"], ["F", "G", "H"], ["I", "J", "K"]], "as designed"
    assert sorted(batch.dead) == ["D", "E", "Z"] and {"R", "S", "O"} <= set(batch.dropped)
    assert batch.trained_sizes["B"] == len(v0["B"].samples) - 1, "B trained without its poison member"
    assert accumulated.applied == batch.applied
    assert accumulated.dead == batch.dead and accumulated.dropped == batch.dropped
    assert accumulated.trained_sizes == batch.trained_sizes
    assert [g.task_id for g in batch.ready] == ["L"], "waiting for the next update's other groups"
    assert accumulated.step is not None and [g.task_id for g in accumulated.step.groups] == ["L"], "... accumulated"
    assert accumulated.ready == []
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    for update, (a, b) in enumerate(zip(batch.after, accumulated.after, strict=True)):
        assert_same_update(a, b, before, f"update {update + 1}")
        before = {n: p.clone() for n, p in params(a).items()}

"""An on-policy update built while its groups arrive, so that it ends when its last sample does.

In a synchronous step nothing the update computes for a group depends on the other groups: the group's
advantages are its own, the policy does not change until the step is applied, and the token-mean loss is
a sum over tokens divided by the step's token count. So `StepAccumulator` runs each group's forward and
backward as soon as the group is complete, with its losses *not* divided, adding to the gradients the
parameters hold; when the step's last group is in, `finish` multiplies the summed gradient (and loss) by
1 / (the step's response tokens), clips by the global norm and takes the optimizer step. That is
`LearnerCore.step` over the same groups up to floating-point summation order; the step's figures (loss,
clip fraction, both KL estimates, the logprob mismatch, TIS weights, tokens) are kept as raw sums and
divided by the step's token count at the end, as the batch update's are.

What differs besides summation order: micro-batches are packed within one group, not longest first across
the step, so padding and kernel shapes differ (in fp32 a few ulps of the update; in bf16 autocast each
matmul's output rounds to bf16, and the update differs within bf16 precision, as the batch update at
another `micro_batch_tokens` does). A policy with dropout is refused (`dropout_of`): its update is a random
draw, and a different draw when the same work is split differently.

A step takes exactly the groups the batch update would: `take` moves groups from the front of the ready
queue in their order of completion, never more than `groups_per_step`. Failure keeps the batch update's
semantics too. An error while a group is added (or while the step is applied: a non-finite gradient norm)
voids the whole step, as it voids the batch update: the groups still arriving are taken but not computed,
`finish` raises the first error once the step has all its groups, the gradients are cleared, and the
caller puts the groups back at the front of the queue as it does today (dead-lettering those that failed
too often), so the next attempt takes the same groups and recomputes the survivors from their samples.
Nothing per group is kept: per-group gradients would cost a copy of the parameters per group, and a
failed step is rare, while the recomputation costs what the batch update's retry costs. A poison member or
a group dropped as stale never reaches a step: a group is taken only once it is complete (without its
dead-lettered members) and inside the staleness window, and the window does not move until the step is
applied. A learner killed mid-step loses only memory: nothing is acked before the step's checkpoint, so
its groups' samples are still pending and are assembled and accumulated again.

Sharded (`rl/sharded.py`), rank 0 deals each group's samples to the ranks by tokens and sends ACCUMULATE
with the group's number of rounds, the longest share; a rank with a shorter share runs idle one-row
batches, so every rank runs the same forward/backward rounds (FSDP's collectives) however unevenly groups
arrive: the groups arrive at rank 0 alone, and every rank runs every command rank 0 sends, in order. The
step's token count, unknown before its last group, travels with APPLY, which every rank runs as the batch
update's end (scale, the global norm, the step); DISCARD clears a voided step's gradients on every rank.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tlt_stream.basics.failpoints import failpoint
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerCore, LossSums
from tlt_stream.rl.ranks import Command, RanksOutOfStep

__all__ = ["StepAccumulator", "dropout_of"]


class StepAccumulator:
    """One synchronous update of `groups_per_step` groups, computed group by group as they complete."""

    def __init__(self, core: LearnerCore, groups_per_step: int) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        found = dropout_of(core.model)
        if found:
            raise ValueError(
                "an accumulated update needs a policy without dropout (its update would be another random draw "
                f"than the batch update's): {', '.join(found)}"
            )
        self.core = core
        self.groups_per_step = groups_per_step
        self._groups: list[ReadyGroup] = []
        self._sums = LossSums()
        self._error: Exception | None = None
        """The first error of this step: it is void, and `finish` raises this."""
        self._started = False
        """Gradients of this step exist (sharded: on every rank)."""
        self._seconds = 0.0

    @property
    def groups(self) -> list[ReadyGroup]:
        """The step's groups so far, in the order they were taken."""
        return list(self._groups)

    @property
    def full(self) -> bool:
        return len(self._groups) >= self.groups_per_step

    def take(self, ready: list[ReadyGroup]) -> bool:
        """Move groups from the front of `ready` (complete groups in their order of completion) into the step,
        each accumulated as it is taken, until the step has `groups_per_step`; True when it has."""
        while ready and not self.full:
            self.add(ready.pop(0))
        return self.full

    def add(self, group: ReadyGroup) -> None:
        """Accumulate `group`'s share of the update now. An error voids the step (raised by `finish`); a
        collective that breaks (sharded) raises `RanksOutOfStep` at once, as in the batch update."""
        if self.full:
            raise ValueError(f"the step already has its {self.groups_per_step} groups")
        self._groups.append(group)
        if self._error is not None:  # void already: the group is taken, as the batch update takes it
            return
        started = time.perf_counter()
        try:
            plan = self.core.plan([group])
            if plan.used and not self._started:
                self.core.optimizer.zero_grad(set_to_none=True)  # the step's first gradients
                self._started = True
            self.core.backward(plan, self._sums, total=None)
        except RanksOutOfStep:
            raise
        except Exception as exc:
            self._error = exc
            self.core.optimizer.zero_grad(set_to_none=True)  # a backward cut short may have added part of itself
        finally:
            self._seconds += time.perf_counter() - started
        # Fault tests: die with part of a step taken and accumulated, nothing of it applied or acked (a degenerate
        # group too: the fault runs' random policy makes every group degenerate).
        failpoint("learner.accumulated")

    def finish(self) -> dict[str, Any]:
        """Apply the step, once it has all its groups: the metrics `LearnerCore.step` returns over the same
        groups (with `accumulate_seconds`, the time spent adding groups, and `apply_seconds`), or what it
        would raise. Either way the accumulator is empty afterwards, ready for the next step."""
        if not self.full:
            raise ValueError(f"the step has {len(self._groups)} of its {self.groups_per_step} groups")
        started = time.perf_counter()
        try:
            if self._error is not None:
                raise self._error
            plan = self.core.plan(self._groups)
            metrics: dict[str, Any] = dict(plan.figures)
            if not plan.used:  # nothing to learn from, as in the batch update: no optimizer step
                metrics.update(loss=0.0, clip_fraction=0.0, approx_kl_old=0.0, kl_ref=0.0, grad_norm=0.0, updated=0.0)
            else:
                if self.core.ranks is not None:
                    self._tell(Command.APPLY, plan.total)
                self._started = False  # applying clears the gradients on every rank, applied or not
                metrics.update(self.core.apply(self._sums, plan.total, scale=1.0 / plan.total))
        except RanksOutOfStep:
            self._reset()
            raise
        except Exception:
            self._void()
            raise
        apply_seconds = time.perf_counter() - started
        metrics.update(
            accumulate_seconds=self._seconds,
            apply_seconds=apply_seconds,
            learn_seconds=self._seconds + apply_seconds,
        )
        self._reset()
        return metrics

    def discard(self) -> list[ReadyGroup]:
        """Void the step without applying it (its gradients cleared on every rank); returns its groups, for the
        caller to put back at the front of its queue."""
        groups = self.groups
        self._void()
        return groups

    def _void(self) -> None:
        self.core.optimizer.zero_grad(set_to_none=True)
        if self._started and self.core.ranks is not None:
            self._tell(Command.DISCARD)
        self._reset()

    def _tell(self, kind: Command, *args: int) -> None:
        assert self.core.ranks is not None
        try:
            self.core.ranks.command(kind, *args)
        except Exception as exc:
            raise RanksOutOfStep(f"update {self.core.updates + 1}: {kind.name} did not reach the ranks: {exc}") from exc

    def _reset(self) -> None:
        self._groups = []
        self._sums = LossSums()
        self._error = None
        self._started = False
        self._seconds = 0.0


def dropout_of(model: Any) -> list[str]:
    """Where `model` drops activations at random while training: its configuration's dropout probabilities
    above 0 (`attention_dropout = 0.1`, GPT-2's `resid_pdrop`, ...) and its dropout modules with p > 0."""
    found = []
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    for key, value in sorted(settings.items()):
        named = "dropout" in key or key.endswith("pdrop")
        if named and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            found.append(f"{key} = {value}")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or type(module).__name__} (p = {module.p})")
    return found

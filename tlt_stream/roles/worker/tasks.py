"""The tasks a rollout worker holds: groups started in its engine, and tasks read that cannot start yet.

`InFlight` is the one piece of state the worker's components share: the intake adds to it, generation
finishes what is in it, the reports ask whether a draft is running. Each of a group's G requests is
seeded by its sample id, and its hidden states are kept or not by a stable hash of that id, so a redelivered
task generates the same responses and streams the same windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tlt_stream.basics.common import stable_int
from tlt_stream.basics.messages import PromptGroup, Sample
from tlt_stream.bus.consumer import Delivery

__all__ = ["GroupTask", "InFlight", "streams_hidden"]


def streams_hidden(sample_id: str, share: float) -> bool:
    """Whether the sample's hidden states are streamed: a stable hash of its id against `share`
    (`rollout.hidden_share`; the same in every process and on redelivery, salted apart from the drafter
    trainer's held-out split)."""
    if share >= 1:
        return True
    return stable_int(f"hidden-share/{sample_id}", 8) < share * 2**32


@dataclass
class GroupTask:
    """A prompt group in flight: its G requests in the engine, its samples as they finish."""

    delivery: Delivery[PromptGroup]
    policy_version: int
    started: float
    samples: dict[int, Sample] = field(default_factory=dict)
    finished: dict[int, tuple[Any, str, float]] = field(default_factory=dict)
    """With a reward pool: (result, response text, generation seconds) per row, until the group is scored."""
    failed: str | None = None
    """Why the task cannot be scored (its reward raised): dead-lettered whole once its rows are done, never
    sent with some samples scored 0, which would bias the update."""
    versions: dict[int, int] = field(default_factory=dict)
    """The policy version each finished row was last verified under (what its sample is stamped with)."""

    @property
    def group(self) -> PromptGroup:
        return self.delivery.message


@dataclass
class InFlight:
    """The worker's tasks: started (by task id) and waiting (read, ahead of the loaded policy)."""

    started: dict[str, GroupTask] = field(default_factory=dict)
    waiting: list[Delivery[PromptGroup]] = field(default_factory=list)

    def rows_left(self) -> int:
        """Rows the started groups still generate (finished responses excluded)."""
        return sum(t.group.group_size - len(t.samples) for t in self.started.values())

    def rows_in_flight(self, version: int | None = None) -> int:
        """Rows the engine still generates for the started groups (rows finished and waiting for their group's
        reward excluded; with `version`, the loaded policy's, drafts begun ahead of it too: the step being
        generated waits for none of them): what the worker reports for learner.accumulate_below_rows."""
        return sum(
            t.group.group_size - max(len(t.samples), len(t.finished))
            for t in self.started.values()
            if version is None or t.group.min_policy_version <= version
        )

    def drafting(self, version: int) -> bool:
        """Whether a started group is a draft: begun ahead of `version`, the loaded policy's."""
        return any(t.group.min_policy_version > version for t in self.started.values())

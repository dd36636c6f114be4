"""The rows a rollout worker reports for learner.accumulate_below_rows: rows its engine still generates for
the step being generated; finished rows (scored inline, or waiting for their group's reward) and drafts begun
ahead of the loaded policy (partial rollouts) are not counted."""

from __future__ import annotations

from tlt_stream.basics.messages import PromptGroup
from tlt_stream.bus.consumer import Delivery
from tlt_stream.roles.worker.tasks import GroupTask, InFlight


def task(task_id: str, size: int, *, ahead_of: int = 0) -> GroupTask:
    group = PromptGroup(
        task_id=task_id, prompt_id=task_id, prompt_ids=[5], answer="", group_size=size, min_policy_version=ahead_of
    )
    return GroupTask(delivery=Delivery("0-1", group, 1), policy_version=0, started=0.0)


def test_rows_in_flight_leave_out_finished_rows_and_drafts_ahead_of_the_policy() -> None:
    flight = InFlight()
    flight.started["a"] = task("a", 8)
    flight.started["b"] = b = task("b", 4)
    flight.started["c"] = c = task("c", 8, ahead_of=3)
    b.samples[0] = b.samples[1] = None  # type: ignore[assignment]  (scored inline)
    b.finished[2] = (None, "", 0.0)  # waiting for the group's reward (fewer than samples: samples count)
    c.finished[0] = (None, "", 0.0)
    assert flight.rows_in_flight() == 8 + 2 + 7
    assert flight.rows_in_flight(2) == 8 + 2, "the draft of version 3 is not the step being generated"
    assert flight.rows_in_flight(3) == 8 + 2 + 7

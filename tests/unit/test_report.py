"""The run report's readings of a run directory's files."""

from __future__ import annotations

import pytest

from tlt_stream.report import draft_sources, state_intervals


def test_state_intervals_follow_each_workers_transitions_until_the_end() -> None:
    timeline = [
        {"kind": "worker_state", "worker_id": "w1", "state": "IDLE", "created_at": 12.0},
        {"kind": "worker_state", "worker_id": "w1", "state": "GENERATING", "created_at": 10.0},
        {"kind": "rollout", "worker_id": "w1", "created_at": 13.0},
        {"kind": "worker_state", "worker_id": "w0", "state": "TRAINING_DRAFTER", "created_at": 11.0},
    ]
    assert state_intervals(timeline) == {
        "w0": [(11.0, 13.0, "TRAINING_DRAFTER")],
        "w1": [(10.0, 12.0, "GENERATING"), (12.0, 13.0, "IDLE")],
    }
    by_end = state_intervals(timeline, end=20.0)
    assert by_end["w1"][-1] == (12.0, 20.0, "IDLE")
    assert state_intervals(timeline, end=11.5)["w1"][-1] == pytest.approx((12.0, 12.0, "IDLE")), "never negative"
    assert state_intervals([]) == {}


def test_draft_sources_sum_the_rollout_reports_of_the_timeline() -> None:
    timeline = [
        {"kind": "rollout", "drafted": {"group": 10, "eagle": 4}, "accepted": {"group": 6}},
        {"kind": "worker_state", "drafted": {"group": 999}},
        {"kind": "rollout", "drafted": {"group": 5}, "accepted": {"group": 1, "eagle": 2}},
        {"kind": "rollout"},  # a report from before per-source counts
    ]
    assert draft_sources(timeline) == {"eagle": {"drafted": 4, "accepted": 2}, "group": {"drafted": 15, "accepted": 7}}

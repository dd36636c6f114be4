"""The run report's readings of a run directory's files."""

from __future__ import annotations

import json
import re

import pytest

from tlt_stream.commands.report import draft_sources, partial_rollouts, stale_drops, state_intervals, write_report


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


def rollout_report(version: int, kept: int, discarded: int, ahead_s: float, at: float) -> dict:
    """A rollout report as `timeline.jsonl` holds it (`launch.save_timeline`)."""
    return {
        "kind": "rollout", "worker_id": "w1", "policy_version": version, "drafter_version": -1, "batch_size": 4,
        "tokens": 10, "seconds": 1.0, "sd_on": False, "created_at": at, "kept_tokens": kept,
        "discarded_tokens": discarded, "ahead_seconds": ahead_s,
    }  # fmt: skip


TIMELINE = [
    {"kind": "worker_state", "worker_id": "w1", "state": "GENERATING", "created_at": 0.0},
    rollout_report(0, kept=0, discarded=0, ahead_s=1.25, at=1.0),  # drafts of step 1 while v0 runs its tail
    rollout_report(0, kept=0, discarded=0, ahead_s=0.75, at=2.0),
    rollout_report(1, kept=90, discarded=30, ahead_s=0.5, at=3.0),  # v1 loaded: step 1's drafts judged
    rollout_report(2, kept=16, discarded=4, ahead_s=0.0, at=4.0),
    {k: v for k, v in rollout_report(2, 7, 7, 7.0, at=4.5).items() if not k.endswith(("_tokens", "_seconds"))},
]
"""A worker's reports across two version changes, and one from before the partial-rollout figures."""


def test_partial_rollouts_are_per_step_the_drafts_were_verified_into() -> None:
    assert partial_rollouts(TIMELINE) == {
        1: {"ahead_tokens": 120, "kept_tokens": 90, "discarded_tokens": 30, "kept_share": 0.75, "ahead_seconds": 2.0},
        2: {"ahead_tokens": 20, "kept_tokens": 16, "discarded_tokens": 4, "kept_share": 0.8, "ahead_seconds": 0.5},
    }
    assert partial_rollouts(TIMELINE[:1]) == {}


def metrics_row(version: int, lens: list[int], **figures: float) -> dict:
    """A `metrics.jsonl` line with the fields the report reads."""
    return {"version": version, "reward_mean": 0.5, "response_lens": lens, "response_len_max": max(lens), **figures}


METRICS = [
    metrics_row(1, [10, 20], stale_dropped_groups=0.0, response_len_mean=15.0),
    metrics_row(2, [20, 30, 40, 50], stale_dropped_groups=3.0, stale_dropped_len_mean=60.0, response_len_mean=35.0),
    metrics_row(3, [30, 30], stale_dropped_groups=1.0, stale_dropped_len_mean=20.0, response_len_mean=30.0),
]


def test_stale_drops_per_update_with_dropped_and_trained_lengths() -> None:
    drops = stale_drops(METRICS)
    assert drops["groups"] == 4
    assert drops["dropped_len_mean"] == pytest.approx((3 * 60 + 1 * 20) / 4)  # 50, per group dropped
    assert drops["trained_len_mean"] == pytest.approx((20 + 30 + 40 + 50 + 30 + 30) / 6)  # 33.3, updates 2 and 3
    assert drops["per_update"][1] == {"groups": 0, "dropped_len_mean": None, "trained_len_mean": 15.0}
    assert drops["per_update"][2] == {"groups": 3, "dropped_len_mean": 60.0, "trained_len_mean": 35.0}
    assert stale_drops([metrics_row(1, [5])])["per_update"] == {}, "a run from before these figures"


def test_the_report_page_shows_both_per_step_tables(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    (run / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in TIMELINE))
    page = write_report(run).read_text()
    items = dict(re.findall(r"<li><b>([^<]*)</b>: ([^<]*)</li>", page))
    assert items["partial rollouts"] == (
        "140 tokens generated ahead, 106 kept (76%) and 34 discarded; drafts filled the tail for 2.5 "
        "worker-seconds (per step below)"
    )
    assert items["groups dropped as too stale"] == (
        "4 over 2 updates; mean response length 50.0 dropped vs 33.3 trained in the same updates (per update below)"
    )
    assert "<tr><td>v1</td><td>120</td><td>90</td><td>30</td><td>75%</td><td>2.0</td></tr>" in page
    assert "<tr><td>v2</td><td>20</td><td>16</td><td>4</td><td>80%</td><td>0.5</td></tr>" in page
    assert "<tr><td>v2</td><td>3</td><td>60.0</td><td>35.0</td></tr>" in page
    assert "<tr><td>v3</td><td>1</td><td>20.0</td><td>30.0</td></tr>" in page
    assert "<td>v1</td><td>0</td>" not in page, "an update that dropped nothing has no row"

"""The monitor's pure figures: consumer lag, pending age, rollout throughput, summaries, Prometheus metrics."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tlt_stream.basics.config import ConfigError
from tlt_stream.basics.messages import DrafterStats, LearnerStats, RolloutStats
from tlt_stream.roles.monitor import (
    MetricsServer,
    MonitorOptions,
    drafter_summary,
    entry_seconds,
    group_lag,
    learner_summary,
    next_entry_id,
    partial_by_step,
    pending_age,
    prometheus_text,
    rollout_summary,
    stale_drops,
    stats_summary,
    worker_summary,
)


def test_entry_ids() -> None:
    assert entry_seconds(b"1796045459058-3") == 1796045459.058
    assert next_entry_id(b"1796045459058-3") == "1796045459058-4"
    assert next_entry_id("5") == "5-1"


def test_group_lag_prefers_redis_and_says_when_it_must_be_counted() -> None:
    assert group_lag({"lag": 4, "last-delivered-id": b"10-0"}, length=9) == 4
    assert group_lag({"lag": 0, "last-delivered-id": b"10-0"}, length=9) == 0
    # Redis cannot tell (deletions) or is older than 7 (no field): nothing delivered means all of the stream.
    assert group_lag({"lag": None, "last-delivered-id": b"0-0"}, length=9) == 9
    assert group_lag({"last-delivered-id": "0-0"}, length=2) == 2
    assert group_lag({"lag": None, "last-delivered-id": b"10-0"}, length=9) is None
    assert group_lag({"last-delivered-id": b"10-0"}, length=9) is None


def test_pending_age_from_the_oldest_pending_entry() -> None:
    oldest = {"message_id": b"100000-0", "consumer": b"w1", "time_since_delivered": 2500, "times_delivered": 3}
    assert pending_age(oldest, now=112.5) == {
        "oldest_pending_id": "100000-0",
        "oldest_pending_age_s": 12.5,
        "oldest_pending_idle_s": 2.5,
        "oldest_pending_consumer": "w1",
        "oldest_pending_deliveries": 3,
    }
    assert pending_age(None, now=1.0)["oldest_pending_age_s"] is None


def rollout(worker: str, tokens: int, seconds: float, forwards: int, sd_on: bool = False, batch: int = 4):
    return RolloutStats(
        worker_id=worker,
        policy_version=2,
        drafter_version=1,
        batch_size=batch,
        tokens=tokens,
        seconds=seconds,
        target_forwards=forwards,
        sd_on=sd_on,
    )


def test_rollout_throughput_over_a_long_run_uses_the_whole_window() -> None:
    now = 1000.0
    reports = [  # newest first, as read with XREVRANGE
        (999.0, rollout("w1", 300, 1.5, 60, sd_on=True, batch=2)),
        (995.0, rollout("w2", 200, 2.0, 100)),
        (990.0, rollout("w1", 100, 1.0, 100)),
        (900.0, rollout("w2", 5000, 50.0, 5000)),  # before the window: only w2's older state, not counted
    ]
    summary = rollout_summary(reports, now, window_s=30.0)
    assert summary["reports"] == 3 and summary["tokens"] == 600
    assert summary["span_s"] == 30.0
    assert summary["tokens_per_s"] == pytest.approx(600 / 30)
    assert summary["generation_tokens_per_s"] == pytest.approx(600 / 4.5)
    assert summary["tokens_per_forward"] == pytest.approx(600 / (60 * 2 + 100 * 4 + 100 * 4))  # per row
    assert summary["sd_on_workers"] == 1  # the latest report of each worker decides
    assert summary["workers"]["w1"] == {
        "sd_on": True,
        "batch_size": 2,
        "policy_version": 2,
        "drafter_version": 1,
        "tokens_per_s": 200.0,
        "tokens_per_forward": 2.5,
        "collapses": 0,
        "age_s": 1.0,
    }
    assert summary["workers"]["w2"]["sd_on"] is False and summary["workers"]["w2"]["age_s"] == 5.0


def test_tokens_per_forward_is_per_row_not_summed_over_the_batch() -> None:
    """A batch of 46 rows, each taking one token per target forward, reads 1.0 (not 46); with SD accepting 2.5
    tokens per row per forward, 2.5: the acceptance length the learner line reports per sample."""
    now = 1000.0
    plain = rollout_summary([(999.0, rollout("w1", 46 * 100, 2.0, 100, batch=46))], now, window_s=60.0)
    assert plain["tokens_per_forward"] == pytest.approx(1.0)
    assert plain["workers"]["w1"]["tokens_per_forward"] == pytest.approx(1.0)
    reports = [
        (999.0, rollout("w1", int(46 * 40 * 2.5), 2.0, 40, sd_on=True, batch=46)),
        (998.0, rollout("w2", 8 * 40 * 1, 2.0, 40, batch=8)),
        (997.0, rollout("w3", 0, 0.0, 0, batch=0)),  # idle: no forwards, no rows, counted nowhere
    ]
    mixed = rollout_summary(reports, now, window_s=60.0)
    assert mixed["workers"]["w1"]["tokens_per_forward"] == pytest.approx(2.5)
    assert mixed["workers"]["w2"]["tokens_per_forward"] == pytest.approx(1.0)
    assert mixed["workers"]["w3"]["tokens_per_forward"] is None
    assert mixed["tokens_per_forward"] == pytest.approx((4600 + 320) / (46 * 40 + 8 * 40))


def test_each_draft_sources_acceptance_is_summed_over_the_window() -> None:
    import msgspec

    old = msgspec.structs.replace(rollout("w1", 10, 1.0, 5), drafted={"eagle": 1000}, accepted={"eagle": 1000})
    a = msgspec.structs.replace(rollout("w1", 10, 1.0, 5), drafted={"eagle": 40, "group": 60}, accepted={"group": 30})
    b = msgspec.structs.replace(rollout("w2", 10, 1.0, 5), drafted={"group": 40}, accepted={"group": 10, "eagle": 0})
    summary = rollout_summary([(999.0, a), (998.0, b), (100.0, old)], 1000.0, window_s=60.0)
    assert summary["draft_sources"] == {
        "eagle": {"drafted": 40, "accepted": 0, "rate": 0.0},
        "group": {"drafted": 100, "accepted": 40, "rate": 0.4},
    }
    from tlt_stream.roles.monitor.dashboard import _sources

    assert _sources(summary["draft_sources"]) == "; drafts accepted: eagle 0.00 (0/40), group 0.40 (40/100)"


def reverified(worker: str, version: int, kept: int, discarded: int, ahead_s: float) -> RolloutStats:
    return RolloutStats(
        worker_id=worker, policy_version=version, drafter_version=1, batch_size=4, tokens=10, seconds=1.0,
        kept_tokens=kept, discarded_tokens=discarded, ahead_seconds=ahead_s,
    )  # fmt: skip


def test_partial_rollouts_count_per_step_the_drafts_were_verified_into() -> None:
    """Two workers across a version change: while at v3 they run drafts of step 4 (ahead seconds, reported
    stamped v3); loading v4 re-verifies them (kept and discarded, reported stamped v4). Step 4 gets both."""
    now = 1000.0
    reports = [  # newest first
        (999.0, reverified("w1", 5, kept=5, discarded=15, ahead_s=0.0)),
        (998.0, reverified("w2", 4, kept=12, discarded=0, ahead_s=0.0)),
        (997.0, reverified("w1", 4, kept=30, discarded=10, ahead_s=0.5)),  # drafts of step 5 already
        (996.0, reverified("w2", 3, kept=0, discarded=0, ahead_s=2.0)),
        (995.0, reverified("w1", 3, kept=0, discarded=0, ahead_s=1.5)),
        (994.0, reverified("w1", 3, kept=0, discarded=0, ahead_s=0.0)),  # no partial rollouts: no step
    ]
    step4 = {"ahead_tokens": 52, "kept_tokens": 42, "discarded_tokens": 10, "kept_share": 42 / 52, "ahead_seconds": 3.5}
    step5 = {"ahead_tokens": 20, "kept_tokens": 5, "discarded_tokens": 15, "kept_share": 0.25, "ahead_seconds": 0.5}
    by_step = partial_by_step(
        (r.policy_version, r.kept_tokens, r.discarded_tokens, r.ahead_seconds) for _, r in reports
    )
    assert by_step == {4: step4, 5: step5}
    summary = rollout_summary(reports, now, window_s=3.5)  # per step over every report read, not the window
    assert summary["partial"] == {"5": step5, "4": step4} and list(summary["partial"]) == ["5", "4"]

    # Ahead seconds alone (drafts in flight, none verified yet): a step with no share; only the newest steps.
    many = [(900.0 + v, reverified("w1", v, kept=v, discarded=0, ahead_s=0.0)) for v in range(1, 9)]
    summary = rollout_summary([(999.0, reverified("w1", 8, 0, 0, ahead_s=0.25)), *many[::-1]], now, window_s=60.0)
    assert list(summary["partial"]) == ["9", "8", "7", "6", "5"]
    assert summary["partial"]["9"] == {
        "ahead_tokens": 0, "kept_tokens": 0, "discarded_tokens": 0, "kept_share": None, "ahead_seconds": 0.25,
    }  # fmt: skip
    from tlt_stream.roles.monitor.dashboard import _partial

    line = _partial({"partial": {"5": step5, "4": step4}})
    assert line is not None and line.plain == (
        "partial rollouts per step (version verified into): v5 20 ahead, kept 5 (25%), discarded 15, tail filled "
        "0.5 worker-s; v4 52 ahead, kept 42 (81%), discarded 10, tail filled 3.5 worker-s"
    )
    assert _partial({"partial": {}}) is None


def learner(version: int, samples: int, **metrics: float) -> LearnerStats:
    return LearnerStats(step=version, policy_version=version, groups=4, samples=samples, metrics=metrics)


def test_stale_drops_compare_dropped_and_trained_lengths_in_the_same_updates() -> None:
    stats = [  # newest first
        (99.0, learner(4, 8, stale_dropped_groups=1.0, stale_dropped_len_mean=70.0, response_len_mean=31.0)),
        (98.0, learner(3, 16, stale_dropped_groups=2.0, stale_dropped_len_mean=40.0, response_len_mean=25.0)),
        (97.0, learner(2, 16, stale_dropped_groups=0.0, response_len_mean=20.0)),  # dropped none: not compared
        (96.0, learner(1, 16, response_len_mean=99.0)),  # from before these figures: left out
    ]
    summary = stats_summary(stats, 0, 96.0, False, 100.0, 60.0, dropped_total=5)["stale_drops"]
    assert summary["groups"] == 3 and summary["run_groups"] == 5 and summary["updates_read"] == 3
    assert summary["dropped_len_mean"] == pytest.approx((2 * 40 + 1 * 70) / 3)  # per group dropped: 50
    assert summary["trained_len_mean"] == pytest.approx((16 * 25 + 8 * 31) / 24)  # per sample trained: 27
    assert summary["per_update"] == {
        "4": {"groups": 1, "dropped_len_mean": 70.0, "trained_len_mean": 31.0},
        "3": {"groups": 2, "dropped_len_mean": 40.0, "trained_len_mean": 25.0},
        "2": {"groups": 0, "dropped_len_mean": None, "trained_len_mean": 20.0},
    }
    none = stale_drops([(1, 16, {"stale_dropped_groups": 0.0, "response_len_mean": 20.0})])
    assert (none["groups"], none["dropped_len_mean"], none["trained_len_mean"]) == (0, None, None)
    from tlt_stream.roles.monitor.dashboard import _stale_drops

    line = _stale_drops(summary)
    assert line is not None and line.plain == (
        "groups dropped as too stale: 5 in the run, 3 in the 3 updates read; mean response length 50.0 dropped "
        "vs 27.0 trained in the same updates; per update: v4 1 (len 70.0 vs 31.0), v3 2 (len 40.0 vs 25.0)"
    )
    assert _stale_drops({**none, "run_groups": 0}) is None


def test_rollout_throughput_of_a_young_or_truncated_read_covers_only_what_was_seen() -> None:
    now = 1000.0
    reports = [(998.0, rollout("w1", 400, 2.0, 400)), (994.0, rollout("w1", 200, 4.0, 200))]
    young = rollout_summary(reports, now, window_s=60.0)
    assert young["span_s"] == pytest.approx(10.0)  # from the first report's start (994 - 4)
    assert young["tokens_per_s"] == pytest.approx(60.0)
    cut = rollout_summary(reports, now, window_s=60.0, horizon=995.0)
    assert cut["span_s"] == pytest.approx(5.0)
    assert cut["tokens_per_s"] == pytest.approx(120.0)
    empty = rollout_summary([], now, window_s=60.0)
    assert empty["tokens_per_s"] == 0.0 and empty["generation_tokens_per_s"] is None
    assert empty["tokens_per_forward"] is None and empty["workers"] == {}


def test_learner_drafter_and_worker_summaries() -> None:
    metrics = {"reward_mean": 0.5, "accuracy": 0.375, "staleness_max": 1.0, "accept_length_mean": 2.5, "loss": 0.1}
    learner = learner_summary(
        (95.0, LearnerStats(step=7, policy_version=7, groups=8, samples=64, metrics=metrics)), 100.0
    )
    assert learner is not None
    assert (learner["step"], learner["age_s"], learner["reward_mean"], learner["accuracy"]) == (7, 5.0, 0.5, 0.375)
    assert learner["accept_length_mean"] == 2.5 and learner["staleness_mean"] is None
    assert learner["metrics"] == metrics
    assert learner_summary(None, 1.0) is None

    def slice_(step: int, adopted: bool, judged: bool = True) -> DrafterStats:
        verdict = dict(accept_new=2.2, accept_current=2.0, adopted=adopted, drafter_version=4 if adopted else -1)
        return DrafterStats(
            worker_id="w2", fence=3, policy_version=7, step=step, steps=10, seconds=2.0, loss=0.8, end="preempted",
            judged=judged, **(verdict if judged else {}),
        )  # fmt: skip

    drafter = drafter_summary([(99.0, slice_(40, True)), (90.0, slice_(30, False))], 100.0)
    assert drafter is not None
    assert (drafter["step"], drafter["adopted"], drafter["drafter_version"], drafter["age_s"]) == (40, True, 4, 1.0)
    assert (drafter["slices_read"], drafter["adopted_read"], drafter["end"]) == (2, 1, "preempted")
    # The newest slice was not judged: its own figures, the newest judgement's verdict.
    drafter = drafter_summary([(99.0, slice_(45, False, judged=False)), (90.0, slice_(40, True))], 100.0)
    assert drafter is not None and (drafter["step"], drafter["judged_step"]) == (45, 40)
    assert (drafter["adopted"], drafter["drafter_version"], drafter["accept_new"]) == (True, 4, 2.2)
    drafter = drafter_summary([(99.0, slice_(45, False, judged=False))], 100.0)
    assert drafter is not None and drafter["judged_step"] is None and drafter["adopted"] is None
    assert drafter_summary([], 1.0) is None

    raw = {"worker_id": "w1", "role": "rollout", "state": "IDLE", "since": "90.0", "heartbeat": "99.5"}
    worker = worker_summary({**raw, "pid": "12", "policy_version": "3"}, 100.0)
    assert (worker["state"], worker["state_seconds"], worker["heartbeat_age_s"]) == ("IDLE", 10.0, 0.5)
    assert (worker["policy_version"], worker["drafter_version"]) == (3, None)
    assert worker["info"] == {"pid": "12", "policy_version": "3"}


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, read back with prometheus_client's own parser."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_text_carries_the_figures_and_escapes_labels() -> None:
    snap = {
        "run": "r1",
        "reachable": True,
        "time": 100.0,
        "streams": {
            "prompts": {
                "length": 6,
                "groups": {
                    "rollout": {
                        "consumers": 1,
                        "pending": 2,
                        "lag": 3,
                        "oldest_pending_age_s": 4.5,
                        "oldest_pending_idle_s": None,
                    }
                },
            },
            "stats": {"length": 9, "groups": {}},
        },
        "dead": {"counts": {"prompts": 1}, "lost_groups": 2},
        "worker_states": {"GENERATING": 1},
        "workers": [
            {
                "worker_id": 'w"1\n',
                "role": "rollout",
                "state": "GENERATING",
                "state_seconds": 2.0,
                "policy_version": 3,
                "drafter_version": None,
            },
        ],
        "rollout": {
            "workers": {'w"1\n': {"sd_on": True, "batch_size": 2}},
            "tokens_per_s": 20.0,
            "generation_tokens_per_s": None,
            "tokens_per_forward": 1.5,
            "sd_on_workers": 1,
        },
        "versions": {"policy": {"version": 3}, "drafter": None, "sd_config": {"version": 1}},
        "learner": {"step": 2, "policy_version": 2, "age_s": 1.0, "metrics": {"reward_mean": 0.5, "nan": float("nan")}},
        "drafter": None,
        "stats_read": {"undecodable": 0},
    }
    text = prometheus_text(snap)
    assert "# TYPE tlt_dead_letters_total counter" in text
    samples = parse_metrics(text)
    run = ("run", "r1")

    def value(name: str, /, **labels: str) -> float:
        return samples[(name, frozenset({run, *labels.items()}))]

    assert value("tlt_up") == 1
    assert value("tlt_stream_length", stream="prompts") == 6
    assert value("tlt_group_lag", stream="prompts", group="rollout") == 3
    assert value("tlt_group_oldest_pending_age_seconds", stream="prompts", group="rollout") == 4.5
    assert not any(name == "tlt_group_oldest_pending_idle_seconds" for name, _ in samples)  # None: no sample
    assert value("tlt_dead_letters_total", stream="prompts") == 1 and value("tlt_lost_groups_total") == 2
    assert value("tlt_workers", state="GENERATING") == 1 and value("tlt_workers", state="IDLE") == 0
    assert '{run="r1",worker="w\\"1\\n"}' in text  # quote and newline escaped in the exposition
    worker = 'w"1\n'
    assert value("tlt_worker_state", worker=worker, role="rollout", state="GENERATING") == 1
    assert value("tlt_worker_sd_on", worker=worker) == 1
    assert value("tlt_version", kind="policy") == 3 and value("tlt_version", kind="sd_config") == 1
    assert not any(name == "tlt_version" and ("kind", "drafter") in labels for name, labels in samples)
    assert value("tlt_rollout_tokens_per_forward") == 1.5
    assert value("tlt_learner_step") == 2 and value("tlt_learner_metric", name="reward_mean") == 0.5
    assert math.isnan(value("tlt_learner_metric", name="nan"))

    down = parse_metrics(prometheus_text({"run": "r1", "reachable": False}))
    assert down == {("tlt_up", frozenset({run})): 0.0}


def test_metrics_server_serves_what_was_published() -> None:
    with MetricsServer("127.0.0.1", 0) as server:
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url, timeout=5)
        assert missing.value.code == 503
        server.publish({"run": "r1", "reachable": False})
        with urllib.request.urlopen(server.url, timeout=5) as reply:
            assert parse_metrics(reply.read().decode()) == {("tlt_up", frozenset({("run", "r1")})): 0.0}
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        with pytest.raises(urllib.error.HTTPError) as elsewhere:
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=5)
        assert elsewhere.value.code == 404


@pytest.mark.parametrize(
    "options",
    [{"interval": 0}, {"window_s": -1.0}, {"timeout": 0.0}, {"prometheus": 70000}, {"once": True, "prometheus": 9}],
)
def test_bad_options_are_config_errors(options: dict) -> None:
    with pytest.raises(ConfigError):
        MonitorOptions(**options)


def test_the_dashboards_head_shows_names_with_brackets_as_written() -> None:
    """The head line is Rich markup: an IPv6 Redis host or a name holding `[/x]` was read as markup (a
    MarkupError for a closing tag nothing opened)."""
    from rich.console import Console

    from tlt_stream.roles.monitor.dashboard import render

    console = Console(width=200, record=True)
    console.print(render({"run": "a[/x]b", "redis": "redis://[::1]:6379/0", "reachable": False, "error": "down"}))
    assert "run a[/x]b  redis redis://[::1]:6379/0" in console.export_text()

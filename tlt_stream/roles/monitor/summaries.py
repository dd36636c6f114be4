"""The monitor's figures as pure functions of what a snapshot read: lag, pending age, rollout throughput and
acceptance, partial rollouts per step, groups dropped as too stale, the latest learner and drafter-training
reports, the workers. `tlt-stream report` reuses the per-step ones on the run directory's files.

Nothing here touches Redis or a clock: times come in as arguments (the Redis server's, from `TIME` and
stream entry ids), so every figure is tested as a plain function and a replayed reading gives the same
numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tlt_stream.basics.common import as_text
from tlt_stream.basics.messages import DrafterStats, LearnerDiskTrouble, LearnerStats, RolloutStats

__all__ = [
    "drafter_summary",
    "entry_seconds",
    "group_lag",
    "learner_disk_summary",
    "learner_summary",
    "load_latency_summary",
    "next_entry_id",
    "partial_by_step",
    "pending_age",
    "rollout_summary",
    "stale_drops",
    "stats_summary",
    "worker_summary",
]

LEARNER_HEADLINES = (
    "reward_mean",
    "accuracy",
    "staleness_max",
    "staleness_mean",
    "rollout_tokens_per_s",
    "accept_length_mean",
)
"""The learner figures shown on their own; the rest stay under `metrics`."""
LOAD_LATENCY_VERSIONS = 5
"""Policy versions whose publish-to-loaded latency a snapshot shows (the newest ones read)."""
RECENT_STEPS = 5
"""Steps whose partial-rollout figures and learner updates whose stale drops a snapshot shows (the newest read)."""


def entry_seconds(entry_id: bytes | str) -> float:
    """When Redis added a stream entry (its id's millisecond part), in seconds."""
    return int(as_text(entry_id).partition("-")[0]) / 1000


def next_entry_id(entry_id: bytes | str) -> str:
    ms, _, seq = as_text(entry_id).partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _number(value: Any, kind: type = float) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def group_lag(group: Mapping[str, Any], length: int) -> int | None:
    """Entries not yet delivered to a group, from its XINFO GROUPS record, or None when they must be counted.

    Redis 7 reports `lag` unless deletions make it unknowable; older servers have no such field. With nothing
    delivered yet, every entry of the stream is undelivered.
    """
    lag = group.get("lag")
    if lag is not None:
        return int(lag)
    if as_text(group.get("last-delivered-id", "0-0")) == "0-0":
        return length
    return None


def pending_age(oldest: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """The oldest pending entry of a group (an XPENDING range row): its age since it was added and since its
    last delivery, who holds it and how often it was delivered."""
    if oldest is None:
        return {"oldest_pending_id": None, "oldest_pending_age_s": None, "oldest_pending_idle_s": None}
    return {
        "oldest_pending_id": as_text(oldest["message_id"]),
        "oldest_pending_age_s": max(0.0, now - entry_seconds(oldest["message_id"])),
        "oldest_pending_idle_s": int(oldest["time_since_delivered"]) / 1000,
        "oldest_pending_consumer": as_text(oldest["consumer"]),
        "oldest_pending_deliveries": int(oldest["times_delivered"]),
    }


def _row_forwards(report: RolloutStats) -> int:
    """Row-forwards of a report: its batched target forwards times the rows decoded in each, taken as the
    running batch at the report (0 when the worker had no rows then: its acceptance cannot be told)."""
    return report.target_forwards * report.batch_size


def draft_source_totals(reports: Iterable[tuple[Mapping[str, int], Mapping[str, int]]]) -> dict[str, dict[str, int]]:
    """Drafted and accepted nodes per draft source summed over rollout reports' (drafted, accepted) counts
    (`RolloutStats.drafted`, `.accepted`), sources sorted by name."""
    out: dict[str, dict[str, int]] = {}
    for drafted, accepted in reports:
        for field, counts in (("drafted", drafted), ("accepted", accepted)):
            for source, n in counts.items():
                out.setdefault(source, {"drafted": 0, "accepted": 0})[field] += n
    return dict(sorted(out.items()))


def rollout_summary(
    reports: Iterable[tuple[float, RolloutStats]], now: float, window_s: float, horizon: float | None = None
) -> dict[str, Any]:
    """Rollout throughput over the last `window_s` seconds, each worker's latest report, and partial rollouts
    per step over every report read (`partial`: the newest `RECENT_STEPS` steps, newest first, keyed by the
    version as a string; see `partial_by_step`).

    `reports` are (time added, entry), newest first. Throughput is the tokens reported in the window over the
    span they cover: the window, or less when the run is younger (from the start of its first report) or
    when nothing older than `horizon` was read. Generation speed is tokens over the workers' own generation
    seconds. Tokens per forward is per row, the acceptance length the learner reports per sample: 1.0
    without SD at any batch, not the batch times that.
    """
    reports = list(reports)
    recent = [(t, r) for t, r in reports if t > now - window_s]
    start = now - window_s
    if horizon is not None:
        start = max(start, horizon)
    elif recent and len(recent) == len(reports):  # nothing older: the run is younger than the window
        start = max(start, min(t - r.seconds for t, r in recent))
    span = max(now - start, 1e-9)
    tokens = sum(r.tokens for _, r in recent)
    seconds = sum(r.seconds for _, r in recent)
    counted = [r for _, r in recent if _row_forwards(r)]
    row_forwards = sum(_row_forwards(r) for r in counted)
    workers: dict[str, dict[str, Any]] = {}
    for t, r in reports:
        if r.worker_id not in workers:
            workers[r.worker_id] = {
                "sd_on": r.sd_on,
                "batch_size": r.batch_size,
                "policy_version": r.policy_version,
                "drafter_version": r.drafter_version,
                "tokens_per_s": r.tokens / r.seconds if r.seconds > 0 else None,
                "tokens_per_forward": r.tokens / _row_forwards(r) if _row_forwards(r) else None,
                "collapses": r.collapses,
                "age_s": max(0.0, now - t),
            }
    sources: dict[str, dict[str, Any]] = dict(draft_source_totals((r.drafted, r.accepted) for _, r in recent))
    for counts in sources.values():
        counts["rate"] = counts["accepted"] / counts["drafted"] if counts["drafted"] else None
    partial = partial_by_step(
        (r.policy_version, r.kept_tokens, r.discarded_tokens, r.ahead_seconds) for _, r in reports
    )
    return {
        "window_s": window_s,
        "span_s": span if recent else 0.0,
        "draft_sources": dict(sorted(sources.items())),
        "partial": {str(s): partial[s] for s in sorted(partial, reverse=True)[:RECENT_STEPS]},
        "reports": len(recent),
        "tokens": tokens,
        "tokens_per_s": tokens / span if recent else 0.0,
        "generation_tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_forward": sum(r.tokens for r in counted) / row_forwards if row_forwards else None,
        "load_latency": load_latency_summary(reports),
        "sd_on_workers": sum(w["sd_on"] for w in workers.values()),
        "acceptance_collapses": sum(w["collapses"] for w in workers.values()),
        "workers": workers,
    }


def partial_by_step(reports: Iterable[tuple[int, int, int, float]]) -> dict[int, dict[str, Any]]:
    """Partial rollouts per step from rollout reports' (`policy_version`, `kept_tokens`, `discarded_tokens`,
    `ahead_seconds`), steps with none left out, in version order.

    Step s is the policy version the drafts were verified into (the version their samples carry). A worker
    re-verifies its rows in flight when it loads a version and stamps its reports with the version it holds,
    so a report's kept and discarded tokens count for its own version; its ahead seconds were spent with
    drafts of the next version in flight, so they count for that one (a worker reports its hops before it
    loads a version, so no report spans a load). Per step:
    `ahead_tokens`, the tokens generated ahead that re-verification judged (kept + discarded), `kept_tokens`,
    `discarded_tokens`, `kept_share` (None with none judged) and `ahead_seconds`, the worker-seconds with a
    draft in flight (the previous step's tail filled with this one's work).
    """
    out: dict[int, dict[str, Any]] = {}

    def row(step: int) -> dict[str, Any]:
        return out.setdefault(step, {"ahead_tokens": 0, "kept_tokens": 0, "discarded_tokens": 0, "ahead_seconds": 0.0})

    for version, kept, discarded, seconds in reports:
        if kept or discarded:
            judged = row(version)
            judged["kept_tokens"] += kept
            judged["discarded_tokens"] += discarded
            judged["ahead_tokens"] += kept + discarded
        if seconds:
            row(version + 1)["ahead_seconds"] += seconds
    for figures in out.values():
        figures["kept_share"] = figures["kept_tokens"] / figures["ahead_tokens"] if figures["ahead_tokens"] else None
    return dict(sorted(out.items()))


def stale_drops(updates: Iterable[tuple[int, int, Mapping[str, float]]]) -> dict[str, Any]:
    """Groups the learner dropped as too stale, and whether they are the long ones, from its updates'
    (version made, samples trained, metrics); updates from before these figures (no `stale_dropped_groups`)
    left out.

    `per_update` maps each version (in order) to the groups dropped while its update was assembled
    (`groups`), their responses' mean length (`dropped_len_mean`, None with none dropped) and the trained
    responses' (`trained_len_mean`). Over the updates that dropped any: `groups`, `dropped_len_mean` weighted
    by groups dropped (the learner keeps one mean per update) and `trained_len_mean` weighted by samples
    trained, so both lengths come from the same stretch of training (lengths drift as the policy learns).
    """
    per: dict[int, dict[str, Any]] = {}
    weights: dict[int, int] = {}
    for version, samples, metrics in updates:
        if "stale_dropped_groups" not in metrics:
            continue
        per[version] = {
            "groups": int(metrics["stale_dropped_groups"]),
            "dropped_len_mean": metrics.get("stale_dropped_len_mean"),
            "trained_len_mean": metrics.get("response_len_mean"),
        }
        weights[version] = samples
    dropping = [v for v, u in per.items() if u["groups"]]
    lengths = [v for v in dropping if per[v]["dropped_len_mean"] is not None]
    trained = [v for v in dropping if per[v]["trained_len_mean"] is not None and weights[v]]
    dropped_groups = sum(per[v]["groups"] for v in lengths)
    trained_samples = sum(weights[v] for v in trained)
    return {
        "per_update": dict(sorted(per.items())),
        "groups": sum(per[v]["groups"] for v in dropping),
        "dropped_len_mean": (
            sum(per[v]["groups"] * per[v]["dropped_len_mean"] for v in lengths) / dropped_groups if lengths else None
        ),
        "trained_len_mean": (
            sum(weights[v] * per[v]["trained_len_mean"] for v in trained) / trained_samples if trained else None
        ),
    }


def load_latency_summary(
    reports: Iterable[tuple[float, RolloutStats]], versions: int = LOAD_LATENCY_VERSIONS
) -> dict[str, dict[str, Any]]:
    """Per policy version (the newest `versions` among the reports, newest first, keyed by the number as a
    string): how many workers reported loading it and the max and mean seconds from its announcement to
    loaded (`RolloutStats.load_latency_s`; each worker reports a version once)."""
    per: dict[int, list[float]] = {}
    for _, report in reports:
        for version, seconds in report.load_latency_s.items():
            per.setdefault(int(version), []).append(seconds)
    return {
        str(v): {"workers": len(per[v]), "max_s": max(per[v]), "mean_s": sum(per[v]) / len(per[v])}
        for v in sorted(per, reverse=True)[:versions]
    }


def learner_summary(entry: tuple[float, LearnerStats] | None, now: float) -> dict[str, Any] | None:
    if entry is None:
        return None
    t, stats = entry
    m = stats.metrics
    return {
        "step": stats.step,
        "policy_version": stats.policy_version,
        "groups": stats.groups,
        "samples": stats.samples,
        "age_s": max(0.0, now - t),
        **{k: m.get(k) for k in LEARNER_HEADLINES},
        "metrics": dict(m),
    }


def learner_disk_summary(stats: list[tuple[float, Any]], now: float) -> dict[str, Any] | None:
    """The learner's newest report of a write that must land (a checkpoint, a metrics line) failing, from the
    `stats` entries read (newest first): `failing` until it was written or a learner update came after it (a
    learner restarted meanwhile reports anew), with the attempts, the error and for how long; None when none
    was read."""
    newest = next(((i, t, e) for i, (t, e) in enumerate(stats) if isinstance(e, LearnerDiskTrouble)), None)
    if newest is None:
        return None
    i, t, entry = newest
    failing = not entry.written and not any(isinstance(e, LearnerStats) for _, e in stats[:i])
    return {
        "failing": failing,
        "write": entry.write,
        "version": entry.version,
        "attempts": entry.attempts,
        "error": entry.error,
        "failing_s": max(0.0, now - entry.since) if failing else None,
        "age_s": max(0.0, now - t),
    }


def drafter_summary(latest: list[tuple[float, DrafterStats]], now: float) -> dict[str, Any] | None:
    """The newest drafter-training slice (`latest` newest first), the newest judgement among those read (the
    verdict fields are None when none was judged), and how many of those read were adopted."""
    if not latest:
        return None
    t, d = latest[0]
    fields = ("worker_id", "fence", "policy_version", "step", "steps", "seconds", "loss", "end", "windows")
    verdict = ("accept_new", "accept_current", "adopted", "drafter_version", "judge_s")
    judged = next((s for _, s in latest if s.judged), None)
    return {
        **{k: getattr(d, k) for k in fields},
        **{k: getattr(judged, k) if judged is not None else None for k in verdict},
        "judged_step": judged.step if judged is not None else None,
        "age_s": max(0.0, now - t),
        "slices_read": len(latest),
        "adopted_read": sum(s.adopted for _, s in latest),
    }


def worker_summary(raw: Mapping[str, str], now: float) -> dict[str, Any]:
    since, beat = _number(raw.get("since")), _number(raw.get("heartbeat"))
    extra = {k: v for k, v in raw.items() if k not in ("worker_id", "role", "state", "since", "heartbeat")}
    return {
        "worker_id": raw["worker_id"],
        "role": raw.get("role"),
        "state": raw.get("state"),
        "since": since,
        "state_seconds": max(0.0, now - since) if since is not None else None,
        "heartbeat_age_s": max(0.0, now - beat) if beat is not None else None,
        "policy_version": _number(extra.get("policy_version"), int),
        "drafter_version": _number(extra.get("drafter_version"), int),
        "info": extra,
    }


def stats_summary(
    stats: list[tuple[float, Any]],
    undecodable: int,
    oldest: float | None,
    truncated: bool,
    now: float,
    window_s: float,
    dropped_total: int | None = None,
) -> dict[str, Any]:
    """The `rollout`, `learner`, `learner_disk`, `stale_drops`, `drafter` and `stats_read` parts of a snapshot from the
    `stats` entries read (newest first), how many were undecodable, when the oldest read was added and whether
    the read was cut short (then throughput covers only what was read). `dropped_total`: the groups dropped as
    too stale in the whole run (the `dropped` hash's size), beside the figures of the learner updates read."""
    rollouts = [(t, e) for t, e in stats if isinstance(e, RolloutStats)]
    updates = [e for _, e in stats if isinstance(e, LearnerStats)]
    learner = next(((t, e) for t, e in stats if isinstance(e, LearnerStats)), None)
    drops = stale_drops((u.policy_version, u.samples, u.metrics) for u in reversed(updates))
    recent = sorted(drops["per_update"], reverse=True)[:RECENT_STEPS]
    return {
        "rollout": rollout_summary(rollouts, now, window_s, oldest if truncated else None),
        "learner": learner_summary(learner, now),
        "learner_disk": learner_disk_summary(stats, now),
        "stale_drops": {
            **drops,
            "per_update": {str(v): drops["per_update"][v] for v in recent},
            "updates_read": len(drops["per_update"]),
            "run_groups": dropped_total,
        },
        "drafter": drafter_summary([(t, e) for t, e in stats if isinstance(e, DrafterStats)], now),
        "stats_read": {
            "entries": len(stats) + undecodable,
            "undecodable": undecodable,
            "truncated": truncated,
            "covers_s": max(0.0, now - oldest) if oldest is not None else None,
        },
    }

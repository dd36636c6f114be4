"""`tlt-stream monitor`: what a run is doing, read from Redis alone, as a dashboard, JSON or Prometheus metrics.

A snapshot reads the run's keys and nothing else (no broker, no files): stream lengths and consumer groups
(what `doctor` reads, plus lag and the oldest pending entry), dead letters, the worker registry, the version
mirror, and the newest entries of `stats`, read newest first in bounded pages so a snapshot costs the same
on a long run. Ages use the Redis server's clock (`TIME` and stream entry ids), never another host's.
The figures are pure functions of what was read (`group_lag`, `pending_age`, `rollout_summary`,
`prometheus_text`), tested without a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import redis.asyncio as aioredis

from tlt_stream.bus.connect import REDIS_RETRYABLE, connect_redis
from tlt_stream.bus.producer import PAYLOAD_FIELD
from tlt_stream.bus.streams import Keys
from tlt_stream.common import as_text
from tlt_stream.config import Config, ConfigError, redact_url
from tlt_stream.doctor import inspect_redis
from tlt_stream.messages import CONTROL_KINDS, DrafterStats, LearnerStats, RolloutStats, codec_for

__all__ = [
    "MetricsServer",
    "MonitorOptions",
    "drafter_summary",
    "group_lag",
    "learner_summary",
    "monitor",
    "pending_age",
    "prometheus_text",
    "render",
    "rollout_summary",
    "snapshot",
    "summary_line",
    "worker_summary",
]

STATS_PAGE = 500
STATS_LIMIT = 2000
"""At most this many `stats` entries are read per snapshot (newest first)."""
DEAD_RECENT = 5
LAG_COUNT_LIMIT = 10_000
"""When Redis cannot tell a group's lag, at most this many undelivered entries are counted (server-side, in
pages small enough that large `hidden` entries stay cheap); a lag at the cap is a lower bound."""

_COUNT_AFTER = """
local n, cursor, cap = 0, ARGV[1], tonumber(ARGV[2])
while n < cap do
  local page = redis.call('XRANGE', KEYS[1], cursor, '+', 'COUNT', math.min(32, cap - n))
  if #page == 0 then break end
  n = n + #page
  local last = page[#page][1]
  local dash = string.find(last, '-', 1, true)
  cursor = string.sub(last, 1, dash - 1) .. '-' .. (tonumber(string.sub(last, dash + 1)) + 1)
end
return n
"""


def _number(value: Any, kind: type = float) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def entry_seconds(entry_id: bytes | str) -> float:
    """When Redis added a stream entry (its id's millisecond part), in seconds."""
    return int(as_text(entry_id).partition("-")[0]) / 1000


def next_entry_id(entry_id: bytes | str) -> str:
    ms, _, seq = as_text(entry_id).partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


# ---------------------------------------------------------------------------------------------- pure figures


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


def rollout_summary(
    reports: Iterable[tuple[float, RolloutStats]], now: float, window_s: float, horizon: float | None = None
) -> dict[str, Any]:
    """Rollout throughput over the last `window_s` seconds and each worker's latest report.

    `reports` are (time added, entry), newest first. Throughput is the tokens reported in the window over the
    span they cover: the window, or less when the run is younger (from the start of its first report) or
    when nothing older than `horizon` was read. Generation speed is tokens over the workers' own generation
    seconds; tokens per target forward is per batched forward (the running batch times acceptance length).
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
    forwards = sum(r.target_forwards for _, r in recent)
    workers: dict[str, dict[str, Any]] = {}
    for t, r in reports:
        if r.worker_id not in workers:
            workers[r.worker_id] = {
                "sd_on": r.sd_on,
                "batch_size": r.batch_size,
                "policy_version": r.policy_version,
                "drafter_version": r.drafter_version,
                "tokens_per_s": r.tokens / r.seconds if r.seconds > 0 else None,
                "tokens_per_forward": r.tokens / r.target_forwards if r.target_forwards else None,
                "age_s": max(0.0, now - t),
            }
    return {
        "window_s": window_s,
        "span_s": span if recent else 0.0,
        "reports": len(recent),
        "tokens": tokens,
        "tokens_per_s": tokens / span if recent else 0.0,
        "generation_tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_forward": tokens / forwards if forwards else None,
        "sd_on_workers": sum(w["sd_on"] for w in workers.values()),
        "workers": workers,
    }


_LEARNER_HEADLINES = (
    "reward_mean",
    "accuracy",
    "staleness_max",
    "staleness_mean",
    "rollout_tokens_per_s",
    "accept_length_mean",
)


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
        **{k: m.get(k) for k in _LEARNER_HEADLINES},
        "metrics": dict(m),
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


# ---------------------------------------------------------------------------------------------- reading


async def _group_detail(redis: aioredis.Redis, key: str, name: str, reported: Mapping[str, Any], length: int) -> dict:
    lag, source = reported.get("lag"), "redis"
    if lag is None:
        source = "counted"
        found = [g for g in await redis.xinfo_groups(key) if as_text(g["name"]) == name]
        lag = group_lag(found[0], length) if found else None
        if lag is None and found:
            start = next_entry_id(found[0]["last-delivered-id"])
            lag = int(await redis.eval(_COUNT_AFTER, 1, key, start, LAG_COUNT_LIMIT))
            source = "at_least" if lag >= LAG_COUNT_LIMIT else source
    async with redis.pipeline(transaction=False) as pipe:  # TIME after XPENDING: the age is never below the idle
        pipe.xpending(key, name)
        pipe.xpending_range(key, name, min="-", max="+", count=1)
        pipe.time()
        summary, oldest, (seconds, micros) = await pipe.execute()
    now = int(seconds) + int(micros) / 1e6
    return {
        "consumers": int(reported.get("consumers", 0)),
        "pending": int(summary["pending"]),
        "pending_per_consumer": {as_text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []},
        "lag": lag,
        "lag_source": source,
        **pending_age(oldest[0] if oldest else None, now),
    }


async def _read_stats(
    redis: aioredis.Redis, key: str, now: float, window_s: float, limit: int
) -> tuple[list[tuple[float, Any]], int, float | None, bool]:
    """Newest-first (time, entry) pairs until the window is covered and a learner entry seen, or `limit`;
    with the undecodable count, the time of the oldest entry read and whether the read was cut short."""
    codec = codec_for("stats")
    entries: list[tuple[float, Any]] = []
    undecodable = read = 0
    cursor, learner_seen, oldest = "+", False, None
    while read < limit:
        wanted = min(STATS_PAGE, limit - read)
        if cursor == "+":
            page = await redis.xrevrange(key, max=cursor, min="-", count=wanted)
        else:  # from the previous page's last row, which is dropped
            page = (await redis.xrevrange(key, max=cursor, min="-", count=wanted + 1))[1:]
        for entry_id, fields in page:
            read += 1
            oldest = entry_seconds(entry_id)
            try:
                message = codec.decode(fields[PAYLOAD_FIELD])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                undecodable += 1
                continue
            learner_seen = learner_seen or isinstance(message, LearnerStats)
            entries.append((oldest, message))
        if len(page) < wanted:  # the start of the stream
            return entries, undecodable, oldest, False
        cursor = as_text(page[-1][0])
        if learner_seen and entry_seconds(cursor) < now - window_s:
            return entries, undecodable, oldest, False
    return entries, undecodable, oldest, True


async def _recent_dead(redis: aioredis.Redis, keys: Keys, now: float) -> list[dict[str, Any]]:
    codec = codec_for("dead")
    recent = []
    for entry_id, fields in await redis.xrevrange(keys.stream("dead"), count=DEAD_RECENT):
        row: dict[str, Any] = {"id": as_text(entry_id), "age_s": max(0.0, now - entry_seconds(entry_id))}
        try:
            letter = codec.decode(fields[PAYLOAD_FIELD])
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            row.update(stream=None, reason=f"undecodable dead letter: {exc}")
        else:
            row.update(stream=letter.stream, entry_id=letter.entry_id, reason=letter.reason, origin=letter.origin)
            row["deliveries"] = letter.deliveries
        recent.append(row)
    return recent


async def _details(
    redis: aioredis.Redis, keys: Keys, base: dict[str, Any], window_s: float, limit: int
) -> dict[str, Any]:
    seconds, micros = await redis.time()
    now = int(seconds) + int(micros) / 1e6
    streams = {}
    for name, entry in base["streams"].items():
        groups = {
            group: await _group_detail(redis, keys.stream(name), group, reported, entry["length"])
            for group, reported in entry["groups"].items()
        }
        streams[name] = {"length": entry["length"], "groups": groups}
    stats, undecodable, oldest, truncated = await _read_stats(redis, keys.stream("stats"), now, window_s, limit)
    rollouts = [(t, e) for t, e in stats if isinstance(e, RolloutStats)]
    learner = next(((t, e) for t, e in stats if isinstance(e, LearnerStats)), None)
    workers = [worker_summary(w, now) for w in base["workers"]]
    states: dict[str, int] = {}
    for worker in workers:
        states[worker["state"]] = states.get(worker["state"], 0) + 1
    return {
        "time": now,
        "streams": streams,
        "dead": {
            "counts": base["dead_counts"],
            "total": sum(base["dead_counts"].values()),
            "recent": await _recent_dead(redis, keys, now),
        },
        "workers": workers,
        "worker_states": states,
        "versions": {kind: base["versions"].get(kind) for kind in CONTROL_KINDS},
        "rollout": rollout_summary(rollouts, now, window_s, oldest if truncated else None),
        "learner": learner_summary(learner, now),
        "drafter": drafter_summary([(t, e) for t, e in stats if isinstance(e, DrafterStats)], now),
        "stats_read": {
            "entries": len(stats) + undecodable,
            "undecodable": undecodable,
            "truncated": truncated,
            "covers_s": max(0.0, now - oldest) if oldest is not None else None,
        },
    }


async def snapshot(
    config: Config,
    *,
    redis: aioredis.Redis | None = None,
    window_s: float = 60.0,
    timeout: float = 5.0,
    stats_limit: int = STATS_LIMIT,
) -> dict[str, Any]:
    """Everything the monitor shows, as builtins. `reachable` is False (with `error`) when Redis is not."""
    base = await inspect_redis(config, timeout)
    snap: dict[str, Any] = {"run": config.run, "redis": base["url"], "reachable": base["reachable"]}
    snap["server"] = base.get("server")
    if "error" in base:
        return {**snap, "error": base["error"]}
    client = redis or connect_redis(config.bus.redis_url or "", name="tlt-monitor", retries=2)
    try:
        async with asyncio.timeout(timeout):
            snap.update(await _details(client, Keys(config.run), base, window_s, stats_limit))
    except (*REDIS_RETRYABLE, TimeoutError) as exc:
        snap.update(reachable=False, error=f"lost Redis at {redact_url(config.bus.redis_url)}: {exc or 'timeout'}")
    finally:
        if redis is None:
            await client.aclose()
    return snap


# ---------------------------------------------------------------------------------------------- showing


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:{spec}}"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def render(snap: Mapping[str, Any]) -> Any:
    """The dashboard: one rich renderable (used live and by `--once`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.from_markup(f"[bold]tlt-stream monitor[/bold]  run [cyan]{snap['run']}[/cyan]  redis {snap['redis']}")
    if not snap["reachable"]:
        return Group(head, Text(snap.get("error", "unreachable"), style="red"))
    versions = snap["versions"]
    parts = []
    for kind in CONTROL_KINDS:
        message = versions.get(kind)
        parts.append(f"{kind} v{message['version']}" if message else f"{kind} -")
    table = (versions.get("sd_config") or {}).get("table") or []
    sd_table = f"  (SD table: {len(table)} batch buckets)" if table else ""
    rows: list[Any] = [head, Text("versions: " + ", ".join(parts) + sd_table)]
    if not (any(message for message in versions.values()) or any(e["length"] for e in snap["streams"].values())):
        rows.append(Text(f"nothing in Redis for run {snap['run']!r} yet (check --run / TLT_RUN)", style="yellow"))

    streams = Table("stream", "length", "group", "consumers", "pending", "lag", "oldest pending", title="streams")
    for name, entry in snap["streams"].items():
        for group, g in (entry["groups"] or {"-": None}).items():
            if g is None:
                streams.add_row(name, str(entry["length"]), "-", "-", "-", "-", "-")
                continue
            oldest = "-"
            if g["oldest_pending_id"] is not None:
                oldest = (
                    f"{_ago(g['oldest_pending_age_s'])} old, idle {_ago(g['oldest_pending_idle_s'])} "
                    f"({g['oldest_pending_consumer']}, x{g['oldest_pending_deliveries']})"
                )
            lag = _fmt(g["lag"], "d") + {"redis": "", "counted": "*", "at_least": "+"}[g["lag_source"]]
            if g["lag_source"] != "redis":
                streams.caption = "lag*: counted here (Redis could not tell); lag+: at least"
            streams.add_row(name, str(entry["length"]), group, str(g["consumers"]), str(g["pending"]), lag, oldest)
    rows.append(streams)

    rollout = snap["rollout"]
    workers = Table("worker", "role", "state", "for", "policy", "drafter", "SD", "batch", "gen tok/s", title="workers")
    for w in snap["workers"]:
        r = rollout["workers"].get(w["worker_id"], {})
        workers.add_row(
            w["worker_id"], w["role"] or "-", w["state"] or "-", _ago(w["state_seconds"]),
            _fmt(w["policy_version"], "d"), _fmt(w["drafter_version"], "d"), _fmt(r.get("sd_on")),
            _fmt(r.get("batch_size"), "d"), _fmt(r.get("tokens_per_s"), ".0f"),
        )  # fmt: skip
    rows.append(workers if snap["workers"] else Text("workers: none alive"))

    rows.append(
        Text(
            f"rollout: {rollout['tokens_per_s']:.0f} tok/s over the last {_ago(rollout['span_s'])} "
            f"({rollout['tokens']} tokens, {rollout['reports']} reports); generation "
            f"{_fmt(rollout['generation_tokens_per_s'], '.0f')} tok/s per worker; "
            f"{_fmt(rollout['tokens_per_forward'], '.2f')} tokens per target forward; "
            f"SD on in {rollout['sd_on_workers']}/{len(rollout['workers'])} workers"
        )
    )
    learner = snap["learner"]
    rows.append(
        Text(
            f"learner: step {learner['step']} (policy v{learner['policy_version']}, {learner['groups']} groups, "
            f"{_ago(learner['age_s'])} ago): reward {_fmt(learner['reward_mean'])}, accuracy "
            f"{_fmt(learner['accuracy'])}, staleness max {_fmt(learner['staleness_max'])} mean "
            f"{_fmt(learner['staleness_mean'])}, rollout {_fmt(learner['rollout_tokens_per_s'], '.0f')} tok/s, "
            f"acceptance length {_fmt(learner['accept_length_mean'], '.2f')}"
        )
        if learner
        else Text("learner: no update in the stats read")
    )
    drafter = snap["drafter"]
    rows.append(
        Text(
            f"drafter training: step {drafter['step']} on {drafter['worker_id']} (fence {drafter['fence']}, "
            f"{_ago(drafter['age_s'])} ago): loss {_fmt(drafter['loss'], '.4g')}, ended by {drafter['end']}; "
            + (
                f"judged at step {drafter['judged_step']}: held-out acceptance {drafter['accept_current']:.2f} -> "
                f"{drafter['accept_new']:.2f}, "
                + (f"adopted as v{drafter['drafter_version']}" if drafter["adopted"] else "not adopted")
                if drafter["judged_step"] is not None
                else "no judgement in the stats read"
            )
        )
        if drafter
        else Text("drafter training: no slice in the stats read")
    )
    dead = snap["dead"]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(dead["counts"].items())) or "none"
    rows.append(Text(f"dead letters: {dead['total']} ({counts})", style="red" if dead["total"] else ""))
    for letter in dead["recent"]:
        rows.append(
            Text(f"  {_ago(letter['age_s'])} ago  {letter['stream']} {letter.get('origin', '')}: {letter['reason']}")
        )
    return Group(*rows)


def summary_line(snap: Mapping[str, Any]) -> str:
    """One plain line per refresh for logs (no terminal)."""
    if not snap["reachable"]:
        return f"monitor {snap['run']}: {snap.get('error')}"
    backlog = ", ".join(
        f"{name} {g['pending']} pending {_fmt(g['lag'], 'd')} lag"
        for name, entry in snap["streams"].items()
        for g in entry["groups"].values()
    )
    learner = snap["learner"] or {}
    states = " ".join(f"{k} {v}" for k, v in sorted(snap["worker_states"].items())) or "none"
    return (
        f"monitor {snap['run']}: step {learner.get('step', '-')} reward {_fmt(learner.get('reward_mean'))} | "
        f"{snap['rollout']['tokens_per_s']:.0f} tok/s, SD on in {snap['rollout']['sd_on_workers']} | "
        f"workers {states} | {backlog or 'no groups'} | dead letters {snap['dead']['total']}"
    )


# ---------------------------------------------------------------------------------------------- Prometheus


class _Exposition:
    """Prometheus text format 0.0.4: families in order of first use, each with HELP and TYPE."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def family(self, name: str, kind: str, text: str) -> None:
        self.families.setdefault(name, (kind, text, []))

    def add(self, metric: str, value: Any, /, **labels: Any) -> None:
        if value is None:
            return
        labels = {"run": self.run, **labels}
        body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        self.families[metric][2].append(f"{metric}{{{body}}} {_sample(value)}")

    def text(self) -> str:
        out = []
        for name, (kind, text, samples) in self.families.items():
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(value: Any) -> str:
    number = float(value)
    if number != number:
        return "NaN"
    if number in (float("inf"), -float("inf")):
        return "+Inf" if number > 0 else "-Inf"
    return repr(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


_FAMILIES = [
    ("tlt_up", "gauge", "1 when the monitor could read the run's Redis, else 0"),
    ("tlt_snapshot_timestamp_seconds", "gauge", "Redis server time of the snapshot these figures come from"),
    ("tlt_stream_length", "gauge", "Entries in the stream"),
    ("tlt_group_consumers", "gauge", "Consumers of the consumer group"),
    ("tlt_group_pending", "gauge", "Entries delivered to the group and not acked yet"),
    ("tlt_group_lag", "gauge", "Entries not yet delivered to the group"),
    ("tlt_group_oldest_pending_age_seconds", "gauge", "Time since the oldest pending entry was added"),
    ("tlt_group_oldest_pending_idle_seconds", "gauge", "Time since the oldest pending entry was last delivered"),
    ("tlt_dead_letters_total", "counter", "Entries ever dead-lettered, by stream of origin"),
    ("tlt_workers", "gauge", "Live workers in each state"),
    ("tlt_worker_state", "gauge", "1 for each live worker's current state"),
    ("tlt_worker_state_seconds", "gauge", "Time the worker has been in its state"),
    ("tlt_worker_policy_version", "gauge", "Policy version the worker generates with"),
    ("tlt_worker_drafter_version", "gauge", "Drafter version the worker drafts with"),
    ("tlt_worker_sd_on", "gauge", "1 when the worker's latest rollout report had speculative decoding on"),
    ("tlt_worker_batch_size", "gauge", "Running batch at the worker's latest rollout report"),
    ("tlt_version", "gauge", "Latest announced version (Redis mirror of the control plane)"),
    ("tlt_rollout_tokens_per_second", "gauge", "Tokens generated by all workers per second, over the window"),
    ("tlt_rollout_generation_tokens_per_second", "gauge", "Tokens per second of generation time, per worker"),
    ("tlt_rollout_tokens_per_forward", "gauge", "Tokens per batched target forward over the window"),
    ("tlt_rollout_sd_on_workers", "gauge", "Workers whose latest rollout report had speculative decoding on"),
    ("tlt_learner_step", "gauge", "Step of the latest learner update"),
    ("tlt_learner_policy_version", "gauge", "Policy version the latest learner update produced"),
    ("tlt_learner_age_seconds", "gauge", "Time since the latest learner update"),
    ("tlt_learner_metric", "gauge", "Figures of the latest learner update (reward_mean, accuracy, staleness_*, ...)"),
    ("tlt_drafter_train_step", "gauge", "Drafter trainer step after the latest slice"),
    ("tlt_drafter_train_loss", "gauge", "Loss of the latest drafter-training slice"),
    ("tlt_drafter_train_acceptance", "gauge", "Held-out acceptance of the new and the current drafter"),
    ("tlt_drafter_train_age_seconds", "gauge", "Time since the latest drafter-training slice"),
    ("tlt_stats_undecodable", "gauge", "Undecodable entries among the stats entries read"),
]

_GROUP_FIGURES = [
    ("tlt_group_consumers", "consumers"),
    ("tlt_group_pending", "pending"),
    ("tlt_group_lag", "lag"),
    ("tlt_group_oldest_pending_age_seconds", "oldest_pending_age_s"),
    ("tlt_group_oldest_pending_idle_seconds", "oldest_pending_idle_s"),
]


def prometheus_text(snap: Mapping[str, Any]) -> str:
    """The snapshot's figures as Prometheus metrics, every series labelled with the run."""
    from tlt_stream.messages import WorkerStatus

    out = _Exposition(snap["run"])
    for family in _FAMILIES:
        out.family(*family)
    out.add("tlt_up", snap["reachable"])
    if not snap["reachable"]:
        return out.text()
    out.add("tlt_snapshot_timestamp_seconds", snap["time"])
    for name, entry in snap["streams"].items():
        out.add("tlt_stream_length", entry["length"], stream=name)
        for group, g in entry["groups"].items():
            for metric, field in _GROUP_FIGURES:
                out.add(metric, g[field], stream=name, group=group)
    for stream, count in sorted(snap["dead"]["counts"].items()):
        out.add("tlt_dead_letters_total", count, stream=stream)
    for state in WorkerStatus:
        out.add("tlt_workers", snap["worker_states"].get(state.value, 0), state=state.value)
    rollout = snap["rollout"]
    for w in snap["workers"]:
        wid = w["worker_id"]
        out.add("tlt_worker_state", 1, worker=wid, role=w["role"] or "", state=w["state"] or "")
        out.add("tlt_worker_state_seconds", w["state_seconds"], worker=wid)
        out.add("tlt_worker_policy_version", w["policy_version"], worker=wid)
        out.add("tlt_worker_drafter_version", w["drafter_version"], worker=wid)
    for wid, r in sorted(rollout["workers"].items()):
        out.add("tlt_worker_sd_on", r["sd_on"], worker=wid)
        out.add("tlt_worker_batch_size", r["batch_size"], worker=wid)
    for kind, message in snap["versions"].items():
        out.add("tlt_version", message["version"] if message else None, kind=kind)
    out.add("tlt_rollout_tokens_per_second", rollout["tokens_per_s"])
    out.add("tlt_rollout_generation_tokens_per_second", rollout["generation_tokens_per_s"])
    out.add("tlt_rollout_tokens_per_forward", rollout["tokens_per_forward"])
    out.add("tlt_rollout_sd_on_workers", rollout["sd_on_workers"])
    if (learner := snap["learner"]) is not None:
        out.add("tlt_learner_step", learner["step"])
        out.add("tlt_learner_policy_version", learner["policy_version"])
        out.add("tlt_learner_age_seconds", learner["age_s"])
        for name, value in sorted(learner["metrics"].items()):
            out.add("tlt_learner_metric", value, name=name)
    if (drafter := snap["drafter"]) is not None:
        out.add("tlt_drafter_train_step", drafter["step"])
        out.add("tlt_drafter_train_loss", drafter["loss"])
        out.add("tlt_drafter_train_acceptance", drafter["accept_new"], drafter="new")
        out.add("tlt_drafter_train_acceptance", drafter["accept_current"], drafter="current")
        out.add("tlt_drafter_train_age_seconds", drafter["age_s"])
    out.add("tlt_stats_undecodable", snap["stats_read"]["undecodable"])
    return out.text()


class MetricsServer:
    """`GET /metrics` on a thread (stdlib http.server), serving the latest published text."""

    def __init__(self, bind: str, port: int) -> None:
        self._body: bytes | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner._body
                if self.path.split("?", 1)[0] != "/metrics":
                    self._reply(404, b"not found; metrics are at /metrics\n")
                elif body is None:
                    self._reply(503, b"no snapshot yet\n")
                else:
                    self._reply(200, body)

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((bind, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="prometheus", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def publish(self, text: str) -> None:
        self._body = text.encode()

    def __enter__(self) -> MetricsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


# ---------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class MonitorOptions:
    """How `tlt-stream monitor` shows what it reads; validated here so a bad flag exits 2 with a message."""

    once: bool = False
    as_json: bool = False
    prometheus: int | None = None
    """Serve Prometheus metrics on this port (0: any free one)."""
    bind: str = "127.0.0.1"
    interval: float = 2.0
    window_s: float = 60.0
    timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("interval", "window_s", "timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"monitor: {name} must be > 0, got {getattr(self, name)}")
        if self.prometheus is not None and not 0 <= self.prometheus <= 65535:
            raise ConfigError(f"monitor: --prometheus needs a port in 0..65535, got {self.prometheus}")
        if self.once and self.prometheus is not None:
            raise ConfigError("monitor: --once prints one snapshot; it cannot also serve --prometheus")


def monitor(config: Config, options: MonitorOptions) -> int:
    """`tlt-stream monitor` / `services/monitor.py`: exit 0, 1 (Redis unreachable with --once, port taken),
    2 (no Redis URL: the embedded servers of another process cannot be found)."""
    from tlt_stream.aio import run

    if config.bus.redis_url is None:
        print(
            "tlt-stream monitor: needs the run's Redis: --redis-url or TLT_REDIS_URL (and --run or TLT_RUN)",
            file=sys.stderr,
        )
        return 2
    return run(_once(config, options) if options.once else _watch(config, options))


def _json(snap: Mapping[str, Any]) -> str:
    return msgspec.json.encode(snap).decode()


async def _once(config: Config, options: MonitorOptions) -> int:
    snap = await snapshot(config, window_s=options.window_s, timeout=options.timeout)
    if options.as_json:
        print(_json(snap), flush=True)
    else:
        from rich.console import Console

        Console().print(render(snap))
    if not snap["reachable"]:
        print(f"tlt-stream monitor: {snap['error']}", file=sys.stderr)
        return 1
    return 0


async def _watch(config: Config, options: MonitorOptions) -> int:
    """Refresh every interval until SIGINT/SIGTERM: a live dashboard on a terminal, JSON lines with --json,
    else one summary line per refresh (none when serving Prometheus)."""
    from rich.console import Console
    from rich.live import Live

    from tlt_stream.aio import install_stop_signals, sleep_or_stop

    stop = asyncio.Event()
    install_stop_signals(stop)
    console = Console()
    try:
        server = MetricsServer(options.bind, options.prometheus) if options.prometheus is not None else None
    except OSError as exc:
        print(f"tlt-stream monitor: cannot serve on {options.bind}:{options.prometheus}: {exc}", file=sys.stderr)
        return 1
    redis = connect_redis(config.bus.redis_url or "", name="tlt-monitor", retries=2)
    with contextlib.ExitStack() as stack:
        if server is not None:
            stack.enter_context(server)
            print(f"tlt-stream monitor: Prometheus metrics on {server.url}", file=sys.stderr, flush=True)
        live = None
        if console.is_terminal and not options.as_json:
            live = stack.enter_context(Live(console=console, auto_refresh=False))
        try:
            while True:
                snap = await snapshot(config, redis=redis, window_s=options.window_s, timeout=options.timeout)
                if server is not None:
                    server.publish(prometheus_text(snap))
                if live is not None:
                    live.update(render(snap), refresh=True)
                elif options.as_json:
                    print(_json(snap), flush=True)
                elif server is None:
                    print(summary_line(snap), flush=True)
                if await sleep_or_stop(stop, options.interval):
                    break
        finally:
            await redis.aclose()
    return 0

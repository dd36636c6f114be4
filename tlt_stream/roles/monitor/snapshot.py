"""What a run is doing, read from its Redis keys alone into one dict of builtins: the snapshot that the
dashboard, `--json` and the Prometheus metrics show, and whose first part (`inspect_redis`) `doctor` prints.

A snapshot reads the run's keys and nothing else (no broker, no files): stream lengths and consumer groups
with their lag and oldest pending entry, dead letters, the worker registry, the version mirror, the groups
dropped as too stale (the `dropped` hash's size), and the newest entries of `stats`, read newest first in
bounded pages so a snapshot costs the same on a long run.
Ages use the Redis server's clock (`TIME` and stream entry ids), never another host's. The figures are
computed by `summaries` from what was read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tlt_stream.basics.common import as_text
from tlt_stream.basics.config import BusConfig, Config, redact_text, redact_url
from tlt_stream.basics.messages import CONTROL_KINDS, LearnerStats, codec_for
from tlt_stream.bus.connect import REDIS_RETRYABLE, connect_redis
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.producer import PAYLOAD_FIELD
from tlt_stream.bus.registry import list_workers
from tlt_stream.bus.streams import ALL_RUNS_GLOB, STREAMS, Keys, run_of_key
from tlt_stream.roles.monitor.summaries import (
    entry_seconds,
    group_lag,
    next_entry_id,
    pending_age,
    stats_summary,
    worker_summary,
)

__all__ = ["STATS_LIMIT", "check_redis_url", "empty_run_note", "inspect_redis", "read_stats", "reason", "snapshot"]

STATS_PAGE = 500
STATS_LIMIT = 2000
"""At most this many `stats` entries are read per snapshot (newest first)."""
DEAD_RECENT = 5
OTHER_RUNS_SHOWN = 10
"""Runs named when the one asked for has nothing in Redis (a mistyped or forgotten --run)."""
OTHER_RUNS_SCAN = 20_000
"""At most this many keys are looked at to find those runs (one SCAN, only when the run has nothing)."""
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


def reason(exc: BaseException) -> str:
    """What went wrong, never empty (a timeout or a TLS handshake with a server that does not speak TLS
    raise exceptions without text) and with no password in it."""
    if text := str(exc).strip():
        return redact_text(text)
    return "no answer in time" if isinstance(exc, TimeoutError) else type(exc).__name__


def check_redis_url(url: str) -> None:
    """Raise ValueError (its text free of secrets) when the Redis client cannot use `url`: an option value it
    cannot read, or an option it does not know (which redis-py would find only on connecting). Connects
    nothing."""
    try:
        connect_redis(url).connection_pool.make_connection()
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the Redis client cannot use the URL {redact_url(url)} ({reason(exc)}): fix or drop the option it names"
        ) from None


def _refused(config: Config, exc: RedisError) -> str:
    """A Redis that answers but refuses a read (an ACL without a permission, a key of the run holding another
    kind of value): what it said and what to check."""
    return (
        f"Redis at {redact_url(config.bus.redis_url)} refused a read of run {config.run!r}: {reason(exc)} (check "
        "the URL's user and its ACL permissions, and that --run names a tlt-stream run)"
    )


# ---------------------------------------------------------------------------------------------- the scan


async def _scan(redis: aioredis.Redis, keys: Keys, bus: BusConfig) -> dict[str, Any]:
    """Per stream its length and groups as XINFO GROUPS tells them; dead-letter counts, live workers and the
    versions mirror."""
    streams = {}
    for name, stream_spec in STREAMS.items():
        key = keys.stream(name)
        entry: dict[str, Any] = {"length": int(await redis.xlen(key)), "groups": {}}
        # A stream trimmed to nothing (prompts, samples once acked) still has its groups to show.
        if stream_spec.group is not None and (entry["length"] or await redis.exists(key)):
            try:
                for group in await redis.xinfo_groups(key):
                    entry["groups"][as_text(group["name"])] = {
                        "pending": int(group["pending"]),
                        "lag": group.get("lag"),
                        "consumers": int(group["consumers"]),
                    }
            except Exception:
                pass
        streams[name] = entry
    return {
        "streams": streams,
        "dead_counts": {as_text(k): int(v) for k, v in (await redis.hgetall(keys.dead_counts)).items()},
        "workers": await list_workers(redis, keys, bus),
        "versions": {kind: msgspec.to_builtins(m) for kind, m in (await read_mirror(redis, keys)).items()},
    }


def _nothing(scan: dict[str, Any]) -> bool:
    """Whether the scan found nothing of the run: no stream entry or group, dead letter, worker or version."""
    streams = scan["streams"].values()
    return not (
        any(e["length"] or e["groups"] for e in streams) or scan["dead_counts"] or scan["workers"] or scan["versions"]
    )


async def _other_runs(redis: aioredis.Redis, run: str) -> list[str] | None:
    """The names of runs with keys on this Redis besides `run` (sorted, at most `OTHER_RUNS_SCAN` keys looked
    at), or None when the server does not allow the SCAN."""
    names: set[str] = set()
    try:
        seen = 0
        async for key in redis.scan_iter(match=ALL_RUNS_GLOB, count=1000):
            name = run_of_key(as_text(key))
            if name is not None and name != run:
                names.add(name)
            seen += 1
            if seen >= OTHER_RUNS_SCAN:
                break
    except RedisError:
        return None
    return sorted(names)


def empty_run_note(run: str, other_runs: list[str] | None) -> str:
    """What to say when a run has nothing in Redis: a run not started yet, or a --run that names no run (with
    the runs that do have keys there, which is where a forgotten --run or a run's own timestamped name shows)."""
    note = f"nothing in Redis for run {run!r} yet (check --run / TLT_RUN)"
    if other_runs:
        shown = ", ".join(other_runs[:OTHER_RUNS_SHOWN])
        more = f" and {len(other_runs) - OTHER_RUNS_SHOWN} more" if len(other_runs) > OTHER_RUNS_SHOWN else ""
        return f"{note}; runs with keys on this server: {shown}{more}"
    if other_runs is not None:
        return f"{note}; no run has keys on this server"
    return note


async def inspect_redis(config: Config, timeout: float, *, redis: aioredis.Redis | None = None) -> dict[str, Any]:
    """Whether the run's Redis answers (`reachable`, else `error`), which server it is, and the scan: what
    `doctor` shows and a snapshot starts from. `run_found` says whether the run has anything there; when it
    has not, `other_runs` names the runs that do (else it is None). A client passed in is used and left open."""
    client = redis or connect_redis(config.bus.redis_url or "", name="tlt-doctor", retries=2)
    report: dict[str, Any] = {"url": redact_url(config.bus.redis_url), "reachable": False}
    try:
        async with asyncio.timeout(timeout):
            await client.ping()
            report["reachable"] = True
            try:
                info = await client.info("server")
                report["server"] = f"redis {info.get('redis_version', '?')}"
            except Exception:  # fakeredis answers no INFO
                report["server"] = "Redis protocol server without INFO (embedded fakeredis?)"
            report.update(await _scan(client, Keys(config.run), config.bus))
            report["run_found"] = not _nothing(report)
            report["other_runs"] = None if report["run_found"] else await _other_runs(client, config.run)
    except (*REDIS_RETRYABLE, TimeoutError) as exc:
        report.update(reachable=False, error=f"cannot reach Redis at {redact_url(config.bus.redis_url)}: {reason(exc)}")
    except RedisError as exc:  # it answers, but not to what a scan reads: the run cannot be shown
        report.update(reachable=False, error=_refused(config, exc))
    finally:
        if redis is None:
            await client.aclose()
    return report


# ---------------------------------------------------------------------------------------------- the details


async def _group_detail(redis: aioredis.Redis, key: str, name: str, reported: dict[str, Any], length: int) -> dict:
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


async def read_stats(
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


def _with_the_registry(rollout: dict[str, Any], workers: list[dict[str, Any]]) -> None:
    """Join the workers' latest rollout reports to the registry: a report's worker is `alive` while it is
    registered (a stopped or finished run's reports stay in `stats`, its workers do not), SD is counted on
    in live workers only, and a live worker that has not swapped a drafter in yet (it records its version on
    a swap) shows the version its reports draft with."""
    live = {w["worker_id"]: w for w in workers}
    for worker_id, report in rollout["workers"].items():
        report["alive"] = worker_id in live
        worker = live.get(worker_id)
        drafter = report["drafter_version"]
        if worker is not None and worker["drafter_version"] is None and drafter is not None and drafter >= 0:
            worker["drafter_version"] = drafter
    rollout["sd_on_workers"] = sum(bool(r["sd_on"]) for r in rollout["workers"].values() if r["alive"])
    rollout["live_workers"] = sum(r["alive"] for r in rollout["workers"].values())


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
    stats, undecodable, oldest, truncated = await read_stats(redis, keys.stream("stats"), now, window_s, limit)
    dropped_total = int(await redis.hlen(keys.dropped))
    workers = [worker_summary(w, now) for w in base["workers"]]
    states: dict[str, int] = {}
    for worker in workers:
        states[worker["state"]] = states.get(worker["state"], 0) + 1
    figures = stats_summary(stats, undecodable, oldest, truncated, now, window_s, dropped_total)
    _with_the_registry(figures["rollout"], workers)
    return {
        "time": now,
        "streams": streams,
        "dead": {
            "counts": base["dead_counts"],
            "total": sum(base["dead_counts"].values()),
            "recent": await _recent_dead(redis, keys, now),
            "lost_groups": int(await redis.hlen(keys.lost)),
        },
        "workers": workers,
        "worker_states": states,
        "versions": {kind: base["versions"].get(kind) for kind in CONTROL_KINDS},
        **figures,
    }


async def snapshot(
    config: Config,
    *,
    redis: aioredis.Redis | None = None,
    window_s: float = 60.0,
    timeout: float = 5.0,
    stats_limit: int = STATS_LIMIT,
) -> dict[str, Any]:
    """Everything the monitor shows, as builtins. `reachable` is False (with `error`) when Redis is not. A
    client passed in (the live monitor's, reused every refresh) is left open."""
    client = redis or connect_redis(config.bus.redis_url or "", name="tlt-monitor", retries=2)
    try:
        base = await inspect_redis(config, timeout, redis=client)
        snap: dict[str, Any] = {"run": config.run, "redis": base["url"], "reachable": base["reachable"]}
        snap["server"] = base.get("server")
        snap["run_found"], snap["other_runs"] = base.get("run_found"), base.get("other_runs")
        if "error" in base:
            return {**snap, "error": base["error"]}
        try:
            async with asyncio.timeout(timeout):
                snap.update(await _details(client, Keys(config.run), base, window_s, stats_limit))
        except (*REDIS_RETRYABLE, TimeoutError) as exc:
            error = f"lost Redis at {redact_url(config.bus.redis_url)}: {reason(exc)}"
            snap.update(reachable=False, error=error)
        except RedisError as exc:
            snap.update(reachable=False, error=_refused(config, exc))
        return snap
    finally:
        if redis is None:
            await client.aclose()

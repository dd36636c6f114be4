"""A snapshot shown to a person: the rich dashboard (live on a terminal, once with `--once`) and one plain
line per refresh for logs.

Only formatting lives here; every figure is already in the snapshot, so what the dashboard shows is what
`--json` and the Prometheus metrics carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tlt_stream.basics.messages import CONTROL_KINDS
from tlt_stream.roles.monitor.snapshot import empty_run_note

__all__ = ["render", "summary_line"]


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


def _streams(snap: Mapping[str, Any]) -> Table:
    table = Table("stream", "length", "group", "consumers", "pending", "lag", "oldest pending", title="streams")
    for name, entry in snap["streams"].items():
        for group, g in (entry["groups"] or {"-": None}).items():
            if g is None:
                table.add_row(name, str(entry["length"]), "-", "-", "-", "-", "-")
                continue
            oldest = "-"
            if g["oldest_pending_id"] is not None:
                oldest = (
                    f"{_ago(g['oldest_pending_age_s'])} old, idle {_ago(g['oldest_pending_idle_s'])} "
                    f"({g['oldest_pending_consumer']}, x{g['oldest_pending_deliveries']})"
                )
            lag = _fmt(g["lag"], "d") + {"redis": "", "counted": "*", "at_least": "+"}[g["lag_source"]]
            if g["lag_source"] != "redis":
                table.caption = "lag*: counted here (Redis could not tell); lag+: at least"
            table.add_row(name, str(entry["length"]), group, str(g["consumers"]), str(g["pending"]), lag, oldest)
    return table


def _workers(snap: Mapping[str, Any]) -> Table | Text:
    if not snap["workers"]:
        return Text("workers: none alive (the run has finished or stopped, or its workers have not started yet)")
    rollout = snap["rollout"]
    table = Table("worker", "role", "state", "for", "policy", "drafter", "SD", "batch", "gen tok/s", title="workers")
    for w in snap["workers"]:
        r = rollout["workers"].get(w["worker_id"], {})
        table.add_row(
            w["worker_id"], w["role"] or "-", w["state"] or "-", _ago(w["state_seconds"]),
            _fmt(w["policy_version"], "d"), _fmt(w["drafter_version"], "d"), _fmt(r.get("sd_on")),
            _fmt(r.get("batch_size"), "d"), _fmt(r.get("tokens_per_s"), ".0f"),
        )  # fmt: skip
    return table


def _rollout(rollout: Mapping[str, Any]) -> Text:
    if rollout["reports"]:
        head = (
            f"rollout: {rollout['tokens_per_s']:.0f} tok/s over the last {_ago(rollout['span_s'])} "
            f"({rollout['tokens']} tokens, {rollout['reports']} reports); generation "
            f"{_fmt(rollout['generation_tokens_per_s'], '.0f')} tok/s per worker; "
            f"{_fmt(rollout['tokens_per_forward'], '.2f')} tokens per row per target forward; "
        )
    else:
        head = f"rollout: no report in the last {_ago(rollout['window_s'])}; "
    live = rollout.get("live_workers", len(rollout["workers"]))
    return Text(
        head
        + f"SD on in {rollout['sd_on_workers']}/{live} live workers"
        + _sources(rollout.get("draft_sources") or {})
        + (f"; ACCEPTANCE COLLAPSED after {n} swap(s)" if (n := rollout.get("acceptance_collapses")) else "")
    )


def _load_latency(rollout: Mapping[str, Any]) -> Text:
    """Publish-to-loaded seconds of the newest policy versions the workers reported loading."""
    latency = rollout.get("load_latency") or {}
    if not latency:
        return Text("weight sync: no policy load reported in the stats read")
    shown = "; ".join(
        f"v{v} max {s['max_s']:.2f}s mean {s['mean_s']:.2f}s ({s['workers']} worker{'s' * (s['workers'] != 1)})"
        for v, s in latency.items()
    )
    return Text(f"weight sync, publish -> loaded: {shown}")


def _sources(sources: Mapping[str, Any]) -> str:
    """Each draft source's acceptance (accepted / drafted nodes) in the window."""
    if not sources:
        return ""
    shown = ", ".join(
        f"{name} {_fmt(s['rate'], '.2f')} ({s['accepted']}/{s['drafted']})" for name, s in sources.items()
    )
    return f"; drafts accepted: {shown}"


def _partial(rollout: Mapping[str, Any]) -> Text | None:
    """Partial rollouts of the newest steps read: per policy version the drafts were verified into, tokens
    generated ahead, kept and discarded, and worker-seconds the previous step's tail was filled with them."""
    steps = rollout.get("partial") or {}
    if not steps:
        return None
    shown = "; ".join(
        f"v{v} {s['ahead_tokens']} ahead, kept {s['kept_tokens']} ({_fmt(s['kept_share'], '.0%')}), discarded "
        f"{s['discarded_tokens']}, tail filled {s['ahead_seconds']:.1f} worker-s"
        for v, s in steps.items()
    )
    return Text(f"partial rollouts per step (version verified into): {shown}")


def _stale_drops(drops: Mapping[str, Any] | None) -> Text | None:
    """Groups dropped as too stale: in the whole run, and in the learner updates read with their responses'
    mean length against the trained ones' (streaming's bias against long responses)."""
    if not drops or not (drops["groups"] or drops["run_groups"]):
        return None
    per = ", ".join(
        f"v{v} {u['groups']} (len {_fmt(u['dropped_len_mean'], '.1f')} vs {_fmt(u['trained_len_mean'], '.1f')})"
        for v, u in drops["per_update"].items()
        if u["groups"]
    )
    return Text(
        f"groups dropped as too stale: {_fmt(drops['run_groups'], 'd')} in the run, {drops['groups']} in the "
        f"{drops['updates_read']} updates read; mean response length {_fmt(drops['dropped_len_mean'], '.1f')} "
        f"dropped vs {_fmt(drops['trained_len_mean'], '.1f')} trained in the same updates"
        + (f"; per update: {per}" if per else ""),
        style="yellow",
    )


def _learner(learner: Mapping[str, Any] | None) -> Text:
    if not learner:
        return Text("learner: no update in the stats read")
    return Text(
        f"learner: step {learner['step']} (policy v{learner['policy_version']}, {learner['groups']} groups, "
        f"{_ago(learner['age_s'])} ago): reward {_fmt(learner['reward_mean'])}, accuracy "
        f"{_fmt(learner['accuracy'])}, staleness max {_fmt(learner['staleness_max'])} mean "
        f"{_fmt(learner['staleness_mean'])}, rollout {_fmt(learner['rollout_tokens_per_s'], '.0f')} tok/s, "
        f"acceptance length {_fmt(learner['accept_length_mean'], '.2f')}"
    )


def _learner_disk(disk: Mapping[str, Any] | None) -> Text | None:
    if not disk or not disk["failing"]:
        return None
    return Text(
        f"learner: the {disk['write']} of version {disk['version']} cannot be written for "
        f"{_fmt(disk['failing_s'], '.0f')} s ({disk['attempts']} attempts: {disk['error']}); retrying, nothing of "
        "the update is acked or published meanwhile",
        style="red",
    )


def _drafter(drafter: Mapping[str, Any] | None) -> Text:
    if not drafter:
        return Text("drafter training: no slice in the stats read")
    verdict = "no judgement in the stats read"
    if drafter["judged_step"] is not None:
        adopted = f"adopted as v{drafter['drafter_version']}" if drafter["adopted"] else "not adopted"
        verdict = (
            f"judged at step {drafter['judged_step']}: held-out acceptance {drafter['accept_current']:.2f} -> "
            f"{drafter['accept_new']:.2f}, {adopted}"
        )
    return Text(
        f"drafter training: step {drafter['step']} on {drafter['worker_id']} (fence {drafter['fence']}, "
        f"{_ago(drafter['age_s'])} ago): loss {_fmt(drafter['loss'], '.4g')}, ended by {drafter['end']}; {verdict}"
    )


def render(snap: Mapping[str, Any]) -> Group:
    """The dashboard: one rich renderable (used live and by `--once`)."""
    run, redis = escape(str(snap["run"])), escape(str(snap["redis"]))  # text, whatever brackets they hold
    head = Text.from_markup(f"[bold]tlt-stream monitor[/bold]  run [cyan]{run}[/cyan]  redis {redis}")
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
    if snap.get("run_found") is False:
        rows.append(Text(empty_run_note(snap["run"], snap.get("other_runs")), style="yellow"))
    rows += [_streams(snap), _workers(snap), _rollout(snap["rollout"]), _load_latency(snap["rollout"])]
    rows += [line for line in (_partial(snap["rollout"]), _stale_drops(snap.get("stale_drops"))) if line]
    rows += [_learner(snap["learner"])]
    rows += [line for line in (_learner_disk(snap.get("learner_disk")),) if line]
    rows.append(_drafter(snap["drafter"]))
    dead = snap["dead"]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(dead["counts"].items())) or "none"
    lost = dead.get("lost_groups")
    lost_note = f"; {lost} group(s) lost to them, each replaced by another prompt of its step" if lost else ""
    rows.append(Text(f"dead letters: {dead['total']} ({counts}){lost_note}", style="red" if dead["total"] else ""))
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
        + (f" | {disk}" if (disk := _learner_disk(snap.get("learner_disk"))) else "")
    )

"""Plots of a run directory: what the learner wrote to `metrics.jsonl` (and `eval.jsonl` when a held-out
evaluation ran), as PNGs plus one HTML page that shows them, with per-step tables of partial rollouts (from
the rollout reports in `timeline.jsonl`) and of groups dropped as too stale. `tlt-stream report RUN_DIR` and
the end of `tlt-stream run` both call `write_report`.
"""

from __future__ import annotations

import argparse
import html
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG
from tlt_stream.rl.records import load_metrics, read_jsonl

__all__ = ["draft_sources", "handle", "partial_rollouts", "register", "stale_drops", "state_intervals", "write_report"]


log = logging.getLogger(__name__)

DRAFTER_KEY = re.compile(r"accept_length_drafter_(-?\d+)")
"""A metrics key of the acceptance length per drafter version (-1: no drafter)."""


class ReportError(ValueError):
    """A run directory the report cannot read: its text says what is wrong and what to do."""


def _real(value: Any) -> bool:
    """A finite number (not a bool): a figure the plots and tables can use."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(value: Any) -> dict[str, int]:
    """A rollout report's per-source node counts (`drafted`, `accepted`), entries of another shape left out."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and _whole(v)}


def clean_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The learner's rows (`load_metrics`) with only what the report can draw: figures that are finite numbers
    (a NaN, an infinity, a string or a null is a missing figure) and `response_lens`, as numbers."""
    out = []
    for row in rows:
        kept = {k: v for k, v in row.items() if _real(v) and k != "response_lens"}
        kept["version"] = row["version"]
        if isinstance(lens := row.get("response_lens"), list):
            kept["response_lens"] = [v for v in lens if _real(v)]
        out.append(kept)
    return out


ROLLOUT_FIELDS = {
    "policy_version": _whole,
    "kept_tokens": _whole,
    "discarded_tokens": _whole,
    "batch_size": _real,
    "ahead_seconds": _real,
    "sd_on": lambda v: isinstance(v, bool),
}
"""The fields of a rollout report the report reads, and the test each must pass to be used."""


def clean_timeline(path: Path) -> list[dict[str, Any]]:
    """The entries of a run's `timeline.jsonl` the report can place: a `kind` and a finite `created_at`, a
    worker state with its worker and state named; a rollout report's fields of another type are left out
    (each read as missing). What was left out is said in one warning."""
    out, skipped = [], 0
    for entry in read_jsonl(path):
        kind = entry.get("kind")
        if not isinstance(kind, str) or not _real(entry.get("created_at")):
            skipped += 1
            continue
        if kind == "worker_state" and not (
            isinstance(entry.get("worker_id"), str) and isinstance(entry.get("state"), str)
        ):
            skipped += 1
            continue
        if kind == "rollout":
            entry = {k: v for k, v in entry.items() if k not in ROLLOUT_FIELDS or ROLLOUT_FIELDS[k](v)}
            entry["drafted"], entry["accepted"] = _counts(entry.get("drafted")), _counts(entry.get("accepted"))
        out.append(entry)
    if skipped:
        log.warning(
            "%s: skipped %d entries without a kind, a time or (worker states) a worker and state", path, skipped
        )
    return out


def clean_evals(path: Path) -> list[dict[str, Any]]:
    """The held-out evaluations of `eval.jsonl` that have an integer version and a finite accuracy."""
    rows = read_jsonl(path)
    kept = [r for r in rows if _whole(r.get("version")) and _real(r.get("accuracy"))]
    if len(kept) < len(rows):
        log.warning("%s: skipped %d rows without an integer version and a finite accuracy", path, len(rows) - len(kept))
    return kept


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _reward_curve(plt, rows: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    versions = [r["version"] for r in rows]
    rewards = [r.get("reward_mean", math.nan) for r in rows]  # a missing reward leaves a gap
    ax.plot(versions, rewards, color="tab:blue", alpha=0.35, label="train reward (per step)")
    window = 10
    if len(rows) >= window:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rows))]
        ax.plot(versions[window - 1 :], smooth, color="tab:blue", label=f"train reward ({window}-step mean)")
    if evals:
        ax.plot(
            [e["version"] for e in evals],
            [e["accuracy"] for e in evals],
            "o-",
            color="tab:red",
            label="held-out accuracy",
        )
    ax.set_xlabel("policy version (learner step)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Reward and held-out accuracy")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _lengths(plt, rows: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        lengths = row.get("response_lens") or []
        ax.scatter([row["version"]] * len(lengths), lengths, s=4, color="tab:gray", alpha=0.3)
    versions = [r["version"] for r in rows]
    for key, style in (("response_len_p50", "-"), ("response_len_p90", "--"), ("response_len_max", ":")):
        if all(key in r for r in rows):
            ax.plot(versions, [r[key] for r in rows], style, color="tab:purple", label=key.rsplit("_", 1)[-1])
    ax.set_xlabel("policy version (learner step)")
    ax.set_ylabel("response tokens")
    ax.set_title("Response lengths per step (the long tail)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none when a row lacks the percentiles
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _time_breakdown(plt, rows: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    versions = [r["version"] for r in rows]
    bottom = [0.0] * len(rows)
    parts = (
        ("rollout_seconds", "rollout span", "tab:blue"),
        ("learn_seconds", "learn", "tab:orange"),
        ("checkpoint_seconds", "checkpoint", "tab:green"),
    )
    for key, label, color in parts:
        values = [float(r.get(key, 0.0)) for r in rows]
        ax.bar(versions, values, bottom=bottom, color=color, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    tails = [float(r.get("tail_seconds", 0.0)) for r in rows]
    ax.bar(versions, tails, color="none", edgecolor="black", hatch="//", width=0.8, label="of which tail phase")
    ax.set_xlabel("policy version (learner step)")
    ax.set_ylabel("seconds")
    ax.set_title("Per-step time (rollout span overlaps learning when asynchronous)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


STATE_COLORS = {
    "GENERATING": "tab:blue",
    "IDLE": "lightgray",
    "TRAINING_DRAFTER": "tab:orange",
    "LOADING": "tab:purple",
    "STOPPED": "black",
}


def _speculation(plt, rows: list[dict[str, Any]], timeline: list[dict[str, Any]], out: Path) -> None:
    """Tokens per target forward per learner step, and the share of rollout reports with SD on over time."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5))
    versions = [r["version"] for r in rows]
    top.plot(versions, [r.get("accept_length_mean", 1.0) for r in rows], "o-", ms=3, label="mean over samples")
    drafters = sorted({int(m[1]) for r in rows for k in r if (m := DRAFTER_KEY.fullmatch(k))})
    for version in drafters:
        key = f"accept_length_drafter_{version}"
        points = [(r["version"], r[key]) for r in rows if key in r]
        top.plot(*zip(*points, strict=True), ".", ms=5, label=f"drafter v{version}" if version >= 0 else "no drafter")
    top.set_xlabel("policy version (learner step)")
    top.set_ylabel("tokens per target forward")
    top.set_title("Acceptance length (per drafter version: weighted by response length)")
    top.grid(alpha=0.3)
    top.legend(loc="best", fontsize="small", ncol=2)
    reports = [e for e in timeline if e["kind"] == "rollout" and "sd_on" in e]
    if reports:
        t0 = min(e["created_at"] for e in timeline)
        bottom.step([e["created_at"] - t0 for e in reports], [float(e["sd_on"]) for e in reports], where="post")
        bottom.scatter(
            [e["created_at"] - t0 for e in reports],
            [e.get("batch_size", 0) / max(1, max(r.get("batch_size", 0) for r in reports)) for e in reports],
            s=4,
            color="tab:gray",
            label="running batch (scaled)",
        )
        bottom.legend(loc="upper right", fontsize="small")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xlabel("seconds since the run started")
    bottom.set_ylabel("SD on")
    bottom.set_title("Speculative decoding on/off (at each rollout report)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def state_intervals(timeline: list[dict[str, Any]], end: float | None = None) -> dict[str, list[tuple]]:
    """Per worker, its (start, stop, state) intervals from the `worker_state` entries of a timeline
    (`timeline.jsonl`); the last state lasts until `end` (default: the timeline's last entry)."""
    changes: dict[str, list[tuple[float, str]]] = {}
    for e in timeline:
        if e["kind"] == "worker_state":
            changes.setdefault(e["worker_id"], []).append((e["created_at"], e["state"]))
    if end is None and timeline:
        end = max(e["created_at"] for e in timeline)
    intervals = {}
    for worker, states in sorted(changes.items()):
        states.sort()
        stops = [t for t, _ in states[1:]] + [end]
        intervals[worker] = [
            (start, max(start, stop), state) for (start, state), stop in zip(states, stops, strict=True)
        ]
    return intervals


def _worker_states(plt, timeline: list[dict[str, Any]], out: Path) -> None:
    """One bar per worker: GENERATING / IDLE / TRAINING_DRAFTER / LOADING over time."""
    intervals = state_intervals(timeline)
    fig, ax = plt.subplots(figsize=(7, 2.0 + 0.6 * max(1, len(intervals))))
    if intervals:
        t0 = min(start for spans in intervals.values() for start, _, _ in spans)
        for row, spans in enumerate(intervals.values()):
            for start, stop, state in spans:
                ax.barh(row, stop - start, left=start - t0, color=STATE_COLORS.get(state, "tab:red"), height=0.6)
        ax.set_yticks(range(len(intervals)), list(intervals))
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLORS.values()]
        ax.legend(
            handles, list(STATE_COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize="small"
        )
    ax.set_xlabel("seconds since the first state change")
    ax.set_title("Worker states (idle time turned into drafter training)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _samples_table(run_dir: Path, limit: int = 6) -> str:
    """The newest sampled responses the learner wrote (RUN_DIR/samples.jsonl), as an HTML table."""
    rows = read_jsonl(run_dir / "samples.jsonl")[-limit:]
    if not rows:
        return ""

    def cell(row: dict[str, Any], key: str) -> str:
        return html.escape(str(row.get(key, "-")))

    cells = "".join(
        f"<tr><td>v{cell(r, 'version')}</td><td>{cell(r, 'sample_id')}</td>"
        f"<td><pre>{cell(r, 'prompt')[-300:]}</pre></td><td><pre>{cell(r, 'response')[:600]}</pre></td>"
        f"<td>{_number(r['reward'], '.3g') if _real(r.get('reward')) else '-'}</td>"
        f"<td>{cell(r, 'finish_reason')}</td></tr>"
        for r in rows
    )
    head = "<tr><th>version</th><th>sample</th><th>prompt (end)</th><th>response</th><th>reward</th><th>end</th></tr>"
    return f"<h2>Sampled responses</h2><table>{head}{cells}</table>"


def draft_sources(timeline: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Drafted and accepted nodes per draft source over the run's rollout reports (`timeline.jsonl`)."""
    from tlt_stream.roles.monitor.summaries import draft_source_totals

    reports = [(e.get("drafted") or {}, e.get("accepted") or {}) for e in timeline if e.get("kind") == "rollout"]
    return {name: s for name, s in draft_source_totals(reports).items() if s["drafted"]}


def partial_rollouts(timeline: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Partial rollouts per step from the run's rollout reports (`timeline.jsonl`), step s being the policy
    version the drafts were verified into: tokens generated ahead (`ahead_tokens`, those re-verification
    judged), kept, discarded, the kept share, and the worker-seconds with a draft in flight (the tail of
    step s - 1 filled with step s's work); steps with none left out (`summaries.partial_by_step`)."""
    from tlt_stream.roles.monitor.summaries import partial_by_step

    return partial_by_step(
        (
            int(e.get("policy_version") or 0),
            e.get("kept_tokens") or 0,
            e.get("discarded_tokens") or 0,
            e.get("ahead_seconds") or 0.0,
        )
        for e in timeline
        if e.get("kind") == "rollout"
    )


def stale_drops(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Groups the learner dropped as too stale per update (`metrics.jsonl`, by the version the update made)
    and their responses' mean length against the trained ones' (`summaries.stale_drops`)."""
    from tlt_stream.roles.monitor.summaries import stale_drops as summarise

    return summarise((r["version"], len(r.get("response_lens") or ()) or 1, r) for r in rows)


def _number(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def _table(title: str, note: str, head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    heads = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<h2>{html.escape(title)}</h2><p>{html.escape(note)}</p><table><tr>{heads}</tr>{cells}</table>"


def _partial_table(partial: dict[int, dict[str, Any]]) -> str:
    rows = [
        (
            f"v{v}",
            p["ahead_tokens"],
            p["kept_tokens"],
            p["discarded_tokens"],
            _number(p["kept_share"], ".0%"),
            f"{p['ahead_seconds']:.1f}",
        )
        for v, p in partial.items()
    ]
    note = (
        "Per step: the policy version the drafts were verified into (the version their samples carry). Tokens "
        "generated ahead under the previous version and judged when this one loaded, how many re-verification "
        "kept and discarded, and the worker-seconds drafts of this step ran while the previous step's tail did."
    )
    head = ("step", "tokens generated ahead", "kept", "discarded", "kept share", "tail filled (worker-s)")
    return _table("Partial rollouts per step", note, head, rows)


def _stale_table(drops: dict[str, Any]) -> str:
    rows = [
        (f"v{v}", u["groups"], _number(u["dropped_len_mean"]), _number(u["trained_len_mean"]))
        for v, u in drops["per_update"].items()
        if u["groups"]
    ]
    note = (
        "Per learner update (the version it made): groups dropped as too stale while it was assembled, and the "
        "mean response length of the dropped and of the trained samples (longer dropped ones: a bias against "
        "long responses)."
    )
    head = ("update", "groups dropped", "dropped response length", "trained response length")
    return _table("Groups dropped as too stale", note, head, rows)


def write_report(run_dir: str | Path) -> Path:
    """Write the run's plots and `report.html` into `RUN_DIR/report/`; returns the HTML path."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"{run_dir}: no such run directory (give the --out directory of `tlt-stream run`)")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a directory (give the run directory that holds metrics.jsonl)")
    rows = clean_metrics(load_metrics(run_dir))
    if not rows:
        raise FileNotFoundError(
            f"{run_dir}/metrics.jsonl: no learner steps recorded yet (the learner writes one line per update: "
            "run the report once it has, and see logs/ in the run directory if it never does)"
        )
    evals = clean_evals(run_dir / "eval.jsonl")
    timeline = clean_timeline(run_dir / "timeline.jsonl")
    out = run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(
            f"{out}: cannot make the report directory ({exc.strerror or exc}); move aside what is there"
        ) from None
    plt = _figure()
    plots = {
        "reward.png": ("Reward and held-out accuracy", _reward_curve, (rows, evals)),
        "lengths.png": ("Response lengths per step", _lengths, (rows,)),
        "time.png": ("Per-step time breakdown", _time_breakdown, (rows,)),
        "speculation.png": ("Acceptance length and SD on/off", _speculation, (rows, timeline)),
    }
    if timeline:
        plots["workers.png"] = ("Worker state timeline", _worker_states, (timeline,))
    for name, (_, draw, args) in plots.items():
        draw(plt, *args, out / name)
    last = rows[-1]
    summary = {
        "steps": len(rows),
        "last version": last["version"],
        "last reward": _number(last.get("reward_mean"), ".3f"),
        "held-out accuracy": " -> ".join(f"{e['accuracy']:.3f} (v{e['version']})" for e in evals) or "not evaluated",
    }
    if sources := draft_sources(timeline):
        summary["draft acceptance by source"] = ", ".join(
            f"{name} {s['accepted'] / s['drafted']:.2f} ({s['accepted']} of {s['drafted']} drafted)"
            for name, s in sources.items()
        )
    tables = ""
    if partial := partial_rollouts(timeline):
        ahead = sum(p["ahead_tokens"] for p in partial.values())
        kept = sum(p["kept_tokens"] for p in partial.values())
        summary["partial rollouts"] = (
            f"{ahead} tokens generated ahead, {kept} kept ({kept / max(ahead, 1):.0%}) and {ahead - kept} "
            f"discarded; drafts filled the tail for {sum(p['ahead_seconds'] for p in partial.values()):.1f} "
            "worker-seconds (per step below)"
        )
        tables += _partial_table(partial)
    drops = stale_drops(rows)
    if drops["groups"]:
        summary["groups dropped as too stale"] = (
            f"{drops['groups']} over {sum(1 for u in drops['per_update'].values() if u['groups'])} updates; mean "
            f"response length {_number(drops['dropped_len_mean'])} dropped vs {_number(drops['trained_len_mean'])} "
            "trained in the same updates (per update below)"
        )
        tables += _stale_table(drops)
    elif drops["per_update"]:
        summary["groups dropped as too stale"] = "none"
    items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in summary.items())
    figures = "".join(
        f'<figure><img src="{name}" alt="{html.escape(title)}"><figcaption>{html.escape(title)}</figcaption></figure>'
        for name, (title, _, _) in plots.items()
    )
    page = out / "report.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>tlt-stream run report</title>"
        "<style>body{font-family:sans-serif;max-width:980px;margin:2em auto}img{max-width:100%}"
        "td{vertical-align:top;padding:2px 6px}pre{white-space:pre-wrap;margin:0}</style>"
        f"<h1>Run {html.escape(run_dir.name)}</h1><ul>{items}</ul>{figures}{tables}{_samples_table(run_dir)}"
    )
    return page


def register(commands: Any) -> None:
    rep = commands.add_parser("report", help="plots and an HTML page for a run directory")
    rep.add_argument("run_dir", help="a run directory written by `tlt-stream run` or the learner")
    rep.add_argument("-v", "--verbose", action="count", default=0)
    rep.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        page = write_report(args.run_dir)
    except (OSError, ValueError) as exc:  # a run directory missing, empty or unreadable: one line, no traceback
        text = f"{exc.filename}: cannot read it ({exc.strerror})" if isinstance(exc, OSError) and exc.filename else exc
        print(f"tlt-stream report: {text}", file=sys.stderr)
        return EXIT_CONFIG
    print(page)
    return 0

"""Plots of a run directory: what the learner wrote to `metrics.jsonl` (and `eval.jsonl` when a held-out
evaluation ran), as PNGs plus one HTML page that shows them. `tlt-stream report RUN_DIR` and the end of
`tlt-stream run` both call `write_report`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

__all__ = ["load_metrics", "write_report"]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    return rows


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The learner's per-step lines, one per policy version, in version order (a resumed run's repeats
    of a version keep the last line written)."""
    by_version = {row["version"]: row for row in _read_jsonl(run_dir / "metrics.jsonl")}
    return [by_version[v] for v in sorted(by_version)]


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _reward_curve(plt, rows: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    versions = [r["version"] for r in rows]
    ax.plot(versions, [r["reward_mean"] for r in rows], color="tab:blue", alpha=0.35, label="train reward (per step)")
    window = 10
    if len(rows) >= window:
        smooth = [
            sum(r["reward_mean"] for r in rows[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rows))
        ]
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


def write_report(run_dir: str | Path) -> Path:
    """Write the run's plots and `report.html` into `RUN_DIR/report/`; returns the HTML path."""
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl: no learner steps recorded yet")
    evals = _read_jsonl(run_dir / "eval.jsonl")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt = _figure()
    plots = {
        "reward.png": ("Reward and held-out accuracy", _reward_curve, (rows, evals)),
        "lengths.png": ("Response lengths per step", _lengths, (rows,)),
        "time.png": ("Per-step time breakdown", _time_breakdown, (rows,)),
    }
    for name, (_, draw, args) in plots.items():
        draw(plt, *args, out / name)
    last = rows[-1]
    summary = {
        "steps": len(rows),
        "last version": last["version"],
        "last reward": round(last["reward_mean"], 3),
        "held-out accuracy": " -> ".join(f"{e['accuracy']:.3f} (v{e['version']})" for e in evals) or "not evaluated",
    }
    items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in summary.items())
    figures = "".join(
        f'<figure><img src="{name}" alt="{html.escape(title)}"><figcaption>{html.escape(title)}</figcaption></figure>'
        for name, (title, _, _) in plots.items()
    )
    page = out / "report.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>tlt-stream run report</title>"
        "<style>body{font-family:sans-serif;max-width:980px;margin:2em auto}img{max-width:100%}</style>"
        f"<h1>Run {html.escape(run_dir.name)}</h1><ul>{items}</ul>{figures}"
    )
    return page

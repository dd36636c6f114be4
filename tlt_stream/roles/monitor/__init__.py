"""`tlt-stream monitor`: what a run is doing, read from Redis alone, as a dashboard, JSON or Prometheus metrics.

One noun per module: `snapshot` reads the run's keys into one dict of builtins (its scan is also what
`doctor` shows), `summaries` turns what was read into figures (pure: no Redis, no clock), `dashboard`
renders a snapshot for a person, `prometheus` exposes it to a scraper, `loop` is the command.

The names other code uses are importable from here. The snapshot and its summaries load with the package
(`doctor` reuses the scan); the dashboard, the Prometheus exposition and the command load on first use, so
neither the snapshot nor `doctor --json` pulls in rich or prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import Any

from tlt_stream.roles.monitor.snapshot import inspect_redis, read_stats, snapshot
from tlt_stream.roles.monitor.summaries import (
    drafter_summary,
    entry_seconds,
    group_lag,
    learner_disk_summary,
    learner_summary,
    next_entry_id,
    partial_by_step,
    pending_age,
    rollout_summary,
    stale_drops,
    stats_summary,
    worker_summary,
)

__all__ = [
    "MetricsServer",
    "MonitorOptions",
    "drafter_summary",
    "entry_seconds",
    "group_lag",
    "inspect_redis",
    "learner_disk_summary",
    "learner_summary",
    "metric_families",
    "monitor",
    "next_entry_id",
    "partial_by_step",
    "pending_age",
    "prometheus_text",
    "read_stats",
    "render",
    "rollout_summary",
    "snapshot",
    "stale_drops",
    "stats_summary",
    "summary_line",
    "worker_summary",
]

_LAZY = {
    "MetricsServer": "prometheus",
    "metric_families": "prometheus",
    "prometheus_text": "prometheus",
    "render": "dashboard",
    "summary_line": "dashboard",
    "MonitorOptions": "loop",
    "monitor": "loop",
}
"""Names loaded on first use, and the module that defines each."""

_read_stats = read_stats  # the name tests/faults/test_fuzz.py imports


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)

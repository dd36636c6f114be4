"""The learner's record of a run: `metrics.jsonl`, one JSON line per policy version.

Written by the learner after each checkpoint, read back by the learner itself (a row lost to a crash is
rewritten from its checkpoint), by `tlt-stream run`'s progress bar and by the report. A line torn by a
killed writer is skipped with a warning; a version written twice (a resumed run) keeps its last line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["load_metrics", "read_jsonl"]

log = logging.getLogger(__name__)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of `path` (none when it does not exist), skipping lines that are not JSON."""
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:  # a line torn by a killed writer: its row is rewritten whole
                log.warning("%s:%d: skipped a line that is not JSON (%s)", path, number, exc)
    return rows


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The learner's per-step lines, one per policy version, in version order (a resumed run's repeats
    of a version keep the last line written)."""
    by_version = {row["version"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    return [by_version[v] for v in sorted(by_version)]

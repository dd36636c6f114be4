"""The learner's record of a run: `metrics.jsonl`, one JSON line per policy version.

Written by the learner after each checkpoint, read back by the learner itself (a row lost to a crash is
rewritten from its checkpoint), by `tlt-stream run`'s progress bar and by the report. A line torn by a
killed writer (cut anywhere, mid-character included) is skipped with a warning, and so is a line that is
JSON but not a row (a list, a number, an object without an integer `version`); a version written twice (a
resumed run) keeps its last line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["load_metrics", "read_jsonl"]

log = logging.getLogger(__name__)


def _skipped(path: Path, what: str, lines: list[tuple[int, str]]) -> None:
    """One warning per file for the lines left out, naming the first."""
    if lines:
        number, why = lines[0]
        more = f" and {len(lines) - 1} more" if len(lines) > 1 else ""
        log.warning("%s:%d%s: skipped %s (%s)", path, number, more, what, why)


def _numbered(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of every JSON object line of `path`; the other lines skipped with one warning."""
    if not path.exists():
        return []
    rows, skipped = [], []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # a line torn by a killed writer, or bytes that are not text
            skipped.append((number, f"not JSON: {exc}"))
            continue
        if isinstance(row, dict):
            rows.append((number, row))
        else:
            skipped.append((number, f"{json.dumps(row)[:40]} is not an object"))
    _skipped(path, "lines that are not JSON objects", skipped)
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of `path` (none when it does not exist), skipping lines that are not one: torn
    by a killed writer (its row is rewritten whole), not UTF-8, or JSON of another shape."""
    return [row for _, row in _numbered(path)]


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The learner's per-step lines, one per policy version, in version order (a resumed run's repeats
    of a version keep the last line written; a line without an integer `version` is left out)."""
    path = run_dir / "metrics.jsonl"
    by_version, skipped = {}, []
    for number, row in _numbered(path):
        version = row.get("version")
        if isinstance(version, int) and not isinstance(version, bool):
            by_version[version] = row
        else:
            skipped.append((number, f"version {version!r}"))
    _skipped(path, "lines without an integer version", skipped)
    return [by_version[v] for v in sorted(by_version)]

"""Reliability figures: the fault-injection and fuzz suites (`tests/faults/`) run with their per-scenario
rows collected, printed as one JSON object (the table of docs/reliability.md): per scenario the medians over
`--runs` runs of what the independent audit found (`tests/faults/audit.py`: Redis and the checkpoints, never
the learner's own report).

    python bench/faults.py                 # every scenario (the extended ones too), fuzzers, security, 3 runs
    python bench/faults.py --runs 1 -k kill9_policy   # a subset (pytest -k expression), once

Each fault scenario runs a small RL loop (2 rollout workers, 6 on-policy steps) against a private redis-server
and Mosquitto, injects its fault and audits the run: tasks dispatched (read from `prompts`), samples trained
(by the checkpoints' ledgers), samples lost and duplicated, entries dead-lettered, and the recovery time (from
the fault, or its repair, to the next policy version).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("tasks_dispatched", "samples_trained", "samples_lost", "samples_duplicated", "dead_lettered", "recovery_s")


def run_suite(k: str | None) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]], float]:
    """One pytest run of tests/faults (extended scenarios included); its exit, its rows and its seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rows.jsonl"
        env = {**os.environ, "TLT_FAULTS_REPORT": str(report), "TLT_FAULTS_EXTENDED": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-rfExX", "-p", "no:cacheprovider", str(ROOT / "tests/faults")]
        if k:
            command += ["-k", k]
        started = time.monotonic()
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - started
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return done, rows, seconds


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per scenario: the median of each figure over its passing runs, and how many runs passed."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_name.setdefault(row["scenario"], []).append(row)
    table = []
    for name, runs in by_name.items():
        figures = {
            f: statistics.median(values) if (values := [r[f] for r in runs if r.get(f) is not None]) else None
            for f in (*FIGURES, "wall_s")
        }
        table.append({"scenario": name, "what": runs[0]["what"], **figures, "runs_passed": len(runs)})
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default=None, help="pytest -k expression selecting scenarios")
    p.add_argument("--runs", type=int, default=3, help="runs of the suite; figures are medians (default 3)")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be >= 1")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    runs = []
    for _ in range(args.runs):
        done, found, seconds = run_suite(args.k)
        rows += found
        lines = done.stdout.splitlines()
        runs.append(
            {
                "pytest_exit_code": done.returncode,
                "pytest_summary": lines[-1] if lines else done.stderr[-500:],
                "seconds": round(seconds, 1),
                "failures": [line for line in lines if line.startswith(("FAILED", "ERROR", "XPASS", "E   "))][:60],
                "known_bugs": [line for line in lines if line.startswith("XFAIL")],
            }
        )
    fuzz: dict[str, dict[str, int]] = {}
    for row in rows:
        if "fuzz" in row:
            entry = fuzz.setdefault(row["fuzz"], {"tried": 0, "dead": 0})
            entry["tried"] += row["tried"]
            entry["dead"] += row["dead"]
    result = {
        "bench": "faults",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "runs": args.runs,
        "seconds": round(time.monotonic() - started, 1),
        "scenarios": medians([row for row in rows if "scenario" in row]),
        "fuzz": fuzz,
        "pytest": runs,
    }
    print(json.dumps(result, indent=2))
    sys.exit(max(run["pytest_exit_code"] for run in runs))


if __name__ == "__main__":
    main()

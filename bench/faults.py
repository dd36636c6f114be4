"""Reliability figures: the fault-injection and fuzz suites (`tests/faults/`) run with their per-scenario
rows collected, printed as one JSON object (the table of docs/reliability.md).

    python bench/faults.py            # every scenario, the fuzzers, the security tests (~5 minutes)
    python bench/faults.py -k kill9   # a subset (pytest -k expression)

Each fault scenario runs a small RL loop (2 rollout workers, 6 steps of 2 prompts x 2 samples) against a
private redis-server and Mosquitto, injects its fault, and audits the learner's record: groups dispatched,
trained, lost, duplicated, and the recovery time (from the fault, or its repair, to the next policy version).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default=None, help="pytest -k expression selecting scenarios")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rows.jsonl"
        env = {**os.environ, "TLT_FAULTS_REPORT": str(report)}
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "faults"),
        ]
        if args.k:
            command += ["-k", args.k]
        started = time.monotonic()
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    fuzz: dict[str, dict[str, int]] = {}
    for row in rows:
        if "fuzz" in row:
            entry = fuzz.setdefault(row["fuzz"], {"tried": 0, "dead": 0})
            entry["tried"] += row["tried"]
            entry["dead"] += row["dead"]
    result = {
        "bench": "faults",
        "pytest_exit_code": done.returncode,
        "pytest_summary": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:],
        "seconds": round(time.monotonic() - started, 1),
        "failures": [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E   "))][:60],
        "scenarios": [row for row in rows if "scenario" in row],
        "fuzz": fuzz,
    }
    print(json.dumps(result, indent=2))
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()

"""The machine's load beside a run, as the planner's CPU model takes it: cores busy with work the simulator
does not model (everything but the run's rollout workers and learner: the policy service, the launcher,
Redis, the broker, and whatever else shares the machine).

Samples every process's CPU time from /proc every `--every` seconds and writes one JSON line per sample:
the sample's wall time and, per class, the cores it kept busy over the interval (CPU seconds over wall
seconds): `worker` and `learner` (service processes whose command line holds `--match`), `other` (the rest,
this sampler left out). Runs until killed (or `--seconds`):

    python bench/plan_load.py --match artifacts/plan/e2e --out artifacts/plan/load.jsonl &
    flock /tmp/tlt-heavy.lock python bench/e2e.py ... --out artifacts/plan/e2e
    kill %1

`bench/plan_check.py --load artifacts/plan/load.jsonl` averages `other` over each measured config's steps
(the background the prediction is made with); `bench/plan_contention.py` uses `background_cores` to measure
the load beside its own microbenchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` now, all its threads (OSError: it is gone)."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    fields = raw[raw.rfind(b")") + 2 :].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of every process now, by pid (processes that vanish are skipped)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            out[int(entry.name)] = cpu_of(int(entry.name))
        except OSError:
            continue
    return out


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def classify(cmdline: str, match: str | None) -> str:
    if match and match in cmdline:
        if "services.rollout_worker" in cmdline:
            return "worker"
        if "services.learner" in cmdline:
            return "learner"
    return "other"


def background_cores(before: dict[int, float], after: dict[int, float], seconds: float, mine: set[int]) -> float:
    """Cores kept busy over `seconds` by processes not in `mine`, from two `cpu_seconds` readings."""
    busy = sum(t - before.get(pid, t) for pid, t in after.items() if pid not in mine)
    return max(0.0, busy / seconds) if seconds > 0 else 0.0


def window_mean(samples: list[dict], start: float, end: float, key: str = "other") -> float | None:
    """Mean of `key` over the samples whose interval ends inside [start, end] (None: no sample there)."""
    inside = [s for s in samples if start < s["t"] <= end]
    if not inside:
        return None
    return sum(s[key] * s["dt"] for s in inside) / sum(s["dt"] for s in inside)


def read_samples(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", help="a string in the command lines of the run's services (their config path)")
    p.add_argument("--out", required=True)
    p.add_argument("--every", type=float, default=0.25)
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until killed)")
    args = p.parse_args()
    me = os.getpid()
    names: dict[int, str] = {}
    before, last = cpu_seconds(), time.time()
    ended = last + args.seconds if args.seconds else float("inf")
    with open(args.out, "a") as out:
        while time.time() < ended:
            time.sleep(args.every)
            now, after = time.time(), cpu_seconds()
            dt = now - last
            busy = {"worker": 0.0, "learner": 0.0, "other": 0.0}
            for pid, t in after.items():
                if pid == me or pid not in before:
                    continue
                if pid not in names:
                    names[pid] = classify(command_line(pid), args.match)
                busy[names[pid]] += t - before[pid]
            row = {"t": round(now, 3), "dt": round(dt, 4), **{k: round(v / dt, 4) for k, v in busy.items()}}
            out.write(json.dumps(row) + "\n")
            out.flush()
            before, last = after, now
            for pid in [p for p in names if p not in after]:
                del names[pid]


if __name__ == "__main__":
    sys.exit(main())

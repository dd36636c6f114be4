#!/usr/bin/env bash
# One hold of the planner's check against this machine (issue 44, point 3 i; docs/benchmarks.md "Projections"):
# under the heavy-work lock, the CPU model fitted on microbenchmarks before and after the measured runs (2 torch
# threads for the synchronous configs, 1 for streaming), the contention bench and the update beside the drafter's
# idle training (bench/plan_beside.py), then bench/e2e.py's (a), (b), (c), (g) in 3 rotations, while
# bench/plan_load.py samples what the runs' own services keep busy; a few seconds of the machine's speed
# (bench/plan_probe.py) before and after each fit and between the runs. Then bench/plan_check.py predicts every
# run from its inputs and the fits around it: check.json, and with the runs' inputs pooled (check-no-replay.json),
# the update beside the idle training not charged (check-no-beside.json), each run's step figure the mean of its
# steps (check-mean.json), and each run's model scaled by the probes beside it (check-probes.json), and as a
# diagnostic each run's engine as fast as its own hops were (check-in-run.json). Each run has STEPS steps (default 8:
# 7 steady steps a run where 3 swung on a streaming run's unlike steps; holds r11-r36 ran 4, r37-r40 8).
# ~48 min on a quiet machine (~40 with STEPS=4).
#
#   bash bench/plan_hold.sh artifacts/plan/r13        # REPS=5 for five rotations, STEPS=4 as r11-r36
#
# Run it on a quiet machine (no tests, no CI): everything else on the cores is in the measurements.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/plan_hold.sh OUT_DIR}
reps=${REPS:-3}
steps=${STEPS:-8}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out/probes"
export PYTHONPATH=$PWD
"$py" bench/plan_load.py --match "$out/e2e" --out "$out/load.jsonl" &
load=$!
trap 'kill $load 2>/dev/null || true' EXIT
flock /tmp/tlt-heavy.lock env py="$py" out="$out" reps="$reps" steps="$steps" sh -c '
  set -e
  fit() {  # fit THREADS WHEN, a probe before and after it
    "$py" bench/plan_probe.py --label "fit-t$1-$2-before" --out "$out/probes/fit-t$1-$2-before.json" > /dev/null
    "$py" bench/plan_fit.py --threads "$1" --out "$out/t$1-$2.json" > "$out/t$1-$2.out" 2> "$out/t$1-$2.log"
    "$py" bench/plan_probe.py --label "fit-t$1-$2-after" --out "$out/probes/fit-t$1-$2-after.json" > /dev/null
  }
  fit 2 pre
  fit 1 pre
  "$py" bench/plan_contention.py --out "$out/contention.json" > "$out/contention.out" 2> "$out/contention.log"
  "$py" bench/plan_beside.py --out "$out/beside.json" > "$out/beside.out" 2> "$out/beside.log"
  TLT_LEARNER__ACCUMULATE=false "$py" bench/e2e.py --only a_sync_plain,b_sync_tlt,c_stream_tlt,g_sync_partial \
      --steps "$steps" --eval 0 --reps "$reps" --out "$out/e2e" --probe-dir "$out/probes" > "$out/e2e-reps.json" 2> "$out/e2e.log"
  fit 2 post
  fit 1 post'
kill $load 2>/dev/null || true
check() {
  "$py" bench/plan_check.py --e2e-json "$out/e2e-reps.json" --calibrated "$out" \
      --costs-sync "$out/t2-pre.json" --costs-stream "$out/t1-pre.json" \
      --load "$out/load.jsonl" --contention "$out/contention.json" --seeds 3 "$@"
}
check --beside "$out/beside.json" > "$out/check.json" 2> "$out/check.log"
check > "$out/check-no-beside.json" 2>> "$out/check.log"
check --beside "$out/beside.json" --no-replay > "$out/check-no-replay.json" 2>> "$out/check.log"
check --beside "$out/beside.json" --step-figure mean > "$out/check-mean.json" 2>> "$out/check.log"
check --beside "$out/beside.json" --probes "$out/probes" > "$out/check-probes.json" 2>> "$out/check.log"
check --beside "$out/beside.json" --engine-factor in-run > "$out/check-in-run.json" 2>> "$out/check.log"
echo "$out/check.json"

#!/usr/bin/env bash
# GPU check of the torch CUDA path (issue 25). Prints one JSON object on stdout, within 10 minutes.
#
#   bash bench/gpu_wheels.sh           # here, once, with a registry: wheels/ (~5 MB, ignored by git) and
#                                      # wheels/world, the check's tiny world (built on this CPU, ~1 MB)
#   bash bench/gpu_check.sh            # there, on a machine with an NVIDIA GPU, torch and transformers,
#                                      # with wheels/ carried beside the repository (device tool: carry ["wheels"])
#
# What it does: installs the carried wheels (msgspec, redis, aiomqtt, fakeredis, amqtt, math-verify and their
# needs; --no-index --no-deps, into a directory of the work folder put first on PYTHONPATH), probes that torch
# sees a GPU and that the project imports, then runs `python -m bench.gpu_check` (its docstring lists the
# phases: greedy identity with and without SD, tokens/s at batch 1 and 32, RL steps with the plain learner,
# `tlt-stream run` for a few steps). vLLM is not carried (its wheel and CUDA libraries are GBs): where it is
# not installed the JSON says the vLLM backend stays unverified.
#
# UNVERIFIED: rehearsed on a CPU (TLT_GPU_CHECK_DEVICE=cpu, Python 3.11, the wheels for 3.11), never on a GPU.
# Budget: wheels (seconds), the world (carried in wheels/world; else built there on the CPU: minutes), the
# greedy phases and RL steps (a couple of minutes), the run (~2 minutes); everything under `timeout`.
#
# Environment: TLT_GPU_PYTHON (default python3), TLT_WHEELS (default ./wheels), TLT_GPU_CHECK_SECONDS (default
# 590), TLT_GPU_CHECK_WORK (default: a fresh temporary directory), TLT_GPU_CHECK_DEVICE (cuda; cpu to rehearse),
# TLT_GPU_CHECK_ARGS (extra bench.gpu_check flags).
# Exit codes: 0 the check ran (its JSON says whether it passed), 3 nothing could run, 124 out of time.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 3
START=$(date +%s)
BUDGET=${TLT_GPU_CHECK_SECONDS:-590}
DEADLINE=$((START + BUDGET))
PY=${TLT_GPU_PYTHON:-python3}
WHEELS=${TLT_WHEELS:-$ROOT/wheels}
DEVICE=${TLT_GPU_CHECK_DEVICE:-cuda}
WORK=${TLT_GPU_CHECK_WORK:-$(mktemp -d -t tlt-gpu-check-XXXXXX)}
mkdir -p "$WORK"
LOG="$WORK/gpu_check.log"

fail() {  # one JSON line on stdout (the details are in the log), then exit
    "$PY" -c 'import json, sys; print(json.dumps({"check": "gpu", "ok": False, "error": sys.argv[1], "log": sys.argv[2]}))' \
        "$1" "$LOG"
    exit "${2:-3}"
}

left() { echo $((DEADLINE - $(date +%s))); }

WHEELS_SECONDS=0
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    T0=$(date +%s)
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$WHEELS"/*.whl >>"$LOG" 2>&1 || fail "installing the wheels in $WHEELS failed"
    WHEELS_SECONDS=$(( $(date +%s) - T0 ))
    export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no wheels in $WHEELS: using what is installed" >>"$LOG"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "wheels installed in ${WHEELS_SECONDS}s" >>"$LOG"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    TLT_GPU_CHECK_CARRIED="$(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sk "$WHEELS" | cut -f1) KiB, installed in ${WHEELS_SECONDS}s"
    export TLT_GPU_CHECK_CARRIED
fi

PROBE="$WORK/probe.json"
rm -f "$PROBE"
"$PY" bench/gpu_probe.py "$PROBE" "$DEVICE" >>"$LOG" 2>&1
[ -s "$PROBE" ] || fail "the environment probe failed before a verdict (see the log)"
ERROR=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("error", ""))' "$PROBE")
[ -z "$ERROR" ] || fail "$ERROR"
echo "environment: $(cat "$PROBE")" >>"$LOG"

WORLD=()
if [ -f "$WHEELS/world/gpu_check_world.json" ]; then  # carried, built by gpu_wheels.sh: no minutes spent here
    WORLD=(--world "$WHEELS/world")
fi
REMAINING=$(( $(left) - 5 ))
[ "$REMAINING" -gt 60 ] || fail "only ${REMAINING}s left after installing; nothing was run"
# shellcheck disable=SC2086  # TLT_GPU_CHECK_ARGS is a list of flags
timeout --kill-after=5 "$REMAINING" "$PY" -m bench.gpu_check --work "$WORK" --device "$DEVICE" \
    --deadline "$((DEADLINE - 10))" ${WORLD[@]+"${WORLD[@]}"} ${TLT_GPU_CHECK_ARGS:-} 2>>"$LOG"
STATUS=$?
if [ "$STATUS" -eq 124 ] || [ "$STATUS" -eq 137 ]; then
    fail "bench.gpu_check ran past the ${BUDGET}s budget" 124
fi
[ "$STATUS" -eq 0 ] || fail "bench.gpu_check exited $STATUS" "$STATUS"
exit 0

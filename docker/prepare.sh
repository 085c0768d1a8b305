#!/usr/bin/env bash
# On a fresh Debian machine (root): installs Docker's engine and debootstrap from Debian, and
# starts the daemon if none answers. Safe to run repeatedly. .ci/run calls it before
# docker/build.sh.
set -euo pipefail
fail() { echo "docker/prepare.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "must run as root"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    echo "[prepare] installing docker.io and debootstrap from apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq docker.io debootstrap >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    echo "[prepare] starting dockerd (log: /var/log/dockerd.log)"
    nohup dockerd > /var/log/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not start: $(tail -3 /var/log/dockerd.log)"
fi
echo "[prepare] Docker $(docker version -f '{{.Server.Version}}') ready"

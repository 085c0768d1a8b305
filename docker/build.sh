#!/usr/bin/env bash
# Builds, from the repository root: the Debian base (debootstrap bookworm, then docker import;
# no registry is needed), hvd_compress:cpu and hvd_compress:gpu. Run as root with a Docker
# daemon and network access to Debian's mirror and PyPI:
#
#   bash docker/build.sh [cpu] [gpu]      # both by default
#
# Horovod wheels are cached in docker/cache/ (copied into the build context and back out of
# each image, seeded with the wheel ci/setup.sh built on this host), so a rebuild skips
# Horovod's 5-10 minute compile. BASE=<image> builds on
# another base (nvidia/cuda:*-devel, nvcr.io/nvidia/pytorch) instead of the local one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SUITE=bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
LOCAL_BASE=hvd_compress-base:$SUITE
BASE=${BASE:-$LOCAL_BASE}
TORCH_VERSION=2.13.0
CACHE=docker/cache
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu gpu)

fail() { echo "docker/build.sh: $*" >&2; exit 1; }
log() { echo "[build] $*"; }

[ "$(id -u)" = 0 ] || fail "must run as root (debootstrap and the Docker daemon need it)"
command -v docker >/dev/null || fail "no docker command: apt-get install docker.io"
docker info >/dev/null 2>&1 || fail "no Docker daemon answers (start it: dockerd > /var/log/dockerd.log 2>&1 &)"
python3 - <<'PY' 2>/dev/null || fail "no network: PyPI (https://pypi.org) cannot be reached"
import urllib.request
urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=15)
PY
for target in "${targets[@]}"; do
    case $target in cpu|gpu) ;; *) fail "unknown target '$target': cpu or gpu" ;; esac
done

if [ "$BASE" = "$LOCAL_BASE" ] && ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || fail "no debootstrap: apt-get install debootstrap"
    root=$(mktemp -d /var/tmp/hvd_compress-base.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    log "debootstrap $SUITE from $MIRROR (a few minutes)"
    debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" > "$root.log" 2>&1 \
        || fail "debootstrap failed (see $root.log): $(tail -1 "$root.log")"
    echo "deb $MIRROR $SUITE main" > "$root/etc/apt/sources.list"
    tar -C "$root" -c . | docker import - "$LOCAL_BASE" >/dev/null
    rm -rf "$root" "$root.log"
    trap - EXIT
fi

mkdir -p "$CACHE/wheels" "$CACHE/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$CACHE/ca-certificates/" 2>/dev/null || true
# The Horovod wheel ci/setup.sh built on this host for the same torch, if any: the one the
# tests passed with (same Debian, Open MPI and Python minor version as the CPU image).
host_wheels=${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd_compress}/horovod-0.28.1-torch-${TORCH_VERSION}_cpu
if [ -d "$host_wheels" ] && [ ! -d "$CACHE/$(basename "$host_wheels")" ]; then
    cp -r "$host_wheels" "$CACHE/"
fi
for target in "${targets[@]}"; do
    gpu=0
    if [ "$target" = cpu ]; then
        # torch's CPU wheel, wherever this host's pip finds it (this machine: a local wheel
        # directory; elsewhere: --extra-index-url https://download.pytorch.org/whl/cpu).
        ls "$CACHE"/wheels/torch-$TORCH_VERSION+cpu-*.whl >/dev/null 2>&1 \
            || python3 -m pip download -q --no-deps -d "$CACHE/wheels" "torch==$TORCH_VERSION+cpu" \
            || fail "could not download torch==$TORCH_VERSION+cpu for the CPU image"
    else
        gpu=1
    fi
    log "building hvd_compress:$target on $BASE"
    started=$SECONDS
    docker build --network host --build-arg BASE="$BASE" --build-arg GPU=$gpu \
        -f docker/Dockerfile -t "hvd_compress:$target" . \
        || fail "building hvd_compress:$target failed (its output is above)"
    # The Horovod wheel it built (or reused) goes back to the cache for the next build.
    docker run --rm "hvd_compress:$target" tar -C /opt/hvd_compress-cache -c . | tar -C "$CACHE" -x
    log "hvd_compress:$target built in $((SECONDS - started)) s: $(docker image inspect -f '{{.Size}}' "hvd_compress:$target" | awk '{printf "%.2f GB", $1 / 1e9}')"
done

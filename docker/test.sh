#!/usr/bin/env bash
# Runs the images docker/build.sh built; exits non-zero on any failure.
#   1. one host: the digits demo in the CPU image;
#   2. several hosts: two CPU containers on a user-defined network, sshd in each, keys made
#      here; horovodrun -np 4 -H c1:2,c2:2 trains the digits CNN with PowerSGD and with L-GreCo,
#      under the MPI and the Gloo controller;
#   3. the GPU image: horovodrun --check-build lists NCCL (no GPU is needed for that).
#   bash docker/test.sh [cpu] [gpu]      # both by default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu gpu)
NETWORK=hvd_compress-test
work=$(mktemp -d)
log() { echo "[docker-test] $*"; }
cleanup() {
    docker rm -f c1 c2 >/dev/null 2>&1 || true
    docker network rm "$NETWORK" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

for target in "${targets[@]}"; do
    docker image inspect "hvd_compress:$target" >/dev/null 2>&1 \
        || { echo "docker/test.sh: no image hvd_compress:$target; run bash docker/build.sh $target" >&2; exit 1; }
    log "hvd_compress:$target: $(docker image inspect -f '{{.Size}}' "hvd_compress:$target" | awk '{printf "%.2f GB", $1 / 1e9}')"
done

if [[ " ${targets[*]} " == *" cpu "* ]]; then
    log "one host: docker run --rm hvd_compress:cpu bash ci/demo.sh"
    docker run --rm hvd_compress:cpu bash ci/demo.sh | tee "$work/demo.log"
    grep -q "accuracy" "$work/demo.log"

    log "several hosts: containers c1 and c2 on network $NETWORK"
    cleanup; work=$(mktemp -d)
    mkdir -p "$work/ssh"
    ssh-keygen -q -t ed25519 -N "" -f "$work/ssh/id_ed25519"
    cp "$work/ssh/id_ed25519.pub" "$work/ssh/authorized_keys"
    printf 'Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' > "$work/ssh/config"
    chmod 600 "$work/ssh/"*
    docker network create "$NETWORK" >/dev/null
    for host in c1 c2; do
        docker run -d --name "$host" --hostname "$host" --network "$NETWORK" \
            -v "$work/ssh:/root/.ssh:ro" hvd_compress:cpu bash -c "ssh-keygen -A >/dev/null && exec /usr/sbin/sshd -D" >/dev/null
    done
    for attempt in $(seq 30); do
        docker exec c1 ssh c2 true 2>/dev/null && break
        [ "$attempt" -lt 30 ] || { echo "docker/test.sh: c1 cannot ssh to c2" >&2; exit 1; }
        sleep 1
    done
    for controller in mpi gloo; do
        for method in powersgd lgreco; do
            adapt=(); [ $method = lgreco ] && adapt=(--compression acpsgd --adapt lgreco)
            [ $method = powersgd ] && adapt=(--compression powersgd)
            log "horovodrun --$controller -np 4 -H c1:2,c2:2 python examples/train_digits.py ${adapt[*]}"
            docker exec -e OMP_NUM_THREADS=1 c1 timeout 900 horovodrun --$controller -np 4 -H c1:2,c2:2 \
                python examples/train_digits.py "${adapt[@]}" | tee "$work/$controller-$method.log"
            grep -q "accuracy" "$work/$controller-$method.log"
        done
    done
fi

if [[ " ${targets[*]} " == *" gpu "* ]]; then
    log "docker run --rm hvd_compress:gpu horovodrun --check-build"
    docker run --rm hvd_compress:gpu horovodrun --check-build | tee "$work/check-build.log"
    grep -Eq '\[X\] NCCL' "$work/check-build.log" || { echo "docker/test.sh: the GPU image's Horovod has no NCCL" >&2; exit 1; }
fi
log "passed"

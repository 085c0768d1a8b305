# Two CPU containers, c1 and c2, on a user-defined Docker network, with sshd in each and keys
# made here: two "hosts" for horovodrun -H c1:2,c2:2. Sourced by docker/test.sh and
# docker/soak.sh (needs "set -euo pipefail" and a log function in the caller).
#   hosts_up WORKDIR    start them (replacing any left from an earlier run)
#   hosts_down          remove them and the network
# HOSTS_CPU_SHARES: the containers' CPU weight (docker run --cpu-shares; Docker's default 1024,
# the weight of one busy process of the host).
HOSTS_NETWORK=hvd_compress-test

hosts_down() {
    docker rm -f c1 c2 >/dev/null 2>&1 || true
    docker network rm "$HOSTS_NETWORK" >/dev/null 2>&1 || true
}

hosts_up() {
    local work=$1
    hosts_down
    log "several hosts: containers c1 and c2 on network $HOSTS_NETWORK"
    mkdir -p "$work/ssh"
    ssh-keygen -q -t ed25519 -N "" -f "$work/ssh/id_ed25519" <<< y >/dev/null
    cp "$work/ssh/id_ed25519.pub" "$work/ssh/authorized_keys"
    printf 'Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' > "$work/ssh/config"
    chmod 600 "$work/ssh/"*
    docker network create "$HOSTS_NETWORK" >/dev/null
    local host attempt
    for host in c1 c2; do
        docker run -d --name "$host" --hostname "$host" --network "$HOSTS_NETWORK" \
            --cpu-shares "${HOSTS_CPU_SHARES:-1024}" \
            -v "$work/ssh:/root/.ssh:ro" hvd_compress:cpu bash -c "ssh-keygen -A >/dev/null && exec /usr/sbin/sshd -D" >/dev/null
    done
    for attempt in $(seq 30); do
        docker exec c1 ssh c2 true 2>/dev/null && return 0
        sleep 1
    done
    echo "docker/hosts.sh: c1 cannot ssh to c2" >&2
    return 1
}

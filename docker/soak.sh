#!/usr/bin/env bash
# Repeats short two-container training jobs under Horovod's Gloo controller (or MPI's, with
# SOAK_CONTROLLER=mpi) and counts how many pass: the check for flakes that one run in
# docker/test.sh cannot see (compressed runs that timed out at random). Needs the image
# docker/build.sh cpu made.
#
#   bash docker/soak.sh [RUNS] [METHOD ...]      # default: 10 runs of powersgd and lgreco
#
# METHOD: powersgd (PowerSGD) or lgreco (ACP-SGD under L-GreCo), as in docker/test.sh, or none:
# horovodrun --gloo -np 4 -H c1:2,c2:2 examples/train_digits.py --epochs 3. Or Horovod alone,
# without hvd_compress (docker/gloo_shapes.py, 200 steps): shapes (tensor names whose shapes
# alternate between steps) or fixed-shapes. HOROVOD_GLOO_TIMEOUT_SECONDS stays at its default
# (30). Or mpi-threads (docker/mpi_threads.py, 1000 rounds, SOAK_CONTROLLER=mpi): mpi4py messages
# beside Horovod's MPI thread, without hvd_compress. Or start (docker/gloo_start.py): Horovod's
# start-up alone, as examples/train_digits.py begins (init, broadcast_parameters, 20 steps).
# SOAK_EPOCHS: epochs of the digits runs (3, as docker/test.sh). SOAK_SLOTS: ranks per container
# (2: 4 ranks on the host's 2 cores; 1: a rank per core, as on a cluster). SOAK_LOG_LEVEL: Horovod's log
# level in every rank (trace logs each enqueued request). Logs: docker/soak-logs/ (or SOAK_LOGS).
# Exits non-zero unless every job passed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
runs=${1:-10}
shift || true
methods=("$@")
[ ${#methods[@]} -gt 0 ] || methods=(powersgd lgreco)
logs=${SOAK_LOGS:-docker/soak-logs}
controller=${SOAK_CONTROLLER:-gloo}
slots=${SOAK_SLOTS:-2}
case $slots in 1|2) ;; *) echo "docker/soak.sh: SOAK_SLOTS must be 1 or 2, got '$slots'" >&2; exit 2 ;; esac
case $controller in gloo|mpi) ;; *) echo "docker/soak.sh: SOAK_CONTROLLER must be gloo or mpi, got '$controller'" >&2; exit 2 ;; esac
log() { echo "[soak] $*"; }
source docker/hosts.sh
work=$(mktemp -d)
trap 'hosts_down; rm -rf "$work"' EXIT
mkdir -p "$logs"
hosts_up "$work"
for host in c1 c2; do
    for probe in gloo_shapes gloo_start mpi_threads; do docker cp "docker/$probe.py" "$host:/tmp/$probe.py"; done
done
failed=0
for method in "${methods[@]}"; do
    script=(examples/train_digits.py --epochs ${SOAK_EPOCHS:-3})
    case $method in
        powersgd) args=(--compression powersgd) ;;
        lgreco) args=(--compression acpsgd --adapt lgreco) ;;
        none) args=(--compression none) ;;
        shapes) script=(/tmp/gloo_shapes.py 200); args=(alternate) ;;
        fixed-shapes) script=(/tmp/gloo_shapes.py 200); args=(fixed) ;;
        start) script=(/tmp/gloo_start.py 20); args=() ;;
        mpi-threads) script=(/tmp/mpi_threads.py 1000); args=() ;;
        *) echo "docker/soak.sh: unknown method '$method': powersgd, lgreco, none, shapes, fixed-shapes, start or mpi-threads" >&2; exit 2 ;;
    esac
    passed=0
    for run in $(seq "$runs"); do
        start=$(date +%s)
        out="$logs/$controller-$slots-$method-$run.log"
        if docker exec -e OMP_NUM_THREADS=1 ${SOAK_LOG_LEVEL:+-e HOROVOD_LOG_LEVEL=$SOAK_LOG_LEVEL} c1 timeout 600 horovodrun --$controller -np $((2 * slots)) -H c1:$slots,c2:$slots \
                python "${script[@]}" "${args[@]}" > "$out" 2>&1 && grep -q "final" "$out"; then
            passed=$((passed + 1)); verdict=passed
        else
            verdict="FAILED ($(grep -m1 -o 'Timed out.*\|Wait timeout[^.]*\|[A-Za-z]*Timeout: .*\|[A-Za-z]*Error: .*' "$out" || echo "see $out"))"
        fi
        log "$method run $run: $verdict in $(( $(date +%s) - start )) s"
    done
    log "$method: $passed of $runs passed"
    [ "$passed" = "$runs" ] || failed=1
done
exit $failed

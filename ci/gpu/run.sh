#!/usr/bin/env bash
# A GPU lease's one prepared run (never on CI's path), from the repository root on the device
# machine, which has CUDA torch but no Horovod (hvd_compress and the DDP benchmarks need none):
# the CUDA tier, then the L-GreCo protocol at larger scale, points side by side, written
# under $OUT/claims and resumed from ci/gpu/claims_gpu.json when present (copy the last run's
# JSON there). Settings: SKIP_SMOKE, RUN_SECONDS, MAX_MINUTES, PARALLEL.
set -u
export PYTHONUNBUFFERED=1
RUN_SECONDS=${RUN_SECONDS:-470}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'cores', __import__('os').cpu_count())" >> $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
mkdir -p $OUT/claims/benchmarks
[ -f ci/gpu/claims_gpu.json ] && cp ci/gpu/claims_gpu.json $OUT/claims/benchmarks/  # resume
if [ -z "${SKIP_SMOKE:-}" ]; then
# Smoke: one quick point on the GPU through DDP over Gloo; stop here if it fails.
if ! timeout 150 python3 -m benchmarks claims --scale gpu --quick --max-minutes 0.01 --job-timeout 120 --out /tmp/smoke > $OUT/smoke.log 2>&1; then
    echo "SMOKE FAILED"; tail -60 $OUT/smoke.log; exit 3
fi
tail -3 $OUT/smoke.log
fi
(python3 -m pytest tests/unit/test_cuda.py -q -p no:cacheprovider -rs > $OUT/cuda_tier.log 2>&1; echo "pytest exit $?" >> $OUT/cuda_tier.log) &
timeout $RUN_SECONDS python3 -m benchmarks claims --scale gpu --parallel ${PARALLEL:-8} --max-minutes ${MAX_MINUTES:-5} --job-timeout 420 --out $OUT/claims > $OUT/claims.log 2>&1
echo "claims exit $?"
wait
tail -5 $OUT/cuda_tier.log
tail -40 $OUT/claims.log

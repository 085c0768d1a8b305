#!/usr/bin/env bash
# The GPU run of the codec work (never on CI's path), from the repository root on the device machine (CUDA
# torch, no Horovod: neither the CUDA tier nor the codec benchmark needs it), in at most 9.5 minutes:
# the CUDA tier (tests/unit/test_cuda.py: the checkpoint fixes and the per-layer waits), then
# `python -m benchmarks codec --device cuda` against torch's powerSGD_hook, with each codec's
# floor. Each benchmark's page lands in a copy of docs/benchmarks/ under $OUT/docs, the list of
# pages in a copy of docs/benchmarks.md; copy them, the JSON and the figures back by hand. Each
# stage has its own limit, and a failed stage does not stop the next. The default stages' limits add up to 570 s (the codec table, last, took 2.1 min on
# an H200), under the device's 600 s a command: a stuck stage cannot cut the codec table off.
# OPERATORS, off by default, adds up to OPERATORS_SECONDS (150): lower another stage's to fit.
# Settings: TIER_SECONDS, CODEC_SECONDS, LOCATE (method ids whose waits to place line by line),
# OPERATORS (shape sets whose operators per step to count on the GPU: the codec table's time per
# operator reads them), OPERATORS_SECONDS, SKIP_CODEC, CODEC_ROUNDS (1: a GPU machine is quiet, and
# three rounds would not fit), BATCHING_SECONDS (0 skips `python -m benchmarks batching --device
# cuda`: what ACP-SGD's same-shape batching buys on the GPU),
# LAYOUTS_SECONDS (0 skips `python -m benchmarks layouts --device cuda`: whether cuBLAS
# runs P = M Q faster as (Q^T M^T)^T, as the CPU's BLAS does at ranks 2-6; `project_right` keeps
# M Q on a GPU until it is known).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/docs/benchmarks
cp docs/benchmarks.md $OUT/docs/
cp docs/benchmarks/*.md $OUT/docs/benchmarks/
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, os, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'cores', os.cpu_count())"
} > $OUT/cuda_tier.log 2>&1
cat $OUT/cuda_tier.log
start=$(date +%s)
timeout ${TIER_SECONDS:-150} python3 -m pytest tests/unit/test_cuda.py -q -p no:cacheprovider -rsxX >> $OUT/cuda_tier.log 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" >> $OUT/cuda_tier.log
tail -25 $OUT/cuda_tier.log
for method in ${LOCATE:-scalecom lgreco-topk}; do
    PYTHONPATH=.:tests/unit timeout 40 python3 tests/unit/test_cuda.py $method 2>&1 | grep -v Warning
done
if [ -n "${OPERATORS:-}" ]; then  # the operator counts on the GPU, for the codec table's time per operator
    start=$(date +%s)
    timeout ${OPERATORS_SECONDS:-150} python3 -m benchmarks codec --operators --device cuda --shapes $OPERATORS --out $OUT/docs > $OUT/operators.log 2>&1
    echo "operators exit $? after $(( $(date +%s) - start )) s" >> $OUT/operators.log
    tail -5 $OUT/operators.log
fi
if [ "${BATCHING_SECONDS:-50}" != 0 ]; then
    timeout ${BATCHING_SECONDS:-50} python3 -m benchmarks batching --device cuda --out $OUT/docs > $OUT/batching.log 2>&1
    echo "batching exit $?" >> $OUT/batching.log
    head -9 $OUT/docs/benchmarks/same-shape-batching-on-a-gpu.md | tail -5
fi
if [ "${LAYOUTS_SECONDS:-50}" != 0 ]; then  # whether cuBLAS, too, runs P = M Q faster transposed
    timeout ${LAYOUTS_SECONDS:-50} python3 -m benchmarks layouts --device cuda --ranks 1,2,3,4,6,8,16,32 --out $OUT/docs > $OUT/layouts.log 2>&1
    echo "layouts exit $?" >> $OUT/layouts.log
    grep -A14 "its transposed form" $OUT/docs/benchmarks/low-rank-products-by-layout-on-a-gpu.md | tail -12
fi
[ -n "${SKIP_CODEC:-}" ] && exit 0
start=$(date +%s)
timeout ${CODEC_SECONDS:-240} python3 -m benchmarks codec --device cuda --rounds ${CODEC_ROUNDS:-1} --out $OUT/docs > $OUT/codec.log 2>&1
echo "codec exit $? after $(( $(date +%s) - start )) s" >> $OUT/codec.log
tail -45 $OUT/codec.log

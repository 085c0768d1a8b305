#!/usr/bin/env bash
# The main job: installs what is missing, then trains the digits CNN on 2 CPU ranks with
# PowerSGD through stock hvd.DistributedOptimizer. Extra arguments go to the example,
# e.g. `bash ci/demo.sh --compression topk`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup.sh
OMP_NUM_THREADS=1 horovodrun -np 2 python examples/train_digits.py "$@"

#!/usr/bin/env bash
# Inside the image build, before the sources are copied: the pinned Python packages, torch
# 2.13.0, then Horovod through ci/setup.sh (built once, then reused from the cache).
#   GPU=0: torch's CPU wheel, from the wheels build.sh put in the build context.
#   GPU=1: torch's default Linux wheel from PyPI (CUDA, cuDNN, NCCL as nvidia-* packages), and
#          Horovod built by ci/setup.sh with NCCL, against that NCCL and nvcc (from the base's
#          /usr/local/cuda if it has one, else the nvidia-cuda-nvcc package).
set -euo pipefail
TORCH_VERSION=2.13.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "[install] $*"; }

pip install -q -r "$HERE/requirements.txt"
if [ "${GPU:-0}" = 1 ]; then
    log "torch==$TORCH_VERSION (CUDA) from PyPI"
    pip install -q "torch==$TORCH_VERSION"
else
    log "torch==$TORCH_VERSION+cpu from the build context's wheels"
    pip install -q --find-links "$HVD_COMPRESS_CACHE/wheels" "torch==$TORCH_VERSION+cpu"
fi
# No GPU is visible while an image builds: GPU=1 asks ci/setup.sh for the NCCL build outright.
HVD_COMPRESS_GPU=${GPU:-0} HVD_COMPRESS_DEPENDENCIES_ONLY=1 PYTHON=python bash "$HERE/../ci/setup.sh"

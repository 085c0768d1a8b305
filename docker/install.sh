#!/usr/bin/env bash
# Inside the image build, before the sources are copied: the pinned Python packages, torch
# 2.13.0, then Horovod through ci/setup.sh (built once, then reused from the cache).
#   GPU=0: torch's CPU wheel, from the wheels build.sh put in the build context.
#   GPU=1: torch's default Linux wheel from PyPI (CUDA, cuDNN, NCCL as nvidia-* packages), and
#          Horovod built with HOROVOD_GPU_OPERATIONS=NCCL against that NCCL and nvcc (from the
#          base's /usr/local/cuda if it has one, else the nvidia-cuda-nvcc package).
set -euo pipefail
TORCH_VERSION=2.13.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "[install] $*"; }

pip install -q -r "$HERE/requirements.txt"
if [ "${GPU:-0}" = 1 ]; then
    log "torch==$TORCH_VERSION (CUDA) from PyPI"
    pip install -q "torch==$TORCH_VERSION"
    site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cuda=$(python -c "import torch; print(torch.version.cuda)")
    major=${cuda%%.*}
    if [ -x /usr/local/cuda/bin/nvcc ]; then
        cuda_home=/usr/local/cuda
    else
        log "nvcc and CUDA headers $cuda from pip (nvidia-cuda-nvcc-cu$major)"
        # CUDA 12 packages carry a -cu12 suffix; CUDA 13 split nvcc into nvcc, crt and nvvm.
        # cuda_fp16.h includes CCCL's <nv/target>.
        pip install -q "nvidia-cuda-nvcc-cu$major==$cuda.*" "nvidia-cuda-runtime-cu$major==$cuda.*" \
                "nvidia-cuda-cccl-cu$major==$cuda.*" 2>/dev/null \
            || pip install -q "nvidia-cuda-nvcc==$cuda.*" "nvidia-cuda-crt==$cuda.*" "nvidia-nvvm==$cuda.*" \
                "nvidia-cuda-runtime==$cuda.*" "nvidia-cuda-cccl==$cuda.*"
        # One CUDA home, as CMake expects it, from the packages' bin/, include/ and lib/.
        cuda_home=/opt/cuda
        mkdir -p "$cuda_home/bin" "$cuda_home/include" "$cuda_home/lib64"
        for part in bin include lib nvvm; do
            find "$site/nvidia" -mindepth 2 -maxdepth 3 -type d -name "$part" | while read -r dir; do
                case $part in
                    lib) cp -rs "$dir/." "$cuda_home/lib64/" ;;
                    nvvm) cp -rs "$dir" "$cuda_home/" 2>/dev/null || true ;;
                    *) cp -rs "$dir/." "$cuda_home/$part/" ;;
                esac
            done
        done
        # CUDA 13 keeps CCCL in include/cccl, which the toolkit's nvcc adds; ours may not.
        [ ! -d "$cuda_home/include/cccl" ] || cp -rs "$cuda_home/include/cccl/." "$cuda_home/include/"
        for lib in "$cuda_home"/lib64/libcudart.so.*; do ln -sf "$(basename "$lib")" "$cuda_home/lib64/libcudart.so"; break; done
        test -x "$cuda_home/bin/nvcc"
    fi
    nccl=$(dirname "$(find "$site/nvidia" -name nccl.h | head -1)")/..
    for lib in "$nccl"/lib/libnccl.so.*; do ln -sf "$(basename "$lib")" "$nccl/lib/libnccl.so"; break; done
    echo "$(realpath "$nccl/lib")" > /etc/ld.so.conf.d/hvd_compress-nccl.conf && ldconfig  # Horovod loads it
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=$cuda_home HOROVOD_NCCL_HOME=$nccl \
        HOROVOD_NCCL_LINK=SHARED HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-80,90} \
        CUDA_HOME=$cuda_home CUDACXX=$cuda_home/bin/nvcc PATH="$cuda_home/bin:$PATH" LIBRARY_PATH="$cuda_home/lib64:$cuda_home/lib64/stubs:${LIBRARY_PATH:-}"
else
    log "torch==$TORCH_VERSION+cpu from the build context's wheels"
    pip install -q --find-links "$HVD_COMPRESS_CACHE/wheels" "torch==$TORCH_VERSION+cpu"
fi
HVD_COMPRESS_DEPENDENCIES_ONLY=1 PYTHON=python bash "$HERE/../ci/setup.sh"

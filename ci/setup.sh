#!/usr/bin/env bash
# Installs whatever is missing for hvd_compress on a fresh Debian machine (root, Python 3.11):
# Open MPI from apt, torch 2.13.0, mpi4py/numpy/pytest/scikit-learn, and Horovod 0.28.1
# built from its sdist with C++17 (see DEVELOPERS.md). The Horovod wheel is cached, so a
# second run takes seconds. Safe to run repeatedly.
#
# GPUs: where the installed torch has CUDA and sees a GPU, Horovod is built with NCCL
# (HOROVOD_GPU_OPERATIONS=NCCL), with nvcc and NCCL from the machine's CUDA toolkit
# (/usr/local/cuda) or else from pip's nvidia-* packages, and cached apart from the CPU wheel.
# HVD_COMPRESS_GPU=1 asks for that without a GPU in sight (an image built for GPUs), =0 never.
set -euo pipefail

PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CACHE_DIR=${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd_compress}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

log() { echo "[setup] $*"; }

# mpicc comes with the development headers that Horovod's MPI build needs.
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
    log "installing Open MPI from apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq openmpi-bin libopenmpi-dev iproute2 >/dev/null
fi

have_py() { "$PYTHON" -c "import $1" 2>/dev/null; }

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION"
    "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi
missing=()
have_py mpi4py || missing+=(mpi4py)
have_py numpy || missing+=(numpy)
have_py pytest || missing+=(pytest)
have_py xdist || missing+=(pytest-xdist)  # ci/test.sh runs the unit tests two at a time
have_py sklearn || missing+=(scikit-learn)
have_py matplotlib || missing+=(matplotlib)  # benchmark plots
have_py tensorboard || missing+=(tensorboard)  # hvd_compress.metrics.TensorBoard and its test
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
fi

gpu=${HVD_COMPRESS_GPU:-auto}
case $gpu in
    auto) gpu=$("$PYTHON" -c "import torch; print(int(torch.version.cuda is not None and torch.cuda.is_available()))") ;;
    0|1) ;;
    *) echo "[setup] HVD_COMPRESS_GPU must be auto, 0 or 1, got '$gpu'" >&2; exit 2 ;;
esac
if [ "$gpu" = 1 ] && [ "$("$PYTHON" -c "import torch; print(torch.version.cuda or '')")" = "" ]; then
    echo "[setup] HVD_COMPRESS_GPU=1, but the installed torch $("$PYTHON" -c "import torch; print(torch.__version__)") has no CUDA" >&2
    exit 2
fi

horovod_ok() {
    NEED_NCCL=$gpu "$PYTHON" - <<'PY' 2>/dev/null
import os, horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1"
assert hvd.mpi_built() and hvd.gloo_built()
assert hvd.nccl_built() or (os.environ["NEED_NCCL"] != "1" and os.environ.get("HOROVOD_GPU_OPERATIONS") != "NCCL")
PY
}

# nvcc, CUDA headers and NCCL for Horovod's NCCL build, and the variables its build reads.
prepare_nccl_build() {
    local site cuda major cuda_home nccl
    site=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cuda=$("$PYTHON" -c "import torch; print(torch.version.cuda)")
    major=${cuda%%.*}
    if [ -x /usr/local/cuda/bin/nvcc ]; then
        cuda_home=/usr/local/cuda
    else
        log "nvcc and CUDA headers $cuda from pip (nvidia-cuda-nvcc-cu$major)"
        # CUDA 12 packages carry a -cu12 suffix; CUDA 13 split nvcc into nvcc, crt and nvvm.
        # cuda_fp16.h includes CCCL's <nv/target>.
        "$PYTHON" -m pip install -q "nvidia-cuda-nvcc-cu$major==$cuda.*" "nvidia-cuda-runtime-cu$major==$cuda.*" \
                "nvidia-cuda-cccl-cu$major==$cuda.*" 2>/dev/null \
            || "$PYTHON" -m pip install -q "nvidia-cuda-nvcc==$cuda.*" "nvidia-cuda-crt==$cuda.*" "nvidia-nvvm==$cuda.*" \
                "nvidia-cuda-runtime==$cuda.*" "nvidia-cuda-cccl==$cuda.*"
        # One CUDA home, as CMake expects it, from the packages' bin/, include/ and lib/.
        cuda_home=/opt/cuda
        mkdir -p "$cuda_home/bin" "$cuda_home/include" "$cuda_home/lib64"
        for part in bin include lib nvvm; do
            find "$site/nvidia" -mindepth 2 -maxdepth 3 -type d -name "$part" | while read -r dir; do
                case $part in
                    lib) cp -rsf "$dir/." "$cuda_home/lib64/" ;;
                    nvvm) cp -rsf "$dir" "$cuda_home/" 2>/dev/null || true ;;
                    *) cp -rsf "$dir/." "$cuda_home/$part/" ;;
                esac
            done
        done
        # CUDA 13 keeps CCCL in include/cccl, which the toolkit's nvcc adds; ours may not.
        [ ! -d "$cuda_home/include/cccl" ] || cp -rsf "$cuda_home/include/cccl/." "$cuda_home/include/"
        for lib in "$cuda_home"/lib64/libcudart.so.*; do ln -sf "$(basename "$lib")" "$cuda_home/lib64/libcudart.so"; break; done
        test -x "$cuda_home/bin/nvcc"
    fi
    # NCCL: the one torch came with (its nvidia-nccl package), which Horovod then loads too.
    nccl=$(dirname "$(find "$site/nvidia" -name nccl.h | head -1)")/..
    for lib in "$nccl"/lib/libnccl.so.*; do ln -sf "$(basename "$lib")" "$nccl/lib/libnccl.so"; break; done
    echo "$(realpath "$nccl/lib")" > /etc/ld.so.conf.d/hvd_compress-nccl.conf && ldconfig
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=$cuda_home HOROVOD_NCCL_HOME=$nccl \
        HOROVOD_NCCL_LINK=SHARED HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-80,90} \
        CUDA_HOME=$cuda_home CUDACXX=$cuda_home/bin/nvcc PATH="$cuda_home/bin:$PATH" \
        LIBRARY_PATH="$cuda_home/lib64:$cuda_home/lib64/stubs:${LIBRARY_PATH:-}"
}

if ! horovod_ok; then
    torch_tag=$("$PYTHON" -c "import torch; print(torch.__version__.replace('+', '_'))")
    wheel_dir="$CACHE_DIR/horovod-$HOROVOD_VERSION-torch-$torch_tag"
    if [ "$gpu" = 1 ]; then
        wheel_dir="$wheel_dir-nccl"
        prepare_nccl_build
    fi
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION against torch $torch_tag (about 10 minutes on 2 cores)"
        command -v cmake >/dev/null || "$PYTHON" -m pip install -q cmake
        work=$(mktemp -d)
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
        tar -xzf "$work"/horovod-$HOROVOD_VERSION.tar.gz -C "$work"
        src="$work/horovod-$HOROVOD_VERSION"
        # torch >= 2.1 headers need C++17; Horovod 0.28.1 pins C++14 in these two files.
        sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
        mkdir -p "$wheel_dir"
        CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$(nproc)" \
            "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$src" -w "$wheel_dir"
        rm -rf "$work"
    fi
    log "installing cached Horovod wheel from $wheel_dir"
    "$PYTHON" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
    "$PYTHON" -m pip install -q cloudpickle psutil pyyaml packaging cffi
    horovod_ok
fi

if [ "${HVD_COMPRESS_DEPENDENCIES_ONLY:-0}" = 1 ]; then  # docker/install.sh: no sources yet
    log "dependencies ready"
    exit 0
fi
# Checked from / so that the source tree in the working directory does not count as installed,
# and against this checkout so that an install from another clone does not either.
if [ "$(cd / && "$PYTHON" -c 'import hvd_compress, os; print(os.path.dirname(os.path.dirname(os.path.realpath(hvd_compress.__file__))))' 2>/dev/null)" != "$(realpath "$REPO_ROOT")" ]; then
    log "installing hvd_compress from $REPO_ROOT (editable)"
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e "$REPO_ROOT"
fi
horovodrun --check-build
log "ready"

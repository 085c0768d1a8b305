#!/usr/bin/env bash
# Installs whatever is missing for hvd_compress on a fresh Debian machine (root, Python 3.11):
# Open MPI from apt, torch 2.13.0, mpi4py/numpy/pytest/scikit-learn, and Horovod 0.28.1
# built from its sdist with C++17 (see DEVELOPERS.md). The Horovod wheel is cached, so a
# second run takes seconds. Safe to run repeatedly.
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
have_py sklearn || missing+=(scikit-learn)
have_py matplotlib || missing+=(matplotlib)  # benchmark plots
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
fi

horovod_ok() {
    "$PYTHON" - <<'PY' 2>/dev/null
import os, horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1"
assert hvd.mpi_built() and hvd.gloo_built()
assert hvd.nccl_built() or os.environ.get("HOROVOD_GPU_OPERATIONS") != "NCCL"
PY
}

if ! horovod_ok; then
    torch_tag=$("$PYTHON" -c "import torch; print(torch.__version__.replace('+', '_'))")
    wheel_dir="$CACHE_DIR/horovod-$HOROVOD_VERSION-torch-$torch_tag"
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

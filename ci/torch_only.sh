#!/usr/bin/env bash
# The torch-only stage (.ci/run): a clean virtual environment with torch and numpy and no
# Horovod, hvd_compress installed into it with pip from a copy of this checkout, then the
# torchrun tier run against the installed package: every file in tests/ddp at np 4 (the DDP hook
# and DiLoCo, tests/ddp/test_ddp_outer.py), tests/teardown at np 2 (no Gloo thread outlives
# destroy_process_group), tests/fsdp at np 4 (FSDP2/HSDP), and the
# no-Horovod unit tests. The tests run from a copy outside the checkout, so that the ranks
# import the installed package and not the source tree (pytest.ini's pythonpath puts the folder
# above tests/ first on the path). Last, the README's torchrun examples (examples/quickstart_*.py)
# run as written there. A few minutes; docs/tests.md has the times.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

log() { echo "[torch-only] $*"; }

work=$(mktemp -d -t hvd_compress-torch-only.XXXXXX)
trap 'rm -rf "$work"' EXIT
started=$SECONDS

"$PYTHON" -m venv "$work/venv"
venv_python=$work/venv/bin/python
log "installing torch==$TORCH_VERSION and numpy, and the tests' pytest and scikit-learn (the digits), into a clean virtual environment"
"$venv_python" -m pip install -q "torch==$TORCH_VERSION" numpy pytest scikit-learn

# A copy of the sources, so that no build/ folder left in the checkout goes into the wheel.
mkdir -p "$work/src"
cp -r setup.py README.md hvd_compress "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
log "pip install hvd_compress (from a copy of $(pwd))"
"$venv_python" -m pip install -q "$work/src"

mkdir -p "$work/run"
cp -r pytest.ini tests examples "$work/run/"
cd "$work/run"
"$venv_python" - <<'PY'
import importlib.util, os, sys
import hvd_compress
assert importlib.util.find_spec("horovod") is None, "Horovod is installed in the torch-only environment"
assert os.path.realpath(hvd_compress.__file__).startswith(os.path.realpath(sys.prefix)), hvd_compress.__file__
print(f"[torch-only] hvd_compress from {os.path.dirname(hvd_compress.__file__)}; no Horovod")
PY
log "ready after $((SECONDS - started)) s"
PATH="$work/venv/bin:$PATH" "$venv_python" -m pytest -v -rs --durations=10 \
    tests/unit/test_torch_only.py tests/test_ddp.py tests/test_fsdp.py -k "not torchrun-2-test_ddp"
run_example() {  # script, ranks: as the README gives the command
    log "README example: torchrun --standalone --nproc_per_node $2 examples/$1"
    OMP_NUM_THREADS=1 timeout 300 "$work/venv/bin/torchrun" --standalone --nproc_per_node "$2" "examples/$1"
}
run_example quickstart_ddp.py 2
run_example quickstart_fsdp.py 4
run_example quickstart_diloco.py 2
log "done in $((SECONDS - started)) s"

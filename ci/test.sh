#!/usr/bin/env bash
# The test command: installs what is missing, then runs the unit tier and the multi-rank tier
# (real Horovod under horovodrun --gloo and mpirun, np 2 and 4). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup.sh
python3 -m pytest -v -rs --durations=10 "$@"

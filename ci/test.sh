#!/usr/bin/env bash
# The test command: installs what is missing, then runs the tests. Extra arguments pass through
# to pytest (e.g. -k, -x).
#
#   bash ci/test.sh --quick   the quick tier, after each change: unit tests not marked slow and
#                             one np 2 launch of test_exchange.py per launcher (both integration
#                             paths under mpirun and horovodrun --gloo), L-GreCo under mpirun and
#                             the DDP exchange under torchrun (pytest -m "not slow"; the marker is
#                             in pytest.ini).
#   bash ci/test.sh           the full tier (.ci/run): every unit test, each multi-rank file under
#                             horovodrun --gloo and mpirun at np 2 and 4 and each DDP file under
#                             torchrun at np 2 and 4, the FSDP/HSDP file under torchrun at np 4
#                             (tests/test_fsdp.py), minus the launches in SKIPPED
#                             (tests/test_multirank.py), and the elastic/fault runs
#                             (tests/test_elastic.py).
# How long each tier takes, measured: docs/tests.md (the one place that says).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
selection=()
arguments=()
for argument in "$@"; do
    if [[ "$argument" == "--quick" ]]; then
        selection=(-m "not slow")
    else
        arguments+=("$argument")
    fi
done
bash ci/setup.sh
python3 -m pytest -v -rs --durations=40 "${selection[@]}" "${arguments[@]}"

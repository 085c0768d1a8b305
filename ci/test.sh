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
quick=
arguments=()
for argument in "$@"; do
    if [[ "$argument" == "--quick" ]]; then
        quick=" and not slow"
    else
        arguments+=("$argument")
    fi
done
bash ci/setup.sh
tier() {  # a selection that leaves nothing to run (e.g. -k matching only launches) is not a failure
    python3 -m pytest -v -rs "$@" || [ $? -eq 5 ]
}
# Two passes. The unit tests, two at a time (pytest-xdist, a worker per core); then the tests
# that start heavy jobs of ranks of their own, one at a time, since those need every core: the
# launches (tests/conftest.py marks them `serial`) and the unit tests marked so.
tier -n 2 -p no:benchmark -m "not serial$quick" "${arguments[@]}"
tier --durations=40 -m "serial$quick" "${arguments[@]}"

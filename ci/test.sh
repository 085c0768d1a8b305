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
marker=
arguments=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=" and not slow" ;;
        -m) marker=" and ($2)"; shift ;;  # joined to each pass's own marker, not replacing it
        *) arguments+=("$1") ;;
    esac
    shift
done
bash ci/setup.sh
# Two passes. The unit tests, two at a time (pytest-xdist; this project's machines have 2
# cores); then the tests that start heavy jobs of ranks of their own, one at a time, since those
# need every core: the launches (tests/conftest.py marks them `serial`) and the unit tests marked
# so. pytest-benchmark is off in the parallel pass, which it would only warn about. A failure in
# the first pass stops there. A pass with nothing selected (exit 5, e.g. -k naming only launches)
# is not a failure unless both are.
status=0
python3 -m pytest -v -rs -n 2 -p no:benchmark -m "not serial$quick$marker" "${arguments[@]}" || status=$?
[ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"
python3 -m pytest -v -rs --durations=40 -m "serial$quick$marker" "${arguments[@]}" && exit 0 || second=$?
if [ "$second" -eq 5 ] && [ "$status" -eq 0 ]; then exit 0; fi
exit "$second"

import os
from pathlib import Path

import pytest

# Single-process tests must not pick up a launcher's environment by accident.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Scripts that tests start outside pytest (faults/, the benchmarks' jobs) import benchmarks and
# examples.workloads from this checkout, as pytest.ini's pythonpath gives them to pytest runs.
ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != ROOT]
)


UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(items):
    """Marks ``serial`` everything outside tests/unit (the launches), whose ranks need every core:
    ci/test.sh runs it one at a time after its parallel pass, with the unit tests marked so."""
    for item in items:
        if UNIT not in item.path.resolve().parents:
            item.add_marker(pytest.mark.serial)

import os
import sys
from pathlib import Path

# Single-process tests must not pick up a launcher's environment by accident.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The workloads live in benchmarks/, outside the installed package: this checkout goes first on
# the path of the tests and of every rank they launch.
ROOT = str(Path(__file__).resolve().parents[1])
if sys.path[:1] != [ROOT]:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != ROOT]
)

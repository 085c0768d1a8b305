"""What the benchmark harness tests share: running ``python -m benchmarks`` and checking that a
sweep of points resumes."""

import json
import sys
from pathlib import Path
from typing import List

import pytest


class BenchmarkRuns:
    """Runs ``python -m benchmarks <options>`` in this process, ``sys.argv`` restored afterwards."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(sys, "argv", list(sys.argv))  # each benchmark's main() sets its own

    def run(self, options: List[str]) -> None:
        # Imported here: the torch-only stage (ci/torch_only.sh) runs tests without benchmarks/.
        from benchmarks import __main__ as bench

        assert bench.main(options) == 0

    def resumes(self, options: List[str], results: Path) -> None:
        """A second run finds every point of ``results`` (the JSON) done: it runs no job
        (``mpirun_job`` of the benchmark, ``options[0]``, fails the test) and only rewrites the
        report."""
        points = json.loads(results.read_text())["points"]
        self.monkeypatch.setattr(
            f"benchmarks.{options[0]}.mpirun_job", lambda *_, **__: pytest.fail("a finished point ran again")
        )
        self.run(options)
        assert json.loads(results.read_text())["points"] == points


@pytest.fixture
def benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> BenchmarkRuns:
    return BenchmarkRuns(monkeypatch)

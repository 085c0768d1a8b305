"""The DiLoCo benchmark's harness (``python -m benchmarks outer --quick``): it runs its points
through real mpirun jobs, resumes, and writes its page. Never a quality number."""

import json

import pytest

# Their jobs start ranks of their own: ci/test.sh runs them one at a time, after the parallel pass.
pytestmark = pytest.mark.serial


@pytest.mark.slow
def test_outer_quick_runs_its_points_resumes_and_writes_its_section(tmp_path, benchmark_runs):
    from benchmarks.outer import SECTION, points
    from benchmarks.harness.render import page

    options = ["outer", "--quick", "--job-timeout", "300", "--out", str(tmp_path)]
    benchmark_runs.run(options)
    path = tmp_path / "benchmarks" / "outer.json"
    done = json.loads(path.read_text())["points"]
    assert set(done) == {spec["key"] for spec in points([5], quick=True)}
    for entry in done.values():
        record = entry["record"]
        assert record["outer_steps"] == record["steps"] // entry["spec"]["inner_steps"]
        # Only outer steps send: at most 1/H of a float32 all-reduce on every step.
        assert 0 < record["wire_bytes"] <= record["dense_wire_bytes"] / entry["spec"]["inner_steps"]
    text = page(tmp_path, SECTION).read_text()
    assert text.startswith(f"# {SECTION}\n") and text.count(f"# {SECTION}") == 1
    benchmark_runs.resumes(options, path)

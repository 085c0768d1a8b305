"""Horovod 0.28.1's own optimizer tests with our compressors injected, on both integration paths,
under ``mpirun -np 2``: the runner is ``tests/horovod_suite/``; this writes its record and page.

``--tests DIR`` names Horovod's ``test/`` folder at v0.28.1 (``tests/horovod_suite/suite.py`` says where it
is found without it). Results go to ``docs/benchmarks/horovod_suite.json`` (resumed: a rerun
skips jobs already there) and a table in ``docs/benchmarks/horovods-own-optimizer-tests.md``; the
explanations of failures are kept in ``EXPLAINED``.
"""

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Sequence

import hvd_compress as hc

from benchmarks.harness.jobs import names_from
from benchmarks.harness.render import DOCS, write_section
from tests.horovod_suite import suite

SECTION = "Horovod's own optimizer tests"
# Why a test fails for a method, where it does: {(test, method): reason}. Filled in from runs.
EXPLAINED = {}  # none fails today: each compressor passes every test that runs on a CPU, on both paths
# How the table was made, written with it.
NOTES = (
    "Source of the tests: this machine cannot reach GitHub, so the tests were read through the "
    "project's code search and written to `/tmp/horovod_tests`, outside the repository. The two "
    "stored versions of `horovod/horovod`'s `test/parallel/test_torch.py` read (about 97,000 "
    "characters each) lack tests this suite runs, such as `test_optimizer_process_sets`; the stored "
    "copy found that has them is the fork "
    "`intel/intel-optimization-for-horovod` at `1084fef052956c9e11d19cce5cf3741cd913e103` "
    "(213,474 characters, Horovod 0.28 plus XPU branches that are dead on CPU). Its tests that "
    "build `hvd.DistributedOptimizer` (the 15 below, and `test_broadcast_state_gpu`, which is "
    "always skipped) were copied verbatim; the imports, the class header, a "
    "`is_xpu_available()` returning False and `test/utils/common.py` "
    "(`mpi_env_rank_and_size`, `skip_or_fail_gpu_test`, `temppath`) are stand-ins written here. "
    "`test_delta_optimizer` and `test_model_parallelism` skip without a GPU.\n\n"
    "PyTorch's `torch.optim.Muon` (newer than the tests) takes only 2-D parameters, so "
    "`test_broadcast_state`, `test_broadcast_state_options` and `test_force_allreduce`, which loop "
    "over every `torch.optim.Optimizer` subclass, failed on Horovod's own optimizer (10 passed, 3 "
    "failed, 2 skipped); `tests/horovod_suite/horovod_inject.py` now hides it from that loop in every job, "
    "the baseline included.\n\n"
    "Every compressor passes all 13 tests that run on a CPU on both paths, as Horovod's own "
    "optimizer does; none fails on a value a lossy compressor changes (these tests check state, "
    "names, options and hooks, not aggregates). The wrapper path first hung in "
    "`test_broadcast_state`: rank 1, whose optimizer had no state, ran our synchronising `step()` "
    "inside `hvd.broadcast_optimizer_state` while rank 0 waited in the broadcast, because our "
    "class took its module name from `hvd.DistributedOptimizer`, which the harness replaces, and "
    "Horovod runs the plain torch `step()` only for an optimizer of `horovod.torch.optimizer`. "
    "The class is now named from that module itself (`integration/horovod/optimizer.py`; "
    "`tests/unit/test_elastic_state.py`), and the wrapper jobs were rerun.\n"
)


def table(results: Dict[str, Any], names: Sequence[str]) -> str:
    """One row per test, one column per job, each cell its outcome."""
    jobs = sorted(results)
    lines = ["| test | " + " | ".join(jobs) + " |", "|---|" + "---|" * len(jobs)]
    for name in names:
        lines.append(f"| `{name}` | " + " | ".join(results[job]["outcomes"].get(name, "-") for job in jobs) + " |")
    return "\n".join(lines)


def render(out: Path) -> None:
    """Writes the page from ``out``/benchmarks/horovod_suite.json: the tests are those its jobs ran."""
    results = json.loads((out / "benchmarks" / "horovod_suite.json").read_text())
    names = sorted({name for job in results.values() for name in job["outcomes"]})
    explained = "\n".join(f"* `{test}` with {method}: {why}" for (test, method), why in sorted(EXPLAINED.items()))
    body = (
        f"Horovod {suite.VERSION}'s `test/parallel/test_torch.py`, the {len(names)} tests that build "
        f"`hvd.DistributedOptimizer`, under `mpirun -np 2`, with each compressor injected on the "
        f"stock path (`compression=`) and the wrapper path (`hvd_compress.DistributedOptimizer`); "
        f"\"horovod\" is Horovod's own optimizer. `python -m benchmarks horovod_suite`.\n\n"
        f"{NOTES}\n{table(results, names)}\n\n{explained}\n"
    )
    write_section(out, SECTION, body)


def main() -> None:
    """Runs the jobs missing from the record, then writes the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", help="Horovod's test/ folder at v0.28.1")
    methods = ["horovod", *sorted(hc.COMPRESSORS)]
    parser.add_argument("--methods", type=names_from(methods), default=methods)
    parser.add_argument("--paths", type=names_from(suite.PATHS), default=list(suite.PATHS))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mpirun job")
    parser.add_argument("--out", type=Path, default=DOCS, help="docs folder to write into")
    args = parser.parse_args()
    suite.run(args.tests, args.methods, args.paths, args.timeout, args.out / "benchmarks" / "horovod_suite.json")
    render(args.out)

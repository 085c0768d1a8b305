"""Runs Horovod 0.28.1's own optimizer tests (``test/parallel/test_torch.py``) with our
compressors injected (``horovod_inject.py``), on both integration paths, under ``mpirun -np 2``:
each (method, path) is one job; "horovod" is Horovod's optimizer alone, the baseline. A test
passes when it passes on every rank. ``python -m benchmarks horovod_suite`` calls ``run`` and
writes the page.

Horovod's ``test/`` folder at v0.28.1 (the sdist on PyPI has none) is the one given, else the one
cached in ``~/.cache/hvd_compress/horovod-0.28.1-tests``, fetched from GitHub's v0.28.1 archive
if absent. The tests run are those of the file whose source builds ``hvd.DistributedOptimizer``.
"""

import ast
import io
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.harness.jobs import LOCAL_MPIRUN, checkout_pythonpath, say
from benchmarks.testbed import run_bounded

VERSION = "0.28.1"
ARCHIVE = f"https://github.com/horovod/horovod/archive/refs/tags/v{VERSION}.tar.gz"
CACHE = Path(os.environ.get("HVD_COMPRESS_CACHE", Path.home() / ".cache" / "hvd_compress")) / f"horovod-{VERSION}-tests"
PATHS = ("stock", "wrapper")


def horovod_tests(folder: Optional[str] = None) -> Path:
    """Horovod's ``test/`` folder: ``folder``, else the cached one, fetched if absent."""
    if folder is not None:
        folder = Path(folder)
    else:
        folder = CACHE / "test"
        if not folder.exists():
            try:
                with urllib.request.urlopen(ARCHIVE, timeout=60) as response:
                    data = response.read()
            except OSError as error:
                raise RuntimeError(
                    f"cannot fetch Horovod {VERSION}'s tests from {ARCHIVE} ({error}); "
                    f"download that archive elsewhere and pass its test/ folder as "
                    f"--tests"
                ) from None
            with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                prefix = f"horovod-{VERSION}/test/"
                members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
                for member in members:
                    member.name = member.name[len(f"horovod-{VERSION}/") :]
                archive.extractall(CACHE, members=members, filter="data")
    if not (folder / "parallel" / "test_torch.py").exists():
        raise RuntimeError(f"--tests: {folder} has no parallel/test_torch.py")
    return folder


def optimizer_tests(test_file: Path) -> List[str]:
    """Names of the tests in ``test_file`` whose source builds ``hvd.DistributedOptimizer``."""
    source = Path(test_file).read_text()
    return sorted(
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and "DistributedOptimizer" in ast.get_source_segment(source, node)
    )


def run_job(
    tests_dir: Path, names: Sequence[str], method: str, path: str, timeout: float
) -> Tuple[Dict[str, str], str]:
    """{test name: "passed" | "failed" | "skipped" | "timed out"} of one mpirun -np 2 job."""
    parallel = tests_dir / "parallel"
    with tempfile.TemporaryDirectory() as out:
        exported = [
            "PYTHONPATH",
            "HOROVOD_DYNAMIC_PROCESS_SETS",
            "OMP_NUM_THREADS",
            *(f"HVD_COMPRESS_SUITE_{n}" for n in ("METHOD", "PATH", "OUT")),
        ]
        argv = [
            *LOCAL_MPIRUN,
            "-np",
            "2",
            *(flag for name in exported for flag in ("-x", name)),
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.horovod_suite.horovod_inject",
            "-p",
            "no:cacheprovider",
            "test_torch.py",
            "-k",
            " or ".join(names),
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            HOROVOD_DYNAMIC_PROCESS_SETS="1",
            HVD_COMPRESS_SUITE_METHOD=method,
            HVD_COMPRESS_SUITE_PATH=path,
            HVD_COMPRESS_SUITE_OUT=out,
            PYTHONPATH=os.pathsep.join([checkout_pythonpath(), str(tests_dir), str(tests_dir / "utils")]),
        )
        cwd = os.getcwd()
        os.chdir(parallel)
        try:
            returncode, stdout, stderr = run_bounded(argv, timeout, env)
        finally:
            os.chdir(cwd)
        per_rank = [json.loads(f.read_text()) for f in sorted(Path(out).glob("outcomes.*.json"))]
    outcomes = {}
    for name in names:
        seen = [next((o for node, o in rank.items() if node.endswith(f"::{name}")), None) for rank in per_rank]
        if returncode is None or len(per_rank) < 2 or None in seen:
            outcomes[name] = "timed out" if returncode is None else "did not run"
        elif "failed" in seen:
            outcomes[name] = "failed"
        else:
            outcomes[name] = "skipped" if "skipped" in seen else "passed"
    tail = (stdout + stderr)[-3000:]
    return outcomes, tail


def run(
    folder: Optional[str], methods: Sequence[str], paths: Sequence[str], timeout: float, record: Path
) -> Dict[str, dict]:
    """Runs each method on each of ``paths`` ("horovod" on the stock path alone) over Horovod's
    tests in ``folder`` (see ``horovod_tests``) and returns the record at ``record``: {job:
    {"outcomes": {test: outcome}, "output_tail": text}}, saved after each job; jobs already in
    it are not run again."""
    tests_dir = horovod_tests(folder)
    names = optimizer_tests(tests_dir / "parallel" / "test_torch.py")
    results = json.loads(record.read_text()) if record.exists() else {}
    for method in methods:
        for path in paths if method != "horovod" else ["stock"]:
            job = "horovod" if method == "horovod" else f"{method} {path}"
            if job in results:
                continue
            outcomes, tail = run_job(tests_dir, names, method, path, timeout)
            results[job] = {"outcomes": outcomes, "output_tail": tail}
            say(f"{job} { ({o: list(outcomes.values()).count(o) for o in set(outcomes.values())}) }")
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(results, indent=1, sort_keys=True))
    return results

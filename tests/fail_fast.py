"""Fail fast in a launched rank: a rank whose test fails would leave the others waiting in a
collective, so it takes the whole job down at once. Shared by the conftest of the Horovod ranks
(tests/multirank/conftest.py) and of the torchrun ranks (tests/torchrun_rank.py)."""

import os
import sys
from typing import Callable, Optional

import pytest


def fail_fast(rank: Callable[[], int], abort: Optional[Callable[[], None]] = None) -> Callable:
    """A ``pytest_runtest_makereport`` hook for a conftest: a failed test is written to stderr
    under ``rank()``, then ``abort()`` runs (MPI's Abort under mpirun) and the process exits."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        if report.failed:
            sys.stderr.write(f"\n[rank {rank()}] {item.nodeid} failed:\n{report.longreprtext}\n")
            sys.stderr.flush()
            if abort is not None:
                abort()
            os._exit(1)

    return pytest_runtest_makereport

"""Runs inside each rank of a ``horovodrun``/``mpirun`` launch (see tests/test_multirank.py).

Fail fast: a rank whose test fails would leave the others waiting in a collective, so it
takes the whole job down at once (MPI Abort under mpirun, process exit under Gloo)."""
import os
import sys

import horovod.torch as hvd
import pytest
import torch

UNDER_MPI = "OMPI_COMM_WORLD_RANK" in os.environ

if UNDER_MPI:
    from mpi4py import MPI  # initialises MPI before Horovod, which then shares the world
    hvd.init(comm=MPI.COMM_WORLD)
else:
    hvd.init()
torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        sys.stderr.write(f"\n[rank {hvd.rank()}] {item.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        if UNDER_MPI:
            MPI.COMM_WORLD.Abort(1)
        os._exit(1)

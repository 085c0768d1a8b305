"""Runs inside each rank of a ``horovodrun``/``mpirun`` launch (see tests/test_multirank.py).

Fail fast: a rank whose test fails would leave the others waiting in a collective, so it
takes the whole job down at once (MPI Abort under mpirun, process exit under Gloo)."""

import os

import horovod.torch as hvd
import torch

from fail_fast import fail_fast

UNDER_MPI = "OMPI_COMM_WORLD_RANK" in os.environ

if UNDER_MPI:
    from mpi4py import MPI  # initialises MPI before Horovod, which then shares the world

    hvd.init(comm=MPI.COMM_WORLD)
else:
    hvd.init()
torch.set_num_threads(1)

pytest_runtest_makereport = fail_fast(hvd.rank, (lambda: MPI.COMM_WORLD.Abort(1)) if UNDER_MPI else None)

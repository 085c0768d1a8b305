"""What every rank of a ``torchrun`` launch of pytest shares (tests/ddp and tests/fsdp import it
from their conftest.py): a Gloo process group, no Horovod initialised, one torch thread.

Fail fast: a rank whose test fails would leave the others waiting in a collective, so it exits
at once; torchrun then stops the other ranks and the launch fails."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        sys.stderr.write(f"\n[rank {dist.get_rank()}] {item.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        os._exit(1)


def pytest_sessionfinish(session, exitstatus):
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

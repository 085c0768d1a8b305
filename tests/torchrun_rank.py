"""What every rank of a ``torchrun`` launch of pytest shares (tests/ddp and tests/fsdp import it
from their conftest.py): a Gloo process group, no Horovod initialised, one torch thread.

Fail fast: a rank whose test fails would leave the others waiting in a collective, so it exits
at once; torchrun then stops the other ranks and the launch fails."""

import torch
import torch.distributed as dist

import hvd_compress  # noqa: F401  (before init_process_group, as users do: integration/binding.py says why)
from fail_fast import fail_fast

dist.init_process_group("gloo")
torch.set_num_threads(1)

pytest_runtest_makereport = fail_fast(dist.get_rank)


def pytest_sessionfinish(session, exitstatus):
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

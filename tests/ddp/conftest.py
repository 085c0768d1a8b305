"""Runs inside each rank of a ``torchrun`` launch (see tests/test_ddp.py): PyTorch DDP on Gloo
(tests/torchrun_rank.py: the process group and the fail-fast hooks)."""

from torchrun_rank import pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401 (pytest hooks)

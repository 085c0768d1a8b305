"""Runs inside each rank of a ``torchrun`` launch (see tests/test_fsdp.py): FSDP2, HSDP over a
2 x 2 mesh, on Gloo (tests/torchrun_rank.py: the process group and the fail-fast hooks)."""

from torchrun_rank import pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401 (pytest hooks)

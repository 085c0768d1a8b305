"""The FSDP2 / HSDP tier: each file in tests/fsdp runs as one ``torchrun`` job of 4 ranks, a
2 x 2 ("replicate", "shard") mesh on Gloo (no Horovod initialised), under a hard timeout that
kills every rank (``test_ddp.run_torchrun``). Full tier only (``slow``)."""

import shutil
from pathlib import Path

import pytest

from test_ddp import run_torchrun

HERE = Path(__file__).parent / "fsdp"
# Seconds per launch: test_fsdp_hsdp.py took 76 s (35 tests) at load average 23 and 129 s (38
# tests) at load 35-42 on this 2-core machine, 10-20 s of it importing torch and the package in
# every rank.
TIMEOUTS = {"test_fsdp_hsdp.py": 400, "test_fsdp_quantized.py": 180}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun (comes with torch)")
@pytest.mark.parametrize("test_file", [pytest.param(f, id=f"torchrun-4-{f}") for f in sorted(TIMEOUTS)])
def test_launch(test_file):
    run_torchrun(4, test_file, HERE, TIMEOUTS[test_file])


def test_every_fsdp_file_is_launched():
    """A file missing from TIMEOUTS would never run: none may be."""
    assert sorted(path.name for path in HERE.glob("test_*.py")) == sorted(TIMEOUTS)

"""One launch of a multi-process tier (torchrun, horovodrun, mpirun running pytest in every
rank), shared by tests/test_ddp.py, tests/test_fsdp.py (through test_ddp) and
tests/test_multirank.py: a hard timeout after which every process of the launch is killed, so
no rank can hang the suite."""

import os
import signal
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest


def run_launch(
    command: List[str],
    cwd: Path,
    timeout: float,
    title: str,
    summary_words: Sequence[str],
    environment: Optional[Dict[str, str]] = None,
) -> None:
    """Runs ``command`` in ``cwd`` (one torch thread a rank, unbuffered output, and
    ``environment``) and fails the calling test if it fails or outlives ``timeout`` seconds;
    prints, under ``title``, the output lines holding any of ``summary_words``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(environment or {}))
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(process.pid)
        output, _ = process.communicate()
        pytest.fail(f"{title} timed out after {timeout} s:\n{output[-6000:]}")
    summary = [line for line in output.splitlines() if any(word in line for word in summary_words)]
    print(f"\n{title}:\n" + "\n".join(summary))
    assert process.returncode == 0, output[-8000:]


def kill_launch(pid: int) -> None:
    """Kills the launcher ``pid`` and every process below it: by id first, since a launcher can
    start ranks in sessions of their own (torchrun does), then the launcher's process group."""
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(pid, signal.SIGKILL)


def descendants(pid: int) -> List[int]:
    """Every process below ``pid``, from /proc (ranks outlive a killed torchrun otherwise, and
    keep its output pipe open)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found

"""The machine a benchmark ran on, and CPU accounting that tells whether a measurement had the
cores to itself."""

import datetime
import os
import platform
import resource
import subprocess
import time
from pathlib import Path

import torch


def machine():
    """CPU, cores, memory, kernel and the versions that set the numbers."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    memory_kib = int(
        next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    )
    described = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(),
    }
    try:
        import horovod

        described["horovod"] = horovod.__version__
        described["mpi"] = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()[0]
    except (ImportError, OSError, IndexError, subprocess.TimeoutExpired):
        pass
    return described


def describe_machine(m):
    """One line for a markdown section."""
    versions = f"Python {m['python']}, torch {m['torch']}"
    if "horovod" in m:
        versions += f", Horovod {m['horovod']}, {m.get('mpi', 'no mpirun')}"
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}; {versions}; {m['date']}."


def gpu_description() -> str:
    """The first CUDA device, as the GPU benchmarks' machine lines name it."""
    import torch

    gpu = torch.cuda.get_device_properties(0)
    return f"{gpu.name}, {gpu.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"


def busy_cpu_seconds():
    """Busy CPU seconds of all cores since boot (/proc/stat), interrupts left out: most of
    them are the testbed's own network traffic, charged to no process."""
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process and its finished descendants (mpirun and, through it, the
    ranks). Busy time beyond it went to other processes, or was stolen by the hypervisor."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OthersShare:
    """The share of the machine's CPU capacity that other processes used between its
    creation and :meth:`share`."""

    def __init__(self):
        self.started, self.busy, self.own = time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()

    def seconds(self):
        return max(0.0, busy_cpu_seconds() - self.busy - (own_cpu_seconds() - self.own))

    def share(self):
        return self.seconds() / ((time.perf_counter() - self.started) * os.cpu_count())

"""Step-time statistics: a summary of a list of step times, timing jobs of one method pooled,
one Horovod step timed in its parts, and the codec's own host time per step."""

import statistics
import time
from typing import Any, Dict, List, Optional

from hvd_compress.metrics import Exporter


def summarise(seconds):
    """Median, quartiles and extremes, in ms, of a list of seconds."""
    ms = sorted(1000 * s for s in seconds)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median": statistics.median(ms), "p25": quartiles[0], "p75": quartiles[2], "min": ms[0], "max": ms[-1]}


# Per-job figures a pooled timing entry gives as the median of its jobs' (each job's kept under
# ``<key>_each_job``), those it sums, and those it gives as the largest (the most disturbed job's).
JOB_MEDIANS = ("compute_ms", "codec_ms")


JOB_SUMS = ("wall_seconds", "disturbed_attempts")


JOB_MAXIMA = ("load_average", "other_cpu_share")


def jobs_of(entry: Optional[Dict[str, Any]]) -> int:
    """Timing jobs an entry holds (failed ones included); an entry from before ``--repeats`` is one."""
    return 0 if entry is None else entry.get("jobs", 1)


def pooled(entry: Optional[Dict[str, Any]], new: Dict[str, Any]) -> Dict[str, Any]:
    """``entry`` (None, or earlier timing jobs of one method: ``step_ms_each`` and its summary
    ``step_ms``) with one more job's: steps pooled, each job's median kept, ``JOB_MEDIANS`` as the
    median of the jobs', ``JOB_SUMS`` summed, ``JOB_MAXIMA`` the largest. A failed job counts, and
    keeps its failure."""
    if entry is None or "failed" in entry and "failed" in new:
        return dict(new, jobs=jobs_of(entry) + 1)
    if "failed" in new or "failed" in entry:
        kept, failed = (entry, new) if "failed" in new else (new, entry)
        return dict(kept, jobs=jobs_of(entry) + 1, failed_jobs=kept.get("failed_jobs", 0) + 1, failure=failed["failed"])
    each = entry["step_ms_each"] + new["step_ms_each"]
    merged = dict(
        entry,
        step_ms=summarise([ms / 1e3 for ms in each]),
        step_ms_each=each,
        job_medians_ms=entry.get("job_medians_ms", [entry["step_ms"]["median"]]) + [new["step_ms"]["median"]],
        jobs=jobs_of(entry) + 1,
    )
    for key in (k for k in JOB_MEDIANS if k in new):
        values = entry.get(f"{key}_each_job", [entry[key]] if key in entry else []) + [new[key]]
        merged.update({key: statistics.median(values), f"{key}_each_job": values})
    for key in (k for k in JOB_SUMS if k in new):
        merged[key] = entry.get(key, 0) + new[key]
    for key in (k for k in JOB_MAXIMA if new.get(k) is not None):
        merged[key] = max(new[key], entry.get(key) if entry.get(key) is not None else new[key])
    return merged


class CodecClock(Exporter):
    """Rank 0's host seconds in this project's codec (compress and decompress, every layer),
    per step: what of a step over compute is codec rather than waiting. It watches
    ``compression`` (a compressor or controller; None: nothing to time, ``seconds`` stays empty)
    from construction; a step's entry is written at its ``end_step``."""

    def __init__(self, compression=None):
        super().__init__(every=1)
        self.seconds = []
        if compression is not None:
            self.watch(compression)

    def write(self, step, numbers):
        self.seconds.append(numbers["codec_seconds"])

    def write_decision(self, step, record):
        """A controller's decisions are not codec time."""


def timed_step(optimizer, forward_backward):
    """One step of a Horovod distributed optimizer, timed: seconds of the whole step, of
    ``forward_backward()`` (zero_grad, forward, backward: the hooks compress and submit
    gradients during it) and of ``synchronize`` (what is left of communication, then the
    decompression)."""
    started = time.perf_counter()
    forward_backward()
    backward_done = time.perf_counter()
    optimizer.synchronize()
    synchronized = time.perf_counter()
    with optimizer.skip_synchronize():
        optimizer.step()
    return {
        "step": time.perf_counter() - started,
        "backward": backward_done - started,
        "synchronize": synchronized - backward_done,
    }


def timed_steps(module: Any, optimizer: Any, data: Any, loss_of: Any, steps: int) -> List[float]:
    """Seconds of each of ``steps`` training steps of ``module``, ``zero_grad`` to ``step``."""
    seconds = []
    for _ in range(steps):
        x, y = next(data)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_of(module, x, y).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return seconds

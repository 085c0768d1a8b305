"""Wall-clock readings that mean the same on a GPU as on a CPU."""

import time
from typing import Optional

import torch


def finished_at(device: Optional[torch.device], settle: bool) -> float:
    """``time.perf_counter()``, read after the work queued on ``device`` has finished when
    ``settle`` is set and ``device`` is a GPU: a duration ending here then measures the work,
    not its launch. That waits for the device, so integrations settle only for a compressor
    whose ``times_communication`` is set, once per step."""
    if settle and device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

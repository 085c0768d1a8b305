"""Moving small host values to a gradient's device without waiting for it.

A plain ``torch.tensor(values, device="cuda")``, or indexing a CUDA tensor with a Python list,
copies from pageable memory and then waits for the stream: a host synchronisation. Through
pinned memory the copy is queued like any kernel."""

from typing import Sequence

import torch


def on_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, copied there without a synchronisation."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)

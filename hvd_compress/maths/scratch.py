"""Buffers kept between calls, for work that would otherwise allocate a gradient-sized
temporary at every call."""

import threading

import torch

_buffers = threading.local()


def scratch(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of ``size`` entries whose contents are whatever the last user left; the caller
    must not keep it past its call. On a CPU it is kept per thread, dtype and device and grown as
    needed: a fresh one per call is new pages at every call once it passes the allocator's mmap
    limit (32 MiB in glibc; lower until large blocks have been freed, and heap memory is given
    back when over twice that is free), and their first-touch faults cost more than writing
    them. Elsewhere it is a new tensor: a GPU's caching allocator recycles freed blocks as they
    are, and a buffer kept for the largest layer would hold that memory for good."""
    if torch.device(device).type != "cpu":
        return torch.empty(size, dtype=dtype, device=device)
    buffers = _buffers.__dict__.setdefault("by_kind", {})
    buffer = buffers.get((dtype, device))
    if buffer is None or buffer.numel() < size:
        buffer = buffers[(dtype, device)] = torch.empty(size, dtype=dtype, device=device)
    return buffer[:size]

"""Whether a tensor holds only finite values, without a host synchronisation."""
from typing import Dict, List

import torch


def extremes(tensor: torch.Tensor) -> List[torch.Tensor]:
    """[min, max] of a non-empty floating-point tensor as 0-dim tensors, else []: all a finiteness
    check needs (NaN propagates through them, and an infinity is one of them)."""
    if tensor.numel() == 0 or not tensor.dtype.is_floating_point:
        return []
    return list(torch.aminmax(tensor))


def all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``tensor``'s device: True iff no entry is NaN or infinite. From the
    extremes (one pass), not ``torch.isfinite(tensor).all()``, which builds a mask as large as
    the tensor and reads it again."""
    found = extremes(tensor)
    if not found:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = found
    return torch.isfinite(low) & torch.isfinite(high)


def stacked(scalars: List[torch.Tensor]) -> torch.Tensor:
    """0-dim tensors (of one device) as one float64 vector: stacked per dtype, then cast, so a
    step's hundreds of extremes cost a cast per dtype, not one each."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for scalar in scalars:
        by_dtype.setdefault(scalar.dtype, []).append(scalar)
    return torch.cat([torch.stack(group).double() for group in by_dtype.values()])


def nonfinite_marker(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 tensor on ``tensor``'s device: 0 if every entry of the (non-empty,
    floating-point) ``tensor`` is finite, else NaN (what a sum or mean over ranks keeps)."""
    low, high = extremes(tensor)
    return low.float() * 0 + high.float() * 0

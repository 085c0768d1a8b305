"""Whether a tensor holds only finite values, without a host synchronisation."""

from typing import Dict, List, Tuple

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


def largest_magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of a non-empty floating-point tensor, as a 0-dim float32 tensor on its
    device: NaN where ``tensor`` holds one, infinite where it holds an infinity (one pass)."""
    return torch.linalg.vector_norm(tensor, float("inf"), dtype=torch.float32)


def verdict(extremes: List[torch.Tensor], bounds: List[Tuple[torch.Tensor, float]]) -> bool:
    """True iff every 0-dim tensor of ``extremes`` is finite and, for every (magnitude, growth)
    of ``bounds``, ``growth`` times ``magnitude`` is within float32's range (NaN is not): one
    host synchronisation for both."""
    checks = [all_finite(stacked(extremes))] if extremes else []
    by_growth: Dict[float, List[torch.Tensor]] = {}  # a few growths: no host value sent per layer
    for magnitude, growth in bounds:
        by_growth.setdefault(growth, []).append(magnitude)
    for growth, magnitudes in by_growth.items():
        checks.append((stacked(magnitudes) <= torch.finfo(torch.float32).max / growth).all())
    return not checks or bool(torch.stack(checks).all())


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

"""The non-finite rule of a compressor's step (``compressors.base``'s module docstring): what a
step changes in the per-parameter state is remembered, the aggregated gradients it returns are
checked, and at the step's end the changes are kept if every one was finite, or put back.

Aggregated gradients are identical on every rank, and a non-finite entry on any rank reaches
them, so every rank reaches the same verdict without communicating."""

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch

from hvd_compress.maths.finite import extremes, largest_magnitude, verdict

# What a result bound (``StepGuard.bound_by``) is multiplied by, for the rounding of the products
# and sums it bounds; and the result dtypes that hold every float32 up to half float32's largest.
BOUND_MARGIN = 2.0
WIDE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


class StepGuard:
    """One step's watch over a compressor: the state as it was before the step (``remember``),
    the aggregated gradients' extremes (``watch``) or the bounds they were made within
    (``bound_by``), and a rejection from outside (``reject``); ``finish`` gives the verdict and
    puts the state back where the step was not finite."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._undo: Dict[str, Any] = {}
        self._extremes: List[torch.Tensor] = []  # this step's aggregated gradients' min and max
        # Results checked through what they were made from: (tensor, growth) by name until the
        # result is seen, then this step's (largest magnitude, growth, result).
        self._bounds_by_name: Dict[Optional[str], Tuple[torch.Tensor, float]] = {}
        self._bounds: List[Tuple[torch.Tensor, float, torch.Tensor]] = []
        self._rejected = False

    def remember(self, name: str, state: Dict[str, Any]) -> None:
        """Keeps ``state[name]`` as it was before this step (once per step: called first thing
        for every gradient)."""
        if name not in self._undo:
            self._undo[name] = copy.copy(state.get(name))

    def reject(self) -> None:
        """Drops this step whatever its gradients (HSDP's replicas found one non-finite)."""
        self._rejected = True

    def watch(self, name: Optional[str], gradient: torch.Tensor) -> None:
        """Keeps ``gradient``'s extremes for the verdict: one pass over it, or none where its
        continuation said what bounds it (``bound_by``)."""
        bound = self._bounds_by_name.pop(name, None)
        if bound is not None and gradient.dtype in WIDE_DTYPES:
            aggregate, growth = bound
            self._bounds.append((largest_magnitude(aggregate), BOUND_MARGIN * growth, gradient))
        else:
            self._extremes.extend(extremes(gradient))

    def bound_by(self, name: Optional[str], aggregate: torch.Tensor, growth: float) -> None:
        """Said by a final continuation whose result's entries are at most ``growth`` times the
        largest magnitude of ``aggregate`` (a factor, or the gathered values or norms: identical on
        every rank, and non-finite wherever the result's input was, as ``payload_carries_input``
        says): the verdict then reads ``aggregate``, not the result, a pass over the gradient's
        memory saved, and fails where ``growth`` times it (doubled, for rounding) could overflow
        float32. Only then, a worst case rarely reached, are the step's results read themselves,
        and they decide. A float16 result is always read itself: its cast can overflow where the
        float32 value did not."""
        self._bounds_by_name[name] = (aggregate, growth)

    def finish(self, state: Dict[str, Any]) -> bool:
        """Whether the step was kept (one host synchronisation): if not, ``state`` is put back in
        place as it was before the step. Ready for the next step either way."""
        found, bounds, rejected, undo = self._extremes, self._bounds, self._rejected, self._undo
        self._reset()
        finite = not rejected and _all_finite(found, bounds)
        if not finite:
            for name, before in undo.items():
                if before is None:
                    state.pop(name, None)
                else:
                    state[name] = before
        return finite


def _all_finite(found, bounds):
    """Whether a step's results were finite, from the ``extremes`` ``found`` of those read and the
    ``bounds`` (largest magnitude, growth, result) of those checked through what they were made
    from; where a bound fails, from those results read."""
    if verdict(found, [(magnitude, growth) for magnitude, growth, _ in bounds]):
        return True
    return bool(bounds) and verdict(found + [e for _, _, result in bounds for e in extremes(result)], [])

"""``torch.amp.GradScaler``'s protocol for optimizers that decide the skip themselves.

An optimizer class with ``_step_supports_amp_scaling = True`` gets ``step()`` called by
``GradScaler.step`` whatever GradScaler found, with two attributes set for that call only:
``found_inf`` (a tensor, non-zero where this rank's checked gradients had an Inf or NaN) and
``grad_scale`` (the scale still to divide by, or None after ``scaler.unscale_``); GradScaler
deletes both after ``step()`` returns. DiLoCo uses it so that a skipped inner step still counts
in the period; the wrapper, so that the skip is decided on exchanged gradients.
"""

from typing import Any, Iterable, Optional, Tuple

import torch


def scaler_call(optimizer: Any) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(``found_inf``, ``grad_scale``) that GradScaler set on ``optimizer`` for this ``step()``
    call, (None, None) outside one. Both are set to None on ``optimizer``: an exception raised in
    ``step()`` (GradScaler then deletes nothing) leaves none for the next plain call."""
    found_inf, grad_scale = getattr(optimizer, "found_inf", None), getattr(optimizer, "grad_scale", None)
    optimizer.found_inf = optimizer.grad_scale = None
    return found_inf, grad_scale


def unscale(parameters: Iterable[torch.Tensor], grad_scale: Optional[torch.Tensor]) -> None:
    """Divides each parameter's gradient by ``grad_scale`` (a 0-dim tensor; None: already
    unscaled), multiplying by its float32 reciprocal as ``GradScaler.unscale_`` does, so that
    the step sees the values GradScaler's own path would give."""
    if grad_scale is None:
        return
    inverse = grad_scale.double().reciprocal().float()
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(inverse.to(p.grad.device))

"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019): the one component that owns
residuals, what compression left out of each parameter's gradient, to be added to its next one.

Every compressor with error feedback keeps its residuals here and only here, so that controllers
(``residual``, ``clear``) and checkpoints see one format, and so that the handling of
non-finite steps and loss scales lives in one place.
"""
from typing import Dict, Optional

import torch


class ErrorFeedback:
    """Residuals by parameter name, in float32 on the gradient's device.

    A compressor asks for ``compensated(name, grad)``, the gradient plus the residual, and
    leaves its new residual behind: either in place in the tensor it was given (the common,
    allocation-free case) or by handing a new tensor to ``keep``. With ``enabled=False`` the
    gradient comes back as a float32 copy and nothing is remembered.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._residuals: Dict[str, torch.Tensor] = {}

    def compensated(self, name: str, grad: torch.Tensor, *, in_place: bool = True) -> torch.Tensor:
        """``grad + residual`` as float32, shaped like ``grad``, which the caller may overwrite.

        ``in_place``: built in the residual's own buffer, so what the caller leaves there is the
        next residual (no gradient-sized allocation per step). Otherwise a new tensor, and the
        residual stays as it was until ``keep``."""
        if not self.enabled:
            return grad.to(torch.float32, copy=True)
        residual = self._residuals.get(name)
        if residual is None:
            residual = self._residuals[name] = torch.zeros(grad.shape, device=grad.device)
        return residual.add_(grad) if in_place else residual + grad

    def keep(self, name: str, residual: torch.Tensor) -> None:
        """Makes ``residual`` (float32, the shape ``compensated`` returned) the next residual."""
        if self.enabled:
            self._residuals[name] = residual

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """The residual waiting to be added to ``name``'s next gradient, or None."""
        return self._residuals.get(name)

    def clear(self, name: str) -> None:
        """Forgets ``name``'s residual: its gradient was sent whole."""
        residual = self._residuals.get(name)
        if residual is not None:
            residual.zero_()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        # Copies: residuals are updated in place, and a checkpoint must not change afterwards.
        return {name: residual.clone() for name, residual in self._residuals.items()}

    def load_state_dict(self, residuals: Dict[str, torch.Tensor]) -> None:
        self._residuals = {name: residual.clone() for name, residual in residuals.items()}

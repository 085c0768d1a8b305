"""Where a compressor's exchange puts its results: in each gradient's own memory, where the
integration said so (``GradientCompression.write_results_into_gradients``), else in new tensors."""

from typing import Optional

import torch


class ResultMemory:
    """``into_gradients``: whether a result may be made in its gradient's memory, which its
    exchange has finished reading by then."""

    def __init__(self) -> None:
        self.into_gradients = False

    def memory(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """``grad``'s memory, flat, for its exchange's result where ``into_gradients`` and it
        holds float32 contiguously; else None (the result is a new tensor)."""
        if self.into_gradients and grad.dtype == torch.float32 and grad.is_contiguous():
            return grad.view(-1)
        return None

    def typed(self, grad: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` (``grad``'s entries in any float dtype) as ``grad``'s result: cast into
        ``memory`` where there is one, else a new tensor of ``grad``'s dtype and shape."""
        into = self.memory(grad)
        if into is None:
            return value.reshape(grad.shape).to(grad.dtype)
        return into.copy_(value.reshape(-1)).view(grad.shape)

    def zeroed(self, grad: torch.Tensor) -> torch.Tensor:
        """A flat float32 zero result for ``grad``'s exchange to scatter into: ``memory`` zeroed
        where there is one, else a new tensor."""
        into = self.memory(grad)
        return torch.zeros(grad.numel(), device=grad.device) if into is None else into.zero_()

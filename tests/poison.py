"""A gradient hook that puts one Inf entry into a gradient on demand: the non-finite step of
the skip-a-bad-step tests, shared by the Horovod (tests/multirank) and DDP (tests/ddp) tiers."""

import torch


class OneInf:
    """Register on a parameter (``weight.register_hook(hook)``); while ``armed``, the gradient
    passes on with its first entry Inf (a copy: autograd's own tensor stays as it was)."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

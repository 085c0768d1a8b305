"""A float16 mean whose sum overflows: rank 0's gradient 30000, the last rank's 50000, the
others evenly between (multiples of 32, which float16 holds there). Their float16 sum is Inf,
their mean (40000 on two ranks) is what torch's ``fp16_compress_hook`` gives, dividing by W
before its float16 all-reduce. Shared by the DDP, FSDP, Horovod and DiLoCo tiers."""

import torch
from torch import nn


def value(rank: int, size: int) -> float:
    """Rank ``rank``'s gradient entries in a world of ``size``."""
    return 30000.0 + round(20000.0 * rank / (size - 1) / 32) * 32


def mean(size: int) -> float:
    return sum(value(rank, size) for rank in range(size)) / size


class Scaled(nn.Module):
    """One (8, 4) parameter whose gradient is the input itself: each rank picks its own."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8, 4, dtype=dtype))

    def forward(self, x):
        return (self.w * x).sum()

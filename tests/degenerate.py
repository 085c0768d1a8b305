"""Gradients of degenerate shapes, which every compressor, controller and integration must carry
(uncompressed where they cannot be compressed): the unit tier's gradients and a small model
holding a parameter of each kind, shared by the DDP and Horovod tiers."""

import torch
from torch import nn

# name -> a gradient of that kind, from a generator.
GRADIENTS = {
    "empty": lambda g: torch.zeros(0, 4),  # nn.Linear(4, 0)'s weight
    "empty_1d": lambda g: torch.zeros(0),
    "scalar": lambda g: torch.randn((), generator=g),
    "row": lambda g: torch.randn(1, 40, generator=g),
    "column": lambda g: torch.randn(40, 1, generator=g),
    "one_by_one": lambda g: torch.randn(1, 1, generator=g),
    "transposed": lambda g: torch.randn(40, 30, generator=g).t(),
    "channels_last": lambda g: torch.randn(8, 6, 3, 3, generator=g).contiguous(memory_format=torch.channels_last),
}


class Degenerate(nn.Module):
    """For N x 1 x 8 x 8 inputs (the digits), two classes out. Parameters of every degenerate
    shape: none of their entries (``nn.Linear(8, 0)``), no dimension (a scalar gain), a
    dimension of 1 (``nn.Linear(8, 1)``), channels_last (a convolution converted with
    ``.to(memory_format=...)``) and a transposed, non-contiguous weight; ``strided=False``: the
    last two contiguous (Horovod's own collectives refuse non-contiguous tensors)."""

    def __init__(self, strided=True):
        super().__init__()
        layout = torch.channels_last if strided else torch.contiguous_format
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1).to(memory_format=layout)
        self.body = nn.Linear(64, 8)
        self.empty = nn.Linear(8, 0)
        self.one = nn.Linear(8, 1)
        self.gain = nn.Parameter(torch.tensor(1.0))
        wide = torch.randn(10, 8).t()  # (8, 10), strides (1, 8)
        self.wide = nn.Parameter(wide if strided else wide.contiguous())

    def forward(self, x):
        h = torch.relu(self.stem(x[:, :, :4, :4])).contiguous(memory_format=torch.channels_last)
        h = torch.relu(self.body(torch.relu(self.conv(h)).flatten(1)))
        return self.gain * (h @ self.wide)[:, :2] + self.one(h) + self.empty(h).sum()

"""Sign bits: one bit per entry, packed 8 per byte, and the majority vote over ranks.

The convention: bit 1 means ``x >= 0`` (+1, so sign(0) = +1 and one bit is enough), bit 0 means
``x < 0`` (-1); NaN gets bit 0. Packing is QSGD's (``packing.pack_codes``) at one bit: with
one bit there are no magnitude levels (s = 0), so a 0/1 code is stored as it is, 8 per byte,
least significant first, in 64-bit words (the count rounded up to a multiple of 64 bits).
"""

import torch

from hvd_compress.maths import packing

# Magnitudes summed in float32 before the sums go to float64 (``mean_magnitude``).
_BLOCK = 1 << 12


def nonnegative(x: torch.Tensor) -> torch.Tensor:
    """The sign bits of ``x`` as bool: True (+1) where ``x >= 0``, False (-1) elsewhere."""
    return torch.ge(x, 0)


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Packs the bool (or 0/1 uint8) ``bits``: ``packed_size(bits.numel())`` uint8 bytes."""
    return packing.pack_codes(bits.reshape(-1).view(torch.uint8), 1)


def unpack_signs(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of ``pack_signs``'s output, as 0/1 uint8."""
    return packing.unpack_codes(packed, 1, count).view(torch.uint8)


def packed_size(count: int) -> int:
    """Bytes that ``count`` sign bits occupy once packed: a multiple of 8."""
    return packing.packed_size(count, 1)


def scaled_signs(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * sign`` per entry, as float32: +scale where the bit is set, -scale elsewhere
    (exactly: 2 * scale - scale and 0 - scale); ``scale`` a 0-d float32 tensor, so nothing
    waits for the device. (Faster than ``torch.where`` on CPU.)"""
    return bits.to(torch.float32).mul_(2 * scale).sub_(scale)


def majority_vote(rows, count: int) -> torch.Tensor:
    """sign(sum over rows of each row's +-1 signs) per entry, as float32 in {-1, 0, 1}: rows
    are ``pack_signs`` outputs (one per rank), and a tie (an even number of rows) gives 0.
    The vote is exact (integer counts in float32, exact up to 2^24 rows), so any order gives
    the same result."""
    rows = list(rows)
    ones = torch.zeros(count, dtype=torch.float32, device=rows[0].device)
    for row in rows:
        ones.add_(unpack_signs(row, count))
    # The sign of (+1 votes) - (-1 votes) = 2 * ones - W, that is of ones - W / 2.
    return ones.sub_(len(rows) / 2).sign_()


def mean_magnitude(x: torch.Tensor) -> torch.Tensor:
    """||x||_1 / numel of the float32 ``x``, as a 0-d float32 tensor. Blocks of ``_BLOCK``
    magnitudes are summed in float32 and the block sums in float64, so the mean of a finite
    ``x`` is finite unless magnitudes reach float32's max / ``_BLOCK`` (about 8e34), at the cost
    of a float32 sum (summing everything in float64 costs several times more on CPU). An Inf or
    NaN entry makes it non-finite."""
    n = x.numel()
    whole = n - n % _BLOCK
    total = torch.linalg.vector_norm(x[whole:], 1, dtype=torch.float64)
    if whole:
        blocks = torch.linalg.vector_norm(x[:whole].view(-1, _BLOCK), 1, dim=1)
        total = total + blocks.sum(dtype=torch.float64)
    return (total / n).to(torch.float32)

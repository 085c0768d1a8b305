"""Sign and bin-mean codes for the values a chunked top-k keeps (SparseLoCo: Sarfi et al. 2025,
arXiv 2508.15706, section 3, which sends top-k values of each chunk in 2 bits).

Values come as rows (one row per chunk, shape (rows, k)). A row's magnitudes are cut into
L = 2^(bits-1) bins of equal width between the row's smallest and largest magnitude; an entry's
code, in [0, 2^bits), is its bin plus L if it is negative. It decodes to its sign times the mean
magnitude of its row's entries in that bin, so each row sends L float32 means: for a given
binning, the bin means are the decoded magnitudes of least squared error. At 1 bit (L = 1) this
is the scaled sign (the mean magnitude of the row). Deterministic.

A row holding an Inf or NaN has a non-finite mean in the bin that entry falls in, so it decodes
non-finite: a payload is non-finite wherever its input was.
"""

from typing import Tuple

import torch

# Bits whose codes pack whole into bytes (``packing.pack_fields``).
BITS = (1, 2, 4, 8)


def bins_for_bits(bits: int) -> int:
    """L, the magnitude bins of a code of ``bits`` bits (one bit is the sign)."""
    return 1 << (bits - 1)


def encode(values: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, means) of float32 ``values`` (rows, k): uint8 codes (rows, k) in [0, 2^bits) and
    float32 means (rows, L), the mean magnitude of each bin's entries (0 for an empty bin)."""
    bins = bins_for_bits(bits)
    magnitudes = values.abs()
    low = magnitudes.amin(dim=1, keepdim=True)
    width = (magnitudes.amax(dim=1, keepdim=True) - low).div_(bins)
    # A row of equal magnitudes (width 0) is one bin; a non-finite row's entries go to bin 0,
    # whose mean is then non-finite (NaN is neither above 0 nor a bin).
    position = torch.where(width > 0, (magnitudes - low) / width, 0.0)
    index = position.nan_to_num_(nan=0.0).floor_().clamp_(0, bins - 1).to(torch.int64)
    sums = torch.zeros(values.shape[0], bins, device=values.device).scatter_add_(1, index, magnitudes)
    counts = torch.zeros_like(sums).scatter_add_(1, index, torch.ones_like(magnitudes))
    means = sums.div_(counts.clamp_(min=1))
    codes = index.add_(torch.signbit(values).to(torch.int64) * bins).to(torch.uint8)
    return codes, means


def decode(codes: torch.Tensor, means: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 values (rows, k) of uint8 ``codes`` (rows, k) with ``means`` (rows, L)."""
    bins = bins_for_bits(bits)
    wide = codes.to(torch.int64)
    magnitudes = means.gather(1, wide.remainder(bins))
    return torch.where(wide >= bins, -magnitudes, magnitudes)

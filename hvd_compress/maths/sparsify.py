"""Top-k selection."""

import functools
import math

import torch

from hvd_compress.maths.compiled import compilable
from hvd_compress.maths.scratch import scratch

# Below this size, or when k is a large fraction of n, torch.topk is as fast as anything.
_THRESHOLD_MIN_NUMEL = 1 << 15
_THRESHOLD_MAX_DENSITY = 0.05
_MAX_SAMPLE_SIZE = 1 << 14
_SAMPLE_SHIFT = 6  # at most one entry in 64 is sampled
# Standard deviations of sampling error the candidate threshold allows for: it misses (and
# selection retries with a lower one) about once in 30,000 calls.
_MARGIN_SIGMAS = 4.0
# Entries whose flags are built at a time: a 4 MiB float buffer that stays in cache (L3);
# smaller chunks cost more in per-op overhead (measured on the benchmark machine).
_MASK_CHUNK = 1 << 20


def topk_indices(values, k, compiled=False):
    """Indices of the k entries of largest magnitude of a 1-D tensor (order unspecified).
    ``compiled``: the candidates' flags in one compiled pass (``indices_at_least``); the same
    indices.

    For large tensors at low density, a threshold estimated from a fixed random sample keeps
    a candidate set a little larger than k in one pass; an exact top-k over the candidates
    then gives the same answer as a full ``torch.topk`` of the magnitudes (up to ties), much
    faster on a CPU, where the magnitudes are taken a chunk at a time and never written out
    whole. On a GPU it is plain ``torch.topk``: the candidate set's size depends on the data,
    and learning it would wait for the device once per layer."""
    n = values.numel()
    if values.is_cuda or n < _THRESHOLD_MIN_NUMEL or k > _THRESHOLD_MAX_DENSITY * n:
        return torch.topk(values.abs(), k, sorted=False).indices
    sample = values.index_select(0, _sample_positions(n, values.device)).abs_()
    sample_size = sample.numel()
    density = k / n
    # The sample quantile at the target density, widened by the sampling error of the count
    # of sampled entries above the true k-th largest (binomial).
    fraction = density + _MARGIN_SIGMAS * math.sqrt(density * (1 - density) / sample_size)
    while True:
        above = min(sample_size, math.ceil(fraction * sample_size))
        # The smallest of the sample's largest entries (a partial sort, faster than kthvalue).
        threshold = sample.topk(above, sorted=False).values.min()
        if not threshold > 0:  # every entry is a candidate
            return torch.topk(values.abs(), k, sorted=False).indices
        candidates = indices_at_least(values, threshold, compiled)
        if candidates.numel() >= k:
            break
        if above == sample_size:
            return torch.topk(values.abs(), k, sorted=False).indices
        fraction *= 4
    chosen = torch.topk(values.index_select(0, candidates).abs_(), k, sorted=False).indices
    return candidates.index_select(0, chosen)


@compilable
def _flags(values, threshold, mask):
    """``mask`` (bool, like ``values``) = |values| >= ``threshold`` (a 0-d tensor), in one pass."""
    mask.copy_(values.abs() >= threshold)


#: The kernels ``topk_indices`` runs compiled.
COMPILED_KERNELS = (_flags,)


def warm_up(numel, device):
    """Compiles ``topk_indices``' kernels for float32 values of ``numel`` entries on ``device``
    (shapes are dynamic: one size serves all); may raise ``maths.compiled.CompileFailed``."""
    mask = scratch(numel, torch.bool, device)
    _flags.compiled(torch.zeros(numel, device=device), torch.ones((), device=device), mask)


def sampled_kth_largest(magnitudes, k):
    """The fixed sample's estimate of the k-th largest of ``magnitudes`` (1-D, >= 0): its
    quantile at density k / n, as a 0-d tensor."""
    n = magnitudes.numel()
    sample = magnitudes.index_select(0, _sample_positions(n, magnitudes.device))
    above = min(sample.numel(), max(1, math.ceil(k / n * sample.numel())))
    return sample.topk(above, sorted=False).values.min()


@functools.lru_cache(maxsize=256)
def _sample_positions(n, device):
    """Random positions to estimate the threshold from, fixed per size (so selection is
    deterministic) and remembered: drawing them costs as much as using them."""
    generator = torch.Generator().manual_seed(n)
    return torch.randint(n, (min(_MAX_SAMPLE_SIZE, n >> _SAMPLE_SHIFT),), generator=generator).to(device)


def indices_at_least(values, threshold, compiled=False):
    """Ascending indices of the entries of ``values`` whose magnitude is >= ``threshold`` (a
    positive 0-d tensor): ``(values.abs() >= threshold).nonzero()``, several times faster
    when few entries qualify.

    Comparisons write bools slowly in eager torch, so the flags come from ``threshold(|x|,
    below, 0)`` (zero unless |x| > below, the float just under ``threshold``) copied to bool,
    a chunk at a time; ``compiled``, from one compiled pass (``_flags``: the same flags, NaN
    flagged by neither). The flags are then scanned eight at a time as 64-bit words, and only
    words with a flag set are expanded."""
    n = values.numel()
    mask = scratch(8 * -(-n // 8), torch.bool, values.device)
    mask[n:] = False
    if compiled:
        _flags.compiled(values, threshold, mask[:n])
    else:
        below = torch.nextafter(threshold, threshold.new_zeros(())).item()
        kept = scratch(min(n, _MASK_CHUNK), values.dtype, values.device)
        for start in range(0, n, _MASK_CHUNK):
            piece = values[start : start + _MASK_CHUNK]
            count = piece.numel()
            magnitudes = torch.abs(piece, out=kept[:count])
            mask[start : start + count].copy_(torch.threshold(magnitudes, below, 0.0, out=magnitudes))
    as_words = mask.view(torch.int64)
    (hit,) = torch.nonzero(as_words, as_tuple=True)
    (flags,) = torch.nonzero(as_words.index_select(0, hit).view(torch.bool), as_tuple=True)
    # A flag's position among the hit words gives its word (hit[p // 8]) and byte (p % 8).
    return hit.index_select(0, flags >> 3).mul_(8).add_(flags & 7)

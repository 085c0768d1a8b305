"""Compression error of one gradient for many settings at once: L-GreCo's error table rows.

Each function returns the L2 norm of (x - decompress(compress(x))) without error feedback, one
value per candidate setting, computed far faster than compressing once per candidate."""
import torch

from hvd_compress.maths.quantize import levels_for_bits


def lowrank_errors(matrix, ranks, power_steps=5):
    """Best rank-r approximation error for every r in ``ranks`` (the L-GreCo paper, appendix B).

    With singular values s, err(r) = sqrt(sum_{i>r} s_i^2): one SVD serves every rank. When the
    largest rank is small against min(n, m), a few warm power iterations per rank cost less than
    an SVD (O(nm r) against O(nm min(n, m))), and converge to the same values."""
    n, m = matrix.shape
    ranks = [min(r, n, m) for r in ranks]
    if 5 * power_steps * sum(ranks) >= min(n, m):
        squared = torch.linalg.svdvals(matrix.double()).square()
        tail = squared.flip(0).cumsum(0).flip(0)  # tail[i] = sum_{j >= i} s_j^2
        tail = torch.cat([tail, tail.new_zeros(1)])
        return [tail[r].clamp_min(0).sqrt().item() for r in ranks]
    return [_power_iteration_error(matrix, r, power_steps) for r in ranks]


def _power_iteration_error(matrix, rank, steps):
    generator = torch.Generator().manual_seed(rank)
    q = torch.randn(matrix.shape[1], rank, generator=generator, dtype=matrix.dtype)
    for _ in range(steps):
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.t() @ p
    return (matrix - p @ q.t()).norm().item()


def topk_errors(flat, ks):
    """Exact top-k error for every k: the norm of everything below the k largest magnitudes."""
    squared = flat.double().square().sort(descending=True).values
    tail = squared.flip(0).cumsum(0).flip(0)
    tail = torch.cat([tail, tail.new_zeros(1)])
    return [tail[min(k, flat.numel())].clamp_min(0).sqrt().item() for k in ks]


def qsgd_errors(flat, bits_options, bucket_size):
    """Expected QSGD error for every bit width, in closed form: stochastic rounding of a level
    with fractional part f has variance f(1-f) in units of norm/s. Exact in expectation, so the
    table does not depend on one random draw."""
    n = flat.numel()
    x = flat.double()
    pad = (-n) % bucket_size
    buckets = torch.nn.functional.pad(x, (0, pad)).view(-1, bucket_size)
    norms = buckets.norm(dim=1, keepdim=True)
    unit = (buckets.abs() / torch.where(norms > 0, norms, torch.ones_like(norms)))
    errors = []
    for bits in bits_options:
        s = levels_for_bits(bits)
        fraction = unit * s - (unit * s).floor()
        variance = (fraction * (1 - fraction) * (norms / s).square()).sum()
        errors.append(variance.sqrt().item())
    return errors

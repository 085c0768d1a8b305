"""Compression error of one gradient for many settings at once: L-GreCo's error table rows.

Each ``*_errors`` function returns the L2 norm of (x - decompress(compress(x))) without error
feedback, one value per candidate setting, computed far faster than compressing once per
candidate. Each ``*_kept_energies`` function returns ||C(x)||^2 for nested settings, from
the least to the most compressed, computing the first and deriving the others from it
(GraVAC's multi-level gains)."""
import torch

from hvd_compress.maths.lowrank import orthogonalize, seeded_normal
from hvd_compress.maths.quantize import levels_for_bits
from hvd_compress.maths.sparsify import topk_indices


# The randomized range finder (Halko, Martinsson and Tropp, 2011): columns beyond the largest
# rank asked for, and power steps. Against the exact SVD, every error lies within 0.5% (relative)
# on matrices whose spectrum decays over three decades, and far closer on faster-decaying
# gradient spectra (tests/unit/test_maths.py).
OVERSAMPLING = 16
POWER_STEPS = 2


def lowrank_errors(matrix, ranks, exact=False):
    """Best rank-r approximation error for every r in ``ranks`` (the L-GreCo paper, appendix B):
    err(r) = sqrt(||M||^2 - sum_{i<=r} s_i^2), so only the top max(ranks) singular values and
    the total energy are needed. A randomized range finder gets them in O(nm k) for
    k = max(ranks) + OVERSAMPLING, against O(nm min(n, m)) for a full SVD, on the matrix's own
    device; small matrices, and ``exact=True``, take the exact SVD."""
    n, m = matrix.shape
    ranks = [min(r, n, m) for r in ranks]
    k = max(ranks) + OVERSAMPLING
    if exact or 2 * k >= min(n, m):
        squared = torch.linalg.svdvals(matrix.double()).square()
    else:
        generator = torch.Generator(device=matrix.device).manual_seed(k)
        x = matrix.float()
        sketch = x @ torch.randn(m, k, generator=generator, device=x.device)
        for _ in range(POWER_STEPS):
            sketch = x @ (x.t() @ torch.linalg.qr(sketch).Q)
        basis = torch.linalg.qr(sketch).Q
        squared = torch.linalg.svdvals((basis.t() @ x).double()).square()
    total = matrix.double().square().sum()
    kept = torch.cat([squared.new_zeros(1), squared.cumsum(0)])
    return (total - kept[ranks]).clamp_min(0).sqrt().tolist()


def topk_errors(flat, ks):
    """Exact top-k error for every k: the norm of everything below the k largest magnitudes.
    Only the largest max(ks) entries are selected and sorted (a partial selection, not a full
    sort); the rest count through the total energy."""
    ks = [min(k, flat.numel()) for k in ks]
    squared = flat.double().square()
    largest = squared.topk(max(ks), sorted=True).values
    kept = torch.cat([largest.new_zeros(1), largest.cumsum(0)])
    return (squared.sum() - kept[ks]).clamp_min(0).sqrt().tolist()


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


def lowrank_kept_energies(matrix, q, ranks, seed, name):
    """Energy kept by rank-r projections for every r in ``ranks`` (ranks[0] the largest), from one
    warm-started power step at ranks[0]: the singular values of the projection P^T M give every
    smaller rank's energy. ``q``: last call's warm start for this matrix, or None (a seeded
    normal start, identical on every rank). Returns (energies, the next warm start)."""
    top = ranks[0]
    if q is None or q.shape[1] != top:
        q = seeded_normal(matrix.shape[1], top, seed, name, "gravac").to(matrix)
    projected = orthogonalize(matrix @ q).t() @ matrix  # top x m
    if not torch.isfinite(projected).all():  # an SVD would raise; the step will be dropped
        return [float("nan")] * len(ranks), q
    squared = torch.linalg.svdvals(projected).square()
    return [squared[:r].sum().item() for r in ranks], projected.t().contiguous()


def topk_kept_energies(flat, ks):
    """Energy of the k largest magnitudes for every k in ``ks`` (ks[0] the largest)."""
    kept = flat[topk_indices(flat.abs(), ks[0])].square()
    return [kept.sum().item()] + [kept.topk(k, sorted=False).values.sum().item() for k in ks[1:]]


def qsgd_kept_energies(flat, bits_options, bucket_size):
    """QSGD is unbiased and ||C(x)|| >= ||x||, so energy kept is taken as ||x||^2 minus the
    expected squared error, and 0 where the error exceeds the signal (at 2 bits it can)."""
    total = flat.square().sum().item()
    return [max(0.0, total - error ** 2) for error in qsgd_errors(flat, bits_options, bucket_size)]

"""Compression error of one gradient for many settings at once: L-GreCo's error table rows.

Each ``*_errors`` function returns the L2 norm of (x - decompress(compress(x))) without error
feedback, one value per candidate setting, computed far faster than compressing once per
candidate, as a float64 tensor on the gradient's device: L-GreCo reads a decision's rows back
once for all layers, not once per layer. Each ``*_kept_energies`` function returns ||C(x)||^2 for nested settings, from
the least to the most compressed, computing the first and deriving the others from it
(GraVAC's multi-level gains). Those run on every step, so they return a float64 tensor on
the gradient's device and never wait for the device: GraVAC sends them with the payload."""

import torch

from hvd_compress.maths.devices import on_device
from hvd_compress.maths.lowrank import orthogonalize, project_right, seeded_normal
from hvd_compress.maths.quantize import bucket_norms, levels_for_bits
from hvd_compress.maths.sparsify import sampled_kth_largest, topk_indices


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
    return lowrank_errors_of_batch(matrix[None], ranks, exact)[0]


def lowrank_errors_of_batch(matrices, ranks, exact=False):
    """``lowrank_errors`` of every matrix of a (batch, n, m) stack at once, as a (batch,
    len(ranks)) float64 tensor: one call per operator for the whole stack, so a decision's
    operators and device waits (svdvals) grow with its distinct shapes, not its layers. Every
    matrix gets the same sketch (seeded by k) whatever the batch."""
    _, n, m = matrices.shape
    ranks = [min(r, n, m) for r in ranks]
    k = max(ranks) + OVERSAMPLING
    if exact or 2 * k >= min(n, m):
        squared = torch.linalg.svdvals(matrices.double()).square()
    else:
        generator = torch.Generator(device=matrices.device).manual_seed(k)
        x = matrices.float()
        sketch = x @ torch.randn(m, k, generator=generator, device=x.device)
        for _ in range(POWER_STEPS):
            sketch = x @ (x.transpose(1, 2) @ torch.linalg.qr(sketch).Q)
        basis = torch.linalg.qr(sketch).Q
        squared = torch.linalg.svdvals((basis.transpose(1, 2) @ x).double()).square()
    total = squared_norms_of_batch(matrices)
    kept = torch.cat([squared.new_zeros(squared.shape[0], 1), squared.cumsum(1)], dim=1)
    return (total[:, None] - kept[:, on_device(ranks, torch.int64, kept.device)]).clamp_min(0).sqrt()


# The total energy's float64 pass on a CPU takes a stack this many entries at a time (2 MiB of
# float64, in cache): the whole stack in float64, and its square, are new pages whose first-touch
# faults cost more than the range finder's products (on bert-base shapes a third of a decision).
TOTAL_CHUNK_ENTRIES = 1 << 18


def squared_norms_of_batch(matrices):
    """||M||^2 of every matrix of a (batch, n, m) stack, as float64 (squares of float32 entries
    are exact in float64). On a CPU a chunk at a time through one buffer; elsewhere in one
    chunk: a GPU's caching allocator recycles the stack-sized buffer, and the operators stay
    per distinct shape."""
    flat = matrices.reshape(matrices.shape[0], -1)
    width = flat.shape[1]
    if flat.is_cpu:
        width = min(width, max(1, TOTAL_CHUNK_ENTRIES // flat.shape[0]))
    buffer = torch.empty(flat.shape[0], width, dtype=torch.float64, device=flat.device)
    total = torch.zeros(flat.shape[0], dtype=torch.float64, device=flat.device)
    for start in range(0, flat.shape[1], width):
        chunk = buffer[:, : min(width, flat.shape[1] - start)]
        total += chunk.copy_(flat[:, start : start + width]).square_().sum(dim=1)
    return total


# Top-K rows of layers of HISTOGRAM_MIN_NUMEL entries or more come from a histogram of the
# squared magnitudes, binned by their float32 bit patterns' top 16 bits (exponent and 7 mantissa
# bits: bins 0.8% wide), instead of a selection of the max(ks) largest: two counting passes
# against a partial sort. Each candidate's kept energy is exact except for the bin its k-th
# largest entry falls in, counted at that bin's mean: off by under 0.8% of what that bin keeps.
# Tests compare the rows and the decisions with the exact selection.
HISTOGRAM_MIN_NUMEL = 1 << 16
HISTOGRAM_SHIFT = 16
HISTOGRAM_BINS = 1 << 15  # non-negative float32 bit patterns >> 16


def topk_errors(flat, ks, exact=False):
    """Top-k error for every k: the norm of everything below the k largest magnitudes. Small
    layers, and ``exact=True``: only the largest max(ks) entries are selected and sorted (a
    partial selection, not a full sort), the rest counting through the total energy. Large
    layers: from the histogram described above."""
    ks = [min(k, flat.numel()) for k in ks]
    if exact or flat.numel() < HISTOGRAM_MIN_NUMEL:
        squared = flat.double().square()
        largest = squared.topk(max(ks), sorted=True).values
        kept = torch.cat([largest.new_zeros(1), largest.cumsum(0)])
        return (squared.sum() - kept[on_device(ks, torch.int64, kept.device)]).clamp_min(0).sqrt()
    kept, total = _histogram_kept_energies(flat, ks)
    return (total - kept).clamp_min(0).sqrt()


def _histogram_kept_energies(flat, ks):
    """(energy of the k largest magnitudes for every k in ``ks``, as float64, and the total)."""
    squared = flat.float().square()
    bins = ((squared.view(torch.int32) >> HISTOGRAM_SHIFT) & (HISTOGRAM_BINS - 1)).long()
    if squared.is_cuda:  # CUDA's bincount reads the largest bin on the host first
        counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=squared.device)
        counts.scatter_add_(0, bins, torch.ones_like(bins))
        sums = torch.zeros(HISTOGRAM_BINS, dtype=torch.float64, device=squared.device)
        sums.scatter_add_(0, bins, squared.double())
    else:
        counts = torch.bincount(bins, minlength=HISTOGRAM_BINS)
        sums = torch.bincount(bins, weights=squared.double(), minlength=HISTOGRAM_BINS)
    # Bin 0 holds the largest magnitudes after the flip.
    counts, sums = counts.flip(0), sums.flip(0)
    count_before = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # in the bins before bin i
    sum_before = torch.cat([sums.new_zeros(1), sums.cumsum(0)])
    k = on_device(ks, count_before.dtype, counts.device)
    within = torch.searchsorted(count_before[1:], k).clamp_max(HISTOGRAM_BINS - 1)  # k-th largest's bin
    mean = sums[within] / counts[within].clamp_min(1)
    return sum_before[within] + (k - count_before[within]).double() * mean, sum_before[-1]


QSGD_CHUNK_ENTRIES = 1 << 18  # 1 MB of float32: every bit width's passes run in cache


def qsgd_errors(flat, bits_options, bucket_size):
    """Expected QSGD error for every bit width, in closed form: stochastic rounding of a level
    with fractional part f has variance f(1-f) in units of norm/s. Exact in expectation, so the
    table does not depend on one random draw."""
    return _qsgd_squared_errors(flat, bits_options, bucket_size).sqrt()


def _qsgd_squared_errors(flat, bits_options, bucket_size):
    """The squared errors of ``qsgd_errors`` as a float64 tensor on ``flat``'s device. Entries
    in float32 (the unit magnitudes lie in [0, 1]), sums per bucket and across buckets in
    float64; a chunk of buckets at a time, every bit width on it while it is in cache (on large
    layers much faster than a pass over the whole layer per width)."""
    n = flat.numel()
    pad = (-n) % bucket_size
    norms32 = bucket_norms(flat, bucket_size)
    norms = norms32.double()
    buckets = torch.nn.functional.pad(flat.float(), (0, pad)).view(-1, bucket_size)
    safe_norms = torch.where(norms32 > 0, norms32, torch.ones_like(norms32))
    levels = [levels_for_bits(bits) for bits in bits_options]
    weights = torch.stack([(norms / s).square() for s in levels])  # (norm / s)^2: width x bucket
    totals = torch.zeros(len(levels), dtype=torch.float64, device=flat.device)
    rows = max(1, QSGD_CHUNK_ENTRIES // bucket_size)
    unit, fraction, square = (
        torch.empty(min(rows, buckets.shape[0]), bucket_size, device=flat.device) for _ in range(3)
    )
    for start in range(0, buckets.shape[0], rows):
        piece = buckets[start : start + rows]
        m = piece.shape[0]
        torch.div(piece.abs(), safe_norms[start : start + m, None], out=unit[:m])
        for i, s in enumerate(levels):
            f = torch.mul(unit[:m], s, out=fraction[:m]).frac_()
            f.sub_(torch.square(f, out=square[:m]))  # f - f^2 = f(1 - f)
            totals[i] += f.sum(dim=1, dtype=torch.float64).mul_(weights[i, start : start + m]).sum()
    return totals


def lowrank_kept_energies(matrix, q, ranks, seed, name):
    """Energy kept by rank-r projections for every r in ``ranks`` (ranks[0] the largest), from one
    warm-started power step at ranks[0]. ``q``: last call's warm start for this matrix, or None
    (a seeded normal start, identical on every rank). Returns (energies, the next warm start).

    P = orthogonalize(M q) keeps its columns nested (the first r span M q[:, :r]), so row i of
    P^T M carries what column i adds, and rank r keeps the first r rows' energy: what a power
    step from the first r columns of the warm start keeps. Repeated over steps this is
    orthogonal iteration, whose columns converge to the leading singular vectors in order,
    so the energies converge to those of the best rank-r approximations. Unlike the singular
    values of P^T M it needs no SVD, which on a GPU waits for the device on every call. A
    non-finite gradient gives non-finite energies (the step is dropped)."""
    top = ranks[0]
    if q is None or q.shape[1] != top:
        q = seeded_normal(matrix.shape[1], top, seed, name, "gravac")
    q = q.to(matrix)  # a start drawn on the CPU, or loaded from a checkpoint mapped there
    projected = orthogonalize(project_right(matrix, q)).t() @ matrix  # top x m
    kept = projected.double().square().sum(dim=1).cumsum(0)
    return torch.stack([kept[r - 1] for r in ranks]), projected.t()  # column-major, as project_right wants


def topk_kept_energies(flat, ks):
    """Energy of the k largest magnitudes for every k in ``ks`` (ks[0] the largest); on large
    layers estimated (``_threshold_kept_energies`` on the CPU, the histogram on a GPU)."""
    if flat.numel() >= HISTOGRAM_MIN_NUMEL:
        ks = [min(k, flat.numel()) for k in ks]
        if flat.is_cuda:
            return _histogram_kept_energies(flat, ks)[0]
        return _threshold_kept_energies(flat.abs(), ks)
    return kept_within_selection(flat[topk_indices(flat, ks[0])], ks)


def _threshold_kept_energies(magnitudes, ks):
    """Kept energies from a threshold t near the k-th largest magnitude (the fixed sample's
    estimate): E + (k - C) t^2, with E the energy and C the count of the entries above t, as
    though the |k - C| entries between t and the k-th largest all had magnitude t. The error
    is second order, |k - C| times the spread of their squares: a few thousandths of
    the energy kept where the histogram allows 0.8% (tests/unit/test_maths.py). Three cheap
    passes per k (threshold, dot, count) on the CPU, against the histogram's seven."""
    above = torch.empty_like(magnitudes)
    kept = []
    for k in ks:
        t = sampled_kth_largest(magnitudes, k)
        torch.threshold(magnitudes, t.item(), 0.0, out=above)
        energy = squared_norm(above)[0]
        # Ones summed in float32: several times faster than count_nonzero, and exact below 2^24.
        count = above.sign_().sum().double()
        kept.append(energy + (k - count) * t.double().square())
    return torch.stack(kept)


def kept_within_selection(selected, ks):
    """``topk_kept_energies`` of a vector whose ks[0] largest magnitudes are ``selected`` (a
    Top-K compression's values): ks[0]'s exactly, the others by top-k within the selection,
    from the histogram where the selection is large."""
    kept = selected.double().square()
    if len(ks) > 1 and selected.numel() >= HISTOGRAM_MIN_NUMEL:
        return torch.cat([kept.sum().reshape(1), _histogram_kept_energies(selected, ks[1:])[0]])
    return torch.stack([kept.sum()] + [kept.topk(k, sorted=False).values.sum() for k in ks[1:]])


# How far a float32 dot drifts grows with its length, by how much depends on the BLAS: on heavy-
# tailed entries one thread of an AMD EPYC's drifted 2.2e-5 (relative) over 2^18 entries and
# 1.4e-4 over 2^22 and more; chunks of 2^16 stay within 3.3e-6 (at 25 M entries 1.4x the time
# of 2^20 chunks: 5.8 against 4.1 ms).
SQUARED_NORM_CHUNK = 1 << 16


def squared_norm(flat):
    """||flat||^2 as a 1-element float64 tensor: float32 dot products of chunks of
    SQUARED_NORM_CHUNK entries, summed in float64. Several times faster than
    ``square().sum()``, which writes a temporary as large as ``flat``; chunking keeps float32
    accumulation within about 1e-5 (relative) on layers of tens of millions of entries."""
    return torch.stack([torch.dot(chunk, chunk).double() for chunk in flat.split(SQUARED_NORM_CHUNK)]).sum().reshape(1)


def qsgd_kept_energies(flat, bits_options, bucket_size):
    """QSGD is unbiased and ||C(x)|| >= ||x||, so energy kept is taken as ||x||^2 minus the
    expected squared error, and 0 where the error exceeds the signal (at 2 bits it can)."""
    total = flat.float().square().sum().double()
    return (total - _qsgd_squared_errors(flat, bits_options, bucket_size)).clamp_min(0)

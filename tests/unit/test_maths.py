"""Invariants of the pure maths: no communication, no state."""

import pytest
import torch

from hvd_compress.maths import lowrank, quantize
from hvd_compress.maths.sparsify import topk_indices


def test_orthogonalize_gives_orthonormal_columns():
    p = torch.randn(50, 4)
    p_hat = lowrank.orthogonalize(p)
    assert torch.allclose(p_hat.t() @ p_hat, torch.eye(4), atol=1e-5)


def test_orthogonalize_zero_matrix_is_finite():
    assert torch.isfinite(lowrank.orthogonalize(torch.zeros(10, 1))).all()
    assert torch.isfinite(lowrank.orthogonalize(torch.zeros(10, 3))).all()


@pytest.mark.parametrize("rank", [1, 4])
def test_projections_give_the_products_in_the_layouts_the_codecs_keep(rank):
    matrix, q, p = torch.randn(40, 30), torch.randn(30, rank), torch.randn(40, rank)
    # P = M Q whatever Q's layout, the same bits for either layout of the same values.
    column_major = q.t().contiguous().t()
    assert torch.allclose(lowrank.project_right(matrix, q), matrix @ q, atol=1e-5)
    assert torch.equal(lowrank.project_right(matrix, q), lowrank.project_right(matrix, column_major))
    # Q = M^T P comes back column-major: its transpose is what travels, with no copy.
    projected = lowrank.project_left(matrix, p)
    assert torch.allclose(projected, matrix.t() @ p, atol=1e-5) and projected.t().is_contiguous()


@pytest.mark.parametrize("shape,rank", [((40, 30), 1), ((40, 30), 4), ((40, 30), 8), ((1024, 512), 8), ((40, 30), 16)])
def test_a_projection_is_sent_contiguous_and_restored_to_its_orientation(shape, rank):
    """P = M Q comes back as M Q or as a transposed view of Q^T M^T, whichever the CPU's BLAS runs
    faster at this shape and rank; either way what travels is contiguous and comes back as P."""
    matrix, q = torch.randn(*shape), torch.randn(shape[1], rank)
    p = lowrank.project_right(matrix, q)
    assert torch.allclose(p, matrix @ q, atol=1e-4)
    payload, restore = lowrank.sendable(p)
    assert payload.is_contiguous() and payload.data_ptr() == p.data_ptr()
    assert torch.equal(restore(payload.clone()), p)


def test_only_a_matrix_or_a_transposed_view_of_one_is_sendable():
    with pytest.raises(ValueError, match="factor"):
        lowrank.sendable(torch.randn(10, 8)[:, ::2])


def test_seeded_normal_is_identical_for_same_seed_and_name():
    a = lowrank.seeded_normal(5, 2, 0, "fc.weight")
    assert torch.equal(a, lowrank.seeded_normal(5, 2, 0, "fc.weight"))
    assert not torch.equal(a, lowrank.seeded_normal(5, 2, 0, "fc.bias"))


def test_resize_columns_keeps_warm_start():
    q = torch.randn(6, 3)
    assert torch.equal(lowrank.resize_columns(q, 2, 0, "x"), q[:, :2])
    grown = lowrank.resize_columns(q, 5, 0, "x")
    assert grown.shape == (6, 5) and torch.equal(grown[:, :3], q)


@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_unpack_roundtrip(bits):
    s = quantize.levels_for_bits(bits)
    codes = torch.randint(-s, s + 1, (1001,), dtype=torch.int8)
    packed = quantize.pack_codes(codes, bits)
    assert packed.numel() == quantize.packed_size(1001, bits)
    assert torch.equal(quantize.unpack_codes(packed, bits, 1001), codes)


@pytest.mark.parametrize(
    "rows,n,bucket_size", [(1, 1000, 64), (3, 1000, 64), (4, (1 << 18) + 700, 512), (2, (1 << 18) + 5, 100)]
)
def test_dequantize_mean_is_the_row_by_row_mean_bit_for_bit(rows, n, bucket_size):
    """Decoded a chunk at a time with every row in cache (several chunks and a partial last
    bucket here), the mean is the one of decoding each row whole, adding in row order, dividing."""
    bits = 4
    drawn = [
        quantize.quantize(torch.randn(n) * 10**row, bits, bucket_size, torch.Generator().manual_seed(row))
        for row in range(rows)
    ]
    expected = quantize.dequantize(*drawn[0], bits, bucket_size)
    for codes, norms in drawn[1:]:
        expected.add_(quantize.dequantize(codes, norms, bits, bucket_size))
    if rows > 1:
        expected.div_(rows)
    mean = quantize.dequantize_mean([c for c, _ in drawn], [m for _, m in drawn], bits, bucket_size)
    assert torch.equal(mean, expected)


@pytest.mark.parametrize("bits", range(2, 9))
def test_packed_words_hold_code_i_at_bits_i_times_width(bits):
    """pack_codes's documented layout: code i of a 64-bit word at bits [i * bits, (i + 1) * bits),
    offset by s (what every rank's unpack_codes reads back, whichever path packed it)."""
    s, per_word = quantize.levels_for_bits(bits), 64 // bits
    codes = torch.randint(-s, s + 1, (2 * per_word,), dtype=torch.int8)
    words = quantize.pack_codes(codes, bits).view(torch.int64).tolist()
    for w, word in enumerate(words):
        expected = sum((int(c) + s) << (i * bits) for i, c in enumerate(codes[w * per_word : (w + 1) * per_word]))
        assert word % (1 << 64) == expected


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_is_unbiased(bits):
    x = torch.randn(300)
    generator = torch.Generator().manual_seed(1)
    trials = 4000
    total = torch.zeros_like(x)
    for _ in range(trials):
        codes, norms = quantize.quantize(x, bits, 64, generator)
        total += quantize.dequantize(codes, norms, bits, 64)
    mean = total / trials
    # Per-entry standard error is at most norm/(s*sqrt(trials)); allow 5 sigma on the average.
    norm_bound = quantize.bucket_norms(x, 64).max()
    tolerance = 5 * norm_bound / (quantize.levels_for_bits(bits) * trials**0.5)
    assert (mean - x).abs().max() < tolerance


def test_qsgd_codes_do_not_depend_on_the_chunking(monkeypatch):
    """Chunks draw the noise words in order: chunks of 12 buckets of 100 give the codes of one
    chunk of everything (with a partial last bucket and a last chunk of part of a word)."""
    x = torch.randn(5003)
    whole = quantize.quantize(x, 5, 100, torch.Generator().manual_seed(3))
    monkeypatch.setattr(quantize, "_CPU_CHUNK", 1024)
    assert quantize._chunk_entries(x.device, 100, x.numel()) == 1200
    chunked = quantize.quantize(x, 5, 100, torch.Generator().manual_seed(3))
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n,bucket_size", [(5003, 100), (4096, 7), (300, 512)])
def test_encode_and_decode_mean_are_pack_and_unpack_of_the_codes_bit_for_bit(monkeypatch, bits, n, bucket_size):
    """The fused path packs each chunk's codes and unpacks each chunk's bytes in cache: the bytes
    of pack_codes(quantize(...)) and the mean of dequantize_mean over the unpacked rows, with
    many chunks (each a whole number of 64-bit words), odd bucket sizes and a partial last one."""
    monkeypatch.setattr(quantize, "_CPU_CHUNK", 1024)
    buckets = -(-n // bucket_size)
    rows = []
    for row in range(3):
        x = torch.randn(n) * 10**row
        codes, norms = quantize.quantize(x, bits, bucket_size, torch.Generator().manual_seed(row))
        packed = torch.empty(quantize.packed_size(n, bits), dtype=torch.uint8)
        encoded_norms = torch.empty(buckets)
        quantize.encode(x, bits, bucket_size, torch.Generator().manual_seed(row), packed, encoded_norms)
        assert torch.equal(packed, quantize.pack_codes(codes, bits)) and torch.equal(encoded_norms, norms)
        rows.append((codes, packed, norms))
    expected = quantize.dequantize_mean([c for c, _, _ in rows], [m for _, _, m in rows], bits, bucket_size)
    decoded = quantize.decode_mean([p for _, p, _ in rows], [m for _, _, m in rows], bits, bucket_size, n)
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize("bits", range(2, 9))
def test_qsgd_codes_stay_within_their_levels_at_the_extremes(bits):
    """An entry that is its bucket's whole norm has the level s exactly, and the noise never
    takes it past s: every draw codes it as +-s."""
    s = quantize.levels_for_bits(bits)
    x = torch.zeros(64 * 200)
    x[::64] = torch.randn(200).abs() * 10.0 ** torch.arange(-20, 20, 0.2)
    x[64::128] *= -1
    codes, _ = quantize.quantize(x, bits, 64, torch.Generator().manual_seed(0))
    assert torch.equal(codes[::64], torch.where(x[::64] > 0, s, -s).to(torch.int8))
    assert not codes.view(200, 64)[:, 1:].any()


@pytest.mark.parametrize("n,k", [(1000, 10), (1 << 17, 1311), (1 << 17, 1), (1 << 16, 3000)])
def test_topk_indices_match_torch_topk_of_the_magnitudes(n, k):
    x = torch.randn(n)
    ours = topk_indices(x, k)
    assert ours.numel() == k and ours.unique().numel() == k
    assert torch.equal(x[ours].abs().sort().values, torch.topk(x.abs(), k).values.sort().values)


def test_topk_indices_reuse_their_flags_buffer_across_sizes():
    # The flags buffer is kept between calls: a smaller tensor after a larger one (whose flags
    # are still in the buffer) and an odd size must select exactly as torch.topk does.
    for n in [1 << 18, (1 << 16) + 3, 1 << 17]:
        x = torch.randn(n)
        k = n // 100
        ours = topk_indices(x, k)
        assert torch.equal(x[ours].abs().sort().values, torch.topk(x.abs(), k).values.sort().values)


def test_topk_indices_with_many_ties():
    x = torch.zeros(1 << 17)
    x[:5] = 1.0
    ours = topk_indices(x, 100)
    assert ours.numel() == 100 and set(range(5)) <= set(ours.tolist())


def one_matrix_lowrank_errors(matrix, ranks):
    """maths/error_tables.py's rows as computed one matrix at a time before they were batched (2-D
    products and factorizations), the reference for the batched ones."""
    from hvd_compress.maths.error_tables import OVERSAMPLING, POWER_STEPS

    n, m = matrix.shape
    ranks = [min(r, n, m) for r in ranks]
    k = max(ranks) + OVERSAMPLING
    if 2 * k >= min(n, m):
        squared = torch.linalg.svdvals(matrix.double()).square()
    else:
        x = matrix.float()
        sketch = x @ torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        for _ in range(POWER_STEPS):
            sketch = x @ (x.t() @ torch.linalg.qr(sketch).Q)
        squared = torch.linalg.svdvals((torch.linalg.qr(sketch).Q.t() @ x).double()).square()
    kept = torch.cat([squared.new_zeros(1), squared.cumsum(0)])
    return (matrix.double().square().sum() - kept[ranks]).clamp_min(0).sqrt()


@pytest.mark.parametrize("shape, ranks", [((32, 48), [2, 3, 4, 8]), ((256, 300), [2, 4, 8])])  # SVD, sketch
def test_batched_lowrank_errors_are_bit_identical_to_one_matrix_at_a_time_on_the_cpu(shape, ranks):
    """L-GreCo's decision batches layers of one shape: its rows, so its choices, stay the same."""
    from hvd_compress.maths.error_tables import lowrank_errors, lowrank_errors_of_batch

    matrices = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    reference = torch.stack([one_matrix_lowrank_errors(m, ranks) for m in matrices])
    assert torch.equal(lowrank_errors_of_batch(matrices, ranks), reference)
    assert torch.equal(torch.stack([lowrank_errors(m, ranks) for m in matrices]), reference)


def test_squared_norms_of_a_batch_in_chunks_match_one_float64_pass(monkeypatch):
    from hvd_compress.maths import error_tables

    matrices = torch.randn(3, 50, 70, generator=torch.Generator().manual_seed(0))
    reference = matrices.double().square().sum(dim=(1, 2))
    monkeypatch.setattr(error_tables, "TOTAL_CHUNK_ENTRIES", 3 * 512)  # 7 chunks, the last one short
    assert torch.allclose(error_tables.squared_norms_of_batch(matrices), reference, rtol=1e-14, atol=0)


def test_lowrank_errors_match_truncated_svd_both_ways():
    from hvd_compress.maths.error_tables import lowrank_errors

    # Seeded: five power steps are an approximation, within 1% for this draw but not for every one.
    matrix = torch.randn(60, 40, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(0, -2, 40))
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    for r in [1, 3, 8]:
        best = (matrix - u[:, :r] @ torch.diag(s[:r]) @ vh[:r]).norm().item()
        # Five power steps approximate the optimum (paper, appendix B); the SVD path is exact.
        assert abs(lowrank_errors(matrix, [r])[0] - best) < 1e-2 * best
        assert abs(lowrank_errors(matrix, [r, 40, 40, 40])[0] - best) < 1e-6 * matrix.norm()  # SVD


def test_topk_errors_are_exact():
    from hvd_compress.maths.error_tables import topk_errors

    x = torch.randn(1000)
    for k, err in zip([1, 10, 999, 1000, 2000], topk_errors(x, [1, 10, 999, 1000, 2000])):
        kept = torch.zeros_like(x)
        idx = x.abs().topk(min(k, 1000)).indices
        kept[idx] = x[idx]
        assert abs(err - (x - kept).norm().item()) < 1e-5


def test_qsgd_errors_equal_the_mean_error_of_many_draws():
    from hvd_compress.maths.error_tables import qsgd_errors

    x = torch.randn(512)
    generator = torch.Generator().manual_seed(0)
    for bits, expected in zip([2, 4], qsgd_errors(x, [2, 4], 64)):
        draws = torch.stack(
            [quantize.dequantize(*quantize.quantize(x, bits, 64, generator), bits, 64) - x for _ in range(400)]
        )
        mean_squared = draws.square().sum(dim=1).mean().item()
        assert abs(mean_squared - expected**2) < 0.1 * expected**2


# ----- QSGD at extreme scales: norms from float64 squares ------------------------------------
def _roundtrip(x, bits, bucket_size, seed=0):
    codes, norms = quantize.quantize(x, bits, bucket_size, torch.Generator().manual_seed(seed))
    packed = quantize.pack_codes(codes, bits)
    decoded = quantize.dequantize(quantize.unpack_codes(packed, bits, x.numel()), norms, bits, bucket_size)
    return codes, norms, decoded


def _extreme_buckets(bucket_size=64):
    """Named gradients of whole buckets at the scales where float32 squares overflow or underflow."""
    signs = torch.randn(bucket_size, generator=torch.Generator().manual_seed(1)).sign()
    unit = signs * (0.5 + torch.rand(bucket_size, generator=torch.Generator().manual_seed(2)))
    single = torch.zeros(bucket_size)
    single[5] = -3e-21
    mixed = unit * 1e-30
    mixed[::7] = unit[::7]
    return {
        "1e30": unit * 1e30,
        "1e-30": unit * 1e-30,
        "1e-25": unit * 1e-25,
        "mixed 1e-30 and 1": mixed,
        "zeros": torch.zeros(bucket_size),
        "single nonzero": single,
        "near float32 max": unit * 2e38,
        "subnormal": unit * 1e-42,
        "partial last bucket": (unit * 1e-30)[: bucket_size - 9],
    }


@pytest.mark.parametrize("name", list(_extreme_buckets()))
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_roundtrip_is_finite_and_within_one_level_at_extreme_scales(name, bits):
    x = _extreme_buckets()[name]
    s = quantize.levels_for_bits(bits)
    codes, norms, decoded = _roundtrip(x, bits, 64)
    assert torch.isfinite(norms).all() and torch.isfinite(decoded).all()
    exact = torch.nn.functional.pad(x.double(), (0, (-x.numel()) % 64)).view(-1, 64).norm(dim=1)
    # The float32 rounding of the float64 norm, clamped to the float32 range (2e38 needs it).
    assert torch.equal(norms, exact.float().clamp(max=torch.finfo(torch.float32).max))
    assert (norms.double() >= x.abs().max().double()).all()  # so |x| / norm <= 1
    assert ((norms > 0) == (exact > 0)).all()  # no nonzero bucket quantises to nothing
    assert codes.abs().max() <= s and (codes * x.sign() >= 0).all()
    # Stochastic rounding moves an entry by less than one level, norm / s (give or take the
    # float32 rounding of the decoded value: 2^-149 apart among subnormals).
    slack = norms.double().max() / s * 1e-6 + 2.0**-149
    assert ((decoded.double() - x.double()).abs() <= norms.double().max() / s + slack).all()
    if name == "zeros":
        assert (codes == 0).all() and (decoded == 0).all()
    if name == "single nonzero":  # |x| is its bucket's norm: the top level, decoded exactly
        assert codes[5] == -s and decoded[5] == x[5] and (decoded[x == 0] == 0).all()


@pytest.mark.parametrize("scale", [1e-25, 1e-38, 1e30])
def test_qsgd_is_unbiased_at_tiny_and_huge_scales(scale):
    """Every bucket gets its own rounding noise, so one call on many copies of a bucket is many
    draws. Float32 squares of 1e-25 are 0: the old norms were 0 and every entry decoded to 0."""
    bits, bucket_size, draws = 4, 64, 4000
    x = _extreme_buckets(bucket_size)["1e-25"] / 1e-25 * scale
    codes, norms = quantize.quantize(x.repeat(draws), bits, bucket_size, torch.Generator().manual_seed(3))
    mean = quantize.dequantize(codes, norms, bits, bucket_size).double().view(draws, -1).mean(dim=0)
    # Per entry the rounding error lies within norm / s, so its mean's standard error is at most
    # norm / (2 s sqrt(draws)); allow 5 of those.
    tolerance = 5 * norms[0].double() / (2 * quantize.levels_for_bits(bits) * draws**0.5)
    assert ((mean - x.double()).abs() <= tolerance).all()


@pytest.mark.parametrize("bits", range(2, 9))
def test_qsgd_codes_lie_in_range_with_the_sign_of_the_entry(bits):
    """Float32 squares between 1e-45 and 1e-38 are subnormal and rounded: a norm from them could
    fall below the bucket's largest magnitude, its level round up to s + 1, and at 8 bits the
    code 128 wrapped to -128 for a positive entry."""
    s = quantize.levels_for_bits(bits)
    generator = torch.Generator().manual_seed(bits)
    # One nonzero entry per bucket, at every float32 exponent, subnormals included.
    magnitudes = torch.randint(1, 0x7F7FFFFF, (20_000,), dtype=torch.int32, generator=generator).view(torch.float32)
    single = torch.zeros(20_000, 16)
    single[:, 3] = magnitudes * torch.randn(20_000, generator=generator).sign()
    # Whole buckets of entries of one random exponent each, from subnormal to 1e38.
    exponents = torch.randint(-149, 127, (2_000, 1), generator=generator).float()
    spread = (
        (torch.rand(2_000, 16, generator=generator) + 0.5)
        * exponents.exp2()
        * torch.randn(2_000, 16, generator=generator).sign()
    )
    for x in [single.flatten(), spread.flatten()]:
        codes, norms = quantize.quantize(x, bits, 16, generator)
        assert codes.min() >= -s and codes.max() <= s
        assert not ((codes > 0) & (x < 0)).any() and not ((codes < 0) & (x > 0)).any()
        assert torch.isfinite(quantize.dequantize(codes, norms, bits, 16)).all()


def test_qsgd_does_not_crash_on_non_finite_entries():
    x = torch.randn(300)
    x[3], x[100], x[200] = float("inf"), float("nan"), -float("inf")
    codes, norms = quantize.quantize(x, 4, 64, torch.Generator().manual_seed(0))
    assert codes.shape == (300,) and norms.shape == (5,)
    assert quantize.dequantize(codes, norms, 4, 64).shape == (300,)


def test_bucket_norms_are_float64_norms_rounded_and_never_below_a_magnitude():
    x = torch.randn(1000) * torch.logspace(-40, 30, 1000)
    norms = quantize.bucket_norms(x, 64)
    exact = torch.nn.functional.pad(x.double(), (0, 24)).view(-1, 64).norm(dim=1)
    assert norms.dtype == torch.float32 and norms.shape == (16,)
    assert torch.equal(norms, exact.float())
    assert (norms >= torch.nn.functional.pad(x.abs(), (0, 24)).view(-1, 64).amax(dim=1)).all()


def test_bucket_norms_and_decoding_off_the_cpu_pad_the_last_bucket():
    """Off the CPU (here the meta device, as on a GPU) everything is one chunk: of whole
    buckets, the last padded. The GPU's codec benchmark failed on ResNet-50's 9,408-entry conv1
    before it was."""
    x = torch.empty(9408, device="meta")
    assert quantize.bucket_norms(x, 512).shape == (19,)
    codes = torch.empty(9408, dtype=torch.int8, device="meta")
    assert quantize.dequantize(codes, torch.empty(19, device="meta"), 4, 512).shape == (9408,)


@pytest.mark.parametrize("scale", [1e-25, 1e30])
def test_qsgd_errors_match_the_quantiser_at_extreme_scales(scale):
    from hvd_compress.maths.error_tables import qsgd_errors

    x = torch.randn(512, generator=torch.Generator().manual_seed(4)) * scale
    generator = torch.Generator().manual_seed(0)
    expected = qsgd_errors(x, [4], 64)[0]
    codes, norms = quantize.quantize(x.repeat(400), 4, 64, generator)
    draws = quantize.dequantize(codes, norms, 4, 64).double().view(400, -1) - x.double()
    assert abs(draws.square().sum(dim=1).mean().item() - expected**2) < 0.1 * expected**2


@pytest.mark.parametrize("shape", [(512, 256), (256, 1024), (1024, 128)])
def test_randomized_lowrank_errors_are_within_half_a_percent_of_the_exact_svd(shape):
    """A spectrum decaying over three decades, slower than gradients' usually do."""
    from hvd_compress.maths.error_tables import lowrank_errors

    g = torch.Generator().manual_seed(3)
    n, m = shape
    r = min(n, m)
    u = torch.linalg.qr(torch.randn(n, r, generator=g)).Q
    v = torch.linalg.qr(torch.randn(m, r, generator=g)).Q
    matrix = (u * torch.logspace(0, -3, r)) @ v.t()
    ranks = list(range(1, 17))
    approximate, exact = lowrank_errors(matrix, ranks), lowrank_errors(matrix, ranks, exact=True)
    assert all(abs(a - b) <= 5e-3 * b for a, b in zip(approximate, exact))
    assert all(a >= b * (1 - 1e-6) for a, b in zip(approximate, exact))  # never optimistic


def test_topk_errors_from_a_partial_selection_match_a_full_sort():
    from hvd_compress.maths.error_tables import topk_errors

    x = torch.randn(100_000, generator=torch.Generator().manual_seed(4))
    ks = [1, 10, 100, 1000, 10_000]
    squared = x.double().square().sort(descending=True).values
    expected = [squared[k:].sum().sqrt().item() for k in ks]
    assert topk_errors(x, ks, exact=True) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tail", ["normal", "heavy"])
def test_topk_errors_from_the_histogram_are_within_its_stated_accuracy(tail):
    """Large layers' Top-K rows come from a histogram of float32 bit patterns: each kept energy
    exact but for the boundary bin, counted at its mean (bins 0.8% wide)."""
    from hvd_compress.maths.error_tables import HISTOGRAM_MIN_NUMEL, topk_errors

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * HISTOGRAM_MIN_NUMEL, generator=g)
    if tail == "heavy":
        x = x / torch.rand(x.shape, generator=g).clamp_min(1e-3)
    ks = [1, 26, 262, 2621, 13107, 26214, x.numel()]
    approximate, exact = topk_errors(x, ks), topk_errors(x, ks, exact=True)
    total = x.double().square().sum().item()
    for k, a, b in zip(ks, approximate, exact):
        # |kept energy - exact kept energy| <= 0.8% of the energy kept from the boundary bin
        assert abs(a**2 - b**2) <= 0.008 * (total - b**2) + 1e-9 * total, k
    assert approximate[-1] == pytest.approx(0.0, abs=1e-6 * total**0.5)


@pytest.mark.parametrize("tail", ["normal", "heavy"])
def test_topk_kept_energies_from_a_threshold_are_close_to_the_exact_ones(tail):
    """Large layers' kept energies on the CPU come from a sampled threshold, as though the
    entries between it and the k-th largest had its magnitude: within 0.5% at GraVAC's
    densities, where the squared norm of a chunked float32 dot is within 1e-5."""
    from hvd_compress.maths.error_tables import HISTOGRAM_MIN_NUMEL, squared_norm, topk_kept_energies

    g = torch.Generator().manual_seed(6)
    x = torch.randn(4 * HISTOGRAM_MIN_NUMEL, generator=g)
    if tail == "heavy":
        x = x / torch.rand(x.shape, generator=g).clamp_min(1e-3)
    ks = [x.numel() // 10, x.numel() // 20, x.numel() // 100]
    exact = torch.stack([x.double().square().topk(k).values.sum() for k in ks])
    torch.testing.assert_close(topk_kept_energies(x, ks), exact, rtol=5e-3, atol=0)
    torch.testing.assert_close(squared_norm(x)[0], x.double().square().sum(), rtol=1e-5, atol=0)


def test_squared_norm_of_a_large_heavy_tailed_layer_is_within_1e_5():
    """One float32 dot over millions of entries drifted 1.4e-4 on an AMD EPYC's BLAS; the chunks
    keep it within the docstring's 1e-5."""
    from hvd_compress.maths.error_tables import squared_norm

    g = torch.Generator().manual_seed(6)
    x = torch.randn(1 << 22, generator=g) / torch.rand(1 << 22, generator=g).clamp_min(1e-3)
    torch.testing.assert_close(squared_norm(x)[0], x.double().square().sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_finds_any_nan_or_infinity(dtype):
    from hvd_compress.maths.finite import all_finite

    x = torch.randn(10_000).to(dtype)
    assert bool(all_finite(x)) and bool(all_finite(x[:0]))
    for bad in [float("nan"), float("inf"), -float("inf")]:
        for at in [0, 4_321, 9_999]:
            y = x.clone()
            y[at] = bad
            assert not bool(all_finite(y)), (bad, at)


def test_a_verdict_fails_on_a_non_finite_extreme_or_a_bound_beyond_float32():
    from hvd_compress.maths.finite import largest_magnitude, verdict

    x = torch.tensor([1.0, -3.0, 2.0])
    assert largest_magnitude(x).item() == 3.0
    assert largest_magnitude(x.half()).dtype == torch.float32
    for bad in [float("nan"), float("inf"), -float("inf")]:
        y = x.clone()
        y[1] = bad
        assert not verdict([largest_magnitude(y)], []) and not verdict([], [(largest_magnitude(y), 1.0)])
    assert verdict([], []) and verdict([x[0]], [(largest_magnitude(x), 1e38)])
    largest = torch.finfo(torch.float32).max
    assert verdict([], [(torch.tensor(largest / 4), 4.0)])
    assert not verdict([], [(torch.tensor(largest / 4), 4.5)])


def test_lowrank_kept_energies_are_nested_projections_that_converge_to_the_best_ranks():
    """Rank r keeps the first r rows of P^T M: at the top rank, all of the projection's energy;
    warm-started over calls on one matrix (orthogonal iteration), the best rank-r energies."""
    from hvd_compress.maths.error_tables import lowrank_kept_energies

    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(48, 48, generator=g)).Q
    v = torch.linalg.qr(torch.randn(96, 48, generator=g)).Q
    matrix = (u * torch.exp(-0.4 * torch.arange(48.0))) @ v.t()
    ranks = [8, 4, 2, 1]
    energies, q = lowrank_kept_energies(matrix, None, ranks, seed=0, name="w")
    assert energies.dtype == torch.float64 and energies.shape == (4,)
    assert energies.tolist() == sorted(energies.tolist(), reverse=True)
    p = lowrank.orthogonalize(matrix @ lowrank.seeded_normal(96, 8, 0, "w", "gravac"))
    assert energies[0].item() == pytest.approx((p.t() @ matrix).double().square().sum().item(), rel=1e-6)
    for _ in range(20):
        energies, q = lowrank_kept_energies(matrix, q, ranks, seed=0, name="w")
    best = torch.linalg.svdvals(matrix.double()).square().cumsum(0)
    assert energies.tolist() == pytest.approx([best[r - 1].item() for r in ranks], rel=1e-4)


def test_lowrank_kept_energies_of_a_non_finite_matrix_are_not_finite():
    from hvd_compress.maths.error_tables import lowrank_kept_energies

    matrix = torch.ones(16, 32)
    matrix[3, 5] = float("nan")
    energies, _ = lowrank_kept_energies(matrix, None, [4, 2], seed=0, name="w")
    assert not torch.isfinite(energies).any()


def test_stacked_extremes_keep_each_dtype_exact_and_catch_any_non_finite():
    from hvd_compress.maths.finite import all_finite, stacked

    scalars = [torch.tensor(1e300, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float16), torch.tensor(-3.0)]
    out = stacked(scalars)
    assert out.dtype == torch.float64 and sorted(out.tolist()) == [-3.0, 2.0, 1e300]
    assert bool(all_finite(out))  # 1e300 survives: no float32 on the way
    assert not bool(all_finite(stacked(scalars + [torch.tensor(float("inf"), dtype=torch.float16)])))

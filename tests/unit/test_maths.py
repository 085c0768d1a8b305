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
    tolerance = 5 * norm_bound / (quantize.levels_for_bits(bits) * trials ** 0.5)
    assert (mean - x).abs().max() < tolerance


@pytest.mark.parametrize("n,k", [(1000, 10), (1 << 17, 1311), (1 << 17, 1), (1 << 16, 3000)])
def test_topk_indices_match_torch_topk(n, k):
    x = torch.randn(n).abs()
    ours = topk_indices(x, k)
    assert ours.numel() == k and ours.unique().numel() == k
    assert torch.equal(x[ours].sort().values, torch.topk(x, k).values.sort().values)


def test_topk_indices_with_many_ties():
    x = torch.zeros(1 << 17)
    x[:5] = 1.0
    ours = topk_indices(x, 100)
    assert ours.numel() == 100 and set(range(5)) <= set(ours.tolist())


def test_lowrank_errors_match_truncated_svd_both_ways():
    from hvd_compress.maths.errors import lowrank_errors
    matrix = torch.randn(60, 40) @ torch.diag(torch.logspace(0, -2, 40))
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    for r in [1, 3, 8]:
        best = (matrix - u[:, :r] @ torch.diag(s[:r]) @ vh[:r]).norm().item()
        # Five power steps approximate the optimum (paper, appendix B); the SVD path is exact.
        assert abs(lowrank_errors(matrix, [r])[0] - best) < 1e-2 * best
        assert abs(lowrank_errors(matrix, [r, 40, 40, 40])[0] - best) < 1e-6 * matrix.norm()  # SVD


def test_topk_errors_are_exact():
    from hvd_compress.maths.errors import topk_errors
    x = torch.randn(1000)
    for k, err in zip([1, 10, 999, 1000, 2000], topk_errors(x, [1, 10, 999, 1000, 2000])):
        kept = torch.zeros_like(x)
        idx = x.abs().topk(min(k, 1000)).indices
        kept[idx] = x[idx]
        assert abs(err - (x - kept).norm().item()) < 1e-5


def test_qsgd_errors_equal_the_mean_error_of_many_draws():
    from hvd_compress.maths.errors import qsgd_errors
    x = torch.randn(512)
    generator = torch.Generator().manual_seed(0)
    for bits, expected in zip([2, 4], qsgd_errors(x, [2, 4], 64)):
        draws = torch.stack([quantize.dequantize(*quantize.quantize(x, bits, 64, generator), bits, 64) - x
                             for _ in range(400)])
        mean_squared = draws.square().sum(dim=1).mean().item()
        assert abs(mean_squared - expected ** 2) < 0.1 * expected ** 2

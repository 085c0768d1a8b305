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

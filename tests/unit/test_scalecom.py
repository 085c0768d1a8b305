"""ScaleCom's cyclic local top-k in a simulated world."""

import math
import random

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.maths.chunked_topk import chunked_topk_indices

W = 3


def rank_grads(step, n=4096):
    return [{"w": torch.randn(64, n // 64, generator=torch.Generator().manual_seed(100 * step + r))} for r in range(W)]


def test_chunked_topk_is_exact_when_large_entries_are_spread():
    x = torch.rand(10_000) * 0.1
    spikes = torch.arange(0, 10_000, 100)  # one large entry in every chunk of 100
    x[spikes] = 1 + torch.rand(100)
    assert set(chunked_topk_indices(x, 100, chunks=100).tolist()) == set(spikes.tolist())
    picked = chunked_topk_indices(torch.rand(1001), 37, chunks=8)
    assert picked.numel() == 37 and picked.unique().numel() == 37 and picked.max() < 1001


# Layer sizes for the chunked top-k sweep: every size up to 200, sizes around chunk and bucket
# boundaries, and a seeded sample up to 5000. Densities span 1e-4..0.5; k = 1..64 is explicit.
SWEEP_SIZES = sorted(
    set(range(1, 201))
    | {255, 256, 257, 1000, 1023, 1024, 1025, 1156, 2304, 4095, 4096, 4097, 5000}
    | set(random.Random(0).sample(range(201, 5001), 150))
)
SWEEP_DENSITIES = [1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.016, 0.021, 0.03, 0.06, 0.1, 0.2, 0.3, 0.5]


def test_chunked_topk_returns_k_distinct_indices_in_range_for_every_size_and_density():
    for n in SWEEP_SIZES:
        magnitudes = torch.rand(n, generator=torch.Generator().manual_seed(n))
        ks = {max(1, math.ceil(d * n)) for d in SWEEP_DENSITIES} | set(range(1, min(64, n) + 1))
        for k in sorted(ks):
            picked = chunked_topk_indices(magnitudes, k, chunks=64)
            assert picked.numel() == k, (n, k)
            assert 0 <= picked.min() and picked.max() < n, (n, k)
            assert picked.unique().numel() == k, (n, k)


@pytest.mark.parametrize(
    "n,k,chunks",
    [
        (1024, 62, 64),
        (2304, 49, 64),
        (1156, 35, 64),
        (1000, 37, 8),
        (4096, 205, 64),
        (65, 64, 64),
        (7, 7, 64),
        (5000, 2500, 64),
    ],
)
def test_chunked_topk_keeps_the_k_largest_chunkwise_candidates(n, k, chunks):
    """The k largest of the p largest of each chunk, where p is the smallest count from
    ceil(k / c) up that gives k candidates (the last chunks may be short or empty)."""
    magnitudes = torch.randperm(n, generator=torch.Generator().manual_seed(k)).float()  # no ties
    c = min(chunks, k, n)
    width = -(-n // c)
    pieces = [magnitudes[i * width : (i + 1) * width] for i in range(c)]
    p = -(-k // c)
    while sum(min(p, piece.numel()) for piece in pieces) < k:
        p += 1
    candidates = torch.cat(
        [i * width + piece.topk(min(p, piece.numel())).indices for i, piece in enumerate(pieces) if piece.numel()]
    )
    expected = candidates[magnitudes[candidates].topk(k).indices]
    picked = chunked_topk_indices(magnitudes, k, chunks)
    assert set(picked.tolist()) == set(expected.tolist())
    assert torch.equal(chunked_topk_indices(magnitudes.clone(), k, chunks), picked)  # deterministic


def test_chunked_topk_rejects_k_above_the_length():
    with pytest.raises(ValueError, match="k must lie in"):
        chunked_topk_indices(torch.rand(10), 11, chunks=64)


@pytest.mark.parametrize("density,side", [(0.06, 32), (0.021, 48), (0.03, 34)])
def test_scalecom_on_layers_whose_last_chunks_are_padding(density, side):
    """Regression: 32x32 at density 0.06 is k = 62 in 62 chunks of 17, the last of them only
    padding; ScaleCom raised IndexError (index 1047 out of bounds for size 1024)."""
    world = SimulatedWorld([hc.ScaleCom(density=density) for _ in range(2)])
    for step in range(3):
        grads = [
            {"w": torch.randn(side, side, generator=torch.Generator().manual_seed(10 * step + r))} for r in range(2)
        ]
        out = world.step(grads)
        k = math.ceil(density * side * side)
        for r in range(2):
            assert out[r]["w"].shape == (side, side)
            assert torch.isfinite(out[r]["w"]).all()
            assert 0 < (out[r]["w"] != 0).sum() <= k
            assert torch.equal(out[r]["w"], out[0]["w"])


def test_cltk_is_commutative_sum_of_compressed_equals_compression_of_sum():
    world = SimulatedWorld([hc.ScaleCom(density=0.05) for _ in range(W)])
    grads = rank_grads(0)
    out = world.step(grads)
    k = 205  # ceil(0.05 * 4096)
    leader_indices = chunked_topk_indices(grads[0]["w"].flatten().abs(), k, 64)
    mean = sum(g["w"] for g in grads).flatten() / W
    expected = torch.zeros_like(mean)
    expected[leader_indices] = mean[leader_indices]  # CLT-k of the mean, with the leader's indices
    for r in range(W):
        assert torch.allclose(out[r]["w"].flatten(), expected, atol=1e-6)
        assert torch.equal(out[r]["w"], out[0]["w"])


def test_leader_rotates_every_step():
    compressors = [hc.ScaleCom(density=0.05) for _ in range(W)]
    world = SimulatedWorld(compressors)
    for step in range(5):
        grads = rank_grads(step)
        leader = step % W
        before = compressors[leader].residual("w").clone() if step else torch.zeros(4096)
        acc = before + grads[leader]["w"].flatten()
        out = world.step(grads)[0]["w"].flatten()
        chosen = set(chunked_topk_indices(acc.abs(), 205, 64).tolist())
        assert set(out.nonzero().flatten().tolist()) <= chosen
        assert compressors[0].leader(step + 1) == leader


def test_beta_one_is_plain_error_feedback_and_beta_filters():
    for beta in [1.0, 0.1]:
        compressor = hc.ScaleCom(density=0.05, beta=beta)
        world = SimulatedWorld([compressor])
        memory = torch.zeros(4096)
        for step in range(3):
            g = rank_grads(step)[0]
            sent = world.step([g])[0]["w"].flatten()
            acc = memory + g["w"].flatten()
            residual = acc - sent  # one rank: what was sent is C(m + g)
            memory = residual if beta == 1.0 else (1 - beta) * memory + beta * residual
            assert torch.allclose(compressor.residual("w"), memory, atol=1e-6)


def test_warmup_steps_are_dense():
    world = SimulatedWorld([hc.ScaleCom(density=0.01, warmup_steps=2) for _ in range(2)])
    for step in range(3):
        grads = rank_grads(step)[:2]
        out = world.step(grads)[0]["w"]
        dense = (grads[0]["w"] + grads[1]["w"]) / 2
        assert torch.allclose(out, dense) == (step < 2)


def test_flops_rule_and_bad_settings():
    param = torch.nn.Parameter(torch.zeros(100, 100))
    compressor = hc.ScaleCom([("a", param), ("b", param), ("c", param)])
    rates = compressor.set_rates_from_flops(
        {"a": 200 * 10_000, "b": 150 * 10_000, "c": 10 * 10_000}, {"a": 10_000, "b": 10_000, "c": 10_000}
    )
    assert rates == {"a": 25, "b": 50, "c": 400}
    assert compressor.setting("a") == 400 and compressor.setting("c") == 25
    with pytest.raises(ValueError, match="beta must lie in"):
        hc.ScaleCom(beta=0)
    with pytest.raises(ValueError, match=r"'a'.*k=20000 is outside"):
        compressor.set_setting("a", 20_000)

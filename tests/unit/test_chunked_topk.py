"""Chunked top-k with bin-mean codes and decaying error feedback (SparseLoCo's compressor), in a
simulated world of W ranks."""

import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.rounds import Collective
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.maths import binned

SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 130), "fc.bias": (64,)}


def grads(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}


@pytest.mark.parametrize("bits", binned.BITS)
def test_codes_decode_to_the_sign_times_their_bins_mean_magnitude(bits):
    values = torch.randn(5, 40, generator=torch.Generator().manual_seed(bits))
    codes, means = binned.encode(values, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2**bits
    assert means.shape == (5, binned.bins_for_bits(bits))
    decoded = binned.decode(codes, means, bits)
    assert torch.equal(torch.signbit(decoded), torch.signbit(values))
    for row in range(5):
        for level in range(means.shape[1]):
            members = (codes[row].long() % means.shape[1]) == level
            if members.any():
                assert torch.allclose(means[row, level], values[row][members].abs().mean())
    if bits == 1:  # the scaled sign
        assert torch.allclose(decoded.abs(), values.abs().mean(dim=1, keepdim=True).expand_as(values))
    # More bits, less error.
    assert (decoded - values).norm() <= 0.75 * values.norm()


def test_a_non_finite_value_decodes_its_row_non_finite_and_no_other():
    values = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    values[1, 2] = float("inf")
    values[2, 5] = float("nan")
    codes, means = binned.encode(values, 2)
    decoded = binned.decode(codes, means, 2)
    assert torch.isfinite(decoded[0]).all()
    assert not torch.isfinite(decoded[1, 2]) and not torch.isfinite(decoded[2]).all()


def test_payload_bytes_match_the_formula_and_the_traffic():
    compressor = hc.ChunkedTopK(density=0.05, chunk=256, bits=2)
    sim = SimulatedWorld([compressor, hc.ChunkedTopK(density=0.05, chunk=256, bits=2)])
    sim.step([grads(0), grads(1)])
    for name, shape in SHAPES.items():
        round_ = compressor.begin(name, torch.randn(shape))
        if len(shape) < 2:
            assert round_.collective is Collective.ALLREDUCE
            continue
        n = math.prod(shape)
        chunks, k = math.ceil(n / 256), math.ceil(0.05 * 256)
        assert round_.collective is Collective.ALLGATHER
        assert round_.payload.numel() == compressor.tuning.payload_bytes(shape, None)
        means, codes, positions = 4 * chunks * 2, 8 * math.ceil(chunks * k / 32), 8 * math.ceil(2 * chunks * k / 8)
        assert round_.payload.numel() == means + codes + positions
        assert round_.payload.numel() % 4 == 0  # gathered rows keep the float32 means readable
    compressor.reject_step()
    compressor.end_step()


def test_each_chunk_sends_its_largest_magnitudes_and_keeps_the_rest_as_residual():
    compressor = hc.ChunkedTopK(density=2 / 64, chunk=64, bits=8, min_numel=0)
    sim = SimulatedWorld([compressor])
    g = torch.zeros(4, 64)  # 4 chunks of 64
    g.view(-1)[[3, 70, 71, 200, 201]] = torch.tensor([5.0, -6.0, 7.0, 8.0, -9.0])
    g.view(-1)[130] = 0.5  # the third chunk's only nonzero, sent with a zero
    out = sim.step([{"w": g}])[0]["w"]
    sent = out.view(-1).nonzero().flatten().tolist()
    assert sent == [3, 70, 71, 130, 200, 201]
    assert torch.allclose(out.view(-1)[sent], g.view(-1)[sent], rtol=0.02)
    # Mass is conserved: what was sent plus the residual is the input.
    assert torch.allclose(out.view(-1) + compressor.residual("w").view(-1), g.view(-1), atol=1e-6)


def test_ranks_get_the_bit_identical_mean_of_what_each_sent():
    sim = SimulatedWorld([hc.ChunkedTopK(density=0.1, chunk=512) for _ in range(3)])
    inputs = [grads(r) for r in range(3)]
    out = sim.step(inputs)
    for name in SHAPES:
        assert all(torch.equal(out[0][name], out[r][name]) for r in range(3))
    # W = 3 separately, each alone: their results' mean is the world's.
    alone = [SimulatedWorld([hc.ChunkedTopK(density=0.1, chunk=512)]).step([g])[0] for g in inputs]
    for name in ["conv.weight", "fc.weight"]:
        assert torch.allclose(out[0][name], sum(a[name] for a in alone) / 3, atol=1e-6)


@pytest.mark.parametrize("decay", [1.0, 0.9, 0.0])
def test_the_residual_decays_before_the_next_input_is_added(decay):
    compressor = hc.ChunkedTopK(density=0.05, chunk=512, feedback_decay=decay)
    sim = SimulatedWorld([compressor])
    first = grads(0)
    out = sim.step([first])[0]
    residual = compressor.residual("fc.weight").clone()
    assert torch.allclose(out["fc.weight"].view(-1) + residual.view(-1), first["fc.weight"].view(-1), atol=1e-6)
    second = grads(1)
    out = sim.step([second])[0]
    x = second["fc.weight"].view(-1) + decay * residual.view(-1)
    assert torch.allclose(out["fc.weight"].view(-1) + compressor.residual("fc.weight").view(-1), x, atol=1e-5)


def test_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="bits must be one of"):
        hc.ChunkedTopK(bits=3)
    with pytest.raises(ValueError, match="chunk"):
        hc.ChunkedTopK(chunk=1 << 16)
    with pytest.raises(ValueError, match="feedback_decay"):
        hc.ChunkedTopK(feedback_decay=1.5)
    with pytest.raises(ValueError, match="density"):
        hc.ChunkedTopK(density=0)

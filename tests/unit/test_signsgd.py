"""EF-SignSGD with majority vote, in a simulated world of W ranks (no Horovod collectives)."""

import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.rounds import Collective
from hvd_compress.compressors.base import MARKER_BYTES
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.maths import signs

SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 130), "fc.bias": (64,)}


def grads(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}


def world(w):
    return SimulatedWorld([hc.SignSGD() for _ in range(w)])


def random_signs(seed, shape=(64, 130)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, shape, generator=g).float() * 2 - 1


def test_payload_is_one_bit_per_entry_plus_the_scale():
    compressor = hc.SignSGD()
    for name, shape in SHAPES.items():
        numel = math.prod(shape)
        round_ = compressor.begin(name, torch.randn(shape))
        if len(shape) < 2:  # 1-D gradients go dense
            assert round_.collective is Collective.ALLREDUCE
            continue
        assert round_.collective is Collective.ALLGATHER and round_.payload.dtype == torch.uint8
        # bits in 64-bit words, the scale, and the 4-byte marker of the input's finiteness
        own = round_.payload.numel() - MARKER_BYTES
        assert own == 8 * math.ceil(numel / 64) + 8
        assert round_.payload.numel() == compressor.tuning.payload_bytes(shape, None)
        assert own % 8 == 0  # what the compressor gets back of each row stays 8-byte aligned
    sim = world(2)
    for step in range(2):
        sim.step([grads(step), grads(step + 10)])
    first = sim.compressors[0]
    predicted = sum(first.tuning.payload_bytes(shape, first.setting(name)) for name, shape in SHAPES.items())
    assert first.traffic.payload_bytes == 2 * predicted


def test_majority_vote_of_three_is_the_majority_sign_times_the_mean_scale():
    s = [random_signs(r) for r in range(3)]
    magnitudes = [1.0, 2.0, 4.0]  # each rank's scale ||g||_1 / d is its magnitude exactly
    out = world(3).step([{"w": m * x} for m, x in zip(magnitudes, s)])
    expected = torch.sign(s[0] + s[1] + s[2]) * torch.tensor(7 / 3, dtype=torch.float32)
    for rank in range(3):
        assert torch.equal(out[rank]["w"], expected)


def test_a_tie_of_two_gives_zero():
    s = [random_signs(r) for r in range(2)]
    out = world(2).step([{"w": 1.0 * s[0]}, {"w": 3.0 * s[1]}])[0]["w"]
    agree = s[0] == s[1]
    assert 0 < agree.sum() < agree.numel()
    assert torch.equal(out[~agree], torch.zeros(int((~agree).sum())))
    assert torch.equal(out[agree], 2.0 * s[0][agree])


def test_error_feedback_identity_and_sign_of_zero():
    """With W = 1 the aggregate is what the rank sent, delta = (||p||_1 / d) * sign(p) with
    sign(0) = +1, and p = delta + the new residual at every step."""
    compressor = hc.SignSGD()
    sim = SimulatedWorld([compressor])
    for step in range(4):
        g = grads(step)
        g["fc.weight"][0, :10] = 0  # at step 0, p = 0 there: sent as +scale
        before = {n: compressor.residual(n).clone() for n in SHAPES if compressor.residual(n) is not None}
        out = sim.step([g])[0]
        kept = [n for n in SHAPES if compressor.residual(n) is not None]
        assert kept == ["conv.weight", "fc.weight"]  # the bias went dense
        for name in kept:
            p = g[name].reshape(-1) + before.get(name, 0)
            delta = torch.where(p >= 0, 1.0, -1.0) * p.abs().mean()
            sent = out[name].reshape(-1)
            assert torch.allclose(sent, delta, rtol=1e-6, atol=0)
            assert torch.allclose(p, sent + compressor.residual(name), atol=1e-6)
        if step == 0:
            zeros = out["fc.weight"][0, :10]
            assert (zeros > 0).all() and torch.equal(compressor.residual("fc.weight")[:10], -zeros)


@pytest.mark.parametrize("w", [2, 3, 4])
def test_bit_identical_on_every_rank(w):
    sim = world(w)
    for step in range(3):
        out = sim.step([grads(10 * step + r) for r in range(w)])
        for rank in range(1, w):
            for name in SHAPES:
                assert torch.equal(out[rank][name], out[0][name]), (step, rank, name)


def test_packing_round_trips_at_every_size():
    g = torch.Generator().manual_seed(0)
    for count in range(1, 101):
        bits = torch.randint(0, 2, (count,), generator=g).bool()
        packed = signs.pack_signs(bits)
        assert packed.dtype == torch.uint8 and packed.numel() == signs.packed_size(count) == 8 * math.ceil(count / 64)
        assert torch.equal(signs.unpack_signs(packed, count), bits.to(torch.uint8)), count
    # sign(0) = +1: an all-zero vector packs to all ones.
    assert torch.equal(signs.pack_signs(signs.nonnegative(torch.zeros(64))), torch.full((8,), 255, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_come_back_in_their_dtype(dtype):
    g = [{"w": torch.randn(64, 64).to(dtype), "b": torch.randn(64).to(dtype)} for _ in range(2)]
    out = world(2).step(g)
    for rank_out in out:
        assert rank_out["w"].dtype == dtype and rank_out["b"].dtype == dtype
        assert torch.isfinite(rank_out["w"].float()).all()
    assert torch.equal(out[0]["w"], out[1]["w"])


def test_no_setting_but_per_parameter_error_feedback():
    param = torch.nn.Parameter(torch.zeros(64, 64))
    compressor = hc.SignSGD([("w", param)])
    assert compressor.setting_name is None and not compressor.controllable
    assert compressor.needs_parameter_names
    with pytest.raises(ValueError, match="'w'.*no per-parameter setting"):
        compressor.set_setting("w", 2)
    with pytest.raises((TypeError, ValueError), match="'layer.weight'"):
        compressor.begin("layer.weight", torch.ones(64, 64, dtype=torch.int32))

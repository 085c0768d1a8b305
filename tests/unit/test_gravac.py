"""GraVAC: the policy on scripted curves, and the mechanism in a simulated world."""
import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.control.gravac import DENSE


def drive(policy, steps, gain, throughput):
    """Feeds the policy scripted global gains and step times; returns the CFs it sent."""
    sent = []
    for _ in range(steps):
        cf = policy.choose()
        sent.append(cf)
        g = gain(cf)
        policy.observe(cf, gain(policy.theta_min), gain(policy.candidate), g / throughput(cf))
    return sent


def distinct(values):
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_exponential_policy_scales_up_and_settles_where_throughput_saturates():
    policy = hc.GraVACPolicy(theta_min=10, theta_max=1000, epsilon=0.7, omega=0.01, window=2,
                             policy="exponential", smoothing=1.0)
    # High gains everywhere; throughput grows with CF up to 160x, then stays flat.
    sent = drive(policy, 14, gain=lambda cf: 0.95, throughput=lambda cf: min(cf, 160))
    assert distinct(sent) == [10, 20, 40, 160, 1000, 160]
    assert policy.settled and sent[-1] == 160


def test_geometric_policy_sequence():
    policy = hc.GraVACPolicy(theta_min=10, theta_max=100, window=2, policy="geometric", smoothing=1.0)
    sent = drive(policy, 10, gain=lambda cf: 0.95, throughput=lambda cf: cf)
    assert distinct(sent)[:5] == [10, 20, 40, 80, 100]


def test_low_gain_falls_back_to_theta_min_or_dense():
    for scale_down_to, expected in [("min", 10), ("dense", DENSE)]:
        policy = hc.GraVACPolicy(theta_min=10, window=100, smoothing=1.0, scale_down_to=scale_down_to)
        policy.observe(10, 0.5, 0.4, 1.0)  # both gains below epsilon = 0.7
        assert policy.choose() == expected
        policy.observe(10, 0.8, 0.4, 1.0)  # theta_min good enough, the candidate not
        assert policy.choose() == 10


def test_bad_policy_arguments_are_named():
    with pytest.raises(ValueError, match="invalid epsilon"):
        hc.GraVACPolicy(epsilon=0)
    with pytest.raises(ValueError, match="invalid policy"):
        hc.GraVACPolicy(policy="linear")
    with pytest.raises(ValueError, match="compressor must be"):
        hc.GraVAC(hc.FP16())


@pytest.mark.parametrize("inner", [lambda: hc.TopK(density=0.1), lambda: hc.PowerSGD(rank=4),
                                   lambda: hc.ACPSGD(rank=4), lambda: hc.QSGD(bits=4)])
def test_every_rank_takes_the_same_factor_every_step(inner):
    ranks = [hc.GraVAC(inner(), theta_min=2, theta_max=64, window=2, smoothing=1.0, epsilon=0.3)
             for _ in range(2)]
    world = SimulatedWorld(ranks)
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        world.step([{"w": torch.randn(64, 128, generator=g), "b": torch.randn(64, generator=g)}
                    for _ in ranks])
    assert ranks[0].history == ranks[1].history
    assert len({h[0] for h in ranks[0].history}) > 1  # the factor did change
    assert all(0 <= h[1] <= 1.0 + 1e-6 and 0 <= h[2] <= h[1] + 1e-6 for h in ranks[0].history)


def test_dense_fallback_sends_gradient_plus_residual_and_clears_it():
    gravac = hc.GraVAC(hc.TopK(density=0.1), theta_min=2, window=100, scale_down_to="dense",
                       epsilon=0.99, smoothing=1.0)
    world = SimulatedWorld([gravac])
    g = {"w": torch.randn(64, 128)}
    world.step([g])  # compressed at theta_min; the gain is far below 0.99
    assert gravac.cf == DENSE
    residual = gravac.inner.residual("w").clone()
    out = world.step([g])[0]["w"]
    assert torch.allclose(out.flatten(), g["w"].flatten() + residual)
    assert gravac.inner.residual("w").abs().sum() == 0

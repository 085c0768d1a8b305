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
    policy = hc.GraVACPolicy(
        hc.GraVACConfig(
            theta_min=10, theta_max=1000, epsilon=0.7, omega=0.01, window=2, policy="exponential", smoothing=1.0
        )
    )
    # High gains everywhere; throughput grows with CF up to 160x, then stays flat.
    sent = drive(policy, 14, gain=lambda cf: 0.95, throughput=lambda cf: min(cf, 160))
    assert distinct(sent) == [10, 20, 40, 160, 1000, 160]
    assert policy.settled and sent[-1] == 160


def test_geometric_policy_sequence():
    policy = hc.GraVACPolicy(hc.GraVACConfig(theta_min=10, theta_max=100, window=2, policy="geometric", smoothing=1.0))
    sent = drive(policy, 10, gain=lambda cf: 0.95, throughput=lambda cf: cf)
    assert distinct(sent)[:5] == [10, 20, 40, 80, 100]


def test_low_gain_falls_back_to_theta_min_or_dense():
    for scale_down_to, expected in [("min", 10), ("dense", DENSE)]:
        policy = hc.GraVACPolicy(hc.GraVACConfig(theta_min=10, window=100, smoothing=1.0, scale_down_to=scale_down_to))
        policy.observe(10, 0.5, 0.4, 1.0)  # both gains below epsilon = 0.7
        assert policy.choose() == expected
        policy.observe(10, 0.8, 0.4, 1.0)  # theta_min good enough, the candidate not
        assert policy.choose() == 10


def test_bad_policy_arguments_are_named():
    with pytest.raises(ValueError, match="epsilon must lie in"):
        hc.GraVACConfig(epsilon=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        hc.GraVACConfig(policy="linear")
    with pytest.raises(ValueError, match="compressor must be"):
        hc.GraVAC(hc.FP16())


def structured_gradient(step, n=64, m=128, decay=0.3, noise=0.01):
    """A fixed matrix whose singular values decay as exp(-decay i), plus noise drawn per step:
    gradients keep their leading directions from step to step. (On fresh Gaussian matrices,
    whose spectrum is flat, a rank-r projection keeps about r / min(n, m) of the energy, and
    the low-rank gains stay below any useful epsilon.)"""
    base = torch.Generator().manual_seed(1234)
    u = torch.linalg.qr(torch.randn(n, n, generator=base)).Q
    v = torch.linalg.qr(torch.randn(m, n, generator=base)).Q
    spectrum = torch.exp(-decay * torch.arange(float(n)))
    return (u * spectrum) @ v.t() + noise * torch.randn(n, m, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize(
    "inner",
    [lambda: hc.TopK(density=0.1), lambda: hc.PowerSGD(rank=4), lambda: hc.ACPSGD(rank=4), lambda: hc.QSGD(bits=4)],
)
def test_every_rank_takes_the_same_factor_every_step(inner):
    ranks = [hc.GraVAC(inner(), theta_min=2, theta_max=64, window=2, smoothing=1.0, epsilon=0.3) for _ in range(2)]
    world = SimulatedWorld(ranks)
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        world.step([{"w": structured_gradient(step), "b": torch.randn(64, generator=g)} for _ in ranks])
    assert ranks[0].history == ranks[1].history
    assert len({h[0] for h in ranks[0].history}) > 1  # the factor did change
    assert all(0 <= h[1] <= 1.0 + 1e-6 and 0 <= h[2] <= h[1] + 1e-6 for h in ranks[0].history)


def test_dense_fallback_sends_gradient_plus_residual_and_clears_it():
    gravac = hc.GraVAC(
        hc.TopK(density=0.1), theta_min=2, window=100, scale_down_to="dense", epsilon=0.99, smoothing=1.0
    )
    world = SimulatedWorld([gravac])
    g = {"w": torch.randn(64, 128)}
    world.step([g])  # compressed at theta_min; the gain is far below 0.99
    assert gravac.cf == DENSE
    residual = gravac.inner.residual("w").clone()
    out = world.step([g])[0]["w"]
    assert torch.allclose(out.flatten(), g["w"].flatten() + residual)
    assert gravac.inner.residual("w") is None


def scripted_clock(durations, start=100.0):
    """A clock for ``GraVAC.clock``: its k-th reading (one per ``end_step``) comes
    ``durations[k]`` seconds after the previous one."""
    readings = iter(torch.tensor([start, *durations], dtype=torch.float64).cumsum(0)[1:].tolist())
    return lambda: next(readings)


def heavy_tailed(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"w": torch.randn(64, 128, generator=g) ** 3, "b": torch.randn(64, generator=g)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_dense_steps_still_feed_the_policy_and_can_leave_dense(dtype):
    """A dense float16 payload used to carry no statistics: the policy, never fed again, stayed
    dense for good. Now every step feeds it, energies are float32 (those of these gradients
    overflow float16), and outputs keep the gradient's dtype, bit-identical on every rank."""
    ranks = [
        hc.GraVAC(
            hc.TopK(density=0.1),
            theta_min=2,
            theta_max=64,
            window=100,
            smoothing=1.0,
            scale_down_to="dense",
            epsilon=0.95,
        )
        for _ in range(2)
    ]
    world = SimulatedWorld(ranks)
    wire = torch.float64 if dtype == torch.float64 else torch.float32
    sent = []
    for step in range(8):
        grads = []
        for rank in range(2):
            g = torch.Generator().manual_seed(100 * step + rank)
            w = 1000 * torch.randn(64, 128, generator=g)  # squares overflow float16
            if step >= 4:  # from now on sparse: theta_min keeps all the energy
                w = w * (torch.rand(64, 128, generator=g) < 0.02)
            grads.append({"w": w.to(dtype), "b": torch.randn(64, generator=g).to(dtype)})
        sent.append(ranks[0].cf)
        out = world.step(grads)
        for name in grads[0]:
            assert out[0][name].dtype == dtype and torch.isfinite(out[0][name]).all()
            assert torch.equal(out[0][name], out[1][name]), (step, name)
        if step == 2:  # dense, the residual already sent at step 1: exactly the mean
            expected = (torch.stack([g["w"] for g in grads]).to(wire).sum(dim=0) / 2).to(dtype)
            assert torch.equal(out[0]["w"], expected)
        assert ranks[0].policy.steps == step + 1  # fed every step, dense or not
        assert len(ranks[0].history) == step  # each entry waits for its step's duration
    assert sent[0] == 2 and sent[1:5] == [DENSE] * 4, sent
    assert sent[5] != DENSE and ranks[0].cf != DENSE, sent
    assert ranks[0].history == ranks[1].history
    assert [h[0] for h in ranks[0].history] == sent[:-1]
    assert all(0 < h[2] <= h[1] + 1e-6 and h[1] <= 1.0 + 1e-6 for h in ranks[0].history)


@pytest.mark.parametrize(
    "inner",
    [lambda: hc.TopK(density=0.1), lambda: hc.PowerSGD(rank=4), lambda: hc.ACPSGD(rank=4), lambda: hc.QSGD(bits=4)],
    ids=["topk", "powersgd", "acpsgd", "qsgd"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_come_back_in_their_dtype(inner, dtype):
    ranks = [hc.GraVAC(inner(), theta_min=2, theta_max=64, window=2, smoothing=1.0, epsilon=0.3) for _ in range(2)]
    world = SimulatedWorld(ranks)
    for step in range(4):
        out = world.step([{k: v.to(dtype) for k, v in heavy_tailed(step, rank).items()} for rank in range(2)])
        for name in out[0]:
            assert out[0][name].dtype == dtype and torch.isfinite(out[0][name]).all()
            assert torch.equal(out[0][name], out[1][name])
    assert ranks[0].history == ranks[1].history and len(ranks[0].history) == 3


def test_each_step_time_is_paired_with_the_factor_that_step_sent():
    """Step 2 takes 0.20 s, the others 0.01 s: the 0.20 s belongs to step 2's history entry,
    with step 2's factor, and to that factor's throughput (it used to land one entry later)."""
    durations = [0.01, 0.01, 0.20, 0.01, 0.01, 0.01, 0.01]
    ranks = [
        hc.GraVAC(hc.TopK(density=0.1), theta_min=2, theta_max=64, window=1, smoothing=1.0, epsilon=0.3)
        for _ in range(2)
    ]
    for gravac in ranks:
        gravac.clock = scripted_clock(durations)
    world = SimulatedWorld(ranks)
    sent = []
    for step in range(len(durations)):
        sent.append(ranks[0].cf)
        world.step([heavy_tailed(step, rank) for rank in range(2)])
    history = list(ranks[0].history)
    assert history == list(ranks[1].history)
    assert len(set(sent[1:4])) == 3, sent  # distinct factors around the slow step
    assert [h[0] for h in history] == sent[:-1]
    assert history[0][3] == 0  # the first step's duration is unknown
    for step, entry in enumerate(history[1:], start=1):
        assert entry[3] == pytest.approx(durations[step], rel=1e-6), (step, entry)
    # With smoothing 1 a factor's throughput is its last step's: gain / seconds. The slow step
    # sent the candidate (its gain is the candidate's), and no other step sent that factor.
    assert sent.count(sent[2]) == 1
    assert ranks[0].policy.throughput[sent[2]] == pytest.approx(history[2][2] / 0.20, rel=1e-6)


def test_a_non_finite_step_leaves_no_trace_in_the_pairing():
    """Step 3 is non-finite and takes 0.5 s: it has no history entry, its duration shows up
    nowhere, and every other step keeps its own factor, gains and duration: the entries are
    those of a run where step 3 is not taken at all."""

    def run(bad):
        durations = [0.01 * (k + 1) for k in range(7)]
        if bad:
            durations[3] = 0.5
        ranks = [
            hc.GraVAC(hc.TopK(density=0.1), theta_min=2, theta_max=64, window=1, smoothing=1.0, epsilon=0.3)
            for _ in range(2)
        ]
        for gravac in ranks:
            gravac.clock = scripted_clock(durations if bad else durations[:3] + durations[4:])
        world = SimulatedWorld(ranks)
        for step in range(7):
            grads = [heavy_tailed(step, rank) for rank in range(2)]
            if step == 3:
                if not bad:
                    continue
                grads[1]["w"][5, 7] = float("inf")
            world.step(grads)
        assert ranks[0].history == ranks[1].history
        return list(ranks[0].history), durations

    history, durations = run(bad=True)
    clean, _ = run(bad=False)
    assert history == clean
    assert [h[3] for h in history[1:]] == pytest.approx([durations[k] for k in (1, 2, 4, 5)], rel=1e-6)


def test_gains_under_loss_scaling_are_those_of_the_unscaled_gradients():
    """Residuals are kept unscaled (``track``): x = gradient + scale * residual, as the
    compressor builds it. A power-of-two scale changes no gain at all."""

    class Scaler:
        def get_scale(self):
            return 1024.0

    def run(scale):
        gravac = hc.GraVAC(hc.TopK(density=0.1), theta_min=2, theta_max=64, window=2, smoothing=1.0, epsilon=0.3)
        if scale != 1:
            gravac.track(Scaler())
        world = SimulatedWorld([gravac])
        for step in range(5):
            world.step([{k: scale * v for k, v in heavy_tailed(step, 0).items()}])
        return [h[:3] for h in gravac.history]

    assert run(1024.0) == run(1)


@pytest.mark.parametrize(
    "inner",
    [lambda: hc.TopK(density=0.1), lambda: hc.PowerSGD(rank=4), lambda: hc.ACPSGD(rank=4), lambda: hc.QSGD(bits=4)],
)
@pytest.mark.parametrize("shape", [(64, 96), (256, 512)])  # the second past the Top-K histogram's size
@pytest.mark.parametrize("sent", [0, 1])  # theta_min's setting, or the candidate's
@pytest.mark.parametrize("with_residual", [False, True])
def test_measuring_begin_gives_the_gains_of_a_separate_measurement(inner, shape, sent, with_residual):
    """``begin_measured`` derives the energies from the compression's work; they are those of
    ``kept_energies`` on gradient plus residual, measured apart: to float32 rounding where the
    selection itself is used, to the histogram's accuracy where the separate measurement used it."""
    compressor = inner()
    settings = [compressor.tuning.setting_for_factor(shape, factor) for factor in (4, 8)]
    compressor.set_setting("w", settings[sent])
    world = SimulatedWorld([compressor])
    if with_residual:
        world.step([{"w": structured_gradient(0, *shape)}])
    grad = structured_gradient(1, *shape)
    x = grad.clone()
    if compressor.residual("w") is not None:
        x += compressor.residual("w").view(shape)
    memo, separate_memo = {}, {}
    expected = torch.cat(
        [x.double().square().sum().reshape(1), compressor.tuning.kept_energies("w", x, settings, separate_memo)]
    )
    _, energies = compressor.tuning.begin_measured("w", grad, settings, memo)
    assert energies.dtype == torch.float64 and energies.shape == (3,)
    histogram = isinstance(compressor, hc.TopK) and x.numel() >= 1 << 16
    torch.testing.assert_close(energies, expected, rtol=1e-2 if histogram else 1e-6, atol=0)
    assert memo.keys() == separate_memo.keys()

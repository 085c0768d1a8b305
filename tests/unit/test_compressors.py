"""Compressor invariants in a simulated world of W ranks (no Horovod collectives)."""

import io

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld

import degenerate  # tests/degenerate.py
from dense_switch import dense_switchable, sends_whole

SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 128), "fc.bias": (64,)}
# Every compressor in the registry, at its defaults.
REGISTERED = [pytest.param(method.cls, id=name) for name, method in sorted(hc.COMPRESSORS.items())]


def grads(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) * scale for name, shape in SHAPES.items()}


def world(make, w):
    return SimulatedWorld([make() for _ in range(w)])


def test_powersgd_recovers_exact_low_rank_matrix():
    # Fixed factors: unseeded, they followed the tests before this one, and 1 draw in 300 is
    # conditioned so that float32's orthogonalisation misses 1e-4 (1.8e-4).
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(64, 3, generator=g), torch.randn(128, 3, generator=g)
    m = u @ v.t()
    sim = world(lambda: hc.PowerSGD(rank=3), 1)
    out = sim.step([{"w": m}])[0]["w"]
    assert torch.allclose(out, m, atol=1e-4 * m.abs().max())


@pytest.mark.parametrize(
    "make", [lambda: hc.PowerSGD(rank=2), lambda: hc.ACPSGD(rank=2), lambda: hc.TopK(density=0.05)]
)
def test_error_feedback_identity(make):
    """compensated = sent + new residual, for every compressed gradient, at every step."""
    compressor = make()
    sim = SimulatedWorld([compressor])
    for step in range(3):
        g = grads(step)
        before = {n: compressor.residual(n).clone() for n in SHAPES if compressor.residual(n) is not None}
        out = sim.step([g])[0]
        kept = [n for n in SHAPES if compressor.residual(n) is not None]
        assert kept == ["conv.weight", "fc.weight"]  # the bias went dense
        for name in kept:
            residual = compressor.residual(name)
            compensated = g[name].reshape(residual.shape) + before.get(name, 0)
            # With W = 1 the aggregate is exactly what this rank sent.
            sent = out[name].reshape(residual.shape)
            assert torch.allclose(compensated, sent + residual, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 2, 8, 16])  # P = M Q in both forms (maths.lowrank.project_right)
@pytest.mark.parametrize("method", [hc.PowerSGD, hc.ACPSGD])
def test_linearity_w_workers_equal_one_worker_at_w_times_batch(method, rank):
    """Mean over W workers of batch-B gradients == one worker with their mean (batch W*B),
    step after step, because every operation is linear in the gradient given shared factors."""
    w = 4
    many, one = world(lambda: method(rank=rank), w), world(lambda: method(rank=rank), 1)
    for step in range(4):
        per_rank = [grads(100 * step + r) for r in range(w)]
        mean = {n: sum(g[n] for g in per_rank) / w for n in SHAPES}
        out_many = many.step(per_rank)
        out_one = one.step([mean])[0]
        for name in SHAPES:
            for r in range(w):
                assert torch.allclose(out_many[r][name], out_one[name], atol=1e-5), (step, name)


def test_qsgd_aggregate_is_unbiased():
    from hvd_compress.maths.quantize import bucket_norms, levels_for_bits

    g = {"w": torch.randn(64, 64)}
    w, bits, bucket, trials = 2, 3, 128, 1500
    sim = SimulatedWorld([hc.QSGD(bits=bits, bucket_size=bucket, seed=s) for s in range(w)])
    total = torch.zeros(64, 64)
    for _ in range(trials):
        total += sim.step([g] * w)[0]["w"]
    error = total / trials - g["w"]
    # Each entry's rounding noise is bounded by norm/s per rank; its mean over trials*W draws
    # has standard error at most sigma below.
    sigma = bucket_norms(g["w"].flatten(), bucket).max() / levels_for_bits(bits) / (trials * w) ** 0.5
    assert error.abs().max() < 5 * sigma
    assert error.mean().abs() < 5 * sigma / error.numel() ** 0.5


def test_topk_keeps_k_entries():
    compressor = hc.TopK(density=0.01, error_feedback=False)
    g = torch.randn(100, 200)
    payload = compressor.begin("w", g)
    out = payload.then(payload.payload.unsqueeze(0))
    assert (out != 0).sum() == 200
    assert torch.equal(out.abs().flatten().topk(200).values, g.abs().flatten().topk(200).values)


@pytest.mark.parametrize(
    "make",
    [
        hc.FP16,
        hc.BF16,
        hc.NoCompression,
        lambda: hc.QSGD(bits=8, bucket_size=16),
        lambda: hc.TopK(density=1.0),
        lambda: hc.PowerSGD(rank=64, min_compression_rate=0.01),
    ],
)
@pytest.mark.parametrize("w", [1, 3])
def test_aggregate_approximates_mean(make, w):
    per_rank = [grads(r) for r in range(w)]
    out = world(make, w).step(per_rank)
    for name in SHAPES:
        mean = sum(g[name] for g in per_rank) / w
        for r in range(w):
            assert out[r][name].shape == mean.shape
            assert torch.equal(out[r][name], out[0][name])  # identical on every rank
            assert torch.allclose(out[r][name], mean, atol=0.05, rtol=0.02), name


def test_small_and_1d_tensors_travel_dense():
    for compressor in [hc.PowerSGD(), hc.ACPSGD(), hc.QSGD(), hc.TopK()]:
        for grad in [torch.randn(5000), torch.randn(10, 10)]:
            r = compressor.begin(f"x{grad.dim()}", grad)
            assert r.last and torch.equal(r.then(r.payload), grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", REGISTERED)
def test_half_precision_gradients_come_back_in_their_dtype(make, dtype):
    g = {"w": torch.randn(64, 64).to(dtype), "b": torch.randn(64).to(dtype)}
    out = world(make, 2).step([g, g])[0]
    assert out["w"].dtype == dtype and out["b"].dtype == dtype
    assert torch.isfinite(out["w"].float()).all()


def test_bf16_dense_tensor_travels_as_float32():
    r = hc.PowerSGD().begin("b", torch.randn(10).to(torch.bfloat16))
    assert r.payload.dtype == torch.float32


@pytest.mark.parametrize("make", REGISTERED)
def test_integer_gradient_is_rejected_with_its_name(make):
    with pytest.raises(TypeError, match="'layer.weight'"):
        make().begin("layer.weight", torch.ones(64, 64, dtype=torch.int32))


# Per rank of two: 30000 and 50000, whose float16 sum overflows and whose mean (40000) does not.
OVERFLOWING_SUM = (30000.0, 50000.0)


@pytest.mark.parametrize(
    "make, dtype",
    [
        (hc.FP16, torch.float32),
        (hc.FP16, torch.float16),
        (hc.NoCompression, torch.float16),
        (lambda: hc.PowerSGD(rank=2), torch.float16),
    ],
)
@pytest.mark.parametrize("w", [2, 4])
def test_a_float16_mean_whose_sum_overflows_survives(make, dtype, w):
    """Every float16 all-reduce (FP16's payload, a float16 gradient sent dense) divides by W
    before the sum, as torch's fp16_compress_hook does: 40000, not Inf."""
    low, high = OVERFLOWING_SUM
    values = [low + (high - low) * r / (w - 1) for r in range(w)]
    values = [float(torch.tensor(v).half()) for v in values]
    out = world(make, w).step([{"w": torch.full((8, 4), v, dtype=dtype)} for v in values])
    for r in range(w):
        assert out[r]["w"].dtype == dtype and torch.equal(out[r]["w"], out[0]["w"])
    assert torch.equal(out[0]["w"], torch.full((8, 4), 40000.0, dtype=dtype))


def test_bf16_mean_near_the_largest_bfloat16_survives():
    """BF16 sums bfloat16 entries in float32: two of 3e38 would overflow it; divided first they
    average to 3e38 (as bfloat16)."""
    big = float(torch.tensor(3e38).bfloat16())
    out = world(hc.BF16, 2).step([{"w": torch.full((8, 4), big)}] * 2)
    assert torch.equal(out[0]["w"], torch.full((8, 4), big))


def degenerate_methods():
    """Every registered compressor, and every registered controller over every compressor it
    can wrap, at their small settings with min_numel 0 (so that each compresses what it can)."""
    return [
        pytest.param(lambda n=n: hc.COMPRESSORS[n].build(small=True, min_numel=0), 2, id=n)
        for n in sorted(hc.COMPRESSORS)
    ] + [
        pytest.param(
            lambda c=c, n=n: hc.CONTROLLERS[c].build(hc.COMPRESSORS[n].build(small=True, min_numel=0), small=True),
            hc.CONTROLLERS[c].simulated_ranks,
            id=f"{c}-{n}",
        )
        for c in sorted(hc.CONTROLLERS)
        for n in hc.registry.controllable()
    ]


@pytest.mark.parametrize("kind", sorted(degenerate.GRADIENTS))
@pytest.mark.parametrize("make, w", degenerate_methods())
def test_degenerate_shapes_travel_and_keep_their_names_in_checkpoints(make, w, kind):
    """An empty gradient, a scalar, a dimension of 1, a transposed and a channels_last one:
    each is compressed where it can be and sent whole where it cannot, beside a layer that is
    compressed, for more steps than a controller takes to decide; results keep the gradient's
    shape and are finite and identical on every rank. A checkpoint round trip keeps the
    parameter's name and resumes bit for bit."""

    def gradients(step):
        g = torch.Generator().manual_seed(step)
        return [{kind: degenerate.GRADIENTS[kind](g), "fc.weight": torch.randn(64, 128, generator=g)} for _ in range(w)]

    compressions = [make() for _ in range(w)]
    sim = SimulatedWorld(compressions)
    for step in range(6):
        per_rank = gradients(step)
        out = sim.step(per_rank)
        for r in range(w):
            assert out[r][kind].shape == per_rank[r][kind].shape
            assert torch.equal(out[r][kind], out[0][kind]) and torch.isfinite(out[r][kind]).all()
    checkpoints = [torch.load(_saved(c.state_dict()), weights_only=True) for c in compressions]
    assert all(kind in str(checkpoint) for checkpoint in checkpoints)
    resumed = [make() for _ in range(w)]
    for compression, checkpoint in zip(resumed, checkpoints):
        compression.load_state_dict(checkpoint)
    for step in range(6, 8):
        expected, got = sim.step(gradients(step)), SimulatedWorld(resumed).step(gradients(step))
        assert all(torch.equal(a[n], b[n]) for a, b in zip(expected, got) for n in a)


def _saved(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return buffer


def test_invalid_settings_name_the_parameter():
    param = torch.nn.Parameter(torch.zeros(10, 10))
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        hc.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="'w'.*rank must be a positive integer, got -1"):
        hc.ACPSGD([("w", param)]).set_setting("w", -1)
    with pytest.raises(ValueError, match=r"'w'.*k=101 is outside \(0, 100\]"):
        hc.TopK([("w", param)]).set_setting("w", 101)
    with pytest.raises(ValueError, match="'w'.*k must be a positive integer, got 0"):
        hc.TopK([("w", param)]).set_setting("w", 0)
    with pytest.raises(ValueError, match="density must lie in"):
        hc.TopK(density=0)
    with pytest.raises(ValueError, match=r"'w'.*bits must be an integer in \[2, 8\], got 9"):
        hc.QSGD([("w", param)]).set_setting("w", 9)
    with pytest.raises(ValueError, match="bits must be"):
        hc.QSGD(bits=1)


def test_settings_change_between_steps():
    compressor = hc.PowerSGD(rank=2)
    sim = SimulatedWorld([compressor])
    sim.step([{"w": torch.randn(64, 64)}])
    compressor.set_setting("w", 5)
    r = compressor.begin("w", torch.randn(64, 64))
    assert r.payload.numel() == 64 * 5  # P, 64 x 5 (it carries the input's non-finite entries: no marker)
    assert compressor.settings() == {} and compressor.setting("w") == 5


def test_topk_k_checked_against_the_gradient_when_unbound():
    compressor = hc.TopK()
    compressor.set_setting("w", 5000)
    with pytest.raises(ValueError, match=r"'w'.*k=5000 is outside \(0, 4096\]"):
        compressor.begin("w", torch.randn(64, 64))


def test_state_dict_roundtrip_resumes_identically():
    a = hc.ACPSGD(rank=2)
    sim_a = SimulatedWorld([a])
    for step in range(3):
        sim_a.step([grads(step)])
    b = hc.ACPSGD(rank=2)
    b.load_state_dict(a.state_dict())
    sim_b = SimulatedWorld([b])
    out_a, out_b = sim_a.step([grads(9)])[0], sim_b.step([grads(9)])[0]
    for name in SHAPES:
        assert torch.equal(out_a[name], out_b[name])


def test_pickle_drops_communication_state():
    import pickle

    compressor = hc.PowerSGD(rank=2)
    SimulatedWorld([compressor]).step([grads(0)])
    restored = pickle.loads(pickle.dumps(compressor))
    assert restored._stock_bridges is None and set(restored.state) == set(compressor.state)


@pytest.mark.parametrize("make", REGISTERED)
def test_payload_bytes_count_what_is_sent(make):
    """L-GreCo's size table must count the bytes actually handed to collectives."""
    sim = world(make, 2)
    for step in range(2):
        sim.step([grads(step), grads(step + 10)])
    compressor = sim.compressors[0]
    predicted = sum(compressor.tuning.payload_bytes(shape, compressor.setting(name)) for name, shape in SHAPES.items())
    assert compressor.traffic.payload_bytes == 2 * predicted


@pytest.mark.parametrize("controller", sorted(hc.CONTROLLERS))
def test_every_controller_wraps_exactly_the_controllable_registered_compressors(controller):
    controllable = hc.registry.controllable()
    names = ", ".join(sorted(hc.COMPRESSORS[n].core.__name__ for n in controllable))
    for name, method in hc.COMPRESSORS.items():
        if name in controllable:
            hc.CONTROLLERS[controller].build(method.build(small=True), small=True)
        else:
            with pytest.raises(ValueError, match=f"compressor must be one of {names} .* got {method.core.__name__}"):
                hc.CONTROLLERS[controller].build(method.build(small=True), small=True)


DENSE_SWITCHABLE = dense_switchable(SHAPES["fc.weight"])


def test_low_rank_compressors_can_send_a_layer_whole():
    """The dense-switch tests below cover what they should (a registry change that drops
    these would leave them testing nothing)."""
    assert {"powersgd", "acpsgd"} <= set(DENSE_SWITCHABLE)


@pytest.mark.parametrize("name", DENSE_SWITCHABLE)
def test_a_layer_switched_to_a_setting_that_sends_it_whole_sends_its_residual_once(name):
    """A controller's decision, ``set_setting`` or a resumed checkpoint can leave a layer at a
    setting that does not compress it. Its first dense step sends gradient plus residual, and
    the residual is gone; later dense steps send the plain mean."""
    w = 2
    sim = world(lambda: hc.COMPRESSORS[name].build(small=True), w)
    for step in range(3):
        sim.step([grads(10 * step + r) for r in range(w)])
    residuals = [c.residual("fc.weight").clone() for c in sim.compressors]
    assert all(r.abs().sum() > 0 for r in residuals)
    whole = sends_whole(sim.compressors[0], SHAPES["fc.weight"])
    for compressor in sim.compressors:
        compressor.set_setting("fc.weight", whole)
    per_rank = [grads(100 + r) for r in range(w)]
    out = sim.step(per_rank)
    expected = sum(g["fc.weight"] + r.view(SHAPES["fc.weight"]) for g, r in zip(per_rank, residuals)) / w
    for rank in range(w):
        assert torch.allclose(out[rank]["fc.weight"], expected, atol=1e-6)
        assert sim.compressors[rank].residual("fc.weight") is None
        assert "fc.weight" not in sim.compressors[rank].state_dict()["residuals"]
    per_rank = [grads(200 + r) for r in range(w)]
    out = sim.step(per_rank)
    assert torch.allclose(out[0]["fc.weight"], sum(g["fc.weight"] for g in per_rank) / w, atol=1e-6)


@pytest.mark.parametrize("name", DENSE_SWITCHABLE)
def test_a_non_finite_dense_switch_step_keeps_the_residual(name):
    """A skipped step leaves no trace: the residual a dense step would have sent is still there."""
    sim = world(lambda: hc.COMPRESSORS[name].build(small=True), 1)
    sim.step([grads(0)])
    compressor = sim.compressors[0]
    before = compressor.residual("fc.weight").clone()
    compressor.set_setting("fc.weight", sends_whole(compressor, SHAPES["fc.weight"]))
    bad = grads(1)
    bad["fc.weight"][0, 0] = float("inf")
    sim.step([bad])
    assert not compressor.last_step_finite
    assert torch.equal(compressor.residual("fc.weight"), before)


# The compressors whose result is a new gradient-sized tensor unless written into the gradient.
WRITE_INTO_GRADIENTS = ("acpsgd", "bf16", "fp16", "powersgd", "qsgd", "scalecom", "topk")


@pytest.mark.parametrize("name", WRITE_INTO_GRADIENTS)
def test_results_go_into_float32_gradients_only_where_the_integration_says(name):
    for into, dtype in [(True, torch.float32), (True, torch.float16), (False, torch.float32)]:
        sim = world(lambda: hc.COMPRESSORS[name].build(small=True, min_numel=0), 2)
        if into:
            for compressor in sim.compressors:
                compressor.write_results_into_gradients()
        for step in range(3):
            per_rank = [{n: g.to(dtype) for n, g in grads(10 * step + r).items()} for r in range(2)]
            out = sim.step(per_rank)
            for rank in range(2):
                shared = out[rank]["fc.weight"].data_ptr() == per_rank[rank]["fc.weight"].data_ptr()
                assert shared == (into and dtype == torch.float32), (name, into, dtype, step)

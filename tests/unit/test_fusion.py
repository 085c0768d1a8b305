"""Fusion plans and fused execution, in one process."""

import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.driver import RoundDriver
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion, plan_buckets, scaled_threshold
from hvd_compress.comm.rounds import Collective, Traffic

SHAPES = {
    "fc2.bias": (10,),
    "fc2.weight": (10, 256),
    "fc1.bias": (256,),
    "fc1.weight": (256, 512),
    "conv.weight": (64, 32, 3, 3),
}


def test_plans_respect_threshold_and_order_and_are_deterministic():
    payloads = [(f"p{i}", size) for i, size in enumerate([5, 30, 10, 60, 1, 1, 45, 20])]
    plan = plan_buckets(payloads, 40)
    assert [name for b in plan.buckets for name in b.members] == [n for n, _ in payloads]
    for bucket in plan.buckets:
        assert bucket.nbytes <= 40 or len(bucket.members) == 1
    assert plan.digest() == plan_buckets(list(payloads), 40).digest()
    assert plan.digest() != plan_buckets(payloads, 41).digest()


def test_threshold_scales_with_compression_rate():
    assert scaled_threshold(64 << 20, 1 << 20, 16 << 20) == 4 << 20
    compressor = hc.ACPSGD(rank=4)
    scheduler = FusionScheduler(compressor, SHAPES, ScaledFusion(dense_threshold=1 << 20))
    plan = scheduler.plan()
    dense = sum(4 * math.prod(s) for s in SHAPES.values())
    sent = sum(b.nbytes for b in plan.buckets)
    assert plan.threshold == scaled_threshold(1 << 20, sent, dense) and sent < dense / 10


def test_acpsgd_has_one_plan_for_p_steps_and_one_for_q_steps_and_replans_on_new_settings():
    compressor = hc.ACPSGD(rank=4, min_numel=0)
    scheduler = FusionScheduler(compressor, SHAPES, ScaledFusion(dense_threshold=1 << 16))
    p_plan = scheduler.plan()
    for name, shape in SHAPES.items():
        compressor.begin(name, torch.randn(shape))  # one P step
    q_plan = scheduler.plan()
    assert (p_plan.phase, q_plan.phase) == ("P", "Q") and p_plan.digest() != q_plan.digest()
    compressor.set_setting("fc1.weight", 16)
    assert scheduler.plan().digest() != q_plan.digest()


class LoopbackBackend:
    """One rank: every collective returns its own payload (stacked for all-gather)."""

    size = 1

    def start(self, op_name, round_):
        if round_.collective is Collective.ALLGATHER:
            return round_.payload.unsqueeze(0)
        return round_.payload.clone()

    def done(self, handle):
        return True

    def wait(self, handle):
        return handle


class MirrorBackend:
    """Rank 0 of two ranks that sent the same payloads: an all-gather returns two rows of it,
    an all-to-all row 0 from each, an all-reduce twice it."""

    size = 2

    def start(self, op_name, round_):
        payload = round_.payload
        if round_.collective is Collective.ALLGATHER:
            return torch.stack([payload, payload])
        if round_.collective is Collective.ALLTOALL:
            return torch.stack([payload[0], payload[0]])
        return payload * 2

    def done(self, handle):
        return True

    def wait(self, handle):
        return handle


@pytest.mark.parametrize(
    "make",
    [
        lambda: hc.ACPSGD(rank=4, min_numel=0),
        lambda: hc.TopK(min_numel=0),
        lambda: hc.PowerSGD(rank=2, min_numel=0),
        lambda: hc.QuantizedAllReduce(bits=4, min_numel=0),  # all-to-all, then all-gather
        lambda: hc.BF16(),
    ],
)
@pytest.mark.parametrize("threshold", [1, 1 << 12, 1 << 40])
@pytest.mark.parametrize("backend", [LoopbackBackend, MirrorBackend])
def test_fused_execution_equals_unfused(make, threshold, backend):
    g = torch.Generator().manual_seed(0)
    grads = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    results = []
    for fused in [False, True]:
        compressor = make()
        compressor.bind_world(0, backend.size)
        driver = RoundDriver(backend(), Traffic())
        if fused:
            scheduler = FusionScheduler(compressor, SHAPES, ScaledFusion(threshold, scaled=False))
            driver.use_plan(scheduler.plan())
        for name, grad in grads.items():
            driver.start(name, grad, compressor.begin(name, grad))
        results.append(driver.finish())
    assert all(torch.equal(results[0][n], results[1][n]) for n in SHAPES)


def test_bad_fusion_argument_is_named():
    with pytest.raises(ValueError, match="fusion must be a ScaledFusion or None"):
        hc.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), fusion=1 << 20)

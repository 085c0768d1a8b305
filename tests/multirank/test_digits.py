"""Convergence on real data: the digits CNN, trained with each compressor through stock Horovod,
reaches the uncompressed test accuracy within 1 point.

One point is 3.6 of the 360 test images, about the seed-to-seed spread, so accuracies are
means over three seeds. Each rank sees 1/W of the data per epoch, so the epochs scale with W
to keep the number of optimizer steps (about 530) the same at every size."""

import functools

import horovod.torch as hvd
import pytest

import hvd_compress as hc
from examples.workloads import digits

from helpers import CONFIGS, distributed

EPOCHS_PER_RANK = 6
SEEDS = range(3)


LGRECO = "lgreco(powersgd)"
GRAVAC = "gravac(topk)"
CONTROLLERS = {
    LGRECO: lambda named: hc.LGreCo(
        hc.COMPRESSORS["powersgd"].build(named, small=True), warmup_steps=100, decide_every=100, apply_delay=5
    ),
    GRAVAC: lambda named: hc.GraVAC(hc.TopK(named), theta_min=10, theta_max=100, window=50, epsilon=0.5),
}


@functools.lru_cache(maxsize=None)
def train(method, path="stock"):
    def make_optimizer(model, optimizer):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if method == "none":
            return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        if method in CONTROLLERS:
            make_optimizer.compressor = CONTROLLERS[method](model.named_parameters())
            return hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), compression=make_optimizer.compressor
            )
        opt, make_optimizer.compressor = distributed(model, optimizer, method, path, broadcast=False)
        return opt

    accuracies = [
        digits.train(make_optimizer, hvd.rank(), hvd.size(), epochs=EPOCHS_PER_RANK * hvd.size(), lr=0.1, seed=seed)[1]
        for seed in SEEDS
    ]
    compressor = getattr(make_optimizer, "compressor", None)
    ratio = compressor.traffic.ratio if compressor is not None else 1.0
    factor = compressor.average_cf if method == GRAVAC else None
    return sum(accuracies) / len(accuracies), ratio, factor


@pytest.fixture(scope="module")
def baseline():
    return train("none")[0]


def assert_within_one_point(label, acc, reference, reference_label, details):
    if hvd.rank() == 0:
        print(f"\n{label}: mean test accuracy {acc:.4f} ({reference_label} {reference:.4f}), {details}", flush=True)
    assert acc >= reference - 0.01


def test_gravac_accuracy_within_one_point_of_uncompressed(baseline):
    acc, ratio, factor = train(GRAVAC)
    assert_within_one_point(
        "GraVAC over Top-K",
        acc,
        baseline,
        "uncompressed",
        f"average compression factor {factor:.1f}x, {ratio:.1f}x fewer bytes on the wire",
    )


def test_lgreco_accuracy_within_one_point_of_its_uniform_setting():
    uniform, uniform_ratio, _ = train("powersgd")
    acc, ratio, _ = train(LGRECO)
    assert_within_one_point(
        "L-GreCo over PowerSGD rank 2",
        acc,
        uniform,
        "uniform rank 2",
        f"{ratio:.1f}x fewer bytes on the wire (uniform {uniform_ratio:.1f}x)",
    )


@pytest.mark.parametrize("method", CONFIGS)
def test_accuracy_within_one_point_of_uncompressed(method, baseline):
    acc, ratio, _ = train(method)
    assert_within_one_point(method, acc, baseline, "uncompressed", f"{ratio:.1f}x fewer bytes on the wire")

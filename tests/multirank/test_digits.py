"""Convergence on real data: the digits CNN, trained with each compressor through stock Horovod,
reaches the uncompressed test accuracy within 1 point.

One point is 3.6 of the 360 test images, about the seed-to-seed spread, so accuracies are
means over three seeds. Each rank sees 1/W of the data per epoch, so the epochs scale with W
to keep the number of optimizer steps (about 530) the same at every size."""
import functools

import horovod.torch as hvd
import pytest

import hvd_compress as hc
from hvd_compress.workloads import digits

from helpers import CONFIGS, distributed

EPOCHS_PER_RANK = 6
SEEDS = range(3)


LGRECO = "lgreco(powersgd)"


@functools.lru_cache(maxsize=None)
def train(method, path="stock"):
    def make_optimizer(model, optimizer):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if method == "none":
            return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        if method == LGRECO:
            make_optimizer.compressor = hc.LGreCo(
                CONFIGS["powersgd"](model.named_parameters()), warmup_steps=100,
                decide_every=100, apply_delay=5, log=None)
            return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=make_optimizer.compressor)
        opt, make_optimizer.compressor = distributed(model, optimizer, method, path, broadcast=False)
        return opt
    accuracies = [digits.train(make_optimizer, hvd.rank(), hvd.size(), epochs=EPOCHS_PER_RANK * hvd.size(), lr=0.1,
                               seed=seed)[1] for seed in SEEDS]
    ratio = make_optimizer.compressor.traffic.ratio if method != "none" else 1.0
    return sum(accuracies) / len(accuracies), ratio


@pytest.fixture(scope="module")
def baseline():
    return train("none")[0]


def test_lgreco_accuracy_within_one_point_of_its_uniform_setting():
    uniform, uniform_ratio = train("powersgd")
    acc, ratio = train(LGRECO)
    if hvd.rank() == 0:
        print(f"\nL-GreCo over PowerSGD rank 2: mean test accuracy {acc:.4f} (uniform rank 2 "
              f"{uniform:.4f}), {ratio:.1f}x fewer bytes on the wire (uniform {uniform_ratio:.1f}x)",
              flush=True)
    assert acc >= uniform - 0.01


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_accuracy_within_one_point_of_uncompressed(method, baseline):
    acc, ratio = train(method)
    if hvd.rank() == 0:
        print(f"\n{method}: mean test accuracy {acc:.4f} (uncompressed {baseline:.4f}), "
              f"{ratio:.1f}x fewer bytes on the wire", flush=True)
    assert acc >= baseline - 0.01

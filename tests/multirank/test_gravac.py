"""GraVAC on real ranks: the factor changes during training, every rank takes the same factor
at the same step, and parameters stay bit-identical through the changes."""

import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from hvd_compress.control.gravac import DENSE
from examples.workloads.digits import DigitsCNN

from helpers import PATHS, assert_parameters_identical, assert_same_on_every_rank, rank_batches

INNER = {
    "topk": lambda named: hc.TopK(named, density=0.1),
    "powersgd": lambda named: hc.PowerSGD(named, rank=4),
    "qsgd": lambda named: hc.QSGD(named, bits=4, bucket_size=128),
    "qallreduce": lambda named: hc.QuantizedAllReduce(named, bits=4, block_size=64),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inner", sorted(INNER))
def test_ranks_stay_identical_through_factor_changes(inner, path):
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = model.named_parameters() if path == "stock" else None
    gravac = hc.GraVAC(INNER[inner](named), theta_min=2, theta_max=64, window=3, epsilon=0.3)
    if path == "stock":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=gravac)
    else:
        opt = hc.DistributedOptimizer(opt, model.named_parameters(), gravac)
    for x, y in rank_batches(20, seed=6):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    factors = [h[0] for h in gravac.history]
    assert len(set(factors)) > 1, factors
    assert_same_on_every_rank(gravac.history, f"gravac.{inner}.{path}")
    assert_parameters_identical(model, f"gravac.{inner}.{path}")


@pytest.mark.parametrize("path", PATHS)
def test_float16_dense_steps_feed_the_policy_on_real_ranks(path):
    """A float16 model that GraVAC sends dense (epsilon 1): the dense float16 payloads travel
    as float32 with the statistics, so the policy is fed every step, and gradients come back
    float16, bit-identical on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).half()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    named = model.named_parameters() if path == "stock" else None
    gravac = hc.GraVAC(
        hc.TopK(named, density=0.1), theta_min=4, theta_max=64, window=3, epsilon=1.0, scale_down_to="dense"
    )
    if path == "stock":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=gravac)
    else:
        opt = hc.DistributedOptimizer(opt, model.named_parameters(), gravac)
    steps = 8
    for x, y in rank_batches(steps, seed=7):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.flatten(1).half()).float(), y).backward()
        opt.step()
        assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    assert gravac.policy.steps == steps and len(gravac.history) == steps - 1
    assert DENSE in [h[0] for h in gravac.history], gravac.history
    assert_same_on_every_rank(gravac.history, f"gravac.fp16.{path}")
    assert_parameters_identical(model, f"gravac.fp16.{path}")

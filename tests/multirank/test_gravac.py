"""GraVAC on real ranks: the factor changes during training, every rank takes the same factor
at the same step, and parameters stay bit-identical through the changes."""
import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from hvd_compress.workloads.digits import DigitsCNN

from helpers import PATHS, gathered, rank_batches

INNER = {
    "topk": lambda named: hc.TopK(named, density=0.1),
    "powersgd": lambda named: hc.PowerSGD(named, rank=4),
    "qsgd": lambda named: hc.QSGD(named, bits=4, bucket_size=128),
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
    everyone = hvd.allgather_object(gravac.history, name=f"gravac.{inner}.{path}")
    assert all(theirs == everyone[0] for theirs in everyone)
    for name, p in model.named_parameters():
        rows = gathered(p, f"gravac.{inner}.{path}.{name}")
        assert all(torch.equal(rows[0], row) for row in rows), name

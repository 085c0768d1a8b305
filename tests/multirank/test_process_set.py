"""A process set that leaves out rank 0 (launched at np 3, with HOROVOD_DYNAMIC_PROCESS_SETS=1):
the exchange, the configuration check and L-GreCo's decisions run among ranks 1 and 2 only,
while rank 0 waits elsewhere. Were any of them to wait on rank 0, the launch would time out."""

import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from examples.workloads.digits import DigitsCNN

from helpers import PATHS, rank_batches

pytestmark = pytest.mark.skipif(hvd.size() != 3, reason="a set of 2 among 3 ranks")

SETS = {}


@pytest.fixture(scope="module")
def pair():
    """Ranks 1 and 2, registered once by every rank (a collective of the whole world)."""
    if "pair" not in SETS:
        SETS["pair"] = hvd.add_process_set([1, 2])
    return SETS["pair"]


@pytest.fixture(autouse=True)
def everyone_finishes_together(pair):
    """Rank 0 waits here for the pair, so that no rank leaves while others still work."""
    yield
    hvd.allreduce(torch.zeros(1), name=f"done.{len(SETS)}")
    SETS[len(SETS)] = True


def methods(named):
    lgreco = dict(warmup_steps=2, decide_every=3, apply_delay=1, timeout=60.0)
    return {
        "powersgd": hc.PowerSGD(named, rank=2),
        "topk": hc.TopK(named, density=0.05),
        "scalecom": hc.ScaleCom(named, density=0.05),
        "lgreco": hc.LGreCo(hc.PowerSGD(named, rank=2), **lgreco),
    }


def trained_with_the_pair(method, path, steps):
    """A model trained for ``steps`` steps by an optimizer restricted to the pair, and its
    compression, on whichever rank calls it."""
    torch.manual_seed(0)  # identical weights: Horovod 0.28.1's broadcast_parameters has no process_set
    model = DigitsCNN()
    named = list(model.named_parameters()) if path == "stock" else None
    compression = methods(named)[method]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if path == "stock":
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=compression, process_set=SETS["pair"]
        )
    else:
        opt = hc.DistributedOptimizer(opt, model.named_parameters(), compression, process_set=SETS["pair"])
    for x, y in rank_batches(steps, seed=8):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, compression


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["powersgd", "topk", "scalecom", "lgreco"])
def test_training_within_a_set_of_two(pair, method, path):
    if not pair.included():
        return
    model, compression = trained_with_the_pair(method, path, 8)
    for name, p in model.named_parameters():
        rows = hvd.allgather(p.detach().reshape(1, -1), name=f"pair.{method}.{path}.{name}", process_set=pair)
        assert torch.equal(rows[0], rows[1]), name
    if method == "lgreco":
        assert [d.version for d in compression.decisions] == [1, 2]
    assert compression.traffic.world_size == 2


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_outside_the_optimizers_set_runs_alone(pair, path):
    """As with Horovod's optimizer: rank 0, outside the set, builds the same optimizer and steps
    on its own gradients, never waiting on the pair."""
    torch.manual_seed(0)
    before = list(DigitsCNN().parameters())
    model, compression = trained_with_the_pair("powersgd", path, 3)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert (compression.traffic.steps == 0) == (not pair.included())

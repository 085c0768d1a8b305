"""Every registered compressor through hvd_compress.ddp on real ranks (torchrun, Gloo): ranks
stay bit-identical, aggregates equal the simulated world's, parameters unused on some or all
ranks (find_unused_parameters=True) and DDP's bucket rebuild after the first iteration."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hvd_compress as hc
import hvd_compress.ddp
from hvd_compress.comm.simulated import SimulatedWorld

from ddp_helpers import (METHODS, Net, assert_identical_across_ranks, batches,
                         check_step_against_reference, make_ddp, train)


@pytest.mark.parametrize("method", METHODS)
def test_parameters_bit_identical_after_8_steps(method):
    compressor = hc.COMPRESSORS[method].build(small=True)
    module, model, state = make_ddp(compressor)
    spare = module.spare.weight.detach().clone()
    train(model, batches(8, seed=1))
    assert state.iter == 8
    assert_identical_across_ranks(module)
    assert torch.equal(module.spare.weight, spare) and module.spare.weight.grad is None
    assert compressor.traffic.steps == 8


@pytest.mark.parametrize("method", METHODS)
def test_aggregate_matches_reference_from_allgathered_gradients(method):
    """Each step every rank's raw gradients are all-gathered and fed to W identically
    configured compressors in one process; DDP's aggregate must equal theirs."""
    module, model, _ = make_ddp(hc.COMPRESSORS[method].build(small=True))
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True)
                                for _ in range(dist.get_world_size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(4, seed=2):
        check_step_against_reference(module, model, optimizer, reference, method, x, y)


@pytest.mark.parametrize("bucket_cap_mb", [0.01, 25])
@pytest.mark.parametrize("method", ["powersgd", "topk", "bf16"])
def test_buckets_rebuilt_after_the_first_iteration(method, bucket_cap_mb):
    """Without find_unused_parameters DDP rebuilds its buckets after the first iteration (new
    bucket contents and indices); state is keyed by name, so nothing changes for compressors."""
    module, model, _ = make_ddp(hc.COMPRESSORS[method].build(small=True), partial=False,
                                bucket_cap_mb=bucket_cap_mb)
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True)
                                for _ in range(dist.get_world_size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(3, seed=3):
        check_step_against_reference(module, model, optimizer, reference, method, x, y)


def test_compressor_with_its_own_names_and_gradient_as_bucket_view():
    """A compressor given named_parameters keeps its own names; gradients that are views of
    DDP's buckets come back right."""
    torch.manual_seed(0)
    module = Net()
    compressor = hc.PowerSGD(module.named_parameters(), rank=2)
    model = DistributedDataParallel(module, find_unused_parameters=True, gradient_as_bucket_view=True,
                                    bucket_cap_mb=0.05)
    state = hvd_compress.ddp.register(model, compressor)
    reference = SimulatedWorld([hc.PowerSGD(rank=2) for _ in range(dist.get_world_size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(3, seed=4):
        check_step_against_reference(module, model, optimizer, reference, "powersgd", x, y)
    assert set(compressor.state) <= {name for name, _ in module.named_parameters()}
    assert state.iter == 3

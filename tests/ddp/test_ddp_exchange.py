"""Every registered compressor through hvd_compress.ddp on real ranks (torchrun, Gloo): ranks
stay bit-identical, aggregates equal the simulated world's, parameters unused on some or all
ranks (find_unused_parameters=True), DDP's bucket rebuild after the first iteration, float16
means whose sum overflows, and parameters of degenerate shapes."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import hvd_compress as hc
import hvd_compress.ddp
from hvd_compress.comm.simulated import SimulatedWorld

import overflow  # tests/overflow.py
from degenerate import Degenerate  # tests/degenerate.py
from ddp_helpers import (
    METHODS,
    Net,
    assert_identical_across_ranks,
    batches,
    check_step_against_reference,
    make_ddp,
    train,
)


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
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True) for _ in range(dist.get_world_size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(4, seed=2):
        check_step_against_reference(module, model, optimizer, reference, method, x, y)


@pytest.mark.parametrize("bucket_cap_mb", [0.01, 25])
@pytest.mark.parametrize("method", ["powersgd", "topk", "bf16"])
def test_buckets_rebuilt_after_the_first_iteration(method, bucket_cap_mb):
    """Without find_unused_parameters DDP rebuilds its buckets after the first iteration (new
    bucket contents and indices); state is keyed by name, so nothing changes for compressors."""
    module, model, _ = make_ddp(hc.COMPRESSORS[method].build(small=True), partial=False, bucket_cap_mb=bucket_cap_mb)
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True) for _ in range(dist.get_world_size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(3, seed=3):
        check_step_against_reference(module, model, optimizer, reference, method, x, y)


def test_compressor_with_its_own_names_and_gradient_as_bucket_view():
    """A compressor given named_parameters keeps its own names; gradients that are views of
    DDP's buckets come back right."""
    torch.manual_seed(0)
    module = Net()
    compressor = hc.PowerSGD(module.named_parameters(), rank=2)
    model = DistributedDataParallel(
        module, find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=0.05
    )
    state = hvd_compress.ddp.register(model, compressor)
    reference = SimulatedWorld([hc.PowerSGD(rank=2) for _ in range(dist.get_world_size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(3, seed=4):
        check_step_against_reference(module, model, optimizer, reference, "powersgd", x, y)
    assert set(compressor.state) <= {name for name, _ in module.named_parameters()}
    assert state.iter == 3


def _ddp_gradient(dtype, register, value):
    module = overflow.Scaled(dtype)
    model = DistributedDataParallel(module)
    register(model)
    model(torch.full((8, 4), value, dtype=dtype)).backward()
    return module.w.grad


@pytest.mark.parametrize(
    "method,dtype",
    [("fp16", torch.float32), ("fp16", torch.float16), ("none", torch.float16), ("powersgd", torch.float16)],
)
def test_a_float16_mean_whose_sum_overflows_is_what_torchs_fp16_hook_gives(method, dtype):
    """30000 on rank 0 and 50000 on the last rank (evenly between): their float16 sum is Inf,
    their mean 40000. torch's fp16_compress_hook divides by W before its float16 all-reduce and
    gives the mean; so must every float16 payload of ours (FP16's, a float16 gradient's)."""
    w = dist.get_world_size()
    value = overflow.value(dist.get_rank(), w)
    ours = _ddp_gradient(dtype, lambda model: hvd_compress.ddp.register(model, hc.COMPRESSORS[method].build()), value)
    torchs = _ddp_gradient(dtype, lambda model: model.register_comm_hook(None, default_hooks.fp16_compress_hook), value)
    assert torch.isfinite(torchs).all()
    assert ours.dtype == dtype and torch.equal(ours, torchs.to(dtype))
    if w == 2:
        assert torch.equal(ours, torch.full((8, 4), 40000.0, dtype=dtype))


def _degenerate_steps(register, steps=3):
    torch.manual_seed(0)
    module = Degenerate()
    assert not module.conv.weight.is_contiguous() and not module.wide.is_contiguous()
    model = DistributedDataParallel(module)
    if register is not None:
        register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(steps, seed=5):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y % 2).backward()
        optimizer.step()
    return module


def test_powersgd_trains_a_model_with_an_empty_layer_as_plain_ddp():
    """nn.Linear(4, 0)'s (0, 4) weight has nothing to compress: it travels as it is, and
    PowerSGD at its defaults (every layer here under min_numel, so dense) trains as plain DDP."""
    plain = _degenerate_steps(None)
    ours = _degenerate_steps(lambda model: hvd_compress.ddp.register(model, hc.PowerSGD(rank=2)))
    for (name, expected), got in zip(plain.state_dict().items(), ours.state_dict().values()):
        assert got.shape == expected.shape and torch.equal(got, expected), name
    assert_identical_across_ranks(ours)


@pytest.mark.parametrize("method", METHODS)
def test_degenerate_shapes_match_the_simulated_world(method):
    """Each degenerate shape compressed where it can be (min_numel 0) and sent whole where it
    cannot; DDP's buckets hold the channels_last and transposed gradients in their own layout,
    and the aggregates written back equal the simulated world's."""
    torch.manual_seed(0)
    module = Degenerate()
    model = DistributedDataParallel(module)
    hvd_compress.ddp.register(model, hc.COMPRESSORS[method].build(small=True, min_numel=0))
    reference = SimulatedWorld(
        [hc.COMPRESSORS[method].build(small=True, min_numel=0) for _ in range(dist.get_world_size())]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(3, seed=6):
        check_step_against_reference(module, model, optimizer, reference, method, x, y % 2)
    assert_identical_across_ranks(module)

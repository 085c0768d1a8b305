"""Horovod's options of DistributedOptimizer, on both paths: honoured, or refused at once."""
import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from benchmarks.workloads.digits import DigitsCNN

from helpers import CONFIGS, PATHS, distributed, gathered, rank_batches

# How close two runs that differ only in summation order (or in a scale of W) must stay.
TOLERANCE = {"fp16": 2e-3, "bf16": 2e-2}


def gradients_after(method, path, steps=3, **options):
    """Every synchronized gradient of ``steps`` steps (SGD, lr 0 so that the model stays put)."""
    torch.manual_seed(0)
    model = DigitsCNN()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.0), method, path, **options)
    history = []
    for x, y in rank_batches(steps, seed=4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        history.append({name: p.grad.clone() for name, p in model.named_parameters()})
        with opt.skip_synchronize():
            opt.step()
    return history


def assert_close(got, expected, method, scale=1.0):
    for step, (a, b) in enumerate(zip(got, expected)):
        for name in b:
            tol = TOLERANCE.get(method, 1e-5) * (scale * b[name]).abs().max().item() + 1e-6
            assert torch.allclose(a[name], scale * b[name], rtol=0, atol=tol), (step, name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", CONFIGS)
def test_op_sum_sums_every_gradient(method, path):
    """Compressed and uncompressed layers alike: W times the average, never a mix."""
    average = gradients_after(method, path)
    summed = gradients_after(method, path, op=hvd.Sum)
    assert_close(summed, average, method, scale=hvd.size())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["powersgd", "topk", "acpsgd"])
def test_gradient_predivide_factor_changes_nothing_but_rounding(method, path):
    assert_close(gradients_after(method, path, gradient_predivide_factor=4.0),
                 gradients_after(method, path), method)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["powersgd", "topk"])
def test_backward_passes_per_step_accumulates_locally(method, path):
    """Two backward passes, one exchange: as one pass over both halves' summed losses."""
    results = []
    for passes in [1, 2]:
        torch.manual_seed(0)
        model = DigitsCNN()
        opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.0), method, path,
                             backward_passes_per_step=passes)
        x, y = next(rank_batches(1, batch_size=32, seed=5))
        opt.zero_grad()
        if passes == 1:
            (nn.functional.cross_entropy(model(x[:16]), y[:16])
             + nn.functional.cross_entropy(model(x[16:]), y[16:])).backward()
        else:
            nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
            nn.functional.cross_entropy(model(x[16:]), y[16:]).backward()
        opt.synchronize()
        results.append([{name: p.grad.clone() for name, p in model.named_parameters()}])
    assert_close(results[1], results[0], method)


@pytest.mark.parametrize("method", ["powersgd", "acpsgd", "topk"])
def test_stock_groups_are_honoured(method):
    assert_close(gradients_after(method, "stock", num_groups=2), gradients_after(method, "stock"), method)


def test_wrapper_refuses_groups_and_unsupported_ops():
    model = DigitsCNN()
    for options, match in [({"num_groups": 2}, "num_groups/groups"),
                           ({"op": hvd.Adasum}, "op: .* got hvd.Adasum"),
                           ({"op": hvd.Max}, "got hvd.Max"),
                           ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "only with op=hvd.Average"),
                           ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor")]:
        with pytest.raises(ValueError, match=match):
            hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), hc.PowerSGD(rank=2), **options)


@pytest.mark.parametrize("op, name", [(hvd.Adasum, "hvd.Adasum"), (hvd.Max, "hvd.Max")])
def test_stock_refuses_unsupported_ops_at_the_first_step_on_every_rank(op, name):
    torch.manual_seed(0)
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op,
                                   compression=hc.PowerSGD(model.named_parameters(), rank=2))
    x, y = next(rank_batches(1))
    with pytest.raises(ValueError, match=f"got {name}"):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # Horovod's Adasum optimizer compresses here, the others in backward


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_as_dense_either_way_keeps_ranks_identical(path, sparse_as_dense):
    torch.manual_seed(0)
    embedding = nn.Embedding(64, 32, sparse=True)
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    compressor = hc.PowerSGD(embedding.named_parameters() if path == "stock" else None, rank=2, min_numel=0)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    if path == "stock":
        opt = hvd.DistributedOptimizer(opt, named_parameters=embedding.named_parameters(),
                                       compression=compressor, sparse_as_dense=sparse_as_dense)
    else:
        opt = hc.DistributedOptimizer(opt, embedding.named_parameters(), compressor,
                                      sparse_as_dense=sparse_as_dense)
    for step in range(3):
        opt.zero_grad()
        embedding(torch.tensor([hvd.rank(), 10 + step])).sum().backward()
        opt.step()
    rows = gathered(embedding.weight, f"sparse.{path}.{sparse_as_dense}")
    assert all(torch.equal(rows[0], row) for row in rows)

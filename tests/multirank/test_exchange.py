"""Real Horovod, several ranks: identical parameters, correct aggregates, the edge cases."""

import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from examples.workloads.digits import DigitsCNN

from helpers import (
    CONFIGS,
    DENSE_SWITCHABLE,
    PATHS,
    assert_parameters_identical,
    distributed,
    gathered,
    rank_batches,
    sends_whole,
)
from degenerate import Degenerate  # tests/degenerate.py
from poison import OneInf  # tests/poison.py

# How close the real aggregate must be to the simulated reference: the methods are
# deterministic given the same gradients, so only summation order differs.
TOLERANCE = {"fp16": 2e-3, "bf16": 2e-2}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", CONFIGS)
def test_parameters_bit_identical_after_20_steps(method, path):
    torch.manual_seed(hvd.rank())  # different initial weights: broadcast must fix them
    model = DigitsCNN()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), method, path)
    for x, y in rank_batches(20):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for name, p in model.named_parameters():
        rows = gathered(p, f"check.{method}.{path}.{name}")
        for r in range(1, hvd.size()):
            assert torch.equal(rows[0], rows[r]), f"{name} differs between rank 0 and rank {r}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", CONFIGS)
def test_aggregate_matches_reference_from_allgathered_gradients(method, path):
    """Each step, every rank's raw gradients are all-gathered and fed to a simulated world of
    W identically configured compressors; the real aggregate must equal what it computes."""
    model = DigitsCNN()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05), method, path)
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True) for _ in range(hvd.size())])
    for step, (x, y) in enumerate(rank_batches(4, seed=1)):
        check_step_against_reference(model, opt, reference, method, x, y, f"raw.{method}.{path}.{step}")
        with opt.skip_synchronize():
            opt.step()


def check_step_against_reference(model, opt, reference, method, x, y, tag):
    """Synchronizes one step; the aggregate in every p.grad must equal what ``reference`` (a
    simulated world of W identically configured compressors) computes from every rank's raw
    gradients, all-gathered."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    # autograd.grad fires no accumulate hooks, so these are untouched by communication
    # (Horovod all-reduces dense gradients in place, asynchronously).
    names, params = zip(*model.named_parameters())
    raw = dict(zip(names, torch.autograd.grad(loss, params, retain_graph=True)))
    loss.backward()
    opt.synchronize()
    per_rank = [{} for _ in range(hvd.size())]
    for name, grad in raw.items():
        for r, row in enumerate(gathered(grad, f"{tag}.{name}")):
            per_rank[r][name] = row.view_as(grad)
    expected = reference.step(per_rank)[hvd.rank()]
    for name, p in model.named_parameters():
        largest = expected[name].abs().max().item() if expected[name].numel() else 0.0
        tol = TOLERANCE.get(method, 1e-5) * largest + 1e-7
        assert torch.allclose(p.grad, expected[name], rtol=0, atol=tol), (tag, name)


def train_skipping_non_finite_steps(method, path, bad_step=None, skipped_step=None, steps=6):
    """Trains as a GradScaler user would: a step whose synchronized gradients are not all finite
    is not applied. At ``bad_step`` the last rank's first weight gradient gets one Inf entry;
    ``skipped_step`` is not taken at all. Returns (parameters, per-step finiteness)."""
    torch.manual_seed(0)
    model = DigitsCNN()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), method, path)
    weight = next(p for p in model.parameters() if p.dim() >= 2)
    poison = OneInf()
    weight.register_hook(poison)
    finite_steps = []
    for step, (x, y) in enumerate(rank_batches(steps, seed=3)):
        if step == skipped_step:
            continue
        poison.armed = step == bad_step and hvd.rank() == hvd.size() - 1
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters())
        finite_steps.append(finite)
        if finite:
            with opt.skip_synchronize():
                opt.step()
    return dict(model.named_parameters()), finite_steps


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", CONFIGS)
def test_a_non_finite_gradient_on_one_rank_is_skipped_everywhere_and_leaves_no_trace(method, path):
    params, finite = train_skipping_non_finite_steps(method, path, bad_step=2)
    flags = gathered(torch.tensor([float(f) for f in finite]), f"finite.{method}.{path}")
    assert finite == [True, True, False, True, True, True]
    assert all(torch.equal(flags[0], row) for row in flags), "ranks disagree on which step was bad"
    reference, _ = train_skipping_non_finite_steps(method, path, skipped_step=2)
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        tol = TOLERANCE.get(method, 1e-5) * reference[name].abs().max().item() + 1e-7
        assert torch.allclose(p, reference[name], rtol=0, atol=tol), name


def train_under_gradscaler(path, explicit_unscale):
    """Horovod's GradScaler order (synchronize, unscale_ if asked, step without synchronizing),
    an Inf in the last rank's first weight gradient at step 1 of 4. Returns (model, the scale
    after each step)."""
    torch.manual_seed(0)
    model = DigitsCNN()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05), "topk", path)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    poison = OneInf()
    next(p for p in model.parameters() if p.dim() >= 2).register_hook(poison)
    scales = []
    for step, (x, y) in enumerate(rank_batches(4, seed=5)):
        poison.armed = step == 1 and hvd.rank() == hvd.size() - 1
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        if explicit_unscale:
            scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, scales


@pytest.mark.parametrize("explicit_unscale", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_gradscaler_overflow_on_one_rank_skips_the_step_on_every_rank(path, explicit_unscale):
    """Every rank's scaler sees the exchanged gradients: the overflow halves every rank's scale,
    no rank steps on it, and the replicas stay identical."""
    model, scales = train_under_gradscaler(path, explicit_unscale)
    assert scales == [2.0**10, 2.0**9, 2.0**9, 2.0**9]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_parameters_identical(model, f"gradscaler.{path}.{explicit_unscale}")


def test_gradscaler_before_synchronize_fails_on_every_rank():
    """The wrapper refuses a GradScaler step that checked unexchanged gradients, on every rank
    alike, rather than let ranks skip different steps."""
    torch.manual_seed(0)
    model = DigitsCNN()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05), "topk", "wrapper")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = next(rank_batches(1))
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="before they were exchanged"):
        scaler.step(opt)
    opt.synchronize()  # leaves no round outstanding for the tests after this one


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["powersgd", "topk", "bf16", "qallreduce"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype, method, path):
    """Gradients come back in the model's dtype and ranks stay identical; bf16 dense tensors
    cross Horovod (which has no bf16) as float32."""
    torch.manual_seed(0)  # identical weights everywhere: Horovod cannot broadcast bf16
    model = DigitsCNN().to(dtype)
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05), method, path, broadcast=False)
    for x, y in rank_batches(3, seed=3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
        opt.synchronize()
        assert all(p.grad.dtype == dtype and torch.isfinite(p.grad.float()).all() for p in model.parameters())
        with opt.skip_synchronize():
            opt.step()
    for name, p in model.named_parameters():
        rows = gathered(p.float(), f"half.{dtype}.{method}.{path}.{name}")
        assert all(torch.equal(rows[0], row) for row in rows), name


class PartlyUsed(nn.Module):
    """``extra`` gets a gradient on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.extra = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.body(x.flatten(1)))
        if hvd.rank() == 0:
            h = h + self.extra(h)
        return self.head(h)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["powersgd", "topk", "bf16"])
def test_gradient_missing_on_some_ranks(method, path):
    model = PartlyUsed()
    opt, _ = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05), method, path)
    for x, y in rank_batches(3, seed=2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert_parameters_identical(model, f"partly.{method}.{path}")


def test_sparse_gradients_take_horovods_allgather_path():
    embedding = nn.Embedding(50, 8, sparse=True)
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    compressor = hc.PowerSGD(embedding.named_parameters(), rank=2, min_numel=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(embedding.parameters(), lr=0.1),
        named_parameters=embedding.named_parameters(),
        compression=compressor,
    )
    ids = torch.tensor([hvd.rank(), 10 + hvd.rank()])
    embedding(ids).sum().backward()
    opt.synchronize()
    dense = embedding.weight.grad.to_dense()
    expected = torch.zeros(50, 8)
    for r in range(hvd.size()):
        expected[[r, 10 + r]] += 1.0 / hvd.size()
    assert torch.allclose(dense, expected)


@pytest.mark.parametrize("path", PATHS)
def test_compressors_configured_differently_fail_loudly(path):
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank_setting = 2 + hvd.rank()  # a deliberately rank-dependent configuration
    with pytest.raises(ValueError, match=r"PowerSGD: default is \d on rank \d but \d on rank \d"):
        if path == "stock":
            compressor = hc.PowerSGD(model.named_parameters(), rank=rank_setting)
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)
        else:
            opt = hc.DistributedOptimizer(opt, model.named_parameters(), hc.PowerSGD(rank=rank_setting))
        x, y = next(rank_batches(1))  # checked at the first step, on either path
        nn.functional.cross_entropy(model(x), y).backward()


FUSIONS = {
    "tiny buckets": hc.ScaledFusion(4096, scaled=False),
    "scaled default": hc.ScaledFusion(),
    "whole model": hc.ScaledFusion(2**62, scaled=False),
}


@pytest.mark.parametrize("fusion", sorted(FUSIONS))
@pytest.mark.parametrize("method", ["acpsgd", "topk"])
def test_fused_aggregates_match_reference_and_plans_agree(method, fusion):
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        hc.COMPRESSORS[method].build(small=True),
        fusion=FUSIONS[fusion],
    )
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True) for _ in range(hvd.size())])
    digests = []
    for step, (x, y) in enumerate(rank_batches(3, seed=7)):
        check_step_against_reference(model, opt, reference, method, x, y, f"fused.{method}.{fusion}.{step}")
        digests.append(opt._scheduler.plan().digest())
        with opt.skip_synchronize():
            opt.step()
    everyone = hvd.allgather_object(digests, name=f"plans.{method}.{fusion}")
    assert all(theirs == digests for theirs in everyone)
    if method == "acpsgd":
        assert digests[0] != digests[1] or fusion == "whole model"  # P and Q steps differ


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", DENSE_SWITCHABLE)
def test_a_layer_switched_to_dense_sends_its_residual_once(method, path):
    """What L-GreCo's decisions do: a layer set to a setting that does not compress it sends,
    at its first dense step, the mean over ranks of gradient plus residual; then plain means."""
    assert DENSE_SWITCHABLE, "no registered compressor can send a layer whole"
    model = DigitsCNN()
    opt, compressor = distributed(model, torch.optim.SGD(model.parameters(), lr=0.05), method, path)
    name = "classifier.1.weight"
    param = dict(model.named_parameters())[name]
    batches = rank_batches(6, seed=3)
    for step, (x, y) in enumerate(batches):
        if step == 3:
            residual = compressor.residual(name)
            assert residual is not None and residual.abs().sum() > 0
            residuals = gathered(residual, f"residual.{method}.{path}")
            compressor.set_setting(name, sends_whole(compressor, tuple(param.shape)))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        (raw,) = torch.autograd.grad(loss, [param], retain_graph=True)
        loss.backward()
        opt.synchronize()
        if step >= 3:
            rows = gathered(raw, f"raw.{method}.{path}.{step}")
            if step == 3:
                rows = rows + residuals
            expected = rows.mean(dim=0).view_as(param)
            assert torch.allclose(param.grad, expected, rtol=0, atol=1e-6), step
            assert compressor.residual(name) is None
        with opt.skip_synchronize():
            opt.step()


def _degenerate_steps(path, method, steps=3):
    """``steps`` SGD steps of the degenerate-shapes model (contiguous: Horovod's own collectives
    refuse the others) on ``path``, the same initial weights on every rank; ``method`` None:
    stock Horovod uncompressed."""
    torch.manual_seed(0)
    module = Degenerate(strided=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    if method is None:
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=module.named_parameters())
    else:
        opt, _ = distributed(module, optimizer, method, path, broadcast=False)
    for x, y in rank_batches(steps, seed=7):
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y % 2).backward()
        opt.step()
    return module


@pytest.mark.parametrize("path", PATHS)
def test_powersgd_trains_a_model_with_an_empty_layer_as_uncompressed_horovod(path):
    """nn.Linear(8, 0)'s (0, 8) weight has nothing to compress and travels as it is; PowerSGD
    (every layer of this model under its min_numel, so dense) trains as uncompressed Horovod."""
    plain = _degenerate_steps(path, None)
    ours = _degenerate_steps(path, "powersgd")
    for (name, expected), got in zip(plain.state_dict().items(), ours.state_dict().values()):
        assert got.shape == expected.shape and torch.equal(got, expected), name


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", sorted(hc.COMPRESSORS))
def test_degenerate_shapes_match_the_reference(method, path):
    """Every degenerate shape, compressed where it can be (min_numel 0), sent whole where it
    cannot: aggregates equal the simulated world's, parameters stay identical on every rank.
    Non-contiguous gradients too (channels_last, transposed), which Horovod's own all-reduce
    refuses: every payload handed to Horovod is contiguous."""
    torch.manual_seed(0)  # the same weights everywhere: hvd.broadcast_parameters refuses strided ones
    module = Degenerate()
    opt, _ = distributed(
        module, torch.optim.SGD(module.parameters(), lr=0.05), method, path, broadcast=False, settings={"min_numel": 0}
    )
    reference = SimulatedWorld([hc.COMPRESSORS[method].build(small=True, min_numel=0) for _ in range(hvd.size())])
    for step, (x, y) in enumerate(rank_batches(3, seed=8)):
        check_step_against_reference(module, opt, reference, method, x, y % 2, f"degenerate.{method}.{path}.{step}")
        with opt.skip_synchronize():
            opt.step()
    assert_parameters_identical(module, f"degenerate.{method}.{path}")

"""hvd_compress.fsdp on pure FSDP (torchrun, Gloo, a 1-D mesh over every rank): the quantized
reduce-scatter gives the exact reduce-scatter of the ranks' dequantized inputs, keeps each
rank's residual, skips a non-finite step on every rank without a trace, resumes from a DCP
checkpoint bit for bit, follows FSDP's reduce dtypes, trains a compiled model as an eager one,
and refuses other compressors and ranks configured differently."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import hvd_compress as hc
import hvd_compress.fsdp

from fsdp_helpers import (
    batches,
    everyone,
    gathered,
    load,
    local_shards,
    loss_of,
    make_fsdp,
    save,
    shared_directory,
    train,
)


def recording(compressor):
    """Records each reduce-scatter's input rows (W, m) and this rank's dequantized rows."""
    calls = []
    quantize = compressor.quantize_reduce_scatter

    def record(rows, layout):
        before = rows.float().clone()
        packed = quantize(rows, layout)
        calls.append((before, compressor.decode_reduce_scatter(packed, rows.shape[1]).clone(), layout))
        return packed

    compressor.quantize_reduce_scatter = record
    return calls


def one_backward(bits=8):
    compressor = hc.QuantizedAllReduce(bits=bits, block_size=64)
    calls = recording(compressor)
    plain, model, state = make_fsdp(compressor)
    x, y = next(batches(1, seed=4))
    loss_of(model, x, y).backward()
    return plain, model, state, calls, (x, y)


@pytest.mark.parametrize("bits", [8, 4])
def test_shards_are_the_exact_reduce_scatter_of_the_dequantized_inputs(bits):
    plain, model, state, calls, (x, y) = one_backward(bits)
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = {name: p.grad.to_local() for name, p in model.named_parameters() if p.grad is not None}
    for _, dequantized, layout in calls:
        everyone_rows = gathered(dequantized).view(world, world, -1)  # [sender, receiver, m]
        # Divided by W first, summed over senders in rank order, in float32: as the receiver does.
        expected = everyone_rows[:, rank].div(world).sum(dim=0)
        offset = 0
        for name, shape in layout:
            rows = -(-shape[0] // world)
            width = rows * torch.Size(shape[1:]).numel()
            mine = grads[name].reshape(-1)
            assert torch.equal(mine, expected[offset : offset + mine.numel()]), name
            offset += width
    # And close to the exact mean of the raw gradients.
    names, params = zip(*plain.named_parameters())
    raw = torch.autograd.grad(loss_of(plain, x, y), params, allow_unused=True)
    for name, p, g in zip(names, params, raw):
        mean = gathered(torch.zeros_like(p) if g is None else g).mean(dim=0).view(p.shape)
        got = dict(model.named_parameters())[name].grad
        if got is not None and mean.abs().max() > 0:
            error = (got.full_tensor() - mean).abs().max() / mean.abs().max()
            assert error < (2e-2 if bits == 8 else 0.3), (name, float(error))
    assert len(calls) == 4  # fc1, fc2, head and the root; spare, used by no rank, reduces nothing


def test_each_rank_keeps_its_input_minus_what_it_sent():
    _, model, state, calls, _ = one_backward()
    world = dist.get_world_size()
    for rows, dequantized, layout in calls:
        left_out = rows - dequantized
        offset = 0
        for name, shape in layout:
            per_rank = -(-shape[0] // world)
            width = per_rank * torch.Size(shape[1:]).numel()
            expected = left_out[:, offset : offset + width].reshape(world * per_rank, *shape[1:])[: shape[0]]
            assert torch.equal(state.compressor.residual(name), expected), name
            offset += width
    assert state.iter == 1


def train_with_a_non_finite_step(bad_step):
    """Five steps; rank 1's fc1 gradient has an Inf at ``bad_step``. The residuals after each
    step, and whether each step's gradients were finite here."""
    _, model, state = make_fsdp(hc.QuantizedAllReduce(bits=8, block_size=64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    residuals, finite = [], []
    for step, (x, y) in enumerate(batches(5, seed=5)):
        optimizer.zero_grad()
        model.poison = step == bad_step and dist.get_rank() == 1
        loss_of(model, x, y).backward()
        finite.append(
            all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters() if p.grad is not None)
        )
        if finite[-1]:
            optimizer.step()
        residuals.append(
            {
                name: state.compressor.residual(name).clone()
                for name, _ in model.named_parameters()
                if state.compressor.residual(name) is not None
            }
        )
    return residuals, finite, state


def test_a_non_finite_gradient_on_one_rank_is_skipped_everywhere_and_leaves_no_trace():
    residuals, finite, state = train_with_a_non_finite_step(bad_step=2)
    assert finite == [True, True, False, True, True]
    assert all(theirs == finite for theirs in everyone(finite))
    assert residuals[2].keys() == residuals[1].keys()
    for name, residual in residuals[2].items():
        assert torch.equal(residual, residuals[1][name]), name
    assert all(torch.isfinite(r).all() for r in residuals[4].values())
    assert state.compressor.skipped_steps == 1 and state.iter == 5


def test_resumed_from_a_dcp_checkpoint_equals_uninterrupted():
    data = list(batches(8, seed=3))
    _, model, _ = make_fsdp(hc.QuantizedAllReduce(bits=4, block_size=64))
    train(model, data)
    uninterrupted = local_shards(model)

    _, model, state = make_fsdp(hc.QuantizedAllReduce(bits=4, block_size=64))
    optimizer = train(model, data[:4])
    path = shared_directory()
    save(model, optimizer, state, path)
    _, model, state = make_fsdp(hc.QuantizedAllReduce(bits=4, block_size=64), seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    load(model, optimizer, state, path)
    assert state.iter == 4 and state.compressor.residual("fc1.weight") is not None
    train(model, data[4:], optimizer)
    for n, p in local_shards(model).items():
        assert torch.equal(p, uninterrupted[n]), n


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_reduce_follows_fsdps_divide_factors(reduce_dtype):
    """bf16 reduces with ReduceOp.AVG, float16 with SUM between FSDP's pre- and post-divide:
    either way the gradients stay near plain FSDP's."""
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    _, model, _ = make_fsdp(hc.QuantizedAllReduce(bits=8, block_size=64), mp_policy=policy)
    _, exact, _ = make_fsdp(mp_policy=policy)
    x, y = next(batches(1, seed=6))
    for m in (model, exact):
        loss_of(m, x, y).backward()
    for (name, p), q in zip(model.named_parameters(), exact.parameters()):
        if q.grad is not None:
            want = q.grad.full_tensor()
            error = (p.grad.full_tensor() - want).abs().max() / want.abs().max()
            assert error < 3e-2, (name, float(error))


def test_another_compressor_is_refused_by_name():
    with pytest.raises(ValueError, match="compressor: pure FSDP .* accepts QuantizedAllReduce only, got PowerSGD"):
        make_fsdp(hc.PowerSGD(rank=2))
    _, model, _ = make_fsdp(hc.QuantizedAllReduce())
    with pytest.raises(ValueError, match="already compressed"):
        hvd_compress.fsdp.register(model, hc.QuantizedAllReduce())


def test_ranks_configured_differently_all_fail_at_the_first_step():
    """Runs last in this file (the failed backward leaves its model unusable): 8 bits on the
    first half of the ranks, 4 on the others; every rank raises, naming the difference."""
    bits = 8 if dist.get_rank() < dist.get_world_size() // 2 else 4
    _, model, _ = make_fsdp(hc.QuantizedAllReduce(bits=bits))
    with pytest.raises(ValueError, match=r"QuantizedAllReduce: default is [48] on rank [0-3] but [48] on rank"):
        train(model, batches(1, seed=9))


def test_a_compiled_model_trains_as_the_eager_one():
    """A pure FSDP2 model wrapped in ``torch.compile`` (inductor) quantizes its reduce-scatter:
    the shards after 3 steps match eager FSDP's up to the compiler's reordering of float sums."""
    shards = []
    for compile_model in (True, False):
        _, model, _ = make_fsdp(hc.QuantizedAllReduce(bits=8, block_size=64))
        train(torch.compile(model) if compile_model else model, batches(3, seed=9))
        shards.append(local_shards(model))
    for name, shard in shards[0].items():
        torch.testing.assert_close(shard, shards[1][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

"""hvd_compress.fsdp on real ranks (torchrun, Gloo, 4 ranks as a 2 x 2 ("replicate", "shard")
mesh): every registered method and both controllers keep replicas bit-identical and match a
reference computed from every rank's raw gradients; checkpoints through
torch.distributed.checkpoint; a non-finite gradient on one rank; unused parameters; gradient
accumulation; mixed precision; misuse refused (pure FSDP: test_fsdp_quantized.py)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hvd_compress as hc
import hvd_compress.fsdp
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.comm.transports import TorchTransport
from hvd_compress.registry import controllable

import overflow  # tests/overflow.py
from degenerate import Degenerate  # tests/degenerate.py
from fsdp_helpers import (
    METHODS,
    TOLERANCE,
    Net,
    assert_replicas_identical,
    batches,
    everyone,
    expected_shards,
    load,
    local_shards,
    loss_of,
    make_hsdp,
    mesh,
    save,
    shared_directory,
    train,
)

# Each registered controller at its multi-rank settings (L-GreCo decides at 2, 5, ...), over
# the first compressor it can wrap.
CONTROLLERS = sorted(hc.CONTROLLERS)


def build(name, named_parameters=None):
    if name in hc.CONTROLLERS:
        method = hc.CONTROLLERS[name]
        return method.build(hc.COMPRESSORS[controllable()[0]].build(named_parameters, small=True), ranks=True)
    return hc.COMPRESSORS[name].build(named_parameters, small=True)


@pytest.mark.parametrize("name", METHODS + CONTROLLERS)
def test_replicas_stay_bit_identical(name):
    _, model, state = make_hsdp(build(name))
    spare = local_shards(model)["spare.weight"]
    train(model, batches(7, seed=1))
    assert state.iter == 7
    assert_replicas_identical(model, state)
    assert torch.equal(model.spare.weight.to_local(), spare)  # zeros everywhere: no update
    if name == "lgreco":
        assert [d.decided_at for d in state.compressor.decisions] == [2, 5]
        assert type(state.compressor.service._transport) is TorchTransport
        assert state.compressor.service._transport.group is state.replicate_group


@pytest.mark.parametrize("name", METHODS)
def test_aggregate_matches_the_reference_from_gathered_shards(name):
    plain, model, state = make_hsdp(build(name))
    reference = SimulatedWorld([build(name) for _ in range(state.replicate_group.size())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(3, seed=2):
        expected = expected_shards(plain, model, x, y, reference, state.replicate_group, state.shard_group)
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        for n, p in model.named_parameters():
            if p.grad is None:  # never all-gathered (unused on every rank): FSDP leaves it
                assert n.startswith("spare"), n
                continue
            got, want = p.grad.to_local(), expected[n]
            tol = TOLERANCE.get(name, 1e-5) * want.abs().max().item() + 1e-7
            assert torch.allclose(got, want, rtol=0, atol=tol), (name, n, (got - want).abs().max())
        optimizer.step()


@pytest.mark.parametrize("name", ["powersgd", "acpsgd", "topk", "lgreco"])
def test_resumed_from_a_dcp_checkpoint_equals_uninterrupted(name):
    """Model, optimizer and compression state through torch.distributed.checkpoint after 4
    steps; fresh ones (other initial weights) load it; 4 more steps equal 8 uninterrupted,
    bit for bit."""
    data = list(batches(8, seed=3))
    _, model, _ = make_hsdp(build(name))
    train(model, data)
    uninterrupted = local_shards(model)

    _, model, state = make_hsdp(build(name))
    optimizer = train(model, data[:4])
    path = shared_directory()
    save(model, optimizer, state, path)
    _, model, state = make_hsdp(build(name), seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    load(model, optimizer, state, path)
    assert state.iter == 4
    train(model, data[4:], optimizer)
    for n, p in local_shards(model).items():
        assert torch.equal(p, uninterrupted[n]), (name, n)


@pytest.mark.parametrize("name", ["powersgd", "lgreco", "gravac"])
def test_another_world_shape_restores_all_but_error_feedback(name):
    """Saved on the 2 x 2 mesh, loaded on 4 x 1 (shards become whole parameters): the settings
    come back (a controller's: its compressor's), error feedback and warm starts of reshaped
    shards do not."""
    _, model, state = make_hsdp(build(name))
    inner = state.compressor.wrapped or state.compressor
    if name != "gravac":  # GraVAC sets every layer's setting itself
        inner.set_setting("fc2.weight", 3)
    optimizer = train(model, batches(3, seed=4))
    assert inner.feedback.residual("fc2.weight") is not None
    settings = {n: state.compressor.setting(n) for n, _ in model.named_parameters()}
    path = shared_directory()
    save(model, optimizer, state, path)
    _, model, state = make_hsdp(build(name), seed=1, shape=(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    load(model, optimizer, state, path)
    inner = state.compressor.wrapped or state.compressor
    assert state.iter == 3
    assert {n: state.compressor.setting(n) for n, _ in model.named_parameters()} == settings
    assert inner.feedback.residual("fc2.weight") is None
    assert "fc2.weight" not in inner.state  # its warm start had the shard's shape
    train(model, batches(2, seed=5), optimizer)
    assert_replicas_identical(model, state)


def train_skipping_non_finite_steps(name, bad_step=None, skipped_step=None, steps=5):
    """At ``bad_step`` the last rank's fc1 gradient gets an Inf (in row 0: only shard 0's
    replicate group sees it); a step whose local gradients are not all finite is not taken.
    ``skipped_step`` is not run at all."""
    _, model, _ = make_hsdp(build(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    finite_steps = []
    for step, (x, y) in enumerate(batches(steps, seed=6)):
        if step == skipped_step:
            continue
        model.poison = step == bad_step and dist.get_rank() == dist.get_world_size() - 1
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        finite = all(torch.isfinite(p.grad.to_local()).all().item() for p in model.parameters() if p.grad is not None)
        finite_steps.append(finite)
        if finite:
            optimizer.step()
    return local_shards(model), finite_steps


@pytest.mark.parametrize("name", ["none", "powersgd", "acpsgd", "topk", "lgreco"])
def test_a_non_finite_gradient_on_one_rank_is_skipped_everywhere_and_leaves_no_trace(name):
    params, finite = train_skipping_non_finite_steps(name, bad_step=2)
    assert finite == [True, True, False, True, True]
    assert all(theirs == finite for theirs in everyone(finite))
    reference, _ = train_skipping_non_finite_steps(name, skipped_step=2)
    for n, p in params.items():
        assert torch.isfinite(p).all(), n
        assert torch.equal(p, reference[n]), (name, n)


def accumulated_gradients(compressor, how, **fsdp_options):
    """Two micro-batches per step, two steps; the local gradient shards after the second
    step's backward. ``how``: "sync" (both backwards communicate), "no_sync"
    (set_requires_gradient_sync(False) on the first), "no_all_reduce"
    (set_requires_all_reduce(False) on the first)."""
    _, model, state = make_hsdp(compressor, **fsdp_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = list(batches(4, seed=7))
    for step in range(2):
        optimizer.zero_grad()
        for micro, (x, y) in enumerate(data[2 * step : 2 * step + 2]):
            last = micro == 1
            if how == "no_sync":
                model.set_requires_gradient_sync(last)
            elif how == "no_all_reduce":
                model.set_requires_all_reduce(last)
            loss_of(model, x, y).backward()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return grads, model, state


@pytest.mark.parametrize("how", ["sync", "no_sync", "no_all_reduce"])
def test_gradient_accumulation_over_two_micro_batches(how):
    """Uncompressed ("none"), the exchange gives HSDP's own gradients; compressed (PowerSGD),
    replicas stay identical and one exchange runs per communicating backward."""
    native, _, _ = accumulated_gradients(None, how)
    ours, _, state = accumulated_gradients(hc.NoCompression(), how)
    for n in native:
        assert torch.allclose(ours[n], native[n], rtol=0, atol=1e-6), (how, n)
    _, model, state = accumulated_gradients(hc.PowerSGD(rank=2), how)
    assert state.iter == (4 if how == "sync" else 2)
    assert_replicas_identical(model, state)


def test_the_exchange_starts_during_backward():
    """``head`` is reduced first and first in the fixed order: its exchange starts at the next
    group's hook, before backward's last hook, not after backward."""
    _, model, state = make_hsdp(build("acpsgd"))
    events = []
    hook, start = state._after_reduce_scatter, state._binding.start
    state._after_reduce_scatter = lambda group, params, out: (events.append("hook"), hook(group, params, out))
    state._binding.start = lambda name, grad: (events.append(name), start(name, grad))
    train(model, batches(1, seed=3))
    last_hook = len(events) - 1 - events[::-1].index("hook")
    assert events.index("head.weight") < last_hook, events
    assert state.iter == 1


def test_payloads_fuse_across_groups_and_fusion_zero_sends_each_shard_alone():
    calls = {}
    for label, fusion in [("fused", None), ("alone", hc.ScaledFusion(0))]:
        _, model, state = make_hsdp(build("acpsgd"), fusion=fusion)
        train(model, batches(2, seed=4))
        assert_replicas_identical(model, state)
        calls[label] = state.compressor.traffic.by_collective["allreduce"][0]
    compressed = 2  # fc1's and fc2's 64-row shards, once a step each (the rest goes dense)
    assert calls["fused"] < calls["alone"], calls
    assert calls["alone"] >= 2 * compressed, calls
    with pytest.raises(ValueError, match="fusion must be a ScaledFusion"):
        make_hsdp(build("acpsgd"), fusion=25 << 20)


def test_parameters_kept_unsharded_after_forward_change_nothing():
    """reshard_after_forward=False (no post-forward mesh description to keep in step with the
    replaced one): the same parameters, bit for bit, as with FSDP's default."""
    results = []
    for options in [{}, {"reshard_after_forward": False}]:
        _, model, state = make_hsdp(hc.PowerSGD(rank=2), **options)
        train(model, batches(4, seed=10))
        assert_replicas_identical(model, state)
        results.append(local_shards(model))
    for n, p in results[0].items():
        assert torch.equal(p, results[1][n]), n


def test_mixed_precision_with_bf16_reduce():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    native, _, _ = accumulated_gradients(None, "sync", mp_policy=policy)
    ours, _, _ = accumulated_gradients(hc.NoCompression(), "sync", mp_policy=policy)
    for n in native:
        assert ours[n].dtype == torch.float32
        tol = 1e-2 * native[n].abs().max().item() + 1e-6  # bf16 sums, in another order
        assert torch.allclose(ours[n], native[n], rtol=0, atol=tol), n
    _, model, state = make_hsdp(hc.PowerSGD(rank=2), mp_policy=policy)
    train(model, batches(4, seed=8))
    assert_replicas_identical(model, state)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="FSDP2 module"):
        hvd_compress.fsdp.register(Net(), hc.PowerSGD(rank=2))
    _, model, _ = make_hsdp(hc.PowerSGD(rank=2))
    with pytest.raises(ValueError, match="already compressed"):
        hvd_compress.fsdp.register(model, hc.PowerSGD(rank=2))
    _, model, _ = make_hsdp()
    with pytest.raises(ValueError, match=r"PowerSGD: named_parameters \['other.weight'\] are not parameters"):
        hvd_compress.fsdp.register(model, hc.PowerSGD([("other.weight", model.fc1.weight)], rank=2))


def test_a_compressor_serving_another_hsdp_model_is_refused():
    """One object for two models: refused at the second ``register``, on every rank alike."""
    compressor = hc.PowerSGD(rank=2)
    _, _, state = make_hsdp(compressor)
    with pytest.raises(
        ValueError,
        match=r"^compressor: this PowerSGD object already serves an HSDP "
        r"model.*compressor=copy\.deepcopy",
    ):
        make_hsdp(compressor, seed=1)
    assert state.compressor is compressor


@pytest.mark.parametrize("name", ["topk", "lgreco"])
def test_a_compressor_built_with_named_parameters_compresses_the_shards(name):
    """Built with the model's named_parameters (after fully_shard: the same names), it takes
    each rank's local shards under those names and trains exactly as one built without them."""
    _, unnamed, _ = make_hsdp(build(name))
    _, named, _ = make_hsdp()
    state = hvd_compress.fsdp.register(named, build(name, named.named_parameters()))
    assert {n: tuple(p.shape) for n, p in state.compressor.parameters.items()} == {
        n: tuple(p.to_local().shape) for n, p in named.named_parameters()
    }
    train(unnamed, batches(5, seed=3))
    train(named, batches(5, seed=3))
    for (n, shard), other in zip(local_shards(named).items(), local_shards(unnamed).values()):
        assert torch.equal(shard, other), n


def test_ranks_configured_differently_all_fail_at_the_first_step():
    """Runs last in this file (the failed backward leaves its model unusable): PowerSGD rank 2
    on the first replica, rank 3 on the second; every rank raises, naming the difference."""
    rank = 2 if dist.get_rank() < dist.get_world_size() // 2 else 3
    _, model, _ = make_hsdp(hc.PowerSGD(rank=rank))
    with pytest.raises(ValueError, match=r"PowerSGD: default is [23] on rank [0-3] but [23] on rank [0-3]"):
        train(model, batches(1, seed=9))


@pytest.mark.parametrize("compressor", [None, "fp16"])
def test_a_float16_mean_whose_sum_overflows_survives_the_replicate_exchange(compressor):
    """30000 on the first replica and 50000 on the second (tests/overflow.py; the same on both
    ranks of a shard group, so that FSDP's float32 reduce-scatter averages it unchanged):
    FP16's float16 all-reduce over the replicate group divides by its size first, as torch's
    fp16_compress_hook does, and gives HSDP's own mean, 40000, not Inf."""
    device_mesh = mesh()
    model = overflow.Scaled()
    fully_shard(model, mesh=device_mesh)
    if compressor is not None:
        hvd_compress.fsdp.register(model, hc.COMPRESSORS[compressor].build())
    model(torch.full((8, 4), overflow.value(device_mesh.get_local_rank("replicate"), 2))).backward()
    shard = model.w.grad.to_local()
    assert torch.equal(shard, torch.full_like(shard, 40000.0))


@pytest.mark.parametrize("name", METHODS)
def test_degenerate_shapes_travel_as_plain_hsdp_trains_them(name):
    """Shards of degenerate shapes (tests/degenerate.py), compressed where they can be
    (min_numel 0): ``nn.Linear(8, 1)``'s one row is the first shard rank's, so the second
    holds an empty shard of it; the scalar gain is one entry. FSDP2 (torch 2.13) itself
    refuses scalar and non-contiguous parameters and cannot reduce an empty one
    (``_chunk_cat expects non-empty tensor``), so those stay out. Three steps keep replicas
    identical, and the uncompressed baseline's shards equal plain HSDP's bit for bit."""

    def trained(compressor):
        torch.manual_seed(0)
        model = Degenerate(strided=False)
        model.gain = torch.nn.Parameter(model.gain.detach().reshape(1))
        model.empty = torch.nn.Linear(8, 2)
        for layer in [model.stem, model.conv, model.body, model.one]:
            fully_shard(layer, mesh=mesh())
        fully_shard(model, mesh=mesh())
        state = None if compressor is None else hvd_compress.fsdp.register(model, compressor)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            optimizer.zero_grad()
            x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(2, (8,), generator=g)
            loss_of(model, x, y).backward()
            optimizer.step()
        return model, state

    model, state = trained(hc.COMPRESSORS[name].build(small=True, min_numel=0))
    assert model.one.weight.to_local().shape[0] == (1 if dist.get_rank() % 2 == 0 else 0)
    assert_replicas_identical(model, state)
    if name == "none":
        plain, _ = trained(None)
        for (key, expected), got in zip(local_shards(plain).items(), local_shards(model).values()):
            assert torch.equal(got, expected), key


def test_a_compiled_hsdp_model_trains_as_the_eager_one():
    """An HSDP model wrapped in ``torch.compile`` (inductor; FSDP2's hooks run around the
    compiled graphs) compresses its replicate-group all-reduce: replicas bit-identical after
    3 steps, and the shards match eager HSDP's up to the compiler's reordering of float sums."""
    shards = []
    for compile_model in (True, False):
        _, model, state = make_hsdp(build("powersgd"))
        train(torch.compile(model) if compile_model else model, batches(3, seed=9))
        assert_replicas_identical(model, state)
        shards.append(local_shards(model))
    for name, shard in shards[0].items():
        torch.testing.assert_close(shard, shards[1][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

"""State across steps through hvd_compress.ddp on real ranks (torchrun, Gloo): L-GreCo's rank-0
decisions over torch.distributed (applied at the same step everywhere, a stalled rank 0 fails
every rank within the timeout), GraVAC's factor changes, and checkpoints that resume exactly."""

import io
import itertools
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hvd_compress as hc
import hvd_compress.ddp
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.comm.transports import DecisionTimeout, TorchTransport
from hvd_compress.registry import controllable

from ddp_helpers import (
    METHODS,
    assert_identical_across_ranks,
    batches,
    check_step_against_reference,
    everyone,
    make_ddp,
    train,
)
from poison import OneInf  # tests/poison.py

# What every controller wraps here: the first registered compressor it can wrap.
WRAPPED = controllable()[0]


def controlled(controller):
    """``controller`` at its multi-rank settings (the registry's ``ranks``: L-GreCo decides at
    steps 2, 5, 8, ...) over ``WRAPPED``; a clock it reads step times from is scripted."""
    compression = hc.CONTROLLERS[controller].build(hc.COMPRESSORS[WRAPPED].build(small=True), ranks=True)
    if hasattr(compression, "clock"):
        compression.clock = scripted_clock()
    return compression


def scripted_clock(start=100.0):
    """GraVAC's step times, the same on every rank and in the reference: step k takes
    0.1 * (1 + k % 3) seconds."""
    readings = itertools.accumulate(itertools.cycle([0.1, 0.2, 0.3]), initial=start)
    return lambda: next(readings)


class SharedDecisions:
    """The reference world's decision transport: its W L-GreCo instances end each step in rank
    order, so rank 0's broadcast is there before the others ask."""

    def __init__(self, rank, size, board):
        self.rank, self.size, self.board = rank, size, board

    def broadcast(self, obj, tag, deadline, what):
        if self.rank == 0:
            self.board[tag] = obj
        return self.board[tag]

    def allgather(self, obj, tag, deadline, what):
        return [obj] * self.size


def reference_world(make):
    compressors = [make() for _ in range(dist.get_world_size())]
    board = {}
    for rank, compressor in enumerate(compressors):
        if isinstance(compressor, hc.LGreCo):
            compressor.service._transport = SharedDecisions(rank, len(compressors), board)
    return SimulatedWorld(compressors)


@pytest.mark.parametrize("controller", sorted(hc.CONTROLLERS))  # a new one needs its case below
def test_controllers_match_the_simulated_world_step_by_step(controller):
    """Every step's aggregate equals that of W controllers in one process, through L-GreCo's
    decisions (taking effect at steps 3, 6 and 9) and GraVAC's factor changes."""
    compression = controlled(controller)
    module, model, _ = make_ddp(compression)
    reference = reference_world(lambda: controlled(controller))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(9, seed=6):
        check_step_against_reference(module, model, optimizer, reference, WRAPPED, x, y)
    if controller == "lgreco":
        assert [(d.version, d.decided_at, d.effective_step) for d in compression.decisions] == [
            (1, 2, 3),
            (2, 5, 6),
            (3, 8, 9),
        ]
        assert type(compression.service._transport) is TorchTransport  # "auto" under DDP
        names = [name for name, _ in module.named_parameters()]
        assert [compression.setting(n) for n in names] == [reference.compressors[0].setting(n) for n in names]
    else:
        factors = [h[0] for h in compression.history]
        assert len(set(factors)) > 1, factors
        assert factors == [h[0] for h in reference.compressors[0].history]


@pytest.mark.parametrize("controller", sorted(hc.CONTROLLERS))  # a new one needs its case below
def test_every_rank_takes_the_same_settings_at_the_same_step(controller):
    compression = controlled(controller)
    module, model, _ = make_ddp(compression)
    history = []
    optimizer = None
    for x, y in batches(12, seed=7):
        optimizer = train(model, [(x, y)], optimizer)
        history.append([compression.setting(name) for name, _ in module.named_parameters()])
    assert len({repr(h) for h in history}) > 1, "the settings never changed"
    assert all(theirs == history for theirs in everyone(history))
    assert_identical_across_ranks(module)


def checkpoint(obj):
    """Through torch.save and torch.load(weights_only=True), as a user would."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def build(name):
    if name == "lgreco":
        return controlled(name)
    return hc.COMPRESSORS[name].build(small=True)


@pytest.mark.parametrize("name", METHODS + ["lgreco"])
def test_resumed_from_a_checkpoint_equals_uninterrupted(name):
    """state_dict after 4 steps (L-GreCo: with a decision in flight, due at step 6), a fresh
    model, optimizer and compressor load it, 4 more steps: parameters equal those of 8 steps
    without interruption, bit for bit."""
    data = list(batches(8, seed=8))
    module, model, _ = make_ddp(build(name))
    train(model, data)
    uninterrupted = {n: p.detach().clone() for n, p in module.named_parameters()}

    compressor = build(name)
    module, model, _ = make_ddp(compressor)
    optimizer = train(model, data[:4])
    saved = checkpoint(
        {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "compressor": compressor.state_dict()}
    )
    compressor = build(name)
    compressor.load_state_dict(saved["compressor"])
    module, model, _ = make_ddp(compressor, seed=1)  # other initial weights: the checkpoint's win
    module.load_state_dict(saved["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    train(model, data[4:], optimizer)
    for n, p in module.named_parameters():
        assert torch.equal(p, uninterrupted[n]), (name, n)
    if name == "lgreco":
        assert [d.version for d in compressor.decisions] == [1, 2]


def test_a_pickled_state_resumes_like_a_checkpoint():
    """The hook's state pickles without its process group, driver and names, as torch's hook
    states do; registered again, it continues where it stopped."""
    data = list(batches(6, seed=9))
    module, model, _ = make_ddp(hc.PowerSGD(rank=2))
    train(model, data)
    uninterrupted = {n: p.detach().clone() for n, p in module.named_parameters()}

    module, model, state = make_ddp(hc.PowerSGD(rank=2))
    optimizer = train(model, data[:3])
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None and restored._binding is None and not restored._names
    assert restored.iter == 3
    saved = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
    torch.manual_seed(1)
    module = type(module)()
    model = torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=True, bucket_cap_mb=0.05)
    hvd_compress.ddp.register(model, restored)
    module.load_state_dict(saved["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    train(model, data[3:], optimizer)
    for n, p in module.named_parameters():
        assert torch.equal(p, uninterrupted[n]), n
    assert restored.iter == 6


def train_skipping_non_finite_steps(name, layer, bad_step=None, skipped_step=None, steps=6):
    """As a GradScaler user would: a step whose aggregated gradients are not all finite is not
    applied. At ``bad_step`` the last rank's ``layer``.weight gradient gets one Inf entry;
    ``skipped_step`` is not taken at all. Returns (parameters, per-step finiteness)."""
    module, model, _ = make_ddp(build(name))
    poison = OneInf()
    getattr(module, layer).weight.register_hook(poison)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    finite_steps = []
    for step, (x, y) in enumerate(batches(steps, seed=11)):
        if step == skipped_step:
            continue
        poison.armed = step == bad_step and dist.get_rank() == dist.get_world_size() - 1
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        finite = all(torch.isfinite(p.grad).all().item() for p in module.parameters() if p.grad is not None)
        finite_steps.append(finite)
        if finite:
            optimizer.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}, finite_steps


@pytest.mark.parametrize("layer", ["conv1", "fc"])  # sent dense (144 weights), compressed
@pytest.mark.parametrize("name", METHODS + ["lgreco"])
def test_a_non_finite_gradient_on_one_rank_is_skipped_everywhere_and_leaves_no_trace(name, layer):
    params, finite = train_skipping_non_finite_steps(name, layer, bad_step=2)
    assert finite == [True, True, False, True, True, True]
    assert all(theirs == finite for theirs in everyone(finite))
    reference, _ = train_skipping_non_finite_steps(name, layer, skipped_step=2)
    for n, p in params.items():
        assert torch.isfinite(p).all(), n
        assert torch.equal(p, reference[n]), (name, n)


def test_stalled_rank0_fails_every_rank_within_the_timeout():
    """Runs last in this file. Rank 0's decision outlives the 3 s timeout: rank 0 raises
    waiting for it, the others waiting for its broadcast."""
    side = dist.new_group(backend="gloo")  # to meet again once every rank has given up
    compression = hc.CONTROLLERS["lgreco"].build(hc.PowerSGD(rank=2), ranks=True, timeout=3.0)
    _, model, _ = make_ddp(compression)
    if dist.get_rank() == 0:
        compression._decide = lambda *args: time.sleep(8)
    start = time.monotonic()
    with pytest.raises(DecisionTimeout, match="L-GreCo decision 1"):
        train(model, batches(6, seed=10))
    assert time.monotonic() - start < 3.0 + 10.0
    # The other ranks gave up on a broadcast of the decision's length that rank 0 never sent.
    # Once all of them have (the side group's barrier), rank 0 sends it, so that the default
    # group's later collectives pair up again.
    dist.barrier(group=side)
    if dist.get_rank() == 0:
        dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0)
    dist.barrier()


def test_two_ddp_models_share_fp16_and_refuse_a_stateful_compressor():
    """One object registered on two DDP models: a stateful compressor or a controller is refused
    at the second ``register``, on every rank alike, with the way out; FP16 keeps no state and
    is shared: the two models train as with an FP16 each."""
    for compression in (hc.PowerSGD(rank=2), controlled("lgreco")):
        served = make_ddp(compression)
        with pytest.raises(
            ValueError,
            match=r"^compressor: this \w+ object already serves an "
            r"hvd_compress.ddp hook's State.*compressor=copy\.deepcopy",
        ):
            make_ddp(compression, seed=1)
        assert served[2].compressor is compression
    data = list(batches(3, seed=5))

    def trained(compressions):
        pairs = [make_ddp(compression, seed=seed)[:2] for seed, compression in enumerate(compressions)]
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.05) for _, model in pairs]
        for x, y in data:  # in turns, as a GAN's two optimizers
            for (_, model), optimizer in zip(pairs, optimizers):
                train(model, [(x, y)], optimizer)
        return [{n: p.detach().clone() for n, p in module.named_parameters()} for module, _ in pairs]

    fp16 = hc.FP16()
    for shared, separate in zip(trained([fp16, fp16]), trained([hc.FP16(), hc.FP16()])):
        for name, p in separate.items():
            assert torch.equal(shared[name], p), name


def compiled_ddp_weights(compile_model):
    """The DDP model's weights after 3 steps with PowerSGD's hook, the DDP model called through
    ``torch.compile`` (inductor; DDP's graph split at bucket boundaries) where ``compile_model``."""
    # torch 2.13's inductor on a CPU gives this CNN's convolutions zero gradients when it
    # converts them to channels_last (layout_optimization); docs/methods.md has the reproducer.
    with torch._inductor.config.patch(layout_optimization=False):
        # DDP's default buckets: DDPOptimizer wants its first bucket no larger than the others.
        module, model, _ = make_ddp(hc.COMPRESSORS["powersgd"].build(small=True), partial=False, bucket_cap_mb=25)
        train(torch.compile(model) if compile_model else model, batches(3, seed=8))
    return module


def test_a_compiled_ddp_model_trains_as_the_eager_one():
    """A DDP model wrapped in ``torch.compile`` runs the registered hook on every bucket: the
    replicas stay bit-identical and the weights match eager DDP's up to the compiler's
    reordering of float sums. At np 2 only: each rank compiles, and one world size shows it."""
    if dist.get_world_size() != 2:
        pytest.skip("the compiled model trains at np 2 only (a compile per rank)")
    compiled = compiled_ddp_weights(compile_model=True)
    assert_identical_across_ranks(compiled)
    eager = compiled_ddp_weights(compile_model=False)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

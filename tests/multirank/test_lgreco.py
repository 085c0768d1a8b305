"""L-GreCo on real ranks: every rank applies every decision at the same step, parameters stay
identical, and a stalled rank 0 makes every rank fail within the timeout. The service runs over
Horovod's collectives under both launchers."""

import threading
import time

import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from hvd_compress.comm.rounds import Collective
from hvd_compress.comm.transports import DecisionTimeout, HorovodTransport
from examples.workloads.digits import DigitsCNN

from helpers import PATHS, assert_parameters_identical, assert_same_on_every_rank, rank_batches

INNER = {
    "powersgd": lambda named: hc.PowerSGD(named, rank=2),
    "acpsgd": lambda named: hc.ACPSGD(named, rank=4),
    "topk": lambda named: hc.TopK(named, density=0.05),
    "qsgd": lambda named: hc.QSGD(named, bits=4, bucket_size=128),
    "qallreduce": lambda named: hc.QuantizedAllReduce(named, bits=4, block_size=64),
}


def lgreco_optimizer(model, inner, path, **kwargs):
    options = dict(warmup_steps=4, decide_every=6, apply_delay=2)
    options.update(kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if path == "stock":
        lgreco = hc.LGreCo(INNER[inner](model.named_parameters()), **options)
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=lgreco), lgreco
    lgreco = hc.LGreCo(INNER[inner](None), **options)
    return hc.DistributedOptimizer(opt, model.named_parameters(), lgreco), lgreco


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inner", sorted(INNER))
def test_every_rank_applies_each_decision_at_the_same_step(inner, path):
    model = DigitsCNN()
    opt, lgreco = lgreco_optimizer(model, inner, path)
    names = [name for name, _ in model.named_parameters()]
    history = []
    for x, y in rank_batches(20, seed=4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        history.append(tuple(lgreco.setting(name) for name in names))
    decisions = [(d.version, d.decided_at, d.effective_step, sorted(d.settings.items())) for d in lgreco.decisions]
    assert [d[:3] for d in decisions] == [(1, 4, 6), (2, 10, 12), (3, 16, 18)]
    # Under mpirun too: no MPI calls of ours beside Horovod's background thread.
    assert isinstance(lgreco.service.transport, HorovodTransport)
    assert_same_on_every_rank((decisions, history), f"lgreco.{inner}.{path}")
    assert_parameters_identical(model, f"lgreco.{inner}.{path}")


@pytest.mark.parametrize("path", PATHS)
def test_start_step_sends_whole_gradients_first_and_decides_one_warm_up_later(path):
    """start_step 5: the first 5 steps send every gradient whole on every rank (the bytes of a
    float32 all-reduce); the first decision comes warmup_steps (4) after, built on the
    gradients plus residuals (the default), alike everywhere."""
    model = DigitsCNN()
    opt, lgreco = lgreco_optimizer(model, "topk", path, start_step=5)
    for step, (x, y) in enumerate(rank_batches(18, seed=5), start=1):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step == 5:
            # Plus, on the stock path, Horovod's 4-byte placeholder for each gradient our driver
            # carries: every gradient some setting compresses (integration/horovod/compression.py).
            driven = (
                0 if path == "wrapper" else sum(lgreco.inner.tuning.tunable(tuple(p.shape)) for p in model.parameters())
            )
            placeholders = step * driven * Collective.ALLREDUCE.wire_bytes(4, hvd.size())
            assert lgreco.traffic.wire_bytes == lgreco.traffic.dense_wire_bytes + placeholders
    assert lgreco.traffic.wire_bytes < lgreco.traffic.dense_wire_bytes
    decisions = [(d.version, d.decided_at, d.effective_step, sorted(d.settings.items())) for d in lgreco.decisions]
    assert [d[:3] for d in decisions] == [(1, 9, 11), (2, 15, 17)]
    assert_same_on_every_rank(decisions, f"lgreco.start.{path}")


def test_auto_delay_postpones_a_slow_decision_alike_on_every_rank():
    """apply_delay="auto": rank 0's first decision (submitted at step 4) is still running when its
    first 10 steps are over; rank 0 names later steps through the exchange and every rank applies
    the decision at the same one, with identical parameters after."""
    model = DigitsCNN()
    opt, lgreco = lgreco_optimizer(model, "powersgd", "stock", apply_delay="auto", decide_every=200)
    past_the_first_exchange = threading.Event()
    if hvd.rank() == 0:
        # Held by the step count, not a sleep: on a loaded machine 10 steps can outlast any sleep.
        errors = lgreco.inner.tuning.errors_of_layers  # the decision's one call for its error rows
        lgreco.inner.tuning.errors_of_layers = lambda *args: (past_the_first_exchange.wait(60), errors(*args))[1]
    for step, (x, y) in enumerate(rank_batches(3000, seed=6), start=1):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= 4 + 10 + 1:
            past_the_first_exchange.set()
        if lgreco.decisions:  # took effect: the same step everywhere
            break
    decisions = [(d.version, d.decided_at, d.effective_step) for d in lgreco.decisions]
    assert len(decisions) == 1 and decisions[0][2] > 4 + 10, decisions
    assert_same_on_every_rank((decisions, lgreco._delay), "lgreco.auto")
    assert_parameters_identical(model, "lgreco.auto")


def test_stalled_rank0_fails_every_rank_within_the_timeout():
    """Rank 0's decision is held past the 3 s timeout, then let go: no decision thread is left
    running when the ranks exit (one asleep at exit wakes during interpreter shutdown)."""
    model = DigitsCNN()
    opt, lgreco = lgreco_optimizer(model, "powersgd", "wrapper", timeout=3.0)
    stalled = threading.Event()
    if hvd.rank() == 0:
        lgreco._decide = lambda *args: stalled.wait(60)
    start = time.monotonic()
    try:
        with pytest.raises(DecisionTimeout, match="L-GreCo decision 1"):
            for x, y in rank_batches(10, seed=5):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        assert time.monotonic() - start < 3.0 + 10.0
    finally:
        stalled.set()
    for thread in threading.enumerate():
        if thread.name == "hvd_compress-decision":
            thread.join(10)
            assert not thread.is_alive()

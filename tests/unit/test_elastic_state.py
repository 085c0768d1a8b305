"""Elastic state, one process: Horovod's own TorchState with a compressor as a keyword (the
handler that importing hvd_compress registers), commit/restore, the error-feedback policy at
sync, and L-GreCo's decision in flight across a world change. The fault-injection runs with
real workers are in tests/test_elastic.py."""

import logging
import threading

import horovod.torch as hvd
import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.control.service import DecisionService
from hvd_compress.integration.horovod.elastic import CompressionStateHandler
from test_checkpoints import assert_same_state, gradients, outputs
from test_lgreco import DECAY, held_decisions, layered_gradients


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()  # one process: Horovod's collectives answer at once


def trained_world(steps=3):
    world = SimulatedWorld([hc.PowerSGD(rank=2, min_numel=0) for _ in range(2)])
    outputs(world, range(steps))
    return world


def test_torch_state_takes_any_compressor_as_a_keyword():
    model = torch.nn.Linear(4, 2)
    for compression in [
        hc.PowerSGD(rank=2),
        hc.LGreCo(hc.TopK(density=0.1), transport="local"),
        hc.GraVAC(hc.ACPSGD(rank=2)),
        hc.FP16(),
    ]:
        state = hvd.elastic.TorchState(model=model, compression=compression, step=0)
        assert isinstance(state._handlers["compression"], CompressionStateHandler)
        assert state.compression is compression


def test_restore_brings_back_the_committed_state_after_a_step_cut_off_midway():
    world = trained_world()
    handlers = [CompressionStateHandler(c) for c in world.compressors]  # commits, as TorchState does
    committed = [c.state_dict() for c in world.compressors]
    outputs(world, range(3, 5))
    world.compressors[1].begin("fc.weight", gradients(5, 1)["fc.weight"])  # a step that never ends
    for handler in handlers:
        handler.restore()
    for compressor, state in zip(world.compressors, committed):
        assert_same_state(compressor.state_dict(), state)
    # And training goes on exactly as from the committed step.
    uninterrupted = trained_world()
    for ours, theirs in zip(outputs(world, range(3, 6)), outputs(uninterrupted, range(3, 6))):
        for mine, reference in zip(ours, theirs):
            assert all(torch.equal(mine[name], reference[name]) for name in mine)


@pytest.mark.parametrize("policy", ["keep", "reset"])
def test_sync_shares_rank0s_state_and_follows_the_feedback_policy(policy):
    world = trained_world()
    compressor = world.compressors[1]  # rank 1 of 2 until the reset; rank 0 of 1 after it
    compressor.feedback_on_world_change = policy
    before = compressor.state_dict()
    assert before["residuals"]
    CompressionStateHandler(compressor).sync()
    after = compressor.state_dict()
    assert (compressor.rank, compressor.size) == (0, 1)
    expected = dict(before, rank=0, world_size=1, residuals=before["residuals"] if policy == "keep" else {})
    assert_same_state(after, expected)


def test_an_unknown_feedback_policy_is_refused_by_name():
    compressor = hc.TopK(density=0.1)
    compressor.feedback_on_world_change = "average"
    with pytest.raises(ValueError, match="TopK.feedback_on_world_change must be one of keep, reset, got 'average'"):
        CompressionStateHandler(compressor).sync()


def lgreco_with_a_decision_in_flight():
    """An L-GreCo whose first decision computes until the test sets its event (the first of
    the events returned; each later decision gets its own)."""
    lgreco = hc.LGreCo(
        hc.PowerSGD(rank=4, min_numel=0), warmup_steps=3, decide_every=50, apply_delay=5, transport="local"
    )
    gates = held_decisions(lgreco)
    world = SimulatedWorld([lgreco])
    for step in range(3):
        world.step([layered_gradients(step, DECAY)])
    assert lgreco.decision_in_flight == 1
    return lgreco, world, gates


def test_an_elastic_commit_does_not_wait_for_a_decision_in_flight():
    lgreco, _, gates = lgreco_with_a_decision_in_flight()
    saved = lgreco.elastic_state_dict()
    assert lgreco.service.running()  # returned while the decision still computes: it did not wait
    assert saved["pending"] is None and saved["outcome"] is None
    gates[0].set()


def test_a_world_change_drops_the_decision_in_flight_and_its_late_result(caplog):
    lgreco, world, gates = lgreco_with_a_decision_in_flight()
    thread = lgreco.service._thread
    with caplog.at_level(logging.WARNING, logger="hvd_compress.control.lgreco"):
        lgreco.bind_world(0, 3)  # was (0, 1)
    assert "decision 1 (gradients up to step 3) dropped" in caplog.text
    assert lgreco.decision_in_flight is None
    gates[0].set()
    thread.join()  # it finished after being abandoned: its outcome is never sent
    assert lgreco.service.finished_outcome() is None
    lgreco.bind_world(0, 1)
    for step in range(3, 60):  # the schedule goes on: the next decision is agreed and applied
        for gate in gates:
            gate.set()
        world.step([layered_gradients(step, DECAY)])
    assert [d.version for d in lgreco.decisions] == [2]


def test_an_abandoned_computation_never_sets_the_outcome_of_a_later_one():
    service = DecisionService("local", timeout=5.0)
    release = threading.Event()
    service.submit(lambda: (release.wait(5), "stale")[1])
    abandoned = service._thread
    service.rejoin()
    service.submit(lambda: "fresh")
    release.set()
    abandoned.join()
    assert service.finished_outcome() == ("ok", "fresh")


def test_only_a_rebinding_forms_a_new_transport():
    """The first binding keeps the transport it was given (the reference worlds of the DDP tier
    set theirs before binding); binding again to the same world (an elastic reset that kept
    rank and size) forms a new one."""
    lgreco = hc.LGreCo(hc.PowerSGD(rank=2), transport="local")
    given = lgreco.service._transport = object()
    lgreco.bind_world(0, 2)
    assert lgreco.service._transport is given
    lgreco.bind_world(0, 2)
    assert lgreco.service._transport is None


def post_accumulate_hooks(param):
    return len(param._post_accumulate_grad_hooks or {})


@pytest.mark.parametrize("name", ["powersgd", "topk"])  # a lone all-reduce and the driver
def test_a_replaced_stock_bridge_leaves_one_hook_per_parameter(name):
    """Each elastic reset (``sync`` bumps the world's generation) makes the stock bridge stale,
    and the next ``compress`` builds a new one: the old one's hooks go with it."""
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Linear(32, 32))
    compression = hc.COMPRESSORS[name].build(model.named_parameters(), small=True)
    for reset in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        sent = [compression.compress(p.grad) for p in model.parameters()]
        for payload, ctx in sent:
            compression.decompress(payload, ctx)
        assert [post_accumulate_hooks(p) for p in model.parameters()] == [1] * 4, reset
        CompressionStateHandler(compression).sync()
        assert compression._stock_bridges[None].stale()  # called outside an optimizer


def test_the_wrapper_is_horovods_own_to_broadcast_optimizer_state_even_with_hvd_patched(monkeypatch):
    # broadcast_optimizer_state initialises an empty state with the plain step() only for an
    # optimizer of Horovod's own module; a replaced hvd.DistributedOptimizer must not change
    # ours (otherwise a rank with an empty state steps alone and waits forever).
    from horovod.torch import optimizer as horovod_optimizer  # what broadcast_optimizer_state imports

    monkeypatch.setattr(hvd, "DistributedOptimizer", lambda *args, **kwargs: None)
    model = torch.nn.Linear(4, 4)
    wrapped = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), hc.NoCompression()
    )
    assert type(wrapped).__module__ == horovod_optimizer.DistributedOptimizer.__module__

"""hvd_compress.DiLoCo in one process (Horovod initialised alone: nothing is exchanged, the
outer step works on this rank's own pseudo-gradient): arguments refused by name, the outer
step's arithmetic, a non-finite period skipped, checkpoints checked before anything changes.
The multi-rank cases run under mpirun/horovodrun (tests/multirank/test_outer.py) and torchrun
(tests/ddp/test_ddp_outer.py)."""

import io

import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()  # one process: Horovod's collectives answer at once


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def train(net, outer, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        outer.zero_grad()
        net(x).square().mean().backward()
        outer.step()


def diloco(net, **options):
    options.setdefault("inner_steps", 2)
    return hc.DiLoCo(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), **options)


def test_bad_arguments_are_refused_by_name():
    net = small_net()
    named = list(net.named_parameters())
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    cases = [
        (lambda: hc.DiLoCo("sgd", named, inner_steps=2), "optimizer must be a torch.optim.Optimizer"),
        (
            lambda: hc.DiLoCo(
                hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named), named, inner_steps=2
            ),
            "optimizer must be the local optimizer",
        ),
        (
            lambda: hc.DiLoCo(
                hc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named), named, inner_steps=2
            ),
            "optimizer must be the local optimizer",
        ),
        (lambda: hc.DiLoCo(sgd, None, inner_steps=2), "named_parameters is required"),
        (lambda: hc.DiLoCo(sgd, named[:1], inner_steps=2), "named_parameters: 3 optimizer parameter"),
        (lambda: hc.DiLoCo(sgd, named, hvd.Compression.fp16, inner_steps=2), "compression must be"),
        (lambda: hc.DiLoCo(sgd, named, inner_steps=0), r"inner_steps must lie in \[1"),
        (lambda: hc.DiLoCo(sgd, named, inner_steps=2.5), "inner_steps must be an integer"),
        (lambda: hc.DiLoCo(sgd, named, inner_steps=True), "inner_steps must be an integer"),
        (lambda: hc.DiLoCo(sgd, named, inner_steps=2, outer_optimizer="sgd"), "outer_optimizer must be a callable"),
        (
            lambda: hc.DiLoCo(sgd, named, inner_steps=2, outer_optimizer=lambda params: None),
            "outer_optimizer must return a torch.optim.Optimizer",
        ),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()
    with pytest.raises(ValueError, match="add_param_group"):
        hc.DiLoCo(sgd, named, inner_steps=2).add_param_group({"params": [torch.zeros(2)]})


@pytest.mark.parametrize("outer_lr", [1.0, 0.5])
def test_the_outer_step_moves_the_anchor_along_its_own_pseudo_gradient(outer_lr):
    """World of one, outer SGD without momentum: the new weights are start - lr x (start - local)
    (lr 1: the local weights, model averaging over one rank)."""
    net, local = small_net(), small_net()
    start = [p.detach().clone() for p in net.parameters()]
    outer = diloco(net, inner_steps=3, outer_optimizer=lambda params: torch.optim.SGD(params, lr=outer_lr))
    train(net, outer, 3)
    train(local, torch.optim.SGD(local.parameters(), lr=0.1), 3)
    assert (outer.outer_steps, outer.step_in_period) == (1, 0)
    for p, q, s in zip(net.parameters(), local.parameters(), start):
        torch.testing.assert_close(p, s - outer_lr * (s - q))


def test_the_default_outer_optimizer_is_nesterov_momentum():
    outer = diloco(small_net())
    group = outer.state_dict()["outer_optimizer"]["param_groups"][0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)


def sparseloco(net, **options):
    options.setdefault("inner_steps", 2)
    return hc.SparseLoCo(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), min_numel=0, **options)


def test_sparseloco_is_diloco_with_chunked_top_k_and_plain_sgd_at_the_outer_lr():
    outer = sparseloco(small_net(), outer_lr=0.8, density=0.1, chunk=64, bits=2, feedback_decay=0.9)
    assert isinstance(outer, hc.DiLoCo) and isinstance(outer.compression, hc.compressors.ChunkedTopK)
    config = outer.compression.config
    assert (config.density, config.chunk, config.bits, config.feedback_decay) == (0.1, 64, 2, 0.9)
    group = outer.state_dict()["outer_optimizer"]["param_groups"][0]
    assert (group["lr"], group["momentum"]) == (0.8, 0)
    # The outer learning rate is agreed across ranks and recorded in checkpoints.
    assert outer.describe()["config"]["outer_optimizer"] == "SGD(lr=0.8)"
    with pytest.raises(ValueError, match="SparseLoCo: outer_lr must"):
        sparseloco(small_net(), outer_lr=0)
    with pytest.raises(ValueError, match="ChunkedTopK: bits must be one of"):
        sparseloco(small_net(), bits=3)


def test_streaming_refuses_bad_fragments_delay_and_mixing_by_name():
    def build(**options):
        net = small_net()
        return hc.StreamingDiLoCo(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), **options)

    with pytest.raises(ValueError, match=r"fragments must lie in \[1, 4\]"):
        build(inner_steps=4, fragments=5)
    with pytest.raises(ValueError, match=r"delay must lie in \[0, 1\]"):
        build(inner_steps=4, fragments=2, delay=2)
    with pytest.raises(ValueError, match="mixing must be below 1"):
        build(inner_steps=4, mixing=1.0)
    outer = build(inner_steps=4, fragments=2, delay=1, mixing=0.25)
    config = outer.describe()["config"]
    assert (config["fragments"], config["delay"], config["mixing"]) == (2, 1, 0.25)


def test_streaming_fragments_are_consecutive_and_about_equal():
    from hvd_compress.integration.torch.diloco.streaming import _fragments

    sizes = {"a": 10, "b": 10, "c": 40, "d": 20, "e": 20}
    named = {name: torch.zeros(n) for name, n in sizes.items()}
    assert _fragments(named, 1) == [list(sizes)]
    assert _fragments(named, 2) == [["a", "b", "c"], ["d", "e"]]
    assert _fragments(named, 5) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert [len(group) for group in _fragments(named, 3)] == [3, 1, 1]


def test_a_nonfinite_period_goes_back_to_its_start_and_leaves_no_trace():
    net = small_net()
    outer = diloco(net, compression=hc.TopK(density=0.05))
    train(net, outer, 2)
    before, start = outer.state_dict(), [p.detach().clone() for p in net.parameters()]
    train(net, outer, 1)
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    train(net, outer, 1)
    assert (outer.outer_steps, outer.skipped_outer_steps) == (1, 1)
    for p, s in zip(net.parameters(), start):
        assert torch.equal(p, s)
    after = outer.state_dict()
    assert all(torch.equal(after["anchors"][k], before["anchors"][k]) for k in before["anchors"])
    assert after["outer_optimizer"]["state"].keys() == before["outer_optimizer"]["state"].keys()


def checkpoint_of(outer):
    buffer = io.BytesIO()
    torch.save(outer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_checkpoint_round_trips_through_weights_only_loading():
    net = small_net()
    outer = diloco(net, inner_steps=3, compression=hc.TopK(density=0.05))
    train(net, outer, 4)
    saved = checkpoint_of(outer)
    fresh = diloco(small_net(), inner_steps=3, compression=hc.TopK(density=0.05))
    fresh.load_state_dict(saved)
    assert fresh.step_in_period == 1 and fresh.outer_steps == 1
    restored = fresh.state_dict()
    for name, anchor in saved["anchors"].items():
        assert torch.equal(restored["anchors"][name], anchor)


def _edited(checkpoint, edit):
    edited = dict(checkpoint, config=dict(checkpoint["config"]))
    edit(edited)
    return edited


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("anchors"), "missing"),
        (lambda c: c.update({"class": "LGreCo"}), "is a LGreCo checkpoint"),
        (lambda c: c["config"].update(inner_steps=5), "inner_steps is 5 in the checkpoint but 2 here"),
        (lambda c: c["config"].update(outer_optimizer="Adam"), "outer_optimizer is 'Adam'"),
        (lambda c: c.update(step_in_period=2), r"step_in_period must lie in \[0, 2\)"),
        (
            lambda c: c.update(anchors=dict(c["anchors"], **{"0.weight": torch.zeros(3, 3)})),
            "anchor of parameter '0.weight'",
        ),
        (lambda c: c.update(anchors=dict(c["anchors"], extra=torch.zeros(3))), r"anchors \['extra'\]"),
        (lambda c: c.update(outer_optimizer={"state": {}, "param_groups": []}), "outer_optimizer state"),
        (
            lambda c: c.update(compression=dict(c["compression"], config={"min_numel": 1024, "default": 7})),
            "TopK.load_state_dict",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(edit, message):
    net = small_net()
    outer = diloco(net, compression=hc.TopK(density=0.05))
    train(net, outer, 3)
    checkpoint = checkpoint_of(outer)
    before = checkpoint_of(outer)
    with pytest.raises(ValueError, match=message):
        outer.load_state_dict(_edited(checkpoint, edit))
    after = outer.state_dict()
    assert after["step_in_period"] == before["step_in_period"]
    assert all(torch.equal(after["anchors"][k], before["anchors"][k]) for k in before["anchors"])
    assert after["compression"]["config"] == before["compression"]["config"]


def test_a_learning_rate_scheduler_takes_it_and_sets_the_inner_learning_rate():
    net = small_net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = hc.DiLoCo(inner, net.named_parameters(), inner_steps=2)
    schedule = torch.optim.lr_scheduler.LambdaLR(outer, lambda step: 0.5**step)
    for _ in range(3):
        train(net, outer, 1)
        schedule.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_elastic_state_commits_restores_and_syncs_the_outer_state():
    """hvd.elastic.TorchState takes DiLoCo as a keyword through its own handler (not Horovod's
    optimizer handler): restore() brings back the committed anchors, period and error feedback;
    sync() loads rank 0's state and makes the wrapper bind again at its next step."""
    from hvd_compress.integration.horovod.elastic import DiLoCoStateHandler

    net = small_net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = hc.DiLoCo(inner, net.named_parameters(), hc.TopK(density=0.05), inner_steps=3)
    state = hvd.elastic.TorchState(net, inner, outer=outer, epoch=0)
    assert isinstance(state._handlers["outer"], DiLoCoStateHandler)
    train(net, outer, 4)
    state.commit()
    committed = checkpoint_of(outer)
    train(net, outer, 3, seed=1)
    assert outer.outer_steps == 2
    state.restore()
    restored = outer.state_dict()
    assert (restored["step_in_period"], restored["outer_steps"]) == (1, 1)
    for key in ("anchors",):
        assert all(torch.equal(restored[key][k], committed[key][k]) for k in committed[key])
    assert all(
        torch.equal(restored["compression"]["residuals"][k], committed["compression"]["residuals"][k])
        for k in committed["compression"]["residuals"]
    )
    state.sync()
    assert outer._binding.stale()
    train(net, outer, 2)
    assert not outer._binding.stale() and (outer.outer_steps, outer.step_in_period) == (2, 0)


def test_streaming_elastic_state_commits_and_restores_an_exchange_in_flight():
    """StreamingDiLoCo under hvd.elastic.TorchState (DiLoCo's handler): a commit while a
    fragment's exchange is in flight saves it (finished, waiting to apply); after a restore the
    run continues bit for bit as the one that was never interrupted."""
    from hvd_compress.integration.horovod.elastic import DiLoCoStateHandler

    def streaming(net):
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        codec = hc.TopK(density=0.05)
        return inner, hc.StreamingDiLoCo(inner, net.named_parameters(), codec, inner_steps=4, fragments=2, delay=1)

    reference = small_net()
    _, uninterrupted = streaming(reference)
    train(reference, uninterrupted, 2)
    train(reference, uninterrupted, 4, seed=2)

    net = small_net()
    inner, outer = streaming(net)
    state = hvd.elastic.TorchState(net, inner, outer=outer, epoch=0)
    assert isinstance(state._handlers["outer"], DiLoCoStateHandler)
    train(net, outer, 2)  # fragment 0's exchange starts at step 2 and applies at step 3
    state.commit()
    committed = checkpoint_of(outer)
    assert committed["pending"]["fragment"] == 0 and committed["step_in_period"] == 2
    train(net, outer, 3, seed=1)
    state.restore()
    restored = outer.state_dict()
    assert restored["step_in_period"] == 2 and restored["pending"]["apply_at"] == committed["pending"]["apply_at"]
    assert all(torch.equal(restored["pending"]["results"][k], v) for k, v in committed["pending"]["results"].items())
    train(net, outer, 4, seed=2)
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert outer.outer_steps == uninterrupted.outer_steps == 2


def test_gradscaler_steps_it_and_an_overflow_step_counts_in_the_period():
    """GradScaler skips the inner step of an overflow, but the call counts in the period (the
    ranks whose gradients were finite count theirs), and the other steps are unscaled."""
    net = small_net()
    outer = diloco(net, inner_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(8, 16)
    for poison in [False, True, False, False]:
        outer.zero_grad()
        scaler.scale(net(x).square().mean()).backward()
        if poison:
            net[0].weight.grad[0, 0] = float("inf")
        scaler.step(outer)
        scaler.update()
    assert (outer.outer_steps, outer.step_in_period) == (2, 0)
    assert scaler.get_scale() == 2.0**9  # the overflow halved it, as for any optimizer


def test_gradscaler_unscales_as_for_the_inner_optimizer_alone():
    """Under GradScaler, with or without an explicit unscale_, the inner step sees the same
    gradients as GradScaler stepping the inner optimizer itself."""
    results = []
    for wrapped, explicit in [(False, False), (True, False), (True, True)]:
        torch.manual_seed(0)
        net = small_net()
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        stepped = hc.DiLoCo(inner, net.named_parameters(), inner_steps=5) if wrapped else inner
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for _ in range(3):
            stepped.zero_grad()
            scaler.scale(net(torch.ones(8, 16)).square().mean()).backward()
            if explicit:
                scaler.unscale_(stepped)
            scaler.step(stepped)
            scaler.update()
        results.append({name: p.detach().clone() for name, p in net.named_parameters()})
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]) and torch.equal(results[0][name], results[2][name])

"""hvd_compress.DiLoCo's multi-rank checks, shared by the Horovod launch
(tests/multirank/test_outer.py) and the torchrun launch (tests/ddp/test_ddp_outer.py): each
passes a ``gather(tensor, name) -> (W, numel)`` over its own collectives. DiLoCo picks its
backend itself (Horovod there, torch.distributed here)."""

import io

import pytest
import torch
from torch import nn

import hvd_compress as hc
import overflow  # tests/overflow.py
from degenerate import Degenerate  # tests/degenerate.py

# Outer steps through these, each with its own state (error feedback, warm starts, L-GreCo).
COMPRESSIONS = ["none", "fp16", "qsgd", "qallreduce", "topk", "chunkedtopk", "powersgd", "lgreco"]
H = 3


def compression(name):
    if name == "lgreco":
        return hc.LGreCo(hc.TopK(density=0.05), warmup_steps=1, decide_every=2, apply_delay=1)
    return hc.COMPRESSORS[name].build(small=True)


def model(seed):
    """16 -> 64 -> 64 -> 4: two weights large enough to be compressed, a dense head."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def batches(rank, steps, seed=0):
    """Rank ``rank``'s data: its own regression batches."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        yield x, torch.tanh(x @ target)


def inner_step(net, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()


def weights(net):
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def assert_identical(gather, net, label):
    for name, p in net.named_parameters():
        rows = gather(p, f"outer.{label}.{name}")
        assert all(torch.equal(rows[0], row) for row in rows), f"{label}: {name} differs between ranks"


def replicas_identical_after_every_outer_step(gather, rank, method):
    """Every rank starts from other weights (the first step broadcasts rank 0's); after each
    outer step every parameter is bit-identical on every rank, and only outer steps exchange."""
    net = model(seed=rank)
    outer = hc.DiLoCo(
        torch.optim.AdamW(net.parameters(), lr=1e-2), net.named_parameters(), compression(method), inner_steps=H
    )
    for step, (x, y) in enumerate(batches(rank, 3 * H), 1):
        outer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        outer.step()
        if step % H == 0:
            assert outer.step_in_period == 0 and outer.outer_steps == step // H
            assert_identical(gather, net, f"{method}.{step}")
    assert outer.compression.traffic.steps == 3  # one exchange per outer step, none between


def outer_step_is_the_reference_outer_optimizer_on_the_mean(gather, rank, size):
    """Uncompressed, two periods: the weights after each outer step are the default Nesterov
    outer optimizer's step on the mean of the ranks' pseudo-gradients, computed here by hand
    from every rank's local weights (a replica of the inner training run beside it)."""
    net, local = model(0), model(0)
    outer = hc.DiLoCo(torch.optim.SGD(net.parameters(), lr=0.05), net.named_parameters(), inner_steps=H)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    anchors = [nn.Parameter(p.detach().clone()) for p in local.parameters()]
    reference = torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)
    for step, (x, y) in enumerate(batches(rank, 2 * H), 1):
        inner_step(net, outer, x, y)
        inner_step(local, local_opt, x, y)
        if step % H:
            continue
        with torch.no_grad():
            for i, (anchor, p) in enumerate(zip(anchors, local.parameters())):
                everyone = gather(p, f"outer.reference.{step}.{i}").view(size, *p.shape)
                anchor.grad = (anchor - everyone).mean(dim=0)
            reference.step()
            for anchor, p in zip(anchors, local.parameters()):
                p.copy_(anchor)
        for (name, p), q in zip(net.named_parameters(), local.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")


def sparseloco_steps_along_the_mean_of_what_each_rank_sent(gather, rank, size):
    """SparseLoCo, three periods: each rank sends C(x) of x = beta e + delta (its decayed
    residual plus its pseudo-gradient, from a replica trained beside it) and keeps e' = x - C(x);
    the weights move by outer_lr times the mean over ranks of C(x); and each chunk of 64 sends
    at most 7 entries (density 0.1)."""
    beta, lr = 0.9, 0.5
    net, local = model(0), model(0)
    outer = hc.SparseLoCo(
        torch.optim.SGD(net.parameters(), lr=0.05),
        net.named_parameters(),
        inner_steps=H,
        density=0.1,
        chunk=64,
        feedback_decay=beta,
        outer_lr=lr,
        min_numel=0,
    )
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    residual = {name: torch.zeros_like(p) for name, p in net.named_parameters()}
    start = weights(net)
    for step, (x, y) in enumerate(batches(rank, 3 * H), 1):
        inner_step(net, outer, x, y)
        inner_step(local, local_opt, x, y)
        if step % H:
            continue
        for (name, p), q in zip(net.named_parameters(), local.parameters()):
            x = beta * residual[name] + (start[name] - q.detach())
            kept = outer.compression.residual(name)
            own = x if kept is None else x - kept.view_as(p)  # C(x); 1-D weights go dense
            if p.dim() >= 2:
                sent = own.abs() > 1e-5 * x.abs().max()  # what was not sent differs by rounding alone
                assert kept is not None and sent.float().mean() <= 7 / 64
                residual[name] = kept.view_as(p).clone()
            mean = gather(own, f"outer.sparseloco.{step}.{name}").mean(dim=0).view_as(p)
            torch.testing.assert_close(p.detach(), start[name] - lr * mean, rtol=1e-5, atol=1e-6, msg=name)
        start = weights(net)
        with torch.no_grad():
            for p, q in zip(local.parameters(), net.parameters()):
                p.copy_(q)


def one_inner_step_is_data_parallel_sgd(gather, rank, size):
    """inner_steps=1, no compression, outer SGD at learning rate 1 without momentum: each outer
    step moves the weights by the mean of the ranks' local SGD steps, i.e. data-parallel SGD
    on the mean gradient, to float32 rounding."""
    net, reference = model(0), model(0)
    outer = hc.DiLoCo(
        torch.optim.SGD(net.parameters(), lr=0.1),
        net.named_parameters(),
        hc.NoCompression(),
        inner_steps=1,
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
    )
    for step, (x, y) in enumerate(batches(rank, 6), 1):
        inner_step(net, outer, x, y)
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p -= 0.1 * gather(p.grad, f"outer.dp.{step}.{i}").mean(dim=0).view_as(p)
        for (name, p), q in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")
    assert outer.outer_steps == 6


def nonfinite_pseudo_gradient_on_one_rank_skips_the_outer_step_everywhere(gather, rank, size):
    """An Inf in the last rank's weights in the second period: every rank skips that outer
    step, its weights go back to the period's start, the outer optimizer and the compressor
    (error feedback) are as before the period, and the next period runs as usual."""
    net = model(0)
    outer = hc.DiLoCo(
        torch.optim.SGD(net.parameters(), lr=0.05), net.named_parameters(), hc.TopK(density=0.05), inner_steps=2
    )
    data = batches(rank, 6)
    for x, y in [next(data), next(data)]:
        inner_step(net, outer, x, y)
    start, before = weights(net), outer.state_dict()
    inner_step(net, outer, *next(data))
    if rank == size - 1:
        with torch.no_grad():
            net[2].weight[0, 0] = float("inf")
    inner_step(net, outer, *next(data))
    assert (outer.outer_steps, outer.skipped_outer_steps, outer.step_in_period) == (1, 1, 0)
    for name, p in net.named_parameters():
        assert torch.equal(p, start[name]), name
    after = outer.state_dict()
    for key in ("anchors", "outer_optimizer"):
        assert _same(after[key], before[key]), key
    assert _same(after["compression"]["residuals"], before["compression"]["residuals"])
    for x, y in [next(data), next(data)]:
        inner_step(net, outer, x, y)
    assert (outer.outer_steps, outer.skipped_outer_steps) == (2, 1)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert_identical(gather, net, "after-skip")


def gradscaler_overflow_on_one_rank_keeps_the_periods_in_step(gather, rank):
    """A reported situation: GradScaler, an Inf in rank 0's gradients at the second of four
    iterations, H = 2. Only rank 0's scaler skips its inner step, but every rank counts the
    call, so every rank takes its outer steps at the same iterations and the replicas end
    identical. Were the skipped call not counted, rank 0's periods would run an iteration
    late: pseudo-gradients of different periods averaged, then a last exchange without partner."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    outer = hc.DiLoCo(
        torch.optim.SGD(net.parameters(), lr=0.05), net.named_parameters(), hc.NoCompression(), inner_steps=2
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024)
    counts = []
    for iteration, (x, y) in enumerate(batches(rank, 4)):
        outer.zero_grad()
        scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
        if rank == 0 and iteration == 1:
            for p in net.parameters():
                p.grad.fill_(float("inf"))
        scaler.step(outer)
        scaler.update()
        counts.append((outer.step_in_period, outer.outer_steps))
    assert counts == [(1, 0), (0, 1), (1, 1), (0, 2)], counts
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert_identical(gather, net, "gradscaler")


def through_bytes(checkpoint):
    """``checkpoint`` through torch.save and torch.load(weights_only=True), as a user would."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resume_mid_period_is_exact(gather, rank):
    """A checkpoint taken mid-period (model, inner AdamW, DiLoCo with Top-K's error feedback and
    Nesterov momentum), loaded into fresh objects built from other weights, continues bit for
    bit as the uninterrupted run."""

    def build(seed):
        net = model(seed)
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return net, inner, hc.DiLoCo(inner, net.named_parameters(), hc.TopK(density=0.05), inner_steps=H)

    steps, cut = 3 * H, H + 1
    net, _, outer = build(0)
    for x, y in batches(rank, steps):
        inner_step(net, outer, x, y)
    expected = weights(net)

    net, inner, outer = build(0)
    data = batches(rank, steps)
    for _ in range(cut):
        inner_step(net, outer, *next(data))
    assert outer.step_in_period == cut % H != 0
    checkpoint = through_bytes({"model": net.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()})

    net, inner, outer = build(100 + rank)  # other weights everywhere: all of it must come back
    net.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["inner"])
    outer.load_state_dict(checkpoint["outer"])
    for x, y in data:
        inner_step(net, outer, x, y)
    for name, p in net.named_parameters():
        assert torch.equal(p, expected[name]), name
    assert_identical(gather, net, "resumed")


def streaming(net, fragments=2, delay=1, mixing=0.5, inner_steps=4):
    return hc.StreamingDiLoCo(
        torch.optim.SGD(net.parameters(), lr=0.05),
        net.named_parameters(),
        hc.TopK(density=0.05),
        inner_steps=inner_steps,
        fragments=fragments,
        delay=delay,
        mixing=mixing,
    )


def streaming_with_one_fragment_is_diloco_bit_for_bit(gather, rank):
    """One fragment, no delay, no mixing: the same weights as DiLoCo's, bit for bit."""
    nets = [model(0), model(0)]
    plain = hc.DiLoCo(
        torch.optim.SGD(nets[0].parameters(), lr=0.05), nets[0].named_parameters(), hc.TopK(density=0.05), inner_steps=H
    )
    stream = streaming(nets[1], fragments=1, delay=0, mixing=0.0, inner_steps=H)
    for x, y in batches(rank, 3 * H):
        inner_step(nets[0], plain, x, y)
        inner_step(nets[1], stream, x, y)
    for (name, p), q in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert torch.equal(p, q), name
    assert stream.outer_steps == plain.outer_steps == 3


def streaming_fragments_exchange_in_turn_and_keep_the_anchors_identical(gather, rank):
    """Two fragments, H = 4, delay 1, mixing 0.5: fragment 0 starts its exchange at step 2 of
    each period and fragment 1 at step 4, each applied one step later; every exchange carries
    its fragment's gradients alone, and the anchors agree on every rank after each."""
    net = model(0)
    outer = streaming(net)
    first, second = outer.fragment_names
    assert first + second == [name for name, _ in net.named_parameters()] and first and second
    exchanged = []
    for step, (x, y) in enumerate(batches(rank, 12), 1):
        before = outer.compression.traffic.steps
        inner_step(net, outer, x, y)
        if outer.compression.traffic.steps > before:
            exchanged.append(step)
        if step in (3, 5, 7, 9, 11):  # just after an outer step; nothing in flight
            for name, anchor in outer.state_dict()["anchors"].items():
                rows = gather(anchor, f"streaming.anchor.{step}.{name}")
                assert all(torch.equal(rows[0], row) for row in rows), (step, name)
    # An exchange ends (and counts) when its result applies: one step after it started.
    assert exchanged == [3, 5, 7, 9, 11] and outer.outer_steps == 5
    assert outer.compression.traffic.steps == 5


def streaming_nonfinite_fragment_on_one_rank_skips_its_step_everywhere(gather, rank, size):
    """An Inf in the last rank's first-fragment weights before that fragment's exchange (H = 4,
    two fragments, no delay, no mixing): every rank skips that fragment's outer step and takes
    its weights back to its anchors, the other fragment's step runs, the weights stay finite
    and the anchors identical on every rank."""
    net = model(0)
    outer = streaming(net, delay=0, mixing=0.0)
    first = outer.fragment_names[0]
    data = batches(rank, 8)
    inner_step(net, outer, *next(data))
    if rank == size - 1:
        with torch.no_grad():
            dict(net.named_parameters())[first[0]][0, 0] = float("inf")
    inner_step(net, outer, *next(data))  # step 2: the first fragment's exchange
    assert (outer.outer_steps, outer.skipped_outer_steps) == (0, 1)
    anchors = outer.state_dict()["anchors"]
    for name, p in net.named_parameters():
        if name in first:
            assert torch.equal(p, anchors[name]), name
    for x, y in data:
        inner_step(net, outer, x, y)
    assert (outer.outer_steps, outer.skipped_outer_steps) == (3, 1)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    # Between their outer steps fragments train locally: the anchors are what every rank shares.
    for name, anchor in outer.state_dict()["anchors"].items():
        rows = gather(anchor, f"streaming.skip.{name}")
        assert torch.isfinite(anchor).all() and all(torch.equal(rows[0], row) for row in rows), name


def streaming_resume_with_an_exchange_in_flight_is_exact(gather, rank):
    """A checkpoint taken while fragment 1's exchange is in flight (after step 4 of the period,
    applied at step 1 of the next), loaded into fresh objects built from other weights,
    continues bit for bit as the uninterrupted run."""
    steps, cut = 12, 8

    def build(seed):
        net = model(seed)
        return net, streaming(net)

    net, outer = build(0)
    for x, y in batches(rank, steps):
        inner_step(net, outer, x, y)
    expected = weights(net)

    net, outer = build(0)
    data = batches(rank, steps)
    for _ in range(cut):
        inner_step(net, outer, *next(data))
    checkpoint = through_bytes({"model": net.state_dict(), "outer": outer.state_dict()})
    assert checkpoint["outer"]["pending"]["fragment"] == 1

    net, outer = build(100 + rank)
    net.load_state_dict(checkpoint["model"])
    outer.load_state_dict(checkpoint["outer"])
    for x, y in data:
        inner_step(net, outer, x, y)
    for name, p in net.named_parameters():
        assert torch.equal(p, expected[name]), name


def ranks_that_disagree_all_fail(rank):
    net = model(0)
    outer = hc.DiLoCo(torch.optim.SGD(net.parameters(), lr=0.05), net.named_parameters(), inner_steps=2 + rank)
    x, y = next(batches(rank, 1))
    with pytest.raises(ValueError, match="inner_steps is"):
        inner_step(net, outer, x, y)


def _same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def float16_pseudo_gradients_average_where_their_sum_overflows(gather, rank, size, method):
    """Pseudo-gradients of 30000 on rank 0 and 50000 on the last rank (tests/overflow.py; one inner
    SGD step at learning rate 1 on a loss whose gradient is that value), outer SGD at learning
    rate 1: the outer step moves the weights by the mean, 40000 at two ranks, as torch's
    fp16_compress_hook would average; a float16 sum would be Inf. FP16's payload, and a float16
    model's pseudo-gradients sent dense, are divided by W before their float16 sum."""
    dtype = torch.float16 if method == "none" else torch.float32
    net = overflow.Scaled(dtype)
    outer = hc.DiLoCo(
        torch.optim.SGD(net.parameters(), lr=1.0),
        net.named_parameters(),
        hc.COMPRESSORS[method].build(),
        inner_steps=1,
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
    )
    outer.zero_grad()
    net(torch.full((8, 4), overflow.value(rank, size), dtype=dtype)).backward()
    outer.step()
    weight = net.w.detach()
    assert weight.dtype == dtype and torch.isfinite(weight).all()
    torch.testing.assert_close(weight.float(), torch.full((8, 4), -overflow.mean(size)), rtol=1e-3, atol=0)
    if size == 2:
        assert torch.equal(weight, torch.full((8, 4), -40000.0, dtype=dtype))
    assert_identical(gather, net, f"float16.{method}")


def degenerate_shapes_travel(gather, rank, method):
    """Pseudo-gradients of every degenerate shape (tests/degenerate.py: an empty layer, a scalar,
    a dimension of 1, channels_last, transposed), compressed where they can be: two outer steps
    keep every replica identical, each parameter in its own layout."""
    torch.manual_seed(0)  # the same weights everywhere
    net = Degenerate()
    layouts = {name: p.stride() for name, p in net.named_parameters()}
    outer = hc.DiLoCo(
        torch.optim.SGD(net.parameters(), lr=0.05), net.named_parameters(), compression(method), inner_steps=2
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        outer.zero_grad()
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(2, (8,), generator=g)
        nn.functional.cross_entropy(net(x), y).backward()
        outer.step()
    assert outer.outer_steps == 2
    assert {name: p.stride() for name, p in net.named_parameters()} == layouts
    assert_identical(gather, net, f"degenerate.{method}")

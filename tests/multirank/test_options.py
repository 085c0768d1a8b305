"""Horovod's options of DistributedOptimizer, on both paths: honoured, or refused at once."""

import copy
import warnings

import horovod.torch as hvd
import pytest
import torch
from torch import nn

import hvd_compress as hc
from examples.workloads.digits import DigitsCNN

import overflow  # tests/overflow.py
from helpers import CONFIGS, PATHS, assert_parameters_identical, distributed, gathered, rank_batches

# How close two runs that differ only in summation order (or in a scale of W) must stay.
TOLERANCE = {"fp16": 2e-3, "bf16": 2e-2}


def gradients_after(method, path, steps=3, made=None, **options):
    """Every synchronized gradient of ``steps`` steps (SGD, lr 0 so that the model stays put);
    the compressor is appended to ``made`` where given."""
    torch.manual_seed(0)
    model = DigitsCNN()
    opt, compressor = distributed(model, torch.optim.SGD(model.parameters(), lr=0.0), method, path, **options)
    if made is not None:
        made.append(compressor)
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
    assert_close(gradients_after(method, path, gradient_predivide_factor=4.0), gradients_after(method, path), method)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["powersgd", "topk"])
def test_backward_passes_per_step_accumulates_locally(method, path):
    """Two backward passes, one exchange: as one pass over both halves' summed losses."""
    results = []
    for passes in [1, 2]:
        torch.manual_seed(0)
        model = DigitsCNN()
        opt, _ = distributed(
            model, torch.optim.SGD(model.parameters(), lr=0.0), method, path, backward_passes_per_step=passes
        )
        x, y = next(rank_batches(1, batch_size=32, seed=5))
        opt.zero_grad()
        if passes == 1:
            (
                nn.functional.cross_entropy(model(x[:16]), y[:16]) + nn.functional.cross_entropy(model(x[16:]), y[16:])
            ).backward()
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
    for options, match in [
        ({"num_groups": 2}, "num_groups/groups"),
        ({"op": hvd.Adasum}, "op: .* got hvd.Adasum"),
        ({"op": hvd.Max}, "got hvd.Max"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "only with op=hvd.Average"),
        ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor"),
    ]:
        with pytest.raises(ValueError, match=match):
            hc.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), hc.PowerSGD(rank=2), **options
            )


@pytest.mark.parametrize("op, name", [(hvd.Adasum, "hvd.Adasum"), (hvd.Max, "hvd.Max")])
def test_stock_refuses_unsupported_ops_at_the_first_step_on_every_rank(op, name):
    torch.manual_seed(0)
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=op,
        compression=hc.PowerSGD(model.named_parameters(), rank=2),
    )
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
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=embedding.named_parameters(), compression=compressor, sparse_as_dense=sparse_as_dense
        )
    else:
        opt = hc.DistributedOptimizer(opt, embedding.named_parameters(), compressor, sparse_as_dense=sparse_as_dense)
    for step in range(3):
        opt.zero_grad()
        embedding(torch.tensor([hvd.rank(), 10 + step])).sum().backward()
        opt.step()
    rows = gathered(embedding.weight, f"sparse.{path}.{sparse_as_dense}")
    assert all(torch.equal(rows[0], row) for row in rows)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_wrapper_hands_sparse_gradients_back_sparse_for_sparse_adam(sparse_as_dense):
    """As in Horovod, sparse gradients come back sparse (torch.optim.SparseAdam refuses dense
    ones): with sparse_as_dense=False all-gathered uncompressed and averaged, the compressor
    never sees them; with True densified, compressed, and made sparse again."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 8, sparse=True)
    linear = nn.Linear(8, 1)
    model = nn.ModuleDict({"embedding": embedding, "linear": linear})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compressor = hc.PowerSGD(rank=2, min_numel=0)
    opts = [
        hc.DistributedOptimizer(
            torch.optim.SparseAdam(embedding.parameters(), lr=0.1),
            embedding.named_parameters(prefix="embedding"),
            compressor,
            sparse_as_dense=sparse_as_dense,
        ),
        hc.DistributedOptimizer(
            torch.optim.SGD(linear.parameters(), lr=0.1),
            linear.named_parameters(prefix="linear"),
            hc.PowerSGD(rank=2, min_numel=0),
        ),
    ]
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        ids = torch.tensor([hvd.rank(), 10 + step])
        linear(embedding(ids)).sum().backward()
        for opt in opts:
            opt.synchronize()
        grad = embedding.weight.grad
        assert grad.is_sparse
        expected = torch.zeros(50, 8)
        for r in range(hvd.size()):
            expected[[r, 10 + step]] += linear.weight.detach()[0] / hvd.size()
        if not sparse_as_dense:  # else compressed
            assert torch.allclose(grad.to_dense(), expected, atol=1e-6)
        for opt in opts:
            with opt.skip_synchronize():
                opt.step()
    assert ("embedding.weight" in compressor.state) == sparse_as_dense
    rows = gathered(embedding.weight, f"sparse.adam.{sparse_as_dense}")
    assert all(torch.equal(rows[0], row) for row in rows)


def test_a_sparse_gradient_leaves_its_fusion_bucket_to_the_others():
    """One optimizer, a sparse embedding and a dense layer planned into one bucket: the bucket
    goes without the sparse member, on every rank, from the first step on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 16))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), hc.TopK(density=0.5, min_numel=0)
    )
    for step in range(3):
        opt.zero_grad()
        model(torch.tensor([hvd.rank(), 10 + step])).sum().backward()
        opt.step()
        assert model[0].weight.grad.is_sparse and not model[1].weight.grad.is_sparse
    assert_parameters_identical(model, "sparse.bucket")


def test_wrapper_warns_as_horovod_when_step_follows_synchronize():
    model = nn.Linear(8, 4)
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for skip in (False, True):
        model(torch.ones(2, 8)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        warned = any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in caught)
        assert warned == (not skip), [str(w.message) for w in caught]


def test_wrapper_names_parameters_as_horovod():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    ours = hc.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    theirs = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    assert ours._parameter_names == theirs._parameter_names
    assert hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters()
    )._parameter_names == {p: name for name, p in model.named_parameters()}


def stock_run(method, named_optimizer, named_compressor, steps=2):
    """Parameters after ``steps`` steps of stock hvd.DistributedOptimizer, with or without
    names given to the optimizer and to the compressor."""
    torch.manual_seed(0)
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compressor = hc.COMPRESSORS[method].build(model.named_parameters() if named_compressor else None, small=True)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters() if named_optimizer else None,
        compression=compressor,
    )
    for x, y in rank_batches(steps, seed=9):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, compressor, opt


@pytest.mark.parametrize("method", CONFIGS)
def test_stock_compressor_without_names_takes_the_optimizers(method):
    """hc.PowerSGD(rank=4) with no named_parameters, as hvd.Compression.fp16: the names are
    those of the calling hvd.DistributedOptimizer (its own "allreduce.noname.i.j" if it has
    none), and with the model's names the run is the one with names given to both."""
    named, _, _ = stock_run(method, True, True)
    adopted, compressor, _ = stock_run(method, True, False)
    for (name, p), q in zip(named.named_parameters(), adopted.parameters()):
        if hvd.size() == 2:
            assert torch.equal(p, q), name
        else:  # Horovod fuses what is ready in a cycle, so above 2 ranks the two runs may sum
            # in another order (Gloo's ring): equal to rounding, not bit for bit
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    if compressor.needs_parameter_names:
        assert sorted(compressor.parameters) == sorted(n for n, _ in named.named_parameters())
    nameless, compressor, opt = stock_run(method, False, False)
    if compressor.needs_parameter_names:
        assert compressor.parameters == {name: p for p, name in opt._parameter_names.items()}
    assert_parameters_identical(nameless, f"nameless.{method}")


class GAN:
    """A generator and a discriminator, each with its own distributed optimizer, trained in the
    usual alternation: the discriminator on detached fakes, then the generator through the
    frozen discriminator."""

    def __init__(self, path, compressions):
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.optimizers = []
        for part, compression in zip(("discriminator", "generator"), compressions):
            model = getattr(self, part)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            named = [(f"{part}.{name}", p) for name, p in model.named_parameters()]
            if path == "stock":
                self.optimizers.append(
                    hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
                )
            else:
                self.optimizers.append(hc.DistributedOptimizer(optimizer, named, compression))

    def train(self, steps):
        g = torch.Generator().manual_seed(hvd.rank())
        loss = nn.functional.binary_cross_entropy_with_logits
        d_opt, g_opt = self.optimizers
        for _ in range(steps):
            real, z = torch.randn(8, 16, generator=g) + 2, torch.randn(8, 8, generator=g)
            d_opt.zero_grad()
            scores = self.discriminator(torch.cat([real, self.generator(z).detach()]))
            loss(scores, torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])).backward()
            d_opt.step()
            g_opt.zero_grad()
            self.discriminator.requires_grad_(False)
            try:
                loss(self.discriminator(self.generator(z)), torch.ones(8, 1)).backward()
            finally:
                self.discriminator.requires_grad_(True)
            g_opt.step()

    def parameters(self):
        return {
            f"{part}.{name}": p.detach().clone()
            for part in ("discriminator", "generator")
            for name, p in getattr(self, part).named_parameters()
        }


def test_a_compressor_shared_by_a_gans_stock_optimizers_is_refused_with_what_to_do():
    """One TopK for both stock optimizers: the discriminator's steps first and serves it; the
    generator's first gradient is refused on every rank alike, with the way out."""
    gan = GAN("stock", [hc.TopK(density=1.0)] * 2)
    with pytest.raises(
        ValueError,
        match=r"compression: this TopK object already serves a stock "
        r"hvd.DistributedOptimizer.*copy\.deepcopy",
    ):
        gan.train(1)


@pytest.mark.parametrize("method", ["topk", "lgreco"])
def test_a_compressor_shared_by_a_gans_wrapper_optimizers_is_refused_at_construction(method):
    compression = (
        hc.TopK(density=1.0) if method == "topk" else hc.CONTROLLERS["lgreco"].build(hc.PowerSGD(rank=2), ranks=True)
    )
    with pytest.raises(
        ValueError,
        match=r"compression: this .* object already serves an "
        r"hvd_compress.DistributedOptimizer over Adam.*copy\.deepcopy",
    ):
        GAN("wrapper", [compression] * 2)


@pytest.mark.parametrize("path", PATHS)
def test_a_gan_shares_fp16_and_trains_as_with_two_copies(path):
    """Horovod users pass hvd.Compression.fp16 to both optimizers: FP16 is shared as they are.
    The two TopK(density=1.0) the error suggests send every entry: an uncompressed run."""
    shared = GAN(path, [hc.FP16()] * 2)
    shared.train(3)
    separate = GAN(path, [hc.FP16(), hc.FP16()])
    separate.train(3)
    for name, p in separate.parameters().items():
        torch.testing.assert_close(shared.parameters()[name], p, rtol=0, atol=1e-6, msg=name)
    topk = hc.TopK(density=1.0, min_numel=0)
    copies = GAN(path, [topk, copy.deepcopy(topk)])
    copies.train(3)
    dense = GAN(path, [hc.NoCompression()] * 2)
    dense.train(3)
    for name, p in dense.parameters().items():
        torch.testing.assert_close(copies.parameters()[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert_parameters_identical(shared.generator, f"gan.{path}.shared")
    assert_parameters_identical(copies.generator, f"gan.{path}.copies")


@pytest.mark.parametrize(
    "options", [{}, {"op": hvd.Sum}, {"gradient_predivide_factor": 2.0}, {"gradient_predivide_factor": "size"}]
)
@pytest.mark.parametrize("method,dtype", [("fp16", torch.float32), ("fp16", torch.float16), ("none", torch.float16)])
@pytest.mark.parametrize("path", PATHS)
def test_a_float16_mean_whose_sum_overflows_survives(path, method, dtype, options):
    """30000 on rank 0 and 50000 on the last rank (evenly between): their float16 sum is Inf,
    their mean 40000, which torch's fp16_compress_hook gives (it divides by W before the
    float16 all-reduce). Every float16 payload (FP16's, a float16 gradient's) is divided first
    on both paths, whatever op and gradient_predivide_factor say (Horovod's own
    Compression.fp16 gives Inf here unless gradient_predivide_factor is the world size);
    hvd.Sum gives W times the mean in the gradient's dtype."""
    w, r = hvd.size(), hvd.rank()
    options = {key: float(w) if value == "size" else value for key, value in options.items()}
    if options.get("op") == hvd.Sum and dtype == torch.float16:
        pytest.skip("the sum itself is beyond float16")
    module = overflow.Scaled(dtype)
    opt, _ = distributed(module, torch.optim.SGD(module.parameters(), lr=0.0), method, path, **options)
    module(torch.full((8, 4), overflow.value(r, w), dtype=dtype)).backward()
    opt.synchronize()
    expected = overflow.mean(w) * (w if options.get("op") == hvd.Sum else 1)
    got = module.w.grad
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert torch.allclose(got.float(), torch.full((8, 4), expected), rtol=1e-3, atol=0)
    if w == 2:
        assert torch.equal(got, torch.full((8, 4), expected, dtype=dtype))
    assert_parameters_identical(module, f"float16.{path}.{method}")


@pytest.mark.parametrize("path", PATHS)
def test_compiled_qsgd_compiles_before_its_first_round_and_keeps_ranks_identical(path):
    """QSGD with ``compiled=True``: its kernels compile in the first step's configuration
    check, before any round (``compile_seconds``), every rank runs them compiled, every
    synchronized gradient is bit-identical on every rank, and matches the eager run's to
    rounding. At np 2 only: decoding compiles a graph per world size, and one shows it."""
    if hvd.size() != 2:
        pytest.skip("compiled QSGD runs at np 2 only (a decode graph per world size)")
    made = []
    compiled = gradients_after("qsgd", path, made=made, settings={"compiled": True})
    for step, gradients in enumerate(compiled):
        for name, gradient in gradients.items():
            rows = gathered(gradient, f"compiled.{path}.{step}.{name}")
            assert all(torch.equal(rows[0], row) for row in rows), (step, name)
    metrics = made[0].metrics()
    assert metrics["compiled"] == 1.0 and metrics["compile_seconds"] > 0 and metrics["compiled_graphs"] >= 1
    assert_close(compiled, gradients_after("qsgd", path), "qsgd")


def skip_unless_one_launch():
    """The compiled-model tests run in the np 2 MPI launch alone: each rank compiles, and the
    launcher and world size change nothing the compiler sees."""
    if hvd.size() != 2 or not hvd.mpi_enabled():
        pytest.skip("a compiled model trains in the np 2 MPI launch only (a compile per rank)")


def trained_weights(path, compile_model, compiled_autograd=False, steps=4):
    """The digits CNN's weights after ``steps`` steps through ``path`` (stock, wrapper or
    DiLoCo over 2 inner steps, so the last step is an outer one) with PowerSGD, the model called
    through ``torch.compile`` (inductor) where ``compile_model``; with ``compiled_autograd``,
    forward and backward run as one compiled function, the backward traced by compiled
    autograd, as PyTorch's tutorial on it does."""
    # torch 2.13's inductor on a CPU gives this CNN's convolutions zero gradients when it
    # converts them to channels_last (layout_optimization); docs/methods.md has the reproducer.
    # torch.compile reads compiled_autograd when it wraps a function: both patched around all.
    with (
        torch._dynamo.config.patch(compiled_autograd=compiled_autograd),
        torch._inductor.config.patch(layout_optimization=False),
    ):
        torch.manual_seed(0)
        module = DigitsCNN()
        model = torch.compile(module) if compile_model else module
        local = torch.optim.SGD(module.parameters(), lr=0.05)
        if path == "diloco":
            opt = hc.DiLoCo(
                local, module.named_parameters(), hc.COMPRESSORS["powersgd"].build(small=True), inner_steps=2
            )
        else:
            opt, _ = distributed(module, local, "powersgd", path)

        def forward_backward(x, y):
            nn.functional.cross_entropy(model(x), y).backward()

        # aot_eager: what is under test is the traced backward with the hooks in it, not code
        # generation (inductor compiled it alike in 180 s a rank).
        step = torch.compile(forward_backward, backend="aot_eager") if compiled_autograd else forward_backward
        for x, y in rank_batches(steps, seed=7):
            opt.zero_grad()
            step(x, y)
            opt.step()
    return module


@pytest.mark.parametrize("path", PATHS + ["diloco"])
def test_a_compiled_model_trains_as_the_eager_one(path):
    """A user's model wrapped in ``torch.compile`` trains under the stock optimizer, the wrapper
    and DiLoCo: the gradient hooks fire on the compiled backward, the ranks stay bit-identical,
    and the weights match the eager model's up to the compiler's reordering of float sums. At
    np 2 only: the model compiles once a rank, and one world size shows it."""
    skip_unless_one_launch()
    compiled = trained_weights(path, compile_model=True)
    assert_parameters_identical(compiled, f"compiled_model.{path}")
    eager = trained_weights(path, compile_model=False)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_compiled_autograd_trains_as_the_eager_one():
    """Compiled autograd traces the backward with Horovod's gradient hooks in it: the stock
    path's exchange still runs once a gradient, the ranks stay bit-identical and the weights
    match eager training's."""
    from torch._dynamo.utils import counters

    skip_unless_one_launch()
    captures = counters["compiled_autograd"]["captures"]
    compiled = trained_weights("stock", compile_model=True, compiled_autograd=True)
    assert counters["compiled_autograd"]["captures"] > captures, "compiled autograd never ran"
    assert_parameters_identical(compiled, "compiled_autograd")
    eager = trained_weights("stock", compile_model=False)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", PATHS)
def test_a_dense_warmup_sends_the_uncompressed_average_then_compresses(path):
    """``DenseWarmup(TopK)`` on both Horovod paths: the first two steps' gradients are the
    uncompressed average, the later ones Top-K's where it compresses, and the ranks stay
    identical throughout."""
    torch.manual_seed(0)
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    topk = hc.COMPRESSORS["topk"].build(model.named_parameters() if path == "stock" else None, small=True)
    warm_up = hc.DenseWarmup(topk, warmup_steps=2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    if path == "stock":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=warm_up)
    else:
        opt = hc.DistributedOptimizer(sgd, model.named_parameters(), warm_up)
    uncompressed = gradients_after("none", path, steps=4)
    for step, (x, y) in enumerate(rank_batches(4, seed=4)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            rows = gathered(p.grad, f"warmup.{path}.{step}.{name}")
            assert all(torch.equal(rows[0], row) for row in rows), (step, name)
            same = torch.allclose(p.grad, uncompressed[step][name], rtol=0, atol=1e-6)
            compressed = step >= 2 and topk.tuning.compresses(p.shape, topk.setting(name))
            assert same != compressed, (step, name)
        with opt.skip_synchronize():
            opt.step()
    assert warm_up.steps == 4
    assert any(topk.tuning.compresses(p.shape, topk.setting(name)) for name, p in model.named_parameters())

"""One compressor or controller object given to two optimizers or models, in one process: refused
at construction (or, under stock ``hvd.DistributedOptimizer``, at the second optimizer's first
``compress``) with an error naming the argument and how to make two; the stateless casts are
shared. The GAN under Horovod at 2 ranks: tests/multirank/test_options.py; DDP and DiLoCo under
torchrun: tests/ddp/test_ddp_state.py."""

import copy
import pickle

import horovod.torch as hvd
import pytest
import torch

import hvd_compress as hc
from hvd_compress.ddp import State

REFUSED = r"compression: this {} object already serves .*compression=copy\.deepcopy"


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()  # one process: Horovod's collectives answer at once


class Owner:
    """Anything an integration makes: an optimizer, a hook's state."""


def stateful():
    return [
        hc.TopK(density=1.0),
        hc.PowerSGD(rank=2),
        hc.BF16(),
        hc.LGreCo(hc.PowerSGD(rank=2), transport="local"),
        hc.GraVAC(hc.TopK(density=0.5)),
    ]


@pytest.mark.parametrize("compression", stateful(), ids=lambda c: type(c).__name__)
def test_a_second_live_owner_is_refused_naming_the_argument_and_the_copy(compression):
    first, second = Owner(), Owner()
    compression.serve(first, "the first")
    compression.serve(first, "the first")  # the same owner again: nothing happens
    with pytest.raises(ValueError, match=REFUSED.format(type(compression).__name__)):
        compression.serve(second, "the second")
    with pytest.raises(ValueError, match=r"^compressor: .*compressor=copy\.deepcopy\(compressor\)"):
        compression.serve(second, "the second", argument="compressor")
    copy.deepcopy(compression).serve(second, "the second")  # a copy is free
    pickle.loads(pickle.dumps(compression)).serve(second, "the second")


@pytest.mark.parametrize("compression", [hc.FP16(), hc.NoCompression()], ids=lambda c: type(c).__name__)
def test_the_stateless_casts_are_shared(compression):
    owners = [Owner(), Owner()]
    for owner in owners:
        compression.serve(owner, "an owner")


def test_a_dropped_owner_frees_the_compression_even_in_a_reference_cycle():
    compression = hc.TopK(density=1.0)
    first = Owner()
    first.cycle = first
    compression.serve(first, "the first")
    del first
    compression.serve(Owner(), "the second")


def test_a_controller_serves_its_wrapped_compressor_too():
    inner = hc.TopK(density=0.5)
    controller = hc.GraVAC(inner)
    first, second = Owner(), Owner()
    controller.serve(first, "the first")
    with pytest.raises(ValueError, match=REFUSED.format("TopK")):
        inner.serve(second, "the second")
    # Refused when the wrapped compressor is taken, and then nothing is recorded.
    other = hc.LGreCo(hc.PowerSGD(rank=2), transport="local")
    other.inner.serve(first, "the first")
    with pytest.raises(ValueError, match=REFUSED.format("PowerSGD")):
        other.serve(second, "the second")
    other.serve(first, "the first")


def linear_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_wrapper_refuses_a_compressor_another_wrapper_serves_at_construction():
    compression = hc.TopK(density=1.0)
    generator, g_opt = linear_optimizer()
    discriminator, d_opt = linear_optimizer()
    hc.DistributedOptimizer(d_opt, discriminator.named_parameters(), compression)
    with pytest.raises(ValueError, match=REFUSED.format("TopK")):
        hc.DistributedOptimizer(g_opt, generator.named_parameters(), compression)
    assert not any(p._post_accumulate_grad_hooks for p in generator.parameters())  # refused whole
    shared = hc.FP16()
    hc.DistributedOptimizer(d_opt, discriminator.named_parameters(), shared)
    hc.DistributedOptimizer(g_opt, generator.named_parameters(), shared)


class StockOptimizer:
    """What the stock bridge reads of ``hvd.DistributedOptimizer``, whose hooks (registered only
    above one rank) call ``compress`` from a method of the optimizer."""

    def __init__(self, model, compression):
        self.model, self._compression = model, compression
        self._parameter_names = {p: name for name, p in model.named_parameters()}
        self.op, self.process_set = hvd.Average, hvd.global_process_set

    def step(self):
        for p in self.model.parameters():
            p.grad = torch.randn_like(p)
        sent = [(p, self._compression.compress(p.grad)) for p in self.model.parameters()]
        for p, (payload, ctx) in sent:
            p.grad = self._compression.decompress(payload, ctx)


@pytest.mark.parametrize("method", ["topk", "powersgd"])  # the driver's rounds and a lone all-reduce
def test_stock_refuses_the_second_optimizer_at_its_first_compress(method):
    """The GAN of the report: the discriminator's optimizer steps first and owns the TopK; the
    generator's is refused with the error that says what to do, not with a lookup failure."""
    generator, discriminator = linear_optimizer()[0], linear_optimizer()[0]
    compression = hc.COMPRESSORS[method].build(small=True, min_numel=0)
    d_opt = StockOptimizer(discriminator, compression)
    d_opt.step()
    g_opt = StockOptimizer(generator, compression)
    with pytest.raises(ValueError, match=REFUSED.format(type(compression).__name__)):
        g_opt.step()
    d_opt.step()  # the owner goes on
    del d_opt
    rebuilt = StockOptimizer(discriminator, compression)  # as after loading a checkpoint
    rebuilt.step()
    assert [bridge.optimizer for bridge in compression._stock_bridges.values()] == [rebuilt]


def test_stock_gives_each_optimizer_sharing_a_cast_its_own_bridge():
    compression = hc.FP16()
    optimizers = [StockOptimizer(linear_optimizer()[0], compression) for _ in range(2)]
    for _ in range(2):
        for opt in optimizers:
            opt.step()
    bridges = compression._stock_bridges.values()
    assert sorted(id(bridge.optimizer) for bridge in bridges) == sorted(map(id, optimizers))


def test_ddp_and_diloco_refuse_a_compressor_already_served():
    compression = hc.PowerSGD(rank=2)
    model, inner = linear_optimizer()
    first = State(compression)
    with pytest.raises(
        ValueError,
        match=r"^compressor: this PowerSGD object already serves an "
        r"hvd_compress.ddp hook's State",
    ):
        State(compression)
    with pytest.raises(ValueError, match=r"^compression: this PowerSGD object already serves"):
        hc.DiLoCo(inner, model.named_parameters(), compression, inner_steps=2)
    del first
    diloco = hc.DiLoCo(inner, model.named_parameters(), compression, inner_steps=2)
    with pytest.raises(ValueError, match=r"already serves a DiLoCo and cannot also serve a DiLoCo"):
        hc.DiLoCo(inner, model.named_parameters(), compression, inner_steps=2)
    assert diloco.compression is compression
    shared = hc.FP16()
    State(shared), State(shared)

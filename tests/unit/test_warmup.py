"""The dense warm-up around a compressor, in a simulated world of W ranks."""

import io

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.rounds import Collective
from hvd_compress.comm.simulated import SimulatedWorld

SHAPES = {"embedding.weight": (64, 32), "fc.weight": (64, 130), "fc.bias": (64,)}


def named():
    return [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]


def grads(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}


def warm(warmup_steps=2, dense=()):
    return hc.DenseWarmup(hc.TopK(named(), density=0.05, min_numel=0), warmup_steps=warmup_steps, dense=dense)


def test_every_gradient_goes_whole_until_the_warmup_ends_then_through_the_compressor():
    compression = warm(warmup_steps=2)
    sim = SimulatedWorld([compression, warm(warmup_steps=2)])
    for step in range(4):
        collectives = {name: compression.begin(name, g).collective for name, g in grads(step).items()}
        compression.reject_step()  # these rounds were only looked at
        compression.end_step()
        inputs = [grads(step), grads(step + 10)]
        out = sim.step(inputs)
        if step < 2:
            assert set(collectives.values()) == {Collective.ALLREDUCE}
            for name in SHAPES:
                torch.testing.assert_close(out[0][name], (inputs[0][name] + inputs[1][name]) / 2)
        else:
            assert collectives["fc.weight"] is Collective.ALLGATHER
    assert compression.steps == 4 and compression.metrics()["dense_warmup"] == 0.0


def test_dense_names_go_whole_at_every_step():
    compression = warm(warmup_steps=0, dense=["embedding.weight"])
    assert compression.next_payload_bytes("embedding.weight", (64, 32)) == 4 * 64 * 32
    assert compression.next_payload_bytes("fc.weight", (64, 130)) < 4 * 64 * 130
    assert compression.begin("embedding.weight", torch.randn(64, 32)).collective is Collective.ALLREDUCE
    assert compression.begin("fc.weight", torch.randn(64, 130)).collective is Collective.ALLGATHER


def test_a_skipped_step_does_not_count_towards_the_warmup():
    compression = warm(warmup_steps=1)
    sim = SimulatedWorld([compression])
    bad = grads(0)
    bad["fc.weight"][0, 0] = float("nan")
    sim.step([bad])
    assert compression.steps == 0
    sim.step([grads(1)])
    assert compression.steps == 1


def test_stock_horovod_rides_only_shapes_the_compressor_never_compresses():
    """The stock path asks ``fixed_payload``: a bias is sent whole before and after the warm-up;
    a matrix changes payload when compression starts; with names kept dense, nothing is fixed."""
    assert warm().fixed_payload((64,)) and not warm().fixed_payload((64, 64))
    assert not warm(dense=["fc.weight"]).fixed_payload((64,))


def test_options_are_agreed_and_a_checkpoint_resumes_the_count():
    compression = warm(warmup_steps=3, dense=["fc.weight", "embedding.weight"])
    config = compression.describe()["config"]
    assert config["warmup_steps"] == 3 and config["dense"] == ["embedding.weight", "fc.weight"]
    assert config["inner"] == compression.inner.describe()
    SimulatedWorld([compression]).step([grads(0)])
    buffer = io.BytesIO()
    torch.save(compression.state_dict(), buffer)
    buffer.seek(0)
    fresh = warm(warmup_steps=3, dense=["embedding.weight", "fc.weight"])
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.steps == 1
    with pytest.raises(ValueError, match="warmup_steps is 3 in the checkpoint but 4 here"):
        warm(warmup_steps=4, dense=["embedding.weight", "fc.weight"]).load_state_dict(compression.state_dict())


def test_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="warmup_steps"):
        warm(warmup_steps=-1)
    with pytest.raises(ValueError, match="dense must be a list of parameter names"):
        warm(dense="fc.weight")
    with pytest.raises(ValueError, match="dense must be parameter names"):
        warm(dense=[3])
    with pytest.raises(ValueError, match="compressor must be an hvd_compress compressor"):
        hc.DenseWarmup("topk")


def test_stock_horovod_takes_it():
    from hvd_compress.optional import horovod_available

    if not horovod_available():
        pytest.skip("needs Horovod")
    from horovod.torch.compression import Compressor as HorovodCompressor

    assert isinstance(warm(), HorovodCompressor)

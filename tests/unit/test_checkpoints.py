"""Checkpoints: through torch.save / torch.load(weights_only=True), a resume at any step is
bit-identical to the uninterrupted run, and a checkpoint that does not fit is refused whole."""

import io
import logging

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.registry import controllable

# Two layers of one shape: ACP-SGD batches them (one call per shape), resumed as exactly.
SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 128), "fc2.weight": (64, 128), "fc.bias": (64,)}
STEPS = 20


def gradients(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    # Decaying magnitudes, so that L-GreCo's decisions differ between layers and windows.
    return {name: torch.randn(*shape, generator=g) * (1 + step % 3) for name, shape in SHAPES.items()}


def saved_and_loaded(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def outputs(world, steps):
    return [world.step([gradients(step, rank) for rank in range(world.size)]) for step in steps]


def assert_same(a, b):
    for step_a, step_b in zip(a, b):
        for rank_a, rank_b in zip(step_a, step_b):
            assert all(torch.equal(rank_a[n], rank_b[n]) for n in SHAPES)


def methods():
    """Every registered compressor, and every registered controller over every compressor it
    can wrap, at their small settings: L-GreCo has decisions in flight within the run; GraVAC's
    small window is longer than the run: the factor follows the gains alone."""
    return [
        pytest.param(lambda n=n: hc.COMPRESSORS[n].build(small=True, min_numel=0), 2, id=n)
        for n in sorted(hc.COMPRESSORS)
    ] + [
        pytest.param(
            lambda c=c, n=n: hc.CONTROLLERS[c].build(hc.COMPRESSORS[n].build(small=True, min_numel=0), small=True),
            hc.CONTROLLERS[c].simulated_ranks,
            id=f"{c}-{n}",
        )
        for c in sorted(hc.CONTROLLERS)
        for n in controllable()
    ]


@pytest.mark.parametrize("make, world_size", methods())
def test_resume_at_every_step_is_bit_identical(make, world_size):
    uninterrupted = outputs(SimulatedWorld([make() for _ in range(world_size)]), range(STEPS))
    for stop in range(1, STEPS):
        first = SimulatedWorld([make() for _ in range(world_size)])
        before = outputs(first, range(stop))
        checkpoints = [saved_and_loaded(c.state_dict()) for c in first.compressors]
        resumed = [make() for _ in range(world_size)]
        for compression, checkpoint in zip(resumed, checkpoints):
            compression.load_state_dict(checkpoint)
        after = outputs(SimulatedWorld(resumed), range(stop, STEPS))
        assert_same(before + after, uninterrupted)


def test_lgreco_resume_keeps_the_decision_in_flight():
    """Checkpointed between a decision and the step it takes effect: the decision survives."""

    def make():
        return hc.LGreCo(
            hc.PowerSGD(rank=4, min_numel=0), warmup_steps=3, decide_every=5, apply_delay=2, transport="local"
        )

    first = SimulatedWorld([make()])
    outputs(first, range(4))  # decided after step 3, effective from step 5
    assert first.compressors[0]._pending is not None
    resumed = make()
    resumed.load_state_dict(saved_and_loaded(first.compressors[0].state_dict()))
    outputs(SimulatedWorld([resumed]), range(4, 6))
    assert [d.version for d in resumed.decisions] == [1]


def trained(make, steps=3, named=True):
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    compressor = make(params.items() if named else None)
    world = SimulatedWorld([compressor])
    outputs(world, range(steps))
    return compressor


def refused(target, checkpoint, match):
    before = saved_and_loaded(target.state_dict())
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(checkpoint)
    after = target.state_dict()
    assert before.keys() == after.keys()
    assert repr(before) == repr(after), "a refused checkpoint must leave the object as it was"


def test_a_checkpoint_of_another_layer_shape_is_refused_naming_the_parameter():
    checkpoint = trained(lambda named: hc.PowerSGD(named, rank=2, min_numel=0)).state_dict()
    other = {"conv.weight": (32, 16, 3, 3), "fc.weight": (32, 64), "fc.bias": (64,)}
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in other.items()}
    refused(
        hc.PowerSGD(params.items(), rank=2, min_numel=0),
        checkpoint,
        r"'fc.weight': has shape \(32, 64\) here but \(64, 128\) in the checkpoint",
    )


def test_without_parameter_names_the_shape_is_checked_at_the_first_gradient():
    checkpoint = trained(lambda named: hc.TopK(named, density=0.05, min_numel=0), named=False).state_dict()
    compressor = hc.TopK(density=0.05, min_numel=0)
    compressor.load_state_dict(checkpoint)
    with pytest.raises(ValueError, match=r"'fc.weight': gradient has shape \(128, 64\)"):
        compressor.begin("fc.weight", torch.zeros(128, 64))


def test_without_parameter_names_a_shape_already_seen_is_checked_at_load():
    checkpoint = trained(lambda named: hc.TopK(named, density=0.05, min_numel=0), named=False).state_dict()
    compressor = hc.TopK(density=0.05, min_numel=0)
    SimulatedWorld([compressor]).step([{"fc.weight": torch.zeros(128, 64)}])
    refused(
        compressor,
        checkpoint,
        r"'fc.weight': had gradients of shape \(128, 64\) here but \(64, 128\) in the checkpoint",
    )


def test_names_taken_from_the_optimizer_must_cover_what_the_compressor_saw():
    compressor = hc.TopK(density=0.05, min_numel=0)
    SimulatedWorld([compressor]).step([{"fc.weight": torch.zeros(64, 128)}])
    with pytest.raises(ValueError, match=r"'fc.weight': has shape \(128, 64\) in the optimizer"):
        compressor.adopt_parameters({"fc.weight": torch.nn.Parameter(torch.zeros(128, 64))})
    with pytest.raises(ValueError, match=r"'fc.weight': is not among the optimizer's parameter names"):
        compressor.adopt_parameters({"allreduce.noname.0.0": torch.nn.Parameter(torch.zeros(64, 128))})
    compressor.adopt_parameters({"fc.weight": torch.nn.Parameter(torch.zeros(64, 128))})
    assert list(compressor.parameters) == ["fc.weight"]


@pytest.mark.parametrize(
    "make_other, match",
    [
        (lambda: hc.ACPSGD(rank=2, min_numel=0), "PowerSGD checkpoint, not a ACPSGD one"),
        (lambda: hc.PowerSGD(rank=2, min_numel=0, seed=1), "seed is 0 in the checkpoint but 1 here"),
        (lambda: hc.PowerSGD(rank=4, min_numel=0), "default is 2 in the checkpoint but 4 here"),
    ],
)
def test_a_checkpoint_of_another_class_or_configuration_is_refused(make_other, match):
    checkpoint = trained(lambda named: hc.PowerSGD(rank=2, min_numel=0), named=False).state_dict()
    refused(make_other(), checkpoint, match)


def test_invalid_settings_inside_a_checkpoint_are_refused_at_load():
    checkpoint = trained(lambda named: hc.QSGD(named, bits=4, min_numel=0)).state_dict()
    checkpoint["settings"]["fc.weight"] = 99
    refused(hc.QSGD(bits=4, min_numel=0), checkpoint, r"'fc.weight': bits must be an integer in \[2, 8\]")
    checkpoint = trained(lambda named: hc.PowerSGD(named, rank=2, min_numel=0)).state_dict()
    checkpoint["settings"]["fc.weight"] = 0
    refused(hc.PowerSGD(rank=2, min_numel=0), checkpoint, "'fc.weight': rank must be a positive integer")


def test_another_ranks_or_world_sizes_checkpoint_brings_all_but_error_feedback(caplog):
    world = SimulatedWorld([hc.TopK(density=0.05, min_numel=0) for _ in range(2)])
    outputs(world, range(2))
    rank0 = world.compressors[0].state_dict()
    assert rank0["residuals"]
    same = hc.TopK(density=0.05, min_numel=0)
    same.bind_world(0, 2)
    same.load_state_dict(rank0)
    assert_same_state(same.state_dict(), rank0)
    elsewhere = hc.TopK(density=0.05, min_numel=0)
    elsewhere.bind_world(1, 2)
    with caplog.at_level(logging.WARNING, logger="hvd_compress.compressors.base"):
        elsewhere.load_state_dict(rank0)
    assert "taken on rank 0 of 2, but this is rank 1 of 2" in caplog.text
    assert_same_state(elsewhere.state_dict(), dict(rank0, rank=1, residuals={}))
    later = hc.TopK(density=0.05, min_numel=0)
    later.load_state_dict(rank0)  # not bound yet: checked when the integration binds it
    later.bind_world(0, 4)
    assert_same_state(later.state_dict(), dict(rank0, world_size=4, residuals={}))
    later.bind_world(0, 2)  # a later world change (elastic) is not a checkpoint's business
    assert later.state_dict()["residuals"] == {}


def assert_same_state(a, b):
    assert set(a) == set(b)
    for key in a:
        if key in ("state", "residuals"):
            assert a[key].keys() == b[key].keys(), key
            for name in a[key]:
                x, y = a[key][name], b[key][name]
                assert (
                    torch.equal(x, y)
                    if torch.is_tensor(x)
                    else all(torch.equal(v, y[k]) if torch.is_tensor(v) else v == y[k] for k, v in x.items())
                ), (key, name)
        else:
            assert a[key] == b[key], key


def test_something_else_is_refused():
    refused(hc.PowerSGD(rank=2), {"settings": {}}, "not an hvd_compress PowerSGD checkpoint")

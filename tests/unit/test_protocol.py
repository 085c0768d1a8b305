"""What ``GradientCompression`` offers the layers above instead of its internals: the wrapped
compressor, a state for a world change, a restart from a compressor's state, and observers."""

import pickle

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.rounds import Round
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.compressors.base import StepObserver

MAKERS = {
    "PowerSGD": lambda: hc.PowerSGD(rank=2, min_numel=0),
    "LGreCo": lambda: hc.LGreCo(hc.PowerSGD(rank=2, min_numel=0), transport="local"),
    "GraVAC": lambda: hc.GraVAC(hc.TopK(density=0.1, min_numel=0), theta_min=2, window=2),
}


def gradients(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return {"fc.weight": torch.randn(16, 12, generator=g), "fc.bias": torch.randn(16, generator=g)}


def trained_world(make, steps=3):
    world = SimulatedWorld([make() for _ in range(2)])
    for step in range(steps):
        world.step([gradients(step, rank) for rank in range(2)])
    return world


def residuals(compression, state):
    """The error feedback in ``state``, wherever ``compression`` keeps it."""
    return state["residuals"] if compression.wrapped is None else state["inner"]["residuals"]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_wrapped_is_a_controllers_compressor(name):
    compression = MAKERS[name]()
    assert (compression.wrapped is None) == (name == "PowerSGD")
    if compression.wrapped is not None:
        assert compression.wrapped.setting("fc.weight") == compression.setting("fc.weight")


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_world_change_state_has_no_feedback_or_this_processs_own(name):
    world = trained_world(MAKERS[name])
    theirs, mine = (c.state_dict() for c in world.compressors)
    compression = world.compressors[1]
    assert residuals(compression, theirs) and residuals(compression, mine)

    bare = compression.world_change_state(theirs)
    assert residuals(compression, bare) == {}
    assert residuals(compression, theirs)  # the state given is left as it was

    rebased = compression.world_change_state(theirs, own=mine, rank=1, size=2)
    assert residuals(compression, rebased) is residuals(compression, mine)
    compression.load_state_dict(rebased)
    for key, residual in residuals(compression, mine).items():
        assert torch.equal((compression.wrapped or compression).residual(key).reshape(-1), residual.reshape(-1))


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_restart_brings_the_compressors_settings_and_forgets_the_reshaped(name):
    trained = trained_world(MAKERS[name]).compressors[0]
    core = trained.wrapped or trained
    if name != "GraVAC":  # GraVAC sets every layer's setting itself
        core.set_setting("fc.weight", 1)
    state = trained.world_change_state(trained.state_dict())

    fresh = MAKERS[name]()
    fresh.restart_from(state, forget={"fc.weight"})
    restarted = fresh.wrapped or fresh
    assert restarted.setting("fc.weight") == core.setting("fc.weight")
    assert "fc.weight" not in restarted.state_dict()["shapes"]
    assert "fc.bias" in restarted.state_dict()["shapes"]
    if fresh.wrapped is not None:  # the controller's own schedule starts afresh
        assert fresh.state_dict().keys() == state.keys()
        assert fresh.state_dict()["shapes"] != state["shapes"]


class Recorder(StepObserver):
    def __init__(self, log, label):
        self.log, self.label = log, label

    def observe_begin(self, name, grad, begin):
        self.log.append((self.label, "begin", name))
        round_ = begin()
        assert isinstance(round_, Round)
        return round_

    def step_ended(self, comm_seconds):
        self.log.append((self.label, "end", comm_seconds))


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_observers_see_each_begin_and_end_and_change_nothing(name):
    plain = trained_world(MAKERS[name], steps=2)
    log = []
    world = SimulatedWorld([MAKERS[name]() for _ in range(2)])
    first, second = Recorder(log, "first"), Recorder(log, "second")
    world.compressors[0].add_observer(first)
    world.compressors[0].add_observer(second)
    with pytest.raises(ValueError, match="already observes"):
        world.compressors[0].add_observer(first)
    for step in range(2):
        world.step([gradients(step, rank) for rank in range(2)])
    expected = plain.step([gradients(2, rank) for rank in range(2)])
    got = world.step([gradients(2, rank) for rank in range(2)])
    if name != "GraVAC":  # GraVAC's factor follows the measured step times
        for mine, reference in zip(got, expected):
            assert all(torch.equal(mine[key], reference[key]) for key in mine)
    # The last added sees a begin first (it wraps the others); both see the same step ends.
    assert [(label, kind) for label, kind, _ in log[:2]] == [("second", "begin"), ("first", "begin")]
    assert log.count(("first", "end", None)) == log.count(("second", "end", None)) == 3

    world.compressors[0].remove_observer(first)
    copies = [pickle.loads(pickle.dumps(compression)) for compression in world.compressors]
    log.clear()
    world.step([gradients(3, rank) for rank in range(2)])
    assert {label for label, _, _ in log} == {"second"}
    log.clear()
    SimulatedWorld(copies).step([gradients(3, rank) for rank in range(2)])
    assert log == []  # a copy has no observers

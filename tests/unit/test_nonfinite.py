"""One non-finite gradient on one rank must leave no trace: every rank sees a non-finite result
at that step, keeps its state as it was, and then goes on exactly as if the step had never been
taken (what GradScaler needs: it skips such steps)."""
import math

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld

SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 128), "fc.bias": (64,)}
STEPS, BAD_STEP = 8, 3


def gradients(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {name: torch.randn(*shape, generator=g).to(dtype) for name, shape in SHAPES.items()}


def poisoned(grads, value):
    bad = {name: grad.clone() for name, grad in grads.items()}
    bad["fc.weight"].view(-1)[17] = value
    return bad


def run(make, world_size, bad_value=None, skip_bad=False):
    """Outputs of rank 0 per step; the bad step either carries ``bad_value`` on the last rank's
    gradient, or (``skip_bad``) is not taken at all."""
    world = SimulatedWorld([make() for _ in range(world_size)])
    outputs = []
    for step in range(STEPS):
        if step == BAD_STEP and skip_bad:
            continue
        grads = [gradients(step, rank) for rank in range(world_size)]
        if step == BAD_STEP and bad_value is not None:
            grads[-1] = poisoned(grads[-1], bad_value)
        outputs.append(world.step(grads))
    return world, outputs


def assert_state_finite(compression):
    def walk(value):
        if torch.is_tensor(value):
            assert torch.isfinite(value).all()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, float):
            assert math.isfinite(value)
    walk(compression.state_dict())


def compressors():
    return [pytest.param(lambda name=name: hc.COMPRESSORS[name].build(small=True, min_numel=0), 2,
                         id=name) for name in sorted(hc.COMPRESSORS)]


# Every registered controller (a new one needs its entry), over compressors it can wrap:
# (id, compressor, its settings, the controller's settings beyond its small ones).
CONTROLLED = {"lgreco": [("lgreco-powersgd", "powersgd", {"rank": 2}, {}),
                         ("lgreco-topk", "topk", {"density": 0.05}, {})],
              "gravac": [("gravac-acpsgd", "acpsgd", {"rank": 4}, {}),
                         ("gravac-topk-dense", "topk", {"density": 0.1}, {"scale_down_to": "dense", "epsilon": 0.99})]}


def controllers():
    return [pytest.param(lambda c=c, n=n, s=s, o=o: hc.CONTROLLERS[c].build(
                hc.COMPRESSORS[n].build(min_numel=0, **s), small=True, **o), 1, id=label)
            for c in sorted(hc.CONTROLLERS) for label, n, s, o in CONTROLLED[c]]


@pytest.mark.parametrize("bad_value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("make, world_size", compressors() + controllers())
def test_a_bad_step_leaves_no_trace(make, world_size, bad_value):
    world, outputs = run(make, world_size, bad_value)
    _, clean = run(make, world_size, skip_bad=True)
    for rank in range(world_size):
        assert not all(torch.isfinite(g).all() for g in outputs[BAD_STEP][rank].values()), \
            "the bad step's gradients must stay non-finite on every rank, so that it is skipped"
    later = outputs[:BAD_STEP] + outputs[BAD_STEP + 1:]
    assert len(later) == len(clean)
    for step, (got, expected) in enumerate(zip(later, clean)):
        for rank in range(world_size):
            for name in SHAPES:
                assert torch.equal(got[rank][name], expected[rank][name]), (step, rank, name)
    for compression in world.compressors:
        assert_state_finite(compression)
        inner = getattr(compression, "inner", compression)
        assert inner.skipped_steps == 1


@pytest.mark.parametrize("name", sorted(hc.COMPRESSORS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_come_back_in_their_dtype(name, dtype):
    world = SimulatedWorld([hc.COMPRESSORS[name].build(small=True, min_numel=0) for _ in range(2)])
    for step in range(3):
        out = world.step([gradients(step, rank, dtype) for rank in range(2)])
        for grads in out:
            assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads.values())

"""Error feedback under loss scaling: with ``track(scaler)`` a run whose gradients carry a
changing loss scale gives, once unscaled, the gradients of the unscaled run."""

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld

SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 128), "fc.bias": (64,)}
# GradScaler's moves: halved on overflow, doubled after a growth interval.
SCALES = [65536.0, 65536.0, 32768.0, 32768.0, 65536.0, 8.0, 8.0, 1024.0]


class ScriptedScaler:
    """Stands in for torch.amp.GradScaler: the scale in force follows a script."""

    def __init__(self):
        self.step = 0

    def get_scale(self):
        return SCALES[self.step]


def gradients(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}


def run(make, world_size, scaled, tracked):
    ranks = [make() for _ in range(world_size)]
    scaler = ScriptedScaler()
    if tracked:
        for compression in ranks:
            compression.track(scaler)
    world = SimulatedWorld(ranks)
    outputs = []
    for step, scale in enumerate(SCALES):
        scaler.step = step
        factor = scale if scaled else 1.0
        grads = [{n: g * factor for n, g in gradients(step, rank).items()} for rank in range(world_size)]
        outputs.append([{n: g / factor for n, g in out.items()} for out in world.step(grads)])
    return outputs


def with_feedback():
    names = [n for n in sorted(hc.COMPRESSORS) if hc.COMPRESSORS[n].build(small=True, min_numel=0).feedback is not None]
    params = [pytest.param(lambda n=n: hc.COMPRESSORS[n].build(small=True, min_numel=0), 2, id=n) for n in names]
    # Every registered controller, over PowerSGD (a compressor with error feedback).
    return params + [
        pytest.param(
            lambda c=c: hc.CONTROLLERS[c].build(hc.COMPRESSORS["powersgd"].build(small=True, min_numel=0), small=True),
            1,
            id=f"{c}-powersgd",
        )
        for c in sorted(hc.CONTROLLERS)
    ]


@pytest.mark.parametrize("make, world_size", with_feedback())
def test_tracked_scale_gives_the_unscaled_run(make, world_size):
    reference = run(make, world_size, scaled=False, tracked=False)
    tracked = run(make, world_size, scaled=True, tracked=True)
    for step, (got, expected) in enumerate(zip(tracked, reference)):
        for rank in range(world_size):
            for name in SHAPES:
                torch.testing.assert_close(
                    got[rank][name], expected[rank][name], rtol=1e-5, atol=1e-6, msg=f"step {step}, rank {rank}, {name}"
                )


@pytest.mark.parametrize("make, world_size", with_feedback()[:1])
def test_untracked_scale_changes_would_distort_error_feedback(make, world_size):
    """Why ``track`` exists: without it, a residual built under one scale meets gradients under
    another, and the unscaled gradients drift from the unscaled run."""
    reference = run(make, world_size, scaled=False, tracked=False)
    untracked = run(make, world_size, scaled=True, tracked=False)
    step = SCALES.index(8.0)  # the first step after a large drop in scale
    assert not torch.allclose(untracked[step][0]["fc.weight"], reference[step][0]["fc.weight"], rtol=1e-3)


def test_track_needs_a_scaler():
    with pytest.raises(ValueError, match="scaler must have get_scale"):
        hc.PowerSGD().track(object())
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    compressor = hc.PowerSGD().track(scaler)
    assert compressor.loss_scale() == 4.0

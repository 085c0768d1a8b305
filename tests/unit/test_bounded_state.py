"""State that grows with training must not: 100,000 cheap steps leave the controllers' memory
(the pickled object) and their checkpoints no larger than after 20,000."""

import io
import pickle

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import exchange_alone

STEPS, EARLY = 100_000, 20_000


def sizes(compression):
    buffer = io.BytesIO()
    torch.save(compression.state_dict(), buffer)
    return len(pickle.dumps(compression)), len(buffer.getvalue())


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: hc.GraVAC(hc.TopK(density=0.5, min_numel=0), theta_min=1.0, theta_max=4.0, window=10, smoothing=1.0),
        lambda: hc.LGreCo(
            hc.TopK(density=0.5, min_numel=0),
            objective="time",
            warmup_steps=1,
            decide_every=200,
            apply_delay=1,
            transport="local",
        ),
    ],
    ids=["gravac", "lgreco-time"],
)
def test_memory_and_checkpoints_stay_flat_over_100k_steps(make):
    torch.set_num_threads(1)
    compression = make()
    gradient = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    for step in range(1, STEPS + 1):
        exchange_alone(compression, "w", gradient)
        compression.end_step(comm_seconds=0.01)  # the time objective samples every step
        if step == EARLY:
            early = sizes(compression)
    memory, checkpoint = sizes(compression)
    assert memory <= early[0] * 1.02 + 1024, (early, memory)
    assert checkpoint <= early[1] * 1.02 + 1024, (early, checkpoint)

"""Same-shape layers in one batched call (``GradientCompression.begin_many``, ACP-SGD's
``_HalfSteps``), as the integrations begin a fusion bucket's gradients together
(``RoundDriver.hold``). The identity, non-finite and checkpoint tests run it too: their worlds
begin each step's gradients together and hold two layers of one shape."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_compress as hc
from hvd_compress.comm.driver import RoundDriver
from hvd_compress.comm.fusion import Bucket, FusionPlan
from hvd_compress.comm.rounds import Traffic
from hvd_compress.comm.simulated import SimulatedWorld
from test_binding import TwinBackend

# Three layers of one shape, two of another, one at its own rank, and a bias sent whole.
SHAPES = {
    "a1": (24, 40),
    "a2": (24, 40),
    "a3": (24, 40),
    "b1": (40, 24),
    "b2": (40, 24),
    "lone": (24, 40),
    "bias": (24,),
}
STEPS = 6


def gradients(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return {name: torch.randn(*shape, generator=generator) for name, shape in SHAPES.items()}


def acpsgd():
    compressor = hc.ACPSGD(rank=3, min_numel=0)
    compressor.set_setting("lone", 2)
    return compressor


class Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def run(world_size, one_at_a_time, steps=STEPS, before_step=None):
    world = SimulatedWorld([acpsgd() for _ in range(world_size)], one_at_a_time=one_at_a_time)
    outputs, operators = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(step, world)
        with Operators() as counted:
            outputs.append(world.step([gradients(step, rank) for rank in range(world_size)]))
        operators.append(counted.counts)
    return world, outputs, operators


def test_a_step_takes_one_qr_and_one_projection_per_shape_not_per_layer():
    """From the second step (the first has no state to batch from), each half-step's QR, its
    projection and its residual run once per (shape, rank) group of two or more: a1-a3 and b1-b2
    batched, ``lone`` (another rank) alone; one at a time, once per layer."""
    _, _, batched = run(1, one_at_a_time=False)
    _, _, alone = run(1, one_at_a_time=True)
    for step in range(1, STEPS):
        assert batched[step]["linalg_qr"] == 3 and alone[step]["linalg_qr"] == 6
        assert batched[step]["bmm"] == 2 and batched[step]["baddbmm_"] == 2
        assert batched[step]["addmm_"] == 1 and alone[step]["addmm_"] == 6


def test_batched_results_match_one_at_a_time_and_ranks_stay_identical():
    _, batched, _ = run(3, one_at_a_time=False)
    _, alone, _ = run(3, one_at_a_time=True)
    for step in range(STEPS):
        for name in SHAPES:
            assert all(torch.equal(batched[step][0][name], batched[step][r][name]) for r in (1, 2)), (step, name)
            assert torch.allclose(batched[step][0][name], alone[step][0][name], rtol=1e-4, atol=1e-5), (step, name)


def test_a_member_without_a_residual_joins_its_batch_through_a_copy():
    """``a2``'s residual cleared (as a controller does when it sends a layer whole): its sum is a
    fresh tensor, not its slice of the stack, so the batch works on a copy and hands each residual
    back; the results and residuals are those of one layer at a time."""

    def clear(step, world):
        if step == 3:
            for compressor in world.compressors:
                compressor.clear_residual("a2")

    batched_world, batched, _ = run(2, one_at_a_time=False, before_step=clear)
    alone_world, alone, _ = run(2, one_at_a_time=True, before_step=clear)
    for name in SHAPES:
        assert torch.allclose(batched[3][0][name], alone[3][0][name], rtol=1e-4, atol=1e-5), name
        ours, theirs = batched_world.compressors[1].residual(name), alone_world.compressors[1].residual(name)
        assert (ours is None) == (theirs is None), name
        if ours is not None:
            assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5), name


def test_error_feedback_buffers_settle_into_two_stacks():
    """After two steps the buffers a batch's sums are built in are the slices of one stack, the
    same two stacks in turn: no allocation per step."""
    world, _, _ = run(1, one_at_a_time=False, steps=2)
    compressor = world.compressors[0]
    stacks = []
    for step in range(2, 6):
        world.step([gradients(step, 0)])
        stacks.append(compressor.residual("a1")._base)
        assert all(compressor.residual(name)._base is stacks[-1] for name in ("a2", "a3"))
    assert stacks[0] is stacks[2] and stacks[1] is stacks[3] and stacks[0] is not stacks[1]


def test_a_held_bucket_is_begun_together_when_its_last_member_arrives():
    calls = []

    def begin_many(items):
        calls.append([name for name, _ in items])
        return [hc.compressors.base.dense_round(grad) for _, grad in items]

    driver = RoundDriver(TwinBackend(), Traffic())
    driver.use_plan(FusionPlan("", 0, (Bucket(("x", "y", "z"), 0),)))
    grads = {name: torch.full((4,), float(i)) for i, name in enumerate(["x", "y", "z", "w"])}
    driver.hold("y", grads["y"], begin_many)
    driver.hold("x", grads["x"], begin_many)
    assert calls == []
    driver.hold("w", grads["w"], begin_many)  # outside the plan: begun at once, alone
    assert calls == [["w"]]
    driver.leave_out("z")  # the bucket is complete without it: begun in the bucket's order
    assert calls == [["w"], ["x", "y"]]
    results = driver.finish()
    assert sorted(results) == ["w", "x", "y"] and torch.equal(results["y"], grads["y"])


def test_a_bucket_never_completed_is_named_at_finish():
    driver = RoundDriver(TwinBackend(), Traffic())
    driver.use_plan(FusionPlan("", 0, (Bucket(("x", "y"), 0),)))
    driver.hold("x", torch.ones(2), lambda items: pytest.fail("begun without all its members"))
    with pytest.raises(RuntimeError, match=r"fusion buckets \[0\] never got all their members"):
        driver.finish()


def test_observers_see_every_gradient_begun_alone():
    """With an observer (the metrics exporters time each ``begin``) the gradients of a bucket are
    begun one at a time, each seen."""
    seen = []

    class Watching(hc.compressors.base.StepObserver):
        def observe_begin(self, name, grad, begin):
            seen.append(name)
            return begin()

    compressor = acpsgd()
    compressor.add_observer(Watching())
    world = SimulatedWorld([compressor])
    for step in range(2):
        world.step([gradients(step, 0)])
    assert seen == list(SHAPES) * 2

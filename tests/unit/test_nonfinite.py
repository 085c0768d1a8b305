"""One non-finite gradient on one rank must leave no trace: every rank sees a non-finite result
at that step, keeps its state as it was, and then goes on exactly as if the step had never been
taken (what GradScaler needs: it skips such steps). Whichever rank it is on, and wherever in
the gradient, even where no sparsifier would pick it."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld, run_alone
from hvd_compress.registry import controllable

# Two layers of one shape: ACP-SGD batches them (its same-shape layers take one call per shape).
SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (64, 128), "fc2.weight": (64, 128), "fc.bias": (64,)}
STEPS, BAD_STEP = 8, 3


def gradients(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {name: torch.randn(*shape, generator=g).to(dtype) for name, shape in SHAPES.items()}


# Where the poison goes: an entry of a compressed weight that is small on every rank (no
# sparsifier picks it unless it is the poison), and a dense bias.
POSITIONS = [("fc.weight", 17), ("conv.weight", 4000), ("fc.bias", 3)]


def quiet_gradients(step, rank):
    """``gradients`` with the poisoned positions near zero."""
    grads = gradients(step, rank)
    for name, index in POSITIONS:
        grads[name].view(-1)[index] = 1e-6
    return grads


def poisoned(grads, value, position):
    name, index = position
    bad = {n: grad.clone() for n, grad in grads.items()}
    bad[name].view(-1)[index] = value
    return bad


def run(make, world_size, bad=None, skip=None, reject=None):
    """Outputs per step and rank. ``bad``: (step, rank, value, position) poisons that rank's
    gradient at that step; ``skip``: a step not taken at all; ``reject``: a step every rank's
    compression is told to drop (``reject_step``, as HSDP does for another group's shard)."""
    world = SimulatedWorld([make() for _ in range(world_size)])
    outputs = []
    for step in range(STEPS):
        if step == skip:
            continue
        grads = [quiet_gradients(step, rank) for rank in range(world_size)]
        if bad is not None and step == bad[0]:
            grads[bad[1]] = poisoned(grads[bad[1]], *bad[2:])
        if step == reject:
            for compression in world.compressors:
                compression.reject_step()
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


# Beyond every controller over every compressor it can wrap: GraVAC sending dense when even
# theta_min loses too much.
SENDING_DENSE = ("gravac", "topk", {"scale_down_to": "dense", "epsilon": 0.99})


def methods():
    """Every registered compressor, and every registered controller over every compressor it
    can wrap (and ``SENDING_DENSE``), in the largest simulated world it runs in: L-GreCo's rank
    0 decides for everyone through a transport, which the simulated world lacks, so it runs
    alone here (tests/ddp poisons one of its ranks under torchrun)."""
    compressors = [
        pytest.param(lambda name=name: hc.COMPRESSORS[name].build(small=True, min_numel=0), 2, id=name)
        for name in sorted(hc.COMPRESSORS)
    ]
    cases = [(c, n, {}) for c in sorted(hc.CONTROLLERS) for n in controllable()] + [SENDING_DENSE]
    controllers = [
        pytest.param(
            lambda c=c, n=n, o=o: hc.CONTROLLERS[c].build(
                hc.COMPRESSORS[n].build(small=True, min_numel=0), small=True, **o
            ),
            hc.CONTROLLERS[c].simulated_ranks,
            id=f"{c}-{n}" + ("-dense" if o else ""),
        )
        for c, n, o in cases
    ]
    return compressors + controllers


@pytest.mark.parametrize("bad_value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("make, world_size", methods())
def test_a_bad_step_on_any_rank_leaves_no_trace(make, world_size, bad_value):
    """Every rank in turn, at a step it leads and one it does not (ScaleCom's leader takes turns),
    at entries nobody would send and at a dense bias: the step is skipped on every rank alike,
    and the run goes on exactly as if it had never been taken."""
    for bad_step in (BAD_STEP, BAD_STEP + 1):
        _, clean = run(make, world_size, skip=bad_step)
        for rank in range(world_size):
            for position in POSITIONS:
                world, outputs = run(make, world_size, bad=(bad_step, rank, bad_value, position))
                where = dict(step=bad_step, rank=rank, position=position)
                for each in range(world_size):
                    assert not all(torch.isfinite(g).all() for g in outputs[bad_step][each].values()), (
                        "the bad step's gradients must be non-finite on every rank, so that it is skipped",
                        where,
                        each,
                    )
                later = outputs[:bad_step] + outputs[bad_step + 1 :]
                assert len(later) == len(clean)
                for step, (got, expected) in enumerate(zip(later, clean)):
                    for each in range(world_size):
                        for name in SHAPES:
                            assert torch.equal(got[each][name], expected[each][name]), (where, step, each, name)
                for compression in world.compressors:
                    assert_state_finite(compression)
                    inner = compression.wrapped or compression
                    assert inner.skipped_steps == 1, where


@pytest.mark.parametrize("make, world_size", methods())
def test_a_rejected_step_leaves_no_trace(make, world_size):
    """A step rejected on every rank (its gradients were finite here) is dropped like a
    non-finite one: the run goes on exactly as if it had never been taken."""
    _, clean = run(make, world_size, skip=BAD_STEP)
    world, outputs = run(make, world_size, reject=BAD_STEP)
    later = outputs[:BAD_STEP] + outputs[BAD_STEP + 1 :]
    for step, (got, expected) in enumerate(zip(later, clean)):
        for each in range(world_size):
            for name in SHAPES:
                assert torch.equal(got[each][name], expected[each][name]), (step, each, name)
    for compression in world.compressors:
        assert (compression.wrapped or compression).skipped_steps == 1


@pytest.mark.parametrize("name", sorted(hc.COMPRESSORS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_come_back_in_their_dtype(name, dtype):
    world = SimulatedWorld([hc.COMPRESSORS[name].build(small=True, min_numel=0) for _ in range(2)])
    for step in range(3):
        out = world.step([gradients(step, rank, dtype) for rank in range(2)])
        for grads in out:
            assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("bad_value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize(
    "name, settings",
    [("topk", {"density": 0.01}), ("qsgd", {"bits": 5}), ("qsgd", {"bits": 4})],
    ids=["topk", "qsgd5", "qsgd4"],
)
def test_a_payload_without_a_marker_carries_a_bad_entry_of_a_large_gradient(name, settings, bad_value):
    """Top-K and QSGD send no marker of their input (``payload_carries_input``): a 65,536-entry
    gradient takes Top-K's sampled threshold (not torch.topk; entry 1,803 is not among the
    sampled, so the threshold is finite), and 5-bit QSGD codes straddle buckets; one bad entry on
    one rank still spoils every rank's aggregate."""
    compressors = [hc.COMPRESSORS[name].build(**settings) for _ in range(2)]
    assert compressors[0].payload_carries_input
    world = SimulatedWorld(compressors)
    g = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(256, 256, generator=g) + 10.0} for _ in range(2)]
    grads[1]["w"][7, 11] = bad_value
    outputs = world.step(grads)
    for rank in range(2):
        assert not torch.isfinite(outputs[rank]["w"]).all(), rank
        assert not compressors[rank].last_step_finite


class ReadsOfTheWhole(TorchDispatchMode):
    """Records the reductions a finiteness check makes (extremes, largest magnitudes) over
    tensors of ``numel`` entries."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.extremes = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func in (torch.ops.aten.aminmax.default, torch.ops.aten.linalg_vector_norm.default)
            and args[0].numel() == self.numel
        ):
            self.extremes.append(str(func))
        return func(*args, **(kwargs or {}))


def into_gradients(make):
    """``make``'s compression, told that its integration replaces gradients with their results."""

    def made():
        compression = make()
        compression.write_results_into_gradients()
        return compression

    return made


@pytest.mark.parametrize("make, world_size", methods())
def test_results_written_into_the_gradients_are_the_same_and_a_bad_step_still_leaves_no_trace(make, world_size):
    """As every integration runs them (``write_results_into_gradients``): each rank's results,
    bad step included, bit for bit those made in new tensors, and the bad step skipped alike."""
    bad = (BAD_STEP, world_size - 1, math.inf, POSITIONS[0])
    _, fresh = run(make, world_size, bad=bad)
    world, written = run(into_gradients(make), world_size, bad=bad)
    for step, (got, expected) in enumerate(zip(written, fresh)):
        for each in range(world_size):
            for name in SHAPES:
                assert torch.equal(got[each][name].nan_to_num(), expected[each][name].nan_to_num()), (step, each, name)
    for compression in world.compressors:
        assert (compression.wrapped or compression).skipped_steps == 1


BOUNDED = ["powersgd", "acpsgd", "topk", "qsgd"]  # results checked through what they were made from


@pytest.mark.parametrize("name", BOUNDED)
def test_the_finiteness_check_reads_what_a_float32_result_was_made_from_not_the_result(name):
    """A float32 result of these compressors is checked through its factor, or its gathered
    values or norms (``_result_bounded_by``): no pass over a compressed gradient's size after its
    collective; a float16 result is read itself."""
    for dtype, reads_results in [(torch.float32, False), (torch.float16, True)]:
        world = SimulatedWorld([hc.COMPRESSORS[name].build(small=True, min_numel=0) for _ in range(2)])
        for step in range(2):
            world.step([gradients(step, rank, dtype) for rank in range(2)])
        compressor = world.compressors[0]
        rounds = [compressor.begin(n, g) for n, g in gradients(2, 0, dtype).items()]
        with ReadsOfTheWhole(math.prod(SHAPES["fc.weight"])) as reads:
            for round_ in rounds:
                run_alone(round_, size=2)  # each round answered with this rank's payload
        assert bool(reads.extremes) == reads_results, (dtype, reads.extremes)


def test_a_step_is_kept_where_a_bound_fails_but_its_results_are_finite_and_not_where_they_overflow():
    """Top-K's bound is twice the ranks' count times the largest value sent: values near float32's
    largest fail it, and the results themselves then decide."""
    for value, finite in [(1e38, True), (3e38, False)]:
        world = SimulatedWorld([hc.COMPRESSORS["topk"].build(density=0.01) for _ in range(2)])
        grads = [{"w": torch.zeros(64, 64)} for _ in range(2)]
        for rank in range(2):
            grads[rank]["w"][5, 9] = value  # both send it, and the sum overflows from 1.7e38
        outputs = world.step(grads)
        for rank in range(2):
            assert bool(torch.isfinite(outputs[rank]["w"]).all()) == finite, (value, rank)
            assert world.compressors[rank].last_step_finite == finite, (value, rank)

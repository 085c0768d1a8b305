"""The one binding every integration goes through (``integration/binding.py``), in one process:
groups of our own stand in for a Horovod process set and a torch.distributed group."""

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld, aggregate
from hvd_compress.integration.binding import Binding, HorovodGroup, reform_world


class TwinBackend:
    """Rank 0 of two ranks that send the same payloads: each collective's result is what
    ``comm/simulated.py`` computes from two copies of this rank's round."""

    def start(self, op_name, round_):
        return aggregate([round_, round_])[0]

    def done(self, handle):
        return True

    def wait(self, handle):
        return handle


class Gathering:
    """A transport whose other ranks answer ``theirs`` as their configuration; counts the
    all-gathers."""

    rank = 0

    def __init__(self, theirs):
        self.theirs, self.calls = theirs, 0

    def allgather(self, obj, tag, deadline, what):
        self.calls += 1
        return [obj, obj if self.theirs is None else dict(obj, configuration=self.theirs)]


class TwinGroup:
    """Two ranks (or ``size``), this one rank 0; ``theirs``: the other rank's description
    (None: the same as this rank's)."""

    included = True
    rank = 0
    process_set = "the twins' process set"

    def __init__(self, size=2, theirs=None):
        self.size = size
        self.gathering = Gathering(theirs)

    def backend(self):
        return TwinBackend()

    def transport(self):
        return self.gathering

    def world(self):
        return None


class ProcessSet:
    """What a binding reads of a Horovod process set."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def included(self):
        return True

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class RecordingTopK(hc.TopK):
    """TopK that records the process set it is given."""

    process_set = None

    def use_process_set(self, process_set):
        self.process_set = process_set


def gradients(seed):
    generator = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(32, 24, generator=generator), "b.weight": torch.randn(16, 16, generator=generator)}


@pytest.mark.parametrize("name", ["powersgd", "topk", "signsgd"])  # two rounds, an all-gather, packed signs
def test_a_bound_step_is_bit_identical_to_the_simulated_worlds(name):
    """Rank 0's aggregates through the binding's driver equal rank 0's in the simulated world
    where both ranks hold the same gradients, step after step (state carried between steps)."""
    bound = hc.COMPRESSORS[name].build(small=True)
    binding = Binding(bound, TwinGroup())
    world = SimulatedWorld([hc.COMPRESSORS[name].build(small=True) for _ in range(2)])
    assert (bound.rank, bound.size) == (0, 2)
    for step in range(3):
        grads = gradients(step)
        results, seconds = binding.exchange(grads, None, None)
        bound.end_step(comm_seconds=seconds)
        expected = world.step([grads, grads])[0]
        assert results.keys() == expected.keys()
        for key in grads:
            assert torch.equal(results[key], expected[key]), (name, step, key)


def test_start_and_finish_drive_the_same_rounds_as_exchange():
    started = Binding(hc.PowerSGD(rank=2), TwinGroup())
    exchanged = Binding(hc.PowerSGD(rank=2), TwinGroup())
    grads = gradients(0)
    for key, grad in grads.items():
        started.start(key, grad)
    results, seconds = started.finish()
    assert seconds >= 0
    expected, _ = exchanged.exchange(grads, None, None)
    assert all(torch.equal(results[key], expected[key]) for key in grads)


def test_binding_hands_the_compression_its_process_set():
    compression = RecordingTopK(density=0.1)
    Binding(compression, TwinGroup())
    assert compression.process_set == TwinGroup.process_set


def test_a_world_of_one_binds_nothing_unless_asked():
    compression = RecordingTopK(density=0.1)
    alone = TwinGroup(size=1)
    binding = Binding(compression, alone)
    assert not binding.active and binding.driver is None and compression.process_set is None
    binding.check_configuration()
    assert alone.gathering.calls == 0
    stock = Binding(compression, alone, bind_alone=True)  # Horovod's elastic world of one
    assert stock.active and stock.driver is not None and (compression.rank, compression.size) == (0, 1)


def test_the_configuration_is_checked_once_per_binding():
    group = TwinGroup()
    binding = Binding(hc.TopK(density=0.1), group)
    assert group.gathering.calls == 0  # never at construction: a collective
    binding.check_configuration()
    binding.check_configuration()
    assert group.gathering.calls == 1


def test_a_configuration_that_differs_raises_naming_the_rank_it_is_told_to():
    theirs = hc.TopK(density=0.2).describe()
    binding = Binding(hc.TopK(density=0.1), TwinGroup(theirs=theirs), rank_name=lambda rank: rank + 4)
    with pytest.raises(ValueError, match="density is 0.1 on rank 4 but 0.2 on rank 5"):
        binding.check_configuration()


def test_what_is_described_is_checked_instead_of_the_compression():
    """DiLoCo binds its compression and checks its own description, which holds it."""

    class Outer:
        def describe(self):
            return {"compressor": "Outer", "settings": {}, "config": {"period": 3}}

    theirs = {"compressor": "Outer", "settings": {}, "config": {"period": 4}}
    binding = Binding(hc.TopK(density=0.1), TwinGroup(theirs=theirs), described=Outer())
    with pytest.raises(ValueError, match="Outer: period is 3"):
        binding.check_configuration()


def test_an_elastic_sync_makes_every_horovod_binding_stale():
    process_set = ProcessSet(0, 1)  # a world of one: no Horovod backend is made
    compression = hc.TopK(density=0.1)
    binding = Binding(compression, HorovodGroup(process_set))
    assert not binding.stale() and not binding.stale(mid_step=True)
    reform_world(compression, 1, 3)
    assert (compression.rank, compression.size) == (1, 3)
    assert binding.stale() and binding.stale(mid_step=True)
    assert not Binding(compression, HorovodGroup(process_set)).stale()


def test_a_world_that_shrank_without_a_sync_is_seen_between_steps_only():
    """Horovod skips sync() after a reset that only removed workers."""
    process_set = ProcessSet(0, 1)
    binding = Binding(hc.TopK(density=0.1), HorovodGroup(process_set))
    process_set._size = 2
    assert binding.stale() and not binding.stale(mid_step=True)


def test_a_group_without_a_world_to_track_is_never_stale():
    """As a torch.distributed group: no elastic reset re-forms it under a binding."""
    binding = Binding(hc.TopK(density=0.1), TwinGroup())
    reform_world(hc.TopK(density=0.1), 0, 1)
    assert not binding.stale() and not binding.stale(mid_step=True)

"""The torch.distributed pieces on real ranks (torchrun, Gloo): the round driver's backend (every
collective and dtype the compressors use, a process group, roots within it), L-GreCo's decision
transport, and the cross-rank configuration check at the first bucket."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hvd_compress as hc
import hvd_compress.ddp
from hvd_compress.comm.driver import RoundDriver
from hvd_compress.comm.rounds import Collective, Round, Traffic
from hvd_compress.comm.torch_backend import TorchBackend
from hvd_compress.comm.transports import TorchTransport, make_transport

from ddp_helpers import batches, make_ddp


def run(backend, payload, collective, root=0):
    handle = backend.start("test", Round(payload, collective, None, root=root))
    result = backend.wait(handle)
    assert backend.done(handle)
    return result


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_allreduce_averages_in_the_payload_dtype(dtype):
    backend = TorchBackend()
    w, r = backend.size, backend.rank
    payload = torch.full((3, 5), r + 1.0, dtype=dtype)
    mean = run(backend, payload, Collective.ALLREDUCE)
    assert mean.dtype == dtype and mean.shape == (3, 5)
    assert torch.equal(mean, torch.full((3, 5), (w + 1) / 2, dtype=dtype))
    assert torch.equal(payload, torch.full((3, 5), r + 1.0, dtype=dtype)), "payload overwritten"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.bool])
def test_allreduce_refuses_integer_payloads_before_sending_anything(dtype):
    with pytest.raises(TypeError, match="all-reduce averages floating-point payloads"):
        TorchBackend().start("codes", Round(torch.zeros(4, dtype=dtype), Collective.ALLREDUCE, None))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.bool, torch.bfloat16, torch.float32])
def test_allgather_rows_are_each_ranks_payload_bit_for_bit(dtype):
    """Gloo has no int16 (BF16's payloads): every dtype travels as its bytes."""
    backend = TorchBackend()
    w, r = backend.size, backend.rank

    def payload(rank):
        values = torch.arange(6, dtype=torch.float32).view(2, 3) * 7 + rank * 31 - 40
        return (values > 0) if dtype == torch.bool else values.to(dtype)

    rows = run(backend, payload(r), Collective.ALLGATHER)
    assert rows.dtype == dtype and rows.shape == (w, 2, 3)
    for j in range(w):
        assert torch.equal(rows[j], payload(j)), j


def test_alltoall_row_j_goes_to_rank_j():
    backend = TorchBackend()
    w, r = backend.size, backend.rank
    chunks = torch.stack([torch.full((3,), 100 * r + j, dtype=torch.int16) for j in range(w)])
    received = run(backend, chunks, Collective.ALLTOALL)
    assert received.dtype == torch.int16 and received.shape == (w, 3)
    for j in range(w):
        assert torch.equal(received[j], torch.full((3,), 100 * j + r, dtype=torch.int16))


def test_broadcast_root_is_a_rank_within_the_group():
    """In a group of every rank but 0, root r is the group's r-th rank (global r + 1); the
    payloads of other ranks are left as they were."""
    w = dist.get_world_size()
    members = list(range(1, w))
    group = dist.new_group(members)  # collective over the world: every rank calls it
    payload = torch.tensor([dist.get_rank(), 7], dtype=torch.int32)
    whole = run(TorchBackend(), payload, Collective.BROADCAST, root=w - 1)
    assert whole.tolist() == [w - 1, 7]
    if dist.get_rank() in members:
        backend = TorchBackend(group)
        assert backend.size == w - 1 and backend.rank == dist.get_rank() - 1
        result = run(backend, payload, Collective.BROADCAST, root=backend.size - 1)
        assert result.tolist() == [w - 1, 7]
        assert payload.tolist() == [dist.get_rank(), 7]
    dist.barrier()


def test_driver_finishes_multi_round_exchanges_in_the_same_order_everywhere():
    """Two-round exchanges started in rank-dependent order would mismatch; started in one
    order and finished by name they all land, averaged."""
    backend = TorchBackend()
    w, r = backend.size, backend.rank
    driver = RoundDriver(backend, Traffic(world_size=w))

    def exchange(value):
        return Round(
            torch.full((4,), float(value)),
            Collective.ALLREDUCE,
            lambda mean: Round(mean * 2, Collective.ALLGATHER, lambda rows: rows.sum(0)),
        )

    for i in range(5):
        driver.start(f"layer{i}", torch.zeros(4), exchange(r + i))
    results = driver.finish()
    for i in range(5):
        assert torch.allclose(results[f"layer{i}"], torch.full((4,), 2 * w * ((w - 1) / 2 + i)))


def test_decision_transport_broadcasts_from_rank_0_and_gathers_everyone():
    transport = make_transport("auto")  # torch.distributed initialised, Horovod not
    assert isinstance(transport, TorchTransport)
    deadline = float("inf")
    decision = {"layer": 3, "notes": ["x" * 1000]} if transport.rank == 0 else None
    assert transport.broadcast(decision, 0, deadline, "test") == {"layer": 3, "notes": ["x" * 1000]}
    mine = ("rank", transport.rank, "y" * transport.rank * 50)  # different lengths
    assert transport.allgather(mine, 1, deadline, "test") == [("rank", r, "y" * r * 50) for r in range(transport.size)]


def test_compressors_configured_differently_fail_loudly_at_the_first_bucket():
    compressor = hc.PowerSGD(rank=2 + dist.get_rank())  # a deliberately rank-dependent setting
    _, model, _ = make_ddp(compressor)
    x, y = next(batches(1))
    with pytest.raises(ValueError, match=r"PowerSGD: default is \d on rank \d but \d on rank \d"):
        nn.functional.cross_entropy(model(x), y).backward()


def test_one_process_group_of_one_rank_passes_buckets_through():
    """As with Horovod, nothing is compressed when there is nobody to exchange with."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank calls each
    torch.manual_seed(0)
    module = nn.Linear(64, 64)
    compressor = hc.PowerSGD(rank=1)
    model = torch.nn.parallel.DistributedDataParallel(module, process_group=groups[dist.get_rank()])
    state = hvd_compress.ddp.register(model, compressor)
    x = torch.randn(8, 64)
    expected = torch.autograd.grad(module(x).square().sum(), module.weight)[0]
    model(x).square().sum().backward()
    assert torch.equal(module.weight.grad, expected)
    assert compressor.traffic.steps == 0 and state.iter == 0

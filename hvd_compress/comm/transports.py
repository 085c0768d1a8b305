"""Transports: how ranks exchange small Python objects (decisions, configurations) outside the
gradient rounds, each wait bounded by a deadline, so a dead or stalled peer makes the others
raise ``DecisionTimeout`` instead of hang.

* ``HorovodTransport``: under ``horovodrun`` (MPI or Gloo controller), Horovod's own
  asynchronous collectives, so every message travels on Horovod's one background thread;
* ``MpiTransport``: only when asked for (``transport="mpi"``), an mpi4py communicator of our
  own (a duplicate of COMM_WORLD). Its messages are MPI calls from the training thread while
  Horovod's background thread makes its own: two threads in MPI (suspected, not proven, in a
  decision message sent and never received between two hosts: DEVELOPERS.md);
* ``TorchTransport``: under PyTorch DDP (``torch.distributed`` initialised, Horovod not, or a
  ``torch.distributed`` process group given), ``torch.distributed``'s asynchronous collectives;
* ``LocalTransport``: one process, no peers.

``make_transport(kind, process_set)`` picks one; L-GreCo's decision service and the
integration's cross-rank configuration check use them.
"""

import pickle
import time


class DefaultTorchGroup:
    """``torch.distributed``'s default group, named without holding it. A ``ProcessGroup`` that
    something still references outlives ``destroy_process_group``; its worker threads then last
    into interpreter shutdown, where one that drops a finished collective's tensors needs the
    GIL and aborts the process ("terminate called without an active exception", DEVELOPERS.md)."""

    def __repr__(self):
        return "DEFAULT_TORCH_GROUP"


DEFAULT_TORCH_GROUP = DefaultTorchGroup()


class DecisionTimeout(RuntimeError):
    """A peer did not answer before the deadline (dead or stalled)."""


def _poll(ready, deadline, what):
    while not ready():
        if time.monotonic() > deadline:
            raise DecisionTimeout(f"{what}: no answer before the deadline; is rank 0 dead or stalled?")
        time.sleep(0.0005)


class MpiTransport:
    """Over the ranks of ``process_set`` (all of them by default), in their order: rank 0 of the
    set decides. Only the set's members create the communicator, so others are never waited on."""

    def __init__(self, process_set=None):
        from mpi4py import MPI  # MPI is already initialised by Horovod or by the user

        world = MPI.COMM_WORLD
        ranks = list(range(world.Get_size())) if process_set is None else list(process_set.ranks)
        if ranks == list(range(world.Get_size())):
            self.comm = world.Dup()
        else:
            self.comm = world.Create_group(world.group.Incl(ranks))
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def broadcast(self, obj, tag, deadline, what):
        if self.rank == 0:
            requests = [self.comm.isend(obj, dest=r, tag=tag) for r in range(1, self.size)]
            _poll(lambda: all(r.test()[0] for r in requests), deadline, what)
            return obj
        _poll(lambda: self.comm.iprobe(source=0, tag=tag), deadline, what)
        return self.comm.recv(source=0, tag=tag)

    def allgather(self, obj, tag, deadline, what):
        others = [r for r in range(self.size) if r != self.rank]
        requests = [self.comm.isend(obj, dest=r, tag=tag) for r in others]
        gathered = [None] * self.size
        gathered[self.rank] = obj
        for r in others:
            _poll(lambda: self.comm.iprobe(source=r, tag=tag), deadline, what)
            gathered[r] = self.comm.recv(source=r, tag=tag)
        _poll(lambda: all(q.test()[0] for q in requests), deadline, what)
        return gathered


class HorovodTransport:
    """Horovod's asynchronous collectives within ``process_set`` (the global one by default)."""

    def __init__(self, process_set=None):
        import horovod.torch as hvd

        self.hvd = hvd
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.rank, self.size = self.process_set.rank(), self.process_set.size()

    def _wait(self, handle, deadline, what):
        _poll(lambda: self.hvd.poll(handle), deadline, what)
        return self.hvd.synchronize(handle)

    def broadcast(self, obj, tag, deadline, what):
        import torch

        data = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        root = self.process_set.ranks[0]  # Horovod's root_rank is a global rank
        length = self._wait(
            self.hvd.broadcast_async(length, root, name=f"{tag}.length", process_set=self.process_set), deadline, what
        )
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(length[0]), dtype=torch.uint8)
        )
        # Named with its length, as every name given to Horovod (comm/horovod_backend.py).
        buffer = self._wait(
            self.hvd.broadcast_async(buffer, root, name=f"{tag}.data.{buffer.numel()}", process_set=self.process_set),
            deadline,
            what,
        )
        return pickle.loads(buffer.numpy().tobytes())

    def allgather(self, obj, tag, deadline, what):
        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        lengths = self._wait(
            self.hvd.allgather_async(torch.tensor([data.numel()]), name=f"{tag}.length", process_set=self.process_set),
            deadline,
            what,
        )
        sizes = "-".join(str(n) for n in lengths.tolist())
        gathered = self._wait(
            self.hvd.allgather_async(data, name=f"{tag}.data.{sizes}", process_set=self.process_set), deadline, what
        )
        pieces = gathered.split(lengths.tolist())
        return [pickle.loads(piece.numpy().tobytes()) for piece in pieces]


class TorchTransport:
    """``torch.distributed``'s asynchronous collectives within ``process_set``, a
    ``torch.distributed`` process group (None or ``DEFAULT_TORCH_GROUP``: the default group);
    rank 0 of the group decides.

    Collectives on a group are matched by the order ranks issue them, not by tag: every rank of
    the group must call ``broadcast``/``allgather`` at the same point of its sequence of
    collectives on that group (the DDP adapter calls them from the comm hook of the last bucket,
    after every round of the step has landed). Waits poll ``Work.is_completed`` against the
    deadline. Bytes travel as uint8 tensors, on the current CUDA device when the group's backend
    is NCCL (untested: no GPU here), on the CPU otherwise."""

    def __init__(self, process_set=None):
        import torch
        import torch.distributed as dist

        self.dist = dist
        # torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same arguments).
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.group = group = None if process_set is DEFAULT_TORCH_GROUP else process_set
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.root = 0 if group is None else dist.get_global_rank(group, 0)
        on_gpu = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    def _wait(self, work, deadline, what):
        _poll(work.is_completed, deadline, what)
        work.wait()

    def broadcast(self, obj, tag, deadline, what):
        import torch

        data = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._wait(self.dist.broadcast(length, self.root, group=self.group, async_op=True), deadline, what)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if self.rank == 0
            else torch.empty(int(length[0]), dtype=torch.uint8, device=self.device)
        )
        self._wait(self.dist.broadcast(buffer, self.root, group=self.group, async_op=True), deadline, what)
        return pickle.loads(buffer.cpu().numpy().tobytes())

    def allgather(self, obj, tag, deadline, what):
        import torch

        data = pickle.dumps(obj)
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = torch.empty(self.size, dtype=torch.int64, device=self.device)
        self._wait(self.all_gather(lengths, length, group=self.group, async_op=True), deadline, what)
        lengths = lengths.tolist()
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = torch.empty(self.size * max(lengths), dtype=torch.uint8, device=self.device)
        self._wait(self.all_gather(rows, padded.to(self.device), group=self.group, async_op=True), deadline, what)
        rows = rows.cpu().view(self.size, -1)
        return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def uses_torch_distributed(process_set):
    """Whether "auto" means "torch": ``process_set`` is a ``torch.distributed`` process group
    (or ``DEFAULT_TORCH_GROUP``), or it is None while ``torch.distributed`` is initialised and
    Horovod is not (torchrun)."""
    import sys

    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    if process_set is DEFAULT_TORCH_GROUP or isinstance(process_set, dist.ProcessGroup):
        return True
    if process_set is not None or not dist.is_initialized():
        return False
    hvd = sys.modules.get("horovod.torch")
    return hvd is None or not hvd.is_initialized()


class LocalTransport:
    """One process, no peers: for single-process tests and tools."""

    rank, size = 0, 1

    def broadcast(self, obj, tag, deadline, what):
        return obj

    def allgather(self, obj, tag, deadline, what):
        return [obj]


TRANSPORTS = ("auto", "mpi", "horovod", "local", "torch")


def make_transport(kind, process_set=None):
    if kind == "auto":
        kind = "torch" if uses_torch_distributed(process_set) else "horovod"
    if kind == "local":
        return LocalTransport()
    return {"mpi": MpiTransport, "horovod": HorovodTransport, "torch": TorchTransport}[kind](process_set)

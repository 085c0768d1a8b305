"""The ranks advise measures on, through ``comm/`` as the integrations reach them: a backend
(Horovod's or torch.distributed's) runs the link probes and barriers, the matching transport
shares what every rank must see (rank 0's measurements, or every rank's codec times)."""

import os
import time
from typing import Any, List, Union

import torch

from hvd_compress.comm.horovod_backend import HorovodBackend
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.comm.torch_backend import TorchBackend
from hvd_compress.comm.transports import HorovodTransport, TorchTransport
from hvd_compress.optional import import_horovod

# How long a rank waits for the others' measurements: every rank times every method's codec on
# its own, so one may arrive well after another (a whole codec pass on a large model).
SHARE_TIMEOUT_S = 600.0


class LaunchedRanks:
    """Every launched rank, through ``backend`` and ``transport`` (both Horovod's or both
    torch.distributed's); barriers run on ``device``, as the probes do (NCCL takes no CPU
    tensor)."""

    def __init__(
        self,
        backend: Union[HorovodBackend, TorchBackend],
        transport: Union[HorovodTransport, TorchTransport],
        device: torch.device,
    ):
        self.backend, self.transport, self.device = backend, transport, device
        self.rank, self.size = backend.rank, backend.size
        # horovod.torch where Horovod launched the ranks: advise times real steps through it.
        self.horovod = import_horovod("hvd_compress.advise") if isinstance(backend, HorovodBackend) else None

    def run(self, collective: str, tensor: torch.Tensor, label: str) -> None:
        """``collective`` ("allreduce", "allgather", "broadcast" from rank 0, "alltoall") of
        ``tensor`` over the ranks, waited for."""
        round_ = Round(tensor, Collective(collective), lambda result: result, last=True)
        self.backend.wait(self.backend.start(label, round_))

    def barrier(self) -> None:
        self.run("allreduce", torch.zeros(1, device=self.device), "hvd_compress.advise.barrier")

    def agree(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return self.transport.broadcast(
            obj,
            "hvd_compress.advise.agree",
            time.monotonic() + SHARE_TIMEOUT_S,
            "hvd_compress.advise: rank 0's measurements",
        )

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        return self.transport.allgather(
            obj,
            "hvd_compress.advise.gather",
            time.monotonic() + SHARE_TIMEOUT_S,
            "hvd_compress.advise: every rank's codec times",
        )


def launched_ranks(device: torch.device) -> LaunchedRanks:
    """torch.distributed's ranks under torchrun (its environment names them; Gloo on CPUs, NCCL
    on GPUs), else Horovod's (``horovodrun`` or ``mpirun``); initialised here if not yet."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return LaunchedRanks(TorchBackend(), TorchTransport(), device)
    hvd = import_horovod("hvd_compress.advise under mpirun or horovodrun (torchrun needs no Horovod)")
    if not hvd.is_initialized():
        hvd.init()
    return LaunchedRanks(HorovodBackend(), HorovodTransport(), device)

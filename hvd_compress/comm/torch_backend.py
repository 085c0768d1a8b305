"""Asynchronous ``torch.distributed`` collectives behind the driver's three-verb interface.

Unlike Horovod, which matches collectives across ranks by name, ``torch.distributed`` (Gloo,
NCCL) matches them by the order in which each rank issues them on a process group. Whoever
drives this backend must therefore start collectives in the same order on every rank:
``RoundDriver.start`` and ``RoundDriver.finish`` do (``finish`` advances the smallest pending
name first); ``RoundDriver.poll`` does not (which round lands first differs between ranks),
so it must not be used with this backend. ``integration/torch/ddp.py`` never calls it.

Dtypes (probed with Gloo at np 2, torch 2.13): all-reduce, all-gather, all-to-all and
broadcast take float16, bfloat16, float32, float64, uint8, int8, int32 and int64, and nothing
takes int16 (BF16's payloads); NCCL has no int16 either. So:

* the data-moving collectives (all-gather, all-to-all, broadcast) move every payload as its
  bytes (a uint8 view, reinterpreted back on arrival): bit-exact for any dtype;
* all-reduce averages in the payload's dtype (sum, then divide by the group size; float16 and
  bfloat16 divide first, ``rounds.divides_first``) and takes floating-point payloads only; integer
  or boolean payloads raise ``TypeError``: a sum of
  packed codes or indices means nothing (packed uint8 payloads travel by all-gather).

Device-agnostic: outputs are allocated on the payload's device, so CUDA tensors on an NCCL
group work the same way (untested here: no GPU on the development machine).
"""

import torch
import torch.distributed as dist

from hvd_compress.comm.rounds import Collective, divides_first

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same arguments).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchBackend:
    """Collectives on ``process_group`` (None: the default group). Rounds' ``root`` is a rank
    within the group, translated to the global rank ``torch.distributed.broadcast`` expects."""

    def __init__(self, process_group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchBackend: torch.distributed is not initialised; call torch.distributed.init_process_group first"
            )
        self.group = process_group

    @property
    def size(self):
        return dist.get_world_size(self.group)

    @property
    def rank(self):
        return dist.get_rank(self.group)

    def global_rank(self, group_rank):
        """The global rank of ``group_rank`` within this backend's group."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def start(self, op_name, round_):
        payload, collective = round_.payload, round_.collective
        if collective is Collective.ALLREDUCE:
            if not payload.dtype.is_floating_point:
                raise TypeError(
                    f"TorchBackend: {op_name}: all-reduce averages floating-point "
                    f"payloads; got {payload.dtype} (integer and packed payloads "
                    f"travel by all-gather)"
                )
            total = payload.detach().clone(memory_format=torch.contiguous_format)
            size = self.size
            if divides_first(total.dtype):  # the float16 sum may overflow where the mean does not
                work = dist.all_reduce(total.div_(size), group=self.group, async_op=True)
                return work, lambda: total
            work = dist.all_reduce(total, group=self.group, async_op=True)
            return work, lambda: total.div_(size)
        data = _bytes_of(payload)
        shape, dtype = payload.shape, payload.dtype
        if collective is Collective.ALLGATHER:
            size = self.size
            # A flat output: Gloo wants W * numel entries, not a (W, numel) tensor.
            rows = torch.empty(size * data.numel(), dtype=torch.uint8, device=data.device)
            work = all_gather_single(rows, data, group=self.group, async_op=True)
            return work, lambda: rows.view(dtype).view(size, *shape)
        if collective is Collective.BROADCAST:
            data = data.clone()  # broadcast writes in place; the payload stays the rank's own
            work = dist.broadcast(data, src=self.global_rank(round_.root), group=self.group, async_op=True)
            return work, lambda: data.view(dtype).view(shape)
        if collective is Collective.ALLTOALL:
            if payload.dim() == 0 or payload.shape[0] != self.size:
                raise ValueError(
                    f"TorchBackend: {op_name}: an all-to-all payload has one row "
                    f"per rank ({self.size}), got shape {tuple(shape)}"
                )
            received = torch.empty_like(data)
            # Row-major bytes split in W equal parts are the W rows: row j goes to rank j.
            work = dist.all_to_all_single(received, data, group=self.group, async_op=True)
            return work, lambda: received.view(dtype).view(shape)
        raise ValueError(f"TorchBackend: unknown collective {collective!r}")

    def done(self, handle):
        return handle[0].is_completed()

    def wait(self, handle):
        work, result = handle
        work.wait()
        return result()


def _bytes_of(payload):
    """The payload's bytes as a flat contiguous uint8 tensor (a view where possible)."""
    flat = payload.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)

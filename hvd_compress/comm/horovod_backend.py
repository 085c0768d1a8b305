"""Asynchronous Horovod collectives behind the driver's three-verb interface. Horovod is
imported when a backend is made, so that ``DiLoCo`` can name this class without Horovod."""

from hvd_compress.comm.rounds import Collective, divides_first


class HorovodBackend:
    def __init__(self, process_set=None):
        """Over ``process_set`` (None: Horovod's global one)."""
        import horovod.torch as hvd

        self.hvd = hvd
        self.process_set = hvd.global_process_set if process_set is None else process_set

    @property
    def size(self):
        return self.process_set.size()

    @property
    def rank(self):
        return self.process_set.rank()

    def start(self, op_name, round_):
        # Horovod refuses non-contiguous tensors (a cast keeps a channels_last gradient's layout).
        hvd, payload = self.hvd, round_.payload.contiguous()
        # A name never carries two sizes (settings change payloads; ACP-SGD's P and Q fuse into
        # buckets of other sizes), so Horovod's response cache never invalidates one of ours
        # (DEVELOPERS.md: suspected in two-container Gloo timeouts, not proven).
        op_name = f"{op_name}.{str(payload.dtype)[6:]}x{payload.numel()}"
        if round_.collective is Collective.ALLREDUCE and divides_first(payload.dtype):
            # hvd.Average divides after the sum (its postscale), which overflows float16 where
            # the mean does not; Horovod's prescale divides each rank's payload before it.
            handle = hvd.allreduce_async(
                payload, name=op_name, op=hvd.Sum, prescale_factor=1.0 / self.size, process_set=self.process_set
            )
        elif round_.collective is Collective.ALLREDUCE:
            handle = hvd.allreduce_async(payload, name=op_name, op=hvd.Average, process_set=self.process_set)
        elif round_.collective is Collective.ALLGATHER:
            handle = hvd.allgather_async(payload.reshape(1, -1), name=op_name, process_set=self.process_set)
        elif round_.collective is Collective.BROADCAST:
            # A round's root is a rank within the set; Horovod's root_rank is a global rank.
            handle = hvd.broadcast_async(
                payload, self.process_set.ranks[round_.root], name=op_name, process_set=self.process_set
            )
        else:
            handle = hvd.alltoall_async(payload, name=op_name, process_set=self.process_set)
        return handle, round_.collective, payload.shape

    def done(self, handle):
        return self.hvd.poll(handle[0])

    def wait(self, handle):
        hvd_handle, collective, shape = handle
        output = self.hvd.synchronize(hvd_handle)
        if collective is Collective.ALLGATHER:
            return output.view(self.size, *shape)
        if collective is Collective.ALLTOALL:
            return output[0]
        return output

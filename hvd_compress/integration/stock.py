"""Horovod's Compression API for hvd_compress compressors: stock ``hvd.DistributedOptimizer``
calls ``compress``/``decompress``, which :class:`StockBridge` serves with our round driver."""
import time

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor

from hvd_compress.comm.driver import RoundDriver
from hvd_compress.comm.horovod_backend import HorovodBackend
from hvd_compress.comm.rounds import Collective
from hvd_compress.integration.agreement import verify_same_configuration
from hvd_compress.integration.names import GradientOwners


class _RidesHorovod:
    """Context of a gradient whose single all-reduce is Horovod's own."""
    __slots__ = ("round",)

    def __init__(self, round_):
        self.round = round_


class _Driven:
    """Context of a gradient whose rounds run on our driver."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


class StockBridge:
    """Horovod's stock optimizer all-reduces whatever ``compress`` returns, once per gradient.

    * A compressor whose exchange is one all-reduce (FP16, ACP-SGD, dense tensors) hands its
      payload to that all-reduce: Horovod's fusion and ``groups=`` apply unchanged.
    * Anything else (PowerSGD's two rounds, all-gathers) is started asynchronously from
      ``compress``, so it overlaps with backward, and Horovod all-reduces a 4-byte placeholder.
      At the first ``decompress`` of a step every gradient has been submitted (Horovod submits
      missing ones first), so the driver finishes all remaining rounds in name order: no rank
      can wait on a collective another rank has not submitted, whatever order Horovod uses.
    """

    def __init__(self, compressor):
        self.compressor = compressor
        compressor.bind_world(hvd.rank(), hvd.size())
        self.owners = GradientOwners(compressor.parameters) if compressor.parameters else None
        self.driver = RoundDriver(HorovodBackend(), compressor.traffic)
        self._results = {}
        self._outstanding = 0
        self._first_decompress = None
        self._verified = False

    def compress(self, tensor):
        if not self._verified:
            verify_same_configuration(self.compressor)
            self._verified = True
        name = self._name_of(tensor)
        round_ = self.compressor.begin(name, tensor)
        self._outstanding += 1
        if round_.last and round_.collective is Collective.ALLREDUCE:
            self.compressor.traffic.add_gradient(tensor)
            self.compressor.traffic.add_payload(round_.payload, round_.collective)
            return round_.payload, _RidesHorovod(round_)
        self.driver.start(name, tensor, round_)
        self.driver.poll()
        placeholder = torch.zeros(1)
        self.compressor.traffic.add_payload(placeholder, Collective.ALLREDUCE)
        return placeholder, _Driven(name)

    def decompress(self, tensor, ctx):
        if ctx is None:  # Horovod's sparse all-gather path: nothing was compressed
            return tensor
        if self._first_decompress is None:
            self._first_decompress = time.perf_counter()
        if isinstance(ctx, _RidesHorovod):
            result = ctx.round.then(tensor)
        else:
            if ctx.name not in self._results:
                self._results.update(self.driver.finish())
            result = self._results.pop(ctx.name)
        self._outstanding -= 1
        if self._outstanding == 0:
            # From the first decompress to the last: the time synchronize() spent waiting.
            waited = time.perf_counter() - self._first_decompress
            self._first_decompress = None
            self.compressor.end_step(comm_seconds=waited)
        return result

    def _name_of(self, tensor):
        name = self.owners.name_of(tensor) if self.owners is not None else None
        if name is None and self.compressor.needs_parameter_names:
            cls = type(self.compressor).__name__
            if self.owners is None:
                raise ValueError(
                    f"{cls}: stock hvd.DistributedOptimizer passes gradients without their "
                    f"parameter names; construct it as {cls}(model.named_parameters(), ...)")
            raise ValueError(f"{cls}: got a gradient of shape {tuple(tensor.shape)} that belongs "
                             f"to none of the named_parameters it was given")
        return name


class StockCompression(HorovodCompressor):
    """Mixin that gives an hvd_compress compressor (or controller) Horovod's Compression API.

    The bridge is built at the first ``compress``, when Horovod is initialised, and dropped when
    pickled (it holds hooks and Horovod handles); a restored compressor rebuilds it."""

    _stock_bridge = None

    def compress(self, tensor):
        return self._bridge().compress(tensor)

    def decompress(self, tensor, ctx):
        return self._bridge().decompress(tensor, ctx)

    def _bridge(self):
        if self._stock_bridge is None:
            self._stock_bridge = StockBridge(self)
        return self._stock_bridge

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_stock_bridge", None)
        return state


def horovod_compression(cls):
    """``cls`` with Horovod's Compression API: the class ``hvd_compress`` exports under the
    same name, which stock ``hvd.DistributedOptimizer(compression=...)`` accepts."""
    return type(cls.__name__, (StockCompression, cls),
                {"__module__": "hvd_compress", "__qualname__": cls.__name__, "__doc__": cls.__doc__})

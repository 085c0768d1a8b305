"""Horovod's Compression API for hvd_compress compressors: stock ``hvd.DistributedOptimizer``
calls ``compress``/``decompress``, which :class:`StockBridge` serves with our round driver.
Imported only where Horovod is (``registry.public_class`` mixes :class:`StockCompression` in)."""

import sys
import time
import weakref

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor

from hvd_compress.comm.timing import finished_at
from hvd_compress.comm.rounds import Collective, divides_first
from hvd_compress.integration.binding import Binding, HorovodGroup
from hvd_compress.integration.names import GradientOwners


class _RidesHorovod:
    """Context of a gradient whose single all-reduce is Horovod's own."""

    __slots__ = ("bridge", "round")

    def __init__(self, bridge, round_):
        self.bridge, self.round = bridge, round_


class _Driven:
    """Context of a gradient whose rounds run on our driver."""

    __slots__ = ("bridge", "name")

    def __init__(self, bridge, name):
        self.bridge, self.name = bridge, name


class StockBridge:
    """Horovod's stock optimizer all-reduces whatever ``compress`` returns, once per gradient.

    * A gradient whose payload has its own shape at every step (FP16, and gradients that no
      setting compresses: ``fixed_payload``) rides that all-reduce: Horovod's fusion and
      ``groups=`` apply unchanged. Except a float16 payload (FP16's, a float16 gradient's)
      where Horovod would sum it undivided (``hvd.Sum``, or ``hvd.Average`` with a
      ``gradient_predivide_factor`` other than the world size): Horovod's ``Average`` divides
      after the sum, which overflows where the mean would not (30000 and 50000 on two ranks
      give Inf; torch's ``fp16_compress_hook`` gives 40000). Such a payload runs on our driver,
      whose all-reduce divides first (``comm.rounds.divides_first``).
    * Anything else (ACP-SGD's P and Q, PowerSGD's two rounds, all-gathers, any setting a
      controller may change) is started asynchronously from ``compress`` on our driver, so it
      overlaps with backward (and Horovod fuses its all-reduces all the same), and Horovod
      all-reduces a 4-byte placeholder. Horovod's own all-reduce of a parameter therefore
      never changes shape between steps, so its response cache never takes the invalidation
      path that only compressed jobs took (suspected, not proven, in two-container Gloo
      receive timeouts; DEVELOPERS.md).
      At the first ``decompress`` of a step every gradient has been submitted (Horovod submits
      missing ones first), so the driver finishes all remaining rounds in name order: no rank
      can wait on a collective another rank has not submitted, whatever order Horovod uses.

    Horovod's options are read from the optimizer that calls ``compress`` (``op``,
    ``process_set``): the exchange runs among the process set's ranks only, and with ``hvd.Sum``
    every gradient is summed, whether it rode Horovod's all-reduce or ran on our driver.
    ``groups``, ``backward_passes_per_step`` and ``sparse_as_dense`` act in Horovod before
    ``compress`` and need nothing here; ``gradient_predivide_factor`` only splits the division
    of what rides Horovod's all-reduce, and decides whether float16 payloads ride it (above). Adasum, Min,
    Max and Product cannot combine compressed payloads and are refused.
    """

    def __init__(self, compressor, optimizer=None):
        self.compressor = compressor
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        op = getattr(optimizer, "op", hvd.Average) if optimizer is not None else hvd.Average
        if optimizer is not None and not hasattr(optimizer, "op"):  # Horovod's Adasum optimizer
            op = hvd.Adasum
        check_op("hvd_compress compression", op)
        self.process_set = getattr(optimizer, "process_set", hvd.global_process_set)
        names = getattr(optimizer, "_parameter_names", None)  # {parameter: name}, as Horovod names them
        own = {name: param for param, name in names.items()} if names else {}
        if not compressor.parameters and own:
            compressor.adopt_parameters(own)
        # A shared cast serves several optimizers: each bridge names its own optimizer's
        # gradients, so that the rounds of two same-sized ones never share a collective's name.
        named = own if own and compressor.shareable else compressor.parameters
        self.sum_scale = self.process_set.size() if op == hvd.Sum else 1
        # Horovod sums a payload that rides its all-reduce as it comes, after dividing by
        # gradient_predivide_factor (hvd.Average only): a float16 payload rides it only where
        # that divides by the world size first, as our driver's all-reduce does
        # (rounds.divides_first); elsewhere its sum could overflow where the mean does not.
        predivide = getattr(optimizer, "gradient_predivide_factor", 1.0)
        self.horovod_divides_first = op == hvd.Average and predivide == self.process_set.size()
        # Bound even in a world of one: Horovod calls compress there under elastic. The
        # configuration check waits for the first compress, when every rank is stepping.
        # Horovod's optimizer sets each gradient to its result; hvd.allreduce returns a new tensor.
        self.binding = Binding(
            compressor, HorovodGroup(self.process_set), bind_alone=True, replaces_gradients=optimizer is not None
        )
        self.owners = GradientOwners(named) if named else None
        self._results = {}
        self._outstanding = 0
        self._first_decompress = None

    @property
    def optimizer(self):
        """The optimizer whose ``compress`` calls this bridge serves; None outside one, or once
        it is gone."""
        return None if self._optimizer is None else self._optimizer()

    def close(self):
        """Removes this bridge's hooks from the parameters: a replacing bridge adds its own."""
        if self.owners is not None:
            self.owners.remove()

    def stale(self):
        """Whether the world was re-formed (elastic): checked in full as a step starts."""
        return self.binding.stale(mid_step=self._outstanding > 0)

    def compress(self, tensor):
        self.binding.check_configuration()
        name = self._name_of(tensor)
        round_ = self.compressor.begin(name, tensor)
        self._outstanding += 1
        if (
            round_.last
            and round_.collective is Collective.ALLREDUCE
            and self.compressor.fixed_payload(tuple(tensor.shape))
            and (self.horovod_divides_first or not divides_first(round_.payload.dtype))
        ):
            self.compressor.traffic.add_gradient(tensor)
            self.compressor.traffic.add_payload(round_.payload, round_.collective)
            # Horovod refuses non-contiguous tensors (a cast keeps a channels_last gradient's layout).
            return round_.payload.contiguous(), _RidesHorovod(self, round_)
        self.binding.driver.start(name, tensor, round_)
        self.binding.driver.poll()
        placeholder = torch.zeros(1, device=tensor.device)  # float32 (Horovod takes no bf16)
        self.compressor.traffic.add_payload(placeholder, Collective.ALLREDUCE)
        return placeholder, _Driven(self, name)

    def decompress(self, tensor, ctx):
        if self._first_decompress is None:
            self._first_decompress = time.perf_counter()
        if isinstance(ctx, _RidesHorovod):
            # Compressors always see means (their state, GraVAC's carried statistics); the sum
            # that hvd.Sum asks for is made from the final gradient.
            result = ctx.round.then(tensor if self.sum_scale == 1 else tensor / self.sum_scale)
        else:
            if ctx.name not in self._results:
                self._results.update(self.binding.driver.finish())
            result = self._results.pop(ctx.name)
        if self.sum_scale != 1:
            result = result * self.sum_scale
        self._outstanding -= 1
        if self._outstanding == 0:
            # From the first decompress to the last: the time synchronize() spent waiting.
            waited = finished_at(result.device, self.compressor.times_communication) - self._first_decompress
            self._first_decompress = None
            self.compressor.end_step(comm_seconds=waited)
        return result

    def _name_of(self, tensor):
        name = self.owners.name_of(tensor) if self.owners is not None else None
        if name is None and self.compressor.needs_parameter_names:
            cls = type(self.compressor).__name__
            if self.owners is None:
                raise ValueError(
                    f"{cls}: compress() was called without parameter names, outside "
                    f"hvd.DistributedOptimizer; construct it as {cls}(model.named_parameters(), ...)"
                )
            raise ValueError(
                f"{cls}: got a gradient of shape {tuple(tensor.shape)} that belongs "
                f"to none of the named_parameters it was given"
            )
        return name


class StockCompression(HorovodCompressor):
    """Mixin that gives an hvd_compress compressor (or controller) Horovod's Compression API.

    A bridge is built at the first ``compress`` from each optimizer, when Horovod is
    initialised, dropped when pickled (it holds hooks and Horovod handles), and rebuilt by a
    restored compressor or after an elastic reset. The first optimizer serves the compression
    (``GradientCompression.serve``): a second one that is still alive is refused at its first
    ``compress``, on every rank alike, unless the compression is ``shareable`` (FP16,
    NoCompression), which then has a bridge per optimizer, each with that optimizer's options
    and steps."""

    _stock_bridges = None  # {calling optimizer, or None outside one: its bridge}

    # Never traced: under compiled autograd Horovod's gradient hooks run inside the traced
    # backward, and dynamo would trace the compressor's Python (each step's rounds, the driver,
    # the optimizer found on the call stack), recompiling ``compress`` up to its limit.
    @torch.compiler.disable
    def compress(self, tensor):
        optimizer = _calling_optimizer(self)
        if self._stock_bridges is None:
            self._stock_bridges = {}
        key = None if optimizer is None else id(optimizer)
        bridge = self._stock_bridges.get(key)
        if bridge is not None and bridge.optimizer is not optimizer:
            bridge = None  # another optimizer that took a dropped one's id
        if bridge is None or bridge.stale():
            if optimizer is not None:
                self.serve(optimizer, "a stock hvd.DistributedOptimizer")
            if bridge is not None:
                bridge.close()
            # Bridges of optimizers that are gone go with their hooks.
            for gone in [k for k, b in self._stock_bridges.items() if k is not None and b.optimizer is None]:
                self._stock_bridges.pop(gone).close()
            bridge = self._stock_bridges[key] = StockBridge(self, optimizer)
        return bridge.compress(tensor)

    @torch.compiler.disable
    def decompress(self, tensor, ctx):
        if ctx is None:  # Horovod's sparse all-gather path: nothing was compressed
            return tensor
        return ctx.bridge.decompress(tensor, ctx)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_stock_bridges", None)
        return state


OP_NAMES = {
    hvd.Average: "hvd.Average",
    hvd.Sum: "hvd.Sum",
    hvd.Adasum: "hvd.Adasum",
    hvd.Min: "hvd.Min",
    hvd.Max: "hvd.Max",
    hvd.Product: "hvd.Product",
}


def check_op(owner, op):
    """Only averages and sums of compressed payloads make sense; ``owner`` names the refuser."""
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(
            f"op: {owner} takes hvd.Average or hvd.Sum, got {OP_NAMES.get(op, op)}; "
            f"Adasum, Min, Max and Product cannot combine compressed payloads"
        )


def _calling_optimizer(compression):
    """The stock ``hvd.DistributedOptimizer`` whose hook calls ``compression.compress``, found on
    the call stack: Horovod 0.28.1 calls it from a method of the optimizer, which holds the
    compression as ``_compression`` (DEVELOPERS.md). None when something else calls it."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and getattr(owner, "_compression", None) is compression:
            return owner
        frame = frame.f_back
    return None

"""``hvd_compress.DistributedOptimizer``: Horovod's signature, our exchange machinery."""

import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Optional, Tuple

import horovod.torch as hvd
import horovod.torch.optimizer as horovod_optimizer
import torch
from horovod.torch.mpi_ops import sparse_allreduce_async

from hvd_compress import arguments
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.compressors.cast import NoCompression
from hvd_compress.integration import amp
from hvd_compress.integration.binding import Binding, HorovodGroup
from hvd_compress.integration.names import parameter_names
from hvd_compress.integration.horovod.compression import check_op


class _CompressedDistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self, params, named_parameters, compression, backward_passes_per_step, op, sparse_as_dense, process_set, fusion
    ):
        super(self.__class__, self).__init__(params)
        compression.serve(self, f"an hvd_compress.DistributedOptimizer over {type(self).__name__}")
        self._compression = compression
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        self._op = op
        self._sparse_as_dense = sparse_as_dense
        self._sparse = {}  # parameter -> Horovod's handle of its sparse gradient's all-gather
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._requires_update = [p for p in self._parameter_names if p.requires_grad]
        self._started = set()
        self._synchronized = False
        self._should_synchronize = True
        self._fusion = fusion
        self._bind_world()
        self._hooks = (
            [p.register_post_accumulate_grad_hook(self._make_hook()) for p in self._requires_update]
            if process_set.included()
            else []
        )

    def _bind_world(self):
        """Binds the compression to the process set's world and builds what depends on it;
        again at the first gradient of a step after an elastic reset (``integration.horovod.elastic``)
        re-formed it. No collective here: an elastic worker that joins builds its optimizer
        while the others synchronise their state."""
        self._binding = Binding(self._compression, HorovodGroup(self._process_set))
        self._started.clear()
        self._sparse.clear()
        self._delay = {p: self.backward_passes_per_step for p in self._parameter_names}
        self._scheduler = None
        if self._binding.active and self._fusion is not None:
            # Backward order: gradients of the last-registered parameters are ready first.
            shapes = {self._parameter_names[p]: tuple(p.shape) for p in reversed(self._requires_update)}
            self._scheduler = FusionScheduler(self._compression, shapes, self._fusion, self._binding.group.rank)

    def _begin_step(self):
        """At the first gradient of a step: rebinds after an elastic reset, and checks that every
        rank runs the same configuration (collective) once per world."""
        if self._binding.stale():
            self._bind_world()
        self._binding.check_configuration({self._parameter_names[p]: tuple(p.shape) for p in self._requires_update})

    def _make_hook(self):
        def hook(p):
            if not self._started:
                self._begin_step()
            if not self._binding.active:
                return
            if self._delay[p] <= 0:
                raise AssertionError(
                    f"gradient of {self._parameter_names[p]!r} was computed more than "
                    f"backward_passes_per_step={self.backward_passes_per_step} times before "
                    f"step(); increase backward_passes_per_step to accumulate locally"
                )
            self._delay[p] -= 1
            if self._delay[p] == 0:
                self._start(p)
            self._binding.driver.poll()

        # Never traced: under compiled autograd the hook runs inside the traced backward
        # (StockCompression.compress says why).
        return torch.compiler.disable(hook)

    def _start(self, p):
        if not self._started and self._scheduler is not None:
            self._binding.driver.use_plan(self._scheduler.plan())  # settings may have changed last step
        name = self._parameter_names[p]
        if p.grad.is_sparse and not self._sparse_as_dense:
            self._start_sparse(p, name)
        else:
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            self._binding.start(name, grad)
        self._started.add(p)

    def _start_sparse(self, p, name):
        """As in Horovod: a sparse gradient is all-gathered whole (its indices and values) and
        handed back sparse; the compressor never sees it, and it leaves the fusion plan."""
        if self._scheduler is not None:
            self._scheduler.shapes.pop(name, None)
        self._binding.driver.leave_out(name)
        self._sparse[p] = sparse_allreduce_async(
            p.grad, name=f"hvd_compress.sparse.{name}", op=self._op, process_set=self._process_set
        )

    def synchronize(self):
        """Finishes every exchange and writes the aggregated gradients into ``p.grad``."""
        if not self._started:
            self._begin_step()
        if not self._binding.active:
            self._synchronized = True
            return
        for p in self._requires_update:
            if p not in self._started:
                # Unused on this rank (or fewer backward passes): other ranks may have a
                # gradient, so this rank must still take part, with zeros.
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._start(p)
        results, comm_seconds = self._binding.finish()
        self._compression.end_step(comm_seconds=comm_seconds)
        scale = self._process_set.size() if self._op == hvd.Sum else 1
        for p in self._started:
            if p in self._sparse:  # averaged or summed by Horovod, as op says
                p.grad = self._sparse.pop(p)()
            else:
                grad = results[self._parameter_names[p]]
                grad = grad * scale if scale != 1 else grad
                # sparse_as_dense: handed back sparse, as Horovod does (SparseAdam needs it)
                p.grad = grad.to_sparse() if p.grad.is_sparse else grad
            self._delay[p] = self.backward_passes_per_step
        self._started.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """For ``optimizer.synchronize(); clip; with optimizer.skip_synchronize(): step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    # GradScaler.step then calls step() whatever it found, with ``found_inf`` and ``grad_scale``
    # set, so that the skip is decided here, on gradients every rank holds alike.
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        found_inf, grad_scale = amp.scaler_call(self)
        if found_inf is not None:
            return self._scaled_step(closure, found_inf, grad_scale)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() "
                    "context after optimizer.synchronize(): the gradients are "
                    "exchanged again. Use `with optimizer.skip_synchronize(): "
                    "optimizer.step()` after optimizer.synchronize()."
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def _scaled_step(self, closure, found_inf, grad_scale):
        """``torch.amp.GradScaler.step``: skips the update where GradScaler found an Inf or NaN,
        else unscales (unless ``scaler.unscale_`` did) and steps. GradScaler must have read the
        exchanged gradients, identical on every rank, so that every rank decides alike (and its
        scale moves alike): a rank that reached ``scaler.step`` before ``synchronize()`` has
        checked only its own gradient, and every rank raises there."""
        if self._binding.active and not self._synchronized:
            raise RuntimeError(
                "GradScaler checked this rank's gradients before they were exchanged, so ranks "
                "could skip different steps. As with hvd.DistributedOptimizer: "
                "optimizer.synchronize(); scaler.unscale_(optimizer) (to clip); then "
                "`with optimizer.skip_synchronize(): scaler.step(optimizer)`"
            )
        self._synchronized = False
        if bool(found_inf):  # identical on every rank: the aggregates are
            return None
        amp.unscale(self._parameter_names, grad_scale)
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if self._started:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but "
                "before optimizer.step() or optimizer.synchronize()"
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, *args, **kwargs):
        self._started.clear()
        self._sparse.clear()
        self._synchronized = False
        self._delay = {p: self.backward_passes_per_step for p in self._parameter_names}
        return super(self.__class__, self).load_state_dict(*args, **kwargs)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
    compression: Optional[GradientCompression] = None,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = hvd.global_process_set,
    *,
    fusion: Optional[ScaledFusion] = ScaledFusion(),
) -> torch.optim.Optimizer:
    """Drop-in for ``hvd.DistributedOptimizer`` (same positional signature) that runs
    hvd_compress compressors with names and steps passed explicitly.

    Compared with the stock optimizer it:
      * needs no ``named_parameters`` on the compressor: names come from here;
      * overlaps every round of multi-round compressors (PowerSGD's Q, BF16's all-gather)
        with backward, starting each round as soon as the previous one lands;
      * sends no placeholder all-reduce for compressors that all-gather;
      * fuses payloads into buckets sized by the compression rate (ACP-SGD's scaled tensor
        fusion), re-planned when L-GreCo or GraVAC change per-layer settings, identically on
        every rank; parameters unused on a rank cannot stall a bucket, since ``synchronize``
        submits them as zeros. Rank 0 logs each new plan at INFO (``hvd_compress.comm.fusion``);
        ``fusion=None`` leaves fusion to Horovod's background cycle.

    ``compression`` must be an hvd_compress compressor (default: :class:`NoCompression`).
    Horovod's options:
      * ``op``: ``hvd.Average`` or ``hvd.Sum`` (every gradient, compressed or not); others raise.
      * ``gradient_predivide_factor`` (with ``hvd.Average``, as in Horovod): accepted; it only
        splits Horovod's scaling around its sum, and payloads here are averaged by the round
        driver (float16 ones divided by the world size before the sum: ``rounds.divides_first``).
      * ``backward_passes_per_step``: gradients accumulate locally, as in Horovod.
      * ``process_set``: the exchange, the configuration check and L-GreCo's decisions run among
        its ranks only; other ranks are never waited on.
      * ``sparse_as_dense``: True densifies sparse gradients, which are then compressed; False
        (the default) all-gathers them uncompressed and hands them back sparse, as Horovod does
        (``torch.optim.SparseAdam`` needs them sparse).
      * ``num_groups``/``groups``: refused; ``fusion`` replaces them.
    """
    compression = NoCompression() if compression is None else compression
    if not isinstance(compression, GradientCompression):
        raise ValueError(
            f"compression must be an hvd_compress compressor, got "
            f"{type(compression).__name__}; use hvd.DistributedOptimizer for "
            f"Horovod's own compressors"
        )
    check_op("hvd_compress.DistributedOptimizer", op)
    arguments.real("DistributedOptimizer", "gradient_predivide_factor", gradient_predivide_factor, low=0, low_open=True)
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor: as in Horovod, only with op=hvd.Average")
    if num_groups or groups is not None:
        raise ValueError("num_groups/groups: not supported; use fusion=ScaledFusion(...)")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    # Horovod's broadcast_optimizer_state (hence elastic TorchState.sync) initialises an empty
    # optimizer state with the wrapped optimizer's own step() when the optimizer's module is
    # that of hvd.DistributedOptimizer, else with step(): ours would exchange zeros on the
    # ranks whose state is empty (a joining worker) and wait forever for the others. Horovod
    # compares with its own module's name, so ours is named from that module, never from
    # hvd.DistributedOptimizer, which a user (or a test harness) may have replaced.
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_CompressedDistributedOptimizer.__dict__, __module__=horovod_optimizer.__name__),
    )
    if fusion is not None and not isinstance(fusion, ScaledFusion):
        raise ValueError(f"fusion must be a ScaledFusion or None, got {type(fusion).__name__}")
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        bool(sparse_as_dense),
        process_set,
        fusion,
    )

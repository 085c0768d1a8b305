"""PyTorch DDP communication hooks for hvd_compress compressors, in torch's hook style: a state
object (:class:`State`) plus a plain function (:func:`hook`), registered with
``ddp_model.register_comm_hook(state, hook)``, or in one line with :func:`register`.

How a step runs, and why it cannot deadlock
--------------------------------------------
``torch.distributed`` matches collectives by the order in which each rank issues them on a
process group (Horovod matches them by name), so every rank must issue the same collectives in
the same order. DDP calls the hook once per bucket, strictly in bucket index order (its reducer
launches bucket i only after buckets 0..i-1), and every rank holds the same buckets: in the
first iteration they come from the parameters' order and sizes, which DDP checks agree; after
DDP rebuilds them (end of the first iteration, without ``find_unused_parameters``) from rank 0's
gradient-ready order, broadcast to all. So:

1. In each bucket's hook, every gradient of the bucket is handed to the compressor (``begin``)
   in the bucket's order, and the bucket's first-round payloads are started at once,
   asynchronously (fused: one collective per kind and dtype, in member order), overlapping the
   rest of backward. Nothing else is started here, and nothing waits.
2. In the hook of the last bucket (``bucket.is_last()``), the driver's ``finish`` completes
   every remaining round of the step in name order: it always waits on the smallest pending key
   and starts that exchange's next round before looking at any other, so the sequence of
   collectives depends only on names and round structure, which agree on every rank. Then each
   bucket's future gets its flat buffer of aggregated gradients (DDP copies it back into the
   gradients), and ``compressor.end_step`` runs (L-GreCo's decision exchange, if due, happens
   there, at the same step on every rank).

``RoundDriver.poll`` is never called: which round lands first differs between ranks, so
advancing rounds as they land would issue collectives in different orders.

The first iteration needs nothing special: state is keyed by parameter name (through
``bucket.parameters()``), not by bucket index, so DDP's rebuilt buckets after it change nothing
(``powerSGD_hook`` keys error feedback by bucket index, hence its all-reduce-only first
iterations). With ``find_unused_parameters=True`` DDP puts zeros in the bucket for parameters
that got no gradient on this rank; they are compressed like any gradient (error feedback
included), so every rank runs the same exchanges.

One process (world size 1): as with Horovod, nothing is compressed; buckets pass through.
NCCL/CUDA: written device-agnostically (outputs on the gradients' device, CUDA-aware futures)
but untested: there is no GPU on the development machine.
"""

import math
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from hvd_compress import arguments
from hvd_compress.comm.fusion import DEFAULT_DENSE_THRESHOLD, Bucket, FusionPlan, plan_buckets, scaled_threshold
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.integration.binding import Binding, TorchGroup

MIB = 1024 * 1024  # DDP's bucket_cap_mb is in MiB


class State:
    """The hook's state: the compressor (or controller), the process group the exchange runs
    on (None: the default group), and the parameters' names.

    ``named_parameters``: ``model.named_parameters()`` of the module DDP wraps; names map
    bucket gradients to parameters by identity, so per-layer settings, L-GreCo and GraVAC see
    the same names as anywhere else. A compressor constructed with ``named_parameters`` needs
    none here (its own names win). :func:`register` passes them.

    Pickling (``torch.save(state)``) drops the process group, the binding and the names, as
    torch's hook states do; a restored state uses the default group until ``process_group`` is
    set, and needs its names again (``register(ddp_model, state)``). For checkpoints prefer
    ``state.compressor.state_dict()`` / ``load_state_dict``.

    ``iter``: steps completed, as in ``PowerSGDState``."""

    def __init__(
        self,
        compressor: GradientCompression,
        process_group: Any = None,
        *,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    ):
        if not isinstance(compressor, GradientCompression):
            raise ValueError(
                f"hvd_compress.ddp.State: compressor must be an hvd_compress "
                f"compressor or controller, got {type(compressor).__name__}"
            )
        compressor.serve(self, "an hvd_compress.ddp hook's State", argument="compressor")
        self.compressor = compressor
        self.process_group = process_group
        self.iter = 0
        self._names: Dict[int, str] = {}
        self._shapes: Dict[str, Tuple[int, ...]] = {}  # what compiled kernels are warmed on
        self._lookup: Dict[int, str] = {}  # id(parameter) -> name
        self._binding: Optional[Binding] = None  # made at the first bucket, configuration checked
        self._plan = []  # this step's buckets so far, as fusion buckets
        self._pending = []  # this step's (buffer, [(name, offset, numel)], future)
        if named_parameters is not None:
            self.name_parameters(named_parameters)

    def name_parameters(self, named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Names gradients by their parameters' identity: ``model.named_parameters()``."""
        named = arguments.named_parameters("hvd_compress.ddp.State", named_parameters)
        self._names = {id(param): name for name, param in named.items()}
        self._shapes = {name: tuple(param.shape) for name, param in named.items()}
        self._build_lookup()

    def _build_lookup(self):
        # The compressor's own names (if it was given named_parameters) win.
        self._lookup = dict(self._names)
        self._lookup.update({id(p): n for n, p in self.compressor.parameters.items()})

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(process_group=None, _names={}, _shapes={}, _lookup={}, _binding=None, _plan=[], _pending=[])
        return state

    # ----- used by hook() -------------------------------------------------------------------
    def _name_of(self, param):
        name = self._lookup.get(id(param))
        if name is None:
            raise ValueError(
                f"hvd_compress.ddp: a bucket holds a parameter of shape {tuple(param.shape)} that "
                f"has no name; use hvd_compress.ddp.register(ddp_model, compressor), or "
                f"State(compressor, named_parameters=model.named_parameters())"
            )
        return name

    def _prepare(self):
        """Once, at the first bucket: bind to the group, check every rank's configuration."""
        if self._binding is not None:
            return
        binding = Binding(self.compressor, TorchGroup(self.process_group))
        binding.check_configuration(self._shapes or None)
        self._build_lookup()
        self._binding = binding

    def _start_bucket(self, bucket):
        buffer = bucket.buffer()
        members = [
            (self._name_of(param), _gradient_in(buffer, param, grad))
            for param, grad in zip(bucket.parameters(), bucket.gradients())
        ]
        # This bucket is one fusion bucket: its first-round payloads travel together.
        self._plan.append(Bucket(tuple(name for name, _ in members), 0))
        self._binding.driver.use_plan(FusionPlan("", 0, tuple(self._plan)))
        for name, grad in members:
            self._binding.start(name, grad)
        future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        self._pending.append((buffer, members, future))
        return future

    def _finish_step(self):
        pending, self._pending, self._plan = self._pending, [], []
        try:
            results, comm_seconds = self._binding.finish(pending[0][0].device if pending else None)
        except BaseException as error:
            for _, _, future in pending:
                future.set_exception(error)
            raise
        for buffer, members, future in pending:
            # Into the bucket's own buffer, as torch's hooks do: every gradient in it was consumed
            # when its exchange began, and a fresh bucket-sized tensor costs page faults per step.
            for name, grad in members:
                grad.copy_(results[name])
            future.set_result(buffer)
        self.iter += 1
        self.compressor.end_step(comm_seconds=comm_seconds)


def _gradient_in(buffer: torch.Tensor, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient in its DDP bucket ``buffer``, laid out as DDP's reducer copies it
    there: in the parameter's own strides where its memory is dense (a channels_last
    convolution, a transposed weight), else C-contiguous (torch 2.13,
    ``torch/csrc/distributed/c10d/reducer.cpp``, ``initialize_bucket_views``). ``grad`` is
    ``GradBucket.gradients()``'s view, always C-contiguous: read through it, such a gradient
    comes out permuted, which only element-wise methods would not notice."""
    if grad.numel() == 0 or param.is_contiguous() or not torch.ops.aten.is_non_overlapping_and_dense(param):
        return grad
    offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
    return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, hook)``.

    Starts the first round of every gradient in ``bucket`` and returns a future; at the last
    bucket of the step, finishes every round of every bucket in name order, completes all the
    step's futures with their buckets' aggregated (averaged) gradients, and ends the
    compressor's step. See the module docstring for why this is deadlock-free."""
    state._prepare()
    if not state._binding.active:
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future
    future = state._start_bucket(bucket)
    if bucket.is_last():
        state._finish_step()
    return future


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, compressor: Any, process_group: Any = None) -> State:
    """``ddp_model.register_comm_hook(State(compressor, ...), hook)`` with the wrapped module's
    parameter names; returns the state. ``process_group``: None takes the DDP model's own.
    ``compressor`` may also be a :class:`State` (a restored one: it gets its names back)."""
    module = getattr(ddp_model, "module", ddp_model)
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    if isinstance(compressor, State):
        state = compressor
        # A restored state's compressor is a copy, which nothing serves yet.
        state.compressor.serve(state, "an hvd_compress.ddp hook's State", argument="compressor")
        if process_group is not None:
            state.process_group = process_group
    else:
        state = State(compressor, process_group)
    state.name_parameters(module.named_parameters())
    ddp_model.register_comm_hook(state, hook)
    return state


def scaled_bucket_cap_mb(
    model: torch.nn.Module, compressor: GradientCompression, dense_mb: float = DEFAULT_DENSE_THRESHOLD / MIB
) -> float:
    """DDP's ``bucket_cap_mb`` under ACP-SGD's scaled fusion rule (docs/ddp.md).

    The rule sizes a buffer of *compressed* payloads at ``dense_mb`` times the compression rate
    (payload bytes / float32 gradient bytes), so that it holds about as many layers as a dense
    buffer of ``dense_mb``. DDP's ``bucket_cap_mb`` counts *dense* gradient bytes, and this hook
    fuses each bucket's first-round payloads into one collective, so a bucket's collective
    carries its dense bytes times the rate. The cap returned is the mean dense size of the
    buckets the scaled rule forms (``comm.fusion.plan_buckets`` over the compressor's
    ``next_payload_bytes``, in backward order, threshold ``dense_mb`` MiB x rate), so DDP makes
    about as many buckets as the rule: about ``dense_mb`` for models larger than that (DDP's
    default 25 already is the scaled rule there), the whole model (one bucket) otherwise. Not
    ``dense_mb`` x rate: that cap would shrink the fused payloads by the rate a second time.

    ``model``: the module (or the DDP model wrapping it), to call before constructing DDP."""
    module = getattr(model, "module", model)
    params = [(name, tuple(p.shape)) for name, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("scaled_bucket_cap_mb: the model has no parameters that require grad")
    arguments.real("scaled_bucket_cap_mb", "dense_mb", dense_mb, low=0, low_open=True)
    dense = sum(4 * math.prod(shape) for _, shape in params)
    payloads = [(name, compressor.next_payload_bytes(name, shape)) for name, shape in reversed(params)]
    threshold = scaled_threshold(dense_mb * MIB, sum(nbytes for _, nbytes in payloads), dense)
    plan = plan_buckets(payloads, threshold)
    return dense / len(plan.buckets) / MIB

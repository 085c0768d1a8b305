"""``Compressor``: a ``GradientCompression`` (``compressors.contract``) with per-parameter
settings and state keyed by parameter name. Controllers (L-GreCo, GraVAC) look inside it only
through its tuning object (``compressor.tuning``, ``compressors.tuning``: the controller
protocol) and the few methods that protocol names. Its collaborators: ``Checkpoint``
(``compressors.checkpoint``: checkpoints and world changes), ``CompiledPath``
(``compressors.compiled_path``: ``compiled=True``), ``StepGuard`` (``compressors.rollback``: the
non-finite rule below) and ``ResultMemory`` (``compressors.results``: where results go).

Non-finite steps: a compressor checks every aggregated gradient it returns. They are identical
on every rank, so all ranks agree whether a step was finite. A non-finite entry of a dense
gradient reaches the aggregate; a compressed one need not (a sparsifier may leave it out of
every payload: ScaleCom sends only the leader's indices, and the entry would stay in that
rank's error feedback for good). So each compressed gradient's exchange also carries a marker
of its input, 0 or NaN, in the payload of its first round that every rank contributes to
(``comm.rounds.carrying``: 4 bytes, no extra collective), and the aggregated gradient is made
non-finite wherever any rank's input was. Compressors whose payload is non-finite whenever
their input is declare ``payload_carries_input`` and send no marker, which saves a pass over
every input: the 16-bit casts; the low-rank projections (``P = M Q``, ``Q = M^T P``: an Inf or
NaN of ``M`` spoils its whole row or column of the product, Inf x 0 being NaN); Top-K (a
non-finite magnitude outranks every finite one); QSGD and QuantizedAllReduce (a bucket's norm,
a block's scale, travels non-finite). ScaleCom and SignSGD keep the marker. PowerSGD, ACP-SGD,
Top-K, QSGD and QuantizedAllReduce check a float32 result through the small aggregate it was
made from, whose largest magnitude bounds it (``StepGuard.bound_by``): a low-rank result is a
mean factor times an orthonormal one, Top-K's and QSGD's a mean of gathered values, or of codes
scaled by gathered norms, each no larger than it, QuantizedAllReduce's codes of at most s times
their gathered block scales; so no pass over the gradient's memory follows its collective. If
the step was not finite, ``end_step`` puts the state back as it was before the step (error
feedback, warm starts, step counters), the gradients handed back stay non-finite (so that
``GradScaler`` or the user's check skips the step), and the next step runs as if the bad one
had never happened. Controllers read ``last_step_finite`` after the wrapped compressor's
``end_step`` and drop their own updates of that step too.

A new compressor subclasses ``Compressor``, passes its configuration (a frozen
``compressors.config.CompressorConfig``, subclassed for the method's own options, checked when it
is made) to ``Compressor.__init__``, and implements ``_begin`` and ``_compressed_bytes``; names
its ``tuning_class`` (``compressors.tuning``: its settings' checks, and the controller protocol
where it is controllable); and its ``state_type`` if it keeps per-parameter state in
``self.state`` (checkpoints rebuild it). Error feedback comes from
``compressors.feedback.ErrorFeedback``. Nothing here knows Horovod: its Compression API is added,
where Horovod is installed, by ``registry.public_class``.
"""

import logging
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Collective, Round, Traffic, carrying, on_result
from hvd_compress.compressors.checkpoint import Checkpoint, state_to_device
from hvd_compress.compressors.compiled_path import CompiledPath
from hvd_compress.compressors.config import CompressorConfig, parameter_error
from hvd_compress.compressors.contract import GradientCompression, Shape, StepObserver
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.compressors.results import ResultMemory
from hvd_compress.compressors.rollback import StepGuard
from hvd_compress.compressors.tuning import MARKER_BYTES, Tuning
from hvd_compress.maths.compiled import Compilable, graphs
from hvd_compress.maths.finite import nonfinite_marker

# The contract's names, and the marker's size, are also importable from here.
__all__ = [
    "MARKER_BYTES",
    "Compressor",
    "GradientCompression",
    "NamedParameters",
    "Shape",
    "StepObserver",
    "dense_round",
]

logger = logging.getLogger(__name__)

# Horovod's all-reduce sums these dtypes; anything else (bf16) travels as float32.
_ALLREDUCE_DTYPES = (torch.float16, torch.float32, torch.float64)

NamedParameters = Optional[Iterable[Tuple[str, torch.Tensor]]]


class Compressor(GradientCompression):
    """Base class of compressors; see the module docstring.

    ``named_parameters`` (e.g. ``model.named_parameters()``) lets the compressor tell which
    parameter each gradient belongs to when stock ``hvd.DistributedOptimizer`` calls
    ``compress(p.grad)`` without a name. Without it, the compressor takes the calling
    optimizer's parameters and names at the first ``compress`` (``adopt_parameters``).
    ``config``: the method's configuration (``compressors.config``), checked when it was made.
    """

    setting_name = "setting"
    controllable = False
    # Whether a non-finite input always makes the payload non-finite (the 16-bit casts, low
    # rank, Top-K, QSGD), so that no marker of the input needs to travel (module docstring).
    payload_carries_input = False
    # Error feedback, for compressors that have it (set in their constructor).
    feedback: Optional[ErrorFeedback] = None
    # The maths kernels the compressor runs compiled under ``config.compiled`` (maths.compiled).
    compiled_kernels: Tuple[Compilable, ...] = ()
    #: The controller protocol and the settings' checks (``compressors.tuning``).
    tuning_class = Tuning
    #: The class of each parameter's state in ``self.state`` (a dataclass), rebuilt from
    #: checkpoints; None for a compressor that keeps none.
    state_type: Optional[type] = None
    checkpoint_class = Checkpoint

    def __init__(self, named_parameters: NamedParameters, config: CompressorConfig):
        # Configuration: fixed at construction, agreed by every rank, recorded in checkpoints.
        self.config = config
        self.parameters = (
            {} if named_parameters is None else arguments.named_parameters(type(self).__name__, named_parameters)
        )
        self.tuning = self.tuning_class(self)
        self.tuning.check_setting(None, config.default, None)
        # State: what a checkpoint holds, and what a non-finite step leaves as it was.
        self._overrides: Dict[str, Any] = {}
        self.state: Dict[str, Any] = {}
        self._shapes: Dict[str, Shape] = {}  # every gradient seen (or checkpointed), by name
        self.skipped_steps = 0  # non-finite steps, which left no trace in the state
        # Binding, by the integration: the world (bind_world), the loss scale (track) and
        # where results go (write_results_into_gradients).
        self.rank, self.size = 0, 1
        self._bound = False
        self.results = ResultMemory()
        self._expected_world: Optional[Tuple[int, int]] = None  # from a loaded checkpoint
        self._scaler = None
        self.traffic = Traffic()
        # Per-step scratch, emptied by end_step.
        self.last_step_finite = True
        self.guard = StepGuard()  # the non-finite rule (compressors.rollback)
        self._step_scale: Optional[float] = None
        self.compiled_path = CompiledPath(type(self).__name__, config.compiled and bool(self.compiled_kernels))

    # ----- settings, addressable by parameter name ---------------------------------------
    def setting(self, name: str) -> Any:
        return self._overrides.get(name, self.config.default)

    def set_setting(self, name: str, value: Any) -> None:
        """Changes one parameter's setting from the next step on. Controllers call this on
        every rank at the same step; a rank-only change makes payload shapes disagree.
        Raises ``ValueError`` for a setting the compressor has no use for."""
        param = self.parameters.get(name)
        self.tuning.check_setting(name, value, None if param is None else param.numel())
        self._overrides[name] = value

    def settings(self) -> Dict[str, Any]:
        """{name: setting} for every known parameter."""
        return {name: self.setting(name) for name in self.parameters}

    def adopt_parameters(self, named: Dict[str, torch.nn.Parameter]) -> None:
        if self.parameters:
            raise ValueError(f"{type(self).__name__}: already has its named_parameters")
        for name, shape in sorted(self._shapes.items()):
            param = named.get(name)
            if param is None:
                raise parameter_error(
                    self,
                    name,
                    f"is not among the optimizer's parameter names "
                    f"{sorted(named)[:8]}{'...' if len(named) > 8 else ''} (a "
                    f"checkpoint or gradient under another name)",
                )
            if tuple(param.shape) != shape:
                raise parameter_error(
                    self,
                    name,
                    f"has shape {tuple(param.shape)} in the optimizer but {shape} before (or in the loaded checkpoint)",
                )
        self.parameters.update(named)  # in place: a controller shares this dict

    def use_shards(self, local: Dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(self.parameters) - set(local))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: named_parameters {unknown[:8]} are not parameters of the sharded model"
            )
        for name, value in self._overrides.items():
            if name in self.parameters:
                self.tuning.check_setting(name, value, local[name].numel())
        self.parameters.update({name: local[name] for name in self.parameters})  # a controller shares it

    # ----- binding ------------------------------------------------------------------------
    def bind_world(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.traffic.world_size = size
        self._bound = True
        if self._expected_world is not None:
            self.checkpoint_class(self).check_world(self._expected_world)
            self._expected_world = None

    def write_results_into_gradients(self) -> None:
        self.results.into_gradients = True

    def prepare_compiled(self, shapes: Optional[Dict[str, Shape]] = None) -> bool:
        return self.compiled_path.prepare(self, shapes)

    def _warm_up(self, numel: int, setting: Any, device: torch.device) -> None:
        """Runs each compiled kernel once on a flat gradient of ``numel`` entries at ``setting``,
        touching no state (``CompiledPath.prepare``)."""
        raise NotImplementedError

    def use_compiled(self, ready: Sequence[bool]) -> None:
        self.compiled_path.use(ready)

    def track(self, scaler: Any) -> "Compressor":
        """Keeps error feedback in unscaled units under loss scaling (mixed precision):
        ``compressor.track(scaler)`` with the ``torch.amp.GradScaler`` whose scale multiplies
        the gradients. Without it, a residual built under one scale is added to gradients under
        another (GradScaler halves the scale on overflow and doubles it every
        ``growth_interval`` steps). Anything with ``get_scale()`` works. Returns ``self``."""
        if not callable(getattr(scaler, "get_scale", None)):
            raise ValueError(
                f"{type(self).__name__}.track: scaler must have get_scale(), like "
                f"torch.amp.GradScaler; got {type(scaler).__name__}"
            )
        self._scaler = scaler
        return self

    def loss_scale(self) -> float:
        """The loss scale in force for this step's gradients (1 unless ``track``-ed); read once
        per step (a host synchronisation when the scale lives on a GPU)."""
        if self._scaler is None:
            return 1.0
        if self._step_scale is None:
            self._step_scale = float(self._scaler.get_scale())
        return self._step_scale

    # ----- the exchange -------------------------------------------------------------------
    def _begin_exchange(self, name: str, grad: torch.Tensor, compress: Optional[Callable] = None) -> Round:
        """``begin``'s work, with ``compress(name, grad)`` (``_begin`` by default, a batch's
        ``add`` or a measuring one) making the rounds of a gradient it compresses."""
        if not grad.dtype.is_floating_point:
            raise TypeError(
                f"{type(self).__name__}: parameter {name!r}: gradient has dtype "
                f"{grad.dtype}; only floating-point gradients can be compressed"
            )
        state_to_device(self.state.get(name), grad.device)
        self._remember_state(name)
        shape = tuple(grad.shape)
        known = self._shapes.setdefault(name, shape) if name is not None else shape  # None: no names
        if known != shape:
            raise parameter_error(
                self, name, f"gradient has shape {shape}, but {known} before (or in the loaded checkpoint)"
            )
        setting = self.setting(name)
        if not self.tuning.compresses(grad.shape, setting):
            round_ = self._dense_round_with_residual(name, grad)
        else:
            self.tuning.check_setting(name, setting, grad.numel())
            round_ = (compress or self._begin)(name, grad)
            if not self.payload_carries_input:
                round_ = _marking_non_finite_input(round_, grad)
        return on_result(round_, lambda gradient: self.guard.watch(name, gradient))

    def _begin_many(self, items):
        """Each gradient through ``_begin_exchange`` (its checks, state and finiteness watch),
        those that ``_batches`` groups compressed by their group's ``add``, each group's shared
        work done once all its members are in (``run``)."""
        batches = self._batches(items)
        rounds = [
            self._begin_exchange(name, grad, batches[name].add if name in batches else None) for name, grad in items
        ]
        for batch in {id(batch): batch for batch in batches.values()}.values():
            batch.run()
        return rounds

    def _batches(self, items):
        """{name: its group} for the gradients among ``items`` that a batched call compresses
        together; none by default. A group's ``add(name, grad)`` is called by
        ``_begin_exchange`` in place of ``_begin`` and returns the member's round (its payload
        memory set aside, filled by ``run``); ``run()`` is called once, after every ``add``."""
        return {}

    def _begin(self, name, grad):
        """The first round of the compressed exchange of ``grad``, parameter ``name``'s."""
        raise NotImplementedError

    def _compressed_bytes(self, shape: Shape, setting: Any) -> int:
        """Bytes ``_begin``'s rounds hand to collectives for a float32 gradient of ``shape`` at
        ``setting``, the non-finite marker left out (``Tuning.payload_bytes`` adds it)."""
        raise NotImplementedError

    def begin_uncompressed(self, name: str, grad: torch.Tensor) -> Round:
        """Sends ``grad`` plus its residual whole, in one all-reduce, and the residual becomes
        zero (GraVAC's scale-down to dense, line 23 of its Algorithm 1)."""
        self._remember_state(name)
        return on_result(self._dense_round_with_residual(name, grad), lambda gradient: self.guard.watch(name, gradient))

    def _dense_round_with_residual(self, name, grad):
        """A layer sent whole (a setting that does not compress it, or GraVAC's dense phase)
        takes what error feedback still holds for it along, once: a residual left behind would
        never reach the weights."""
        residual = self.residual(name, grad.device)
        if residual is None:
            return dense_round(grad)
        self.clear_residual(name)
        return dense_round(torch.add(grad, residual.view(grad.shape), alpha=self.loss_scale()).to(grad.dtype))

    def residual(self, name: str, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """``name``'s error-feedback residual (unscaled), or None; with ``device``, on it (a
        checkpoint loaded with ``map_location="cpu"`` resumes on the GPU)."""
        return None if self.feedback is None else self.feedback.residual(name, device)

    def clear_residual(self, name: str) -> None:
        if self.feedback is not None:
            self.feedback.clear(name)

    def next_payload_bytes(self, name: str, shape: Shape) -> int:
        return self.tuning.payload_bytes(shape, self.setting(name))

    def fixed_payload(self, shape: Shape) -> bool:
        return not self.tuning.tunable(shape)

    # ----- the step -----------------------------------------------------------------------
    def _remember_state(self, name):
        """Called first thing for every gradient of a step."""
        self.guard.remember(name, self.state)
        if self.feedback is not None:
            self.feedback.loss_scale = self.loss_scale()

    def reject_step(self) -> None:
        self.guard.reject()

    def _end_step(self, comm_seconds: Optional[float]) -> None:
        """Keeps the step's state updates if every aggregated gradient was finite; otherwise
        puts the state back as it was before the step (one host synchronisation per step)."""
        self.last_step_finite = self.guard.finish(self.state)
        if self.last_step_finite:
            if self.feedback is not None:
                self.feedback.commit()
        else:
            if self.feedback is not None:
                self.feedback.rollback()
            self.skipped_steps += 1
            logger.warning(
                "%s: non-finite gradient in this step on some rank; the step leaves "
                "no trace in the compression state (%d such steps so far)",
                type(self).__name__,
                self.skipped_steps,
            )
        self._step_scale = None
        self.traffic.end_step()

    def metrics(self) -> Dict[str, float]:
        """This process's numbers after the last step, as one flat dict of numbers (bytes sent,
        ratio, skipped non-finite steps; codec seconds where ``hvd_compress.metrics`` times
        them). Reads no tensor: free to call every step."""
        numbers = dict(self.traffic.metrics(), skipped_steps=self.skipped_steps)
        if self.config.compiled:  # graphs: this process's, for the kernels this class runs
            numbers.update(
                compiled=float(self.compiled_path.compiles),
                compiled_graphs=graphs(self.compiled_kernels),
                compile_seconds=self.compiled_path.seconds,
            )
        return numbers

    def describe(self) -> Dict[str, Any]:
        return {
            "compressor": type(self).__name__,
            "config": self.config.describe(),
            "settings": dict(sorted(self._overrides.items())),
        }

    def __getstate__(self):
        # Traffic counts this process's steps; a restored compressor starts counting afresh.
        state = super().__getstate__()
        state["traffic"] = Traffic(world_size=self.size)
        return state


def _marking_non_finite_input(round_, grad):
    """``round_`` carrying whether ``grad`` had a non-finite entry; its final gradient gets NaN
    added to its first entry where any rank's input had one (one element: no pass over it)."""
    received = []
    marked = carrying(round_, nonfinite_marker(grad).reshape(1), received.append)

    def mark(gradient):
        gradient[(0,) * gradient.dim()] += received[0][0].to(gradient.dtype)

    return on_result(marked, mark)


def dense_round(grad: torch.Tensor) -> Round:
    """All-reduce ``grad`` uncompressed (bf16 travels as float32: Horovod cannot sum bf16)."""
    dtype, shape = grad.dtype, grad.shape
    payload = grad if dtype in _ALLREDUCE_DTYPES else grad.float()
    return Round(payload.reshape(-1), Collective.ALLREDUCE, lambda mean: mean.view(shape).to(dtype), last=True)

"""The two contracts of this layer.

``GradientCompression``: what the integration layer (Horovod's stock optimizer, our wrapper,
the simulated world), the fusion planner and the metrics exporters use. A compressor, or a
controller wrapping one, turns each gradient into a chain of ``Round``s (pure tensor work, no
communication) and is told when a step ends. Drivers in ``comm/`` run the rounds. Beside the
exchange, it offers what the layers above need instead of its internals: ``wrapped`` (a
controller's compressor), ``add_observer``/``remove_observer`` (a ``StepObserver`` sees every
``begin`` and ``end_step``: how metrics time the codec), ``world_change_state`` (a state without
error feedback, or with this process's, for HSDP and elastic world changes),
``restart_from`` (a controller's compressor state alone: its schedule restarts) and
``reject_step`` (drop this step, found non-finite where the compression cannot see it: HSDP's
other replicate groups).

``Compressor``: a ``GradientCompression`` with per-parameter settings and state keyed by
parameter name, plus the **controller protocol**, the only way controllers (L-GreCo, GraVAC)
look inside a compressor:

=============================================  =================================================
``controllable``                               whether the protocol below is implemented
``setting_name``                               what a setting is ("rank", "k", "bits"), for logs
``config.default``                             the uniform setting (L-GreCo's budget)
``tunable(shape)``                             whether any setting compresses such a gradient
``compresses(shape, setting)``                 whether ``setting`` compresses it (else dense)
``check_value(value, label)``                  a user-facing value (a candidate, an Accordion
                                               setting) is valid, or ``ValueError``
``setting_for_value(shape, value)``            that value as a setting (Top-K: density -> k)
``resolve(shape, setting)``                    the concrete setting (Top-K: ``None`` -> its k)
``candidates(shape, default, values)``         the settings L-GreCo searches for one layer
``errors(gradient, settings)``                 compression error norms, one per setting
``payload_bytes(shape, setting)``              bytes handed to collectives per step
``setting_for_factor(shape, factor)``          the setting that compresses about ``factor``-fold
``kept_energies(name, x, settings, memo)``    ||C(x)||^2 for nested settings (GraVAC's gains)
``begin_measured(name, grad, settings, memo,   ``begin`` (or ``begin_uncompressed``) and, from the
uncompressed)``                                same work where it can, ||x||^2 and ``kept_energies``
``residual(name)`` / ``clear_residual(name)``  the error feedback waiting for ``name``
``begin_uncompressed(name, grad)``             send gradient plus residual whole, clear it
``last_step_finite``                           whether the last step was kept (see below)
``loss_scale()``                               the loss scale of this step's gradients (``track``)
``set_setting(name, value)``                   how a controller acts (``setting``/``settings`` read)
=============================================  =================================================

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
made from, whose largest magnitude bounds it (``_result_bounded_by``): a low-rank result is a
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
is made) to ``Compressor.__init__``, and implements ``_check_setting``, ``_begin`` and
``_compressed_bytes``; ``_new_state_from`` if it keeps per-parameter state in ``self.state``
(checkpoints rebuild it); the protocol, to be controllable. Error feedback comes from
``compressors.feedback.ErrorFeedback``. Nothing here knows Horovod: its Compression API is added,
where Horovod is installed, by ``registry.public_class``.
"""

import functools
import gc
import logging
import math
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Collective, Round, Traffic, carrying, on_result
from hvd_compress.compressors.config import CompressorConfig, check_checkpoint, checkpoint_header
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.maths import error_tables as error_maths
from hvd_compress.maths.compiled import Compilable, CompileFailed, graphs, timed_warm_up
from hvd_compress.compressors.rollback import StepGuard
from hvd_compress.maths.finite import nonfinite_marker

logger = logging.getLogger(__name__)

# Horovod's all-reduce sums these dtypes; anything else (bf16) travels as float32.
_ALLREDUCE_DTYPES = (torch.float16, torch.float32, torch.float64)

Shape = Tuple[int, ...]
NamedParameters = Optional[Iterable[Tuple[str, torch.Tensor]]]


class StepObserver:
    """Watches a compression's steps without changing what they compute
    (``GradientCompression.add_observer``): the metrics exporters (``hvd_compress.metrics``)
    time the codec and write each step's numbers through it. Both methods do nothing here."""

    def observe_begin(self, name: str, grad: torch.Tensor, begin: Callable[[], Round]) -> Round:
        """Around each gradient's ``begin``: calls ``begin()`` and returns its round, as it is or
        wrapped (``comm.rounds.on_result`` style) to see what its continuations do."""
        return begin()

    def step_ended(self, comm_seconds: Optional[float]) -> None:
        """After each ``end_step`` did its work (the state is final for the step)."""


class GradientCompression:
    """What runs a gradient exchange: ``begin`` per gradient, ``end_step`` per step.

    Attributes the integration reads: ``parameters`` ({name: parameter}, may be empty),
    ``needs_parameter_names``, ``times_communication``, ``traffic`` (a ``Traffic``), ``rank``
    and ``size``. Subclasses implement ``_begin_exchange`` and ``_end_step``: ``begin`` and
    ``end_step`` add what observers see."""

    needs_parameter_names = True
    # Whether end_step uses comm_seconds; on a GPU the integration then waits for the device
    # before reading the clock, once per step (comm/timing.py).
    times_communication = False
    parameters: Dict[str, torch.nn.Parameter]
    traffic: Traffic
    # Replaced, never mutated, on change; left out of copies and pickles (__getstate__).
    _observers: Tuple[StepObserver, ...] = ()
    #: Whether one object may serve several optimizers or models at once (``serve``): only a
    #: compression that keeps nothing between steps and sends the same whatever world it is bound
    #: to (FP16, NoCompression), as Horovod's own compressors, which users share. Not BF16: its
    #: chunks follow the size of the world it was bound to last.
    shareable = False
    # (weak reference to the owner, what it is) once an integration serves it; left out of
    # copies and pickles, so that a copy is free to serve another.
    _owner: Optional[Tuple[Any, str]] = None

    @property
    def wrapped(self) -> Optional["GradientCompression"]:
        """The compressor a controller wraps (and whose settings it owns); None for a compressor."""
        return None

    def bind_world(self, rank: int, size: int) -> None:
        """This process's rank and the world size; called before the first ``begin``."""
        raise NotImplementedError

    def adopt_parameters(self, named: Dict[str, torch.nn.Parameter]) -> None:
        """Takes ``named`` ({name: parameter}) as its parameters when it was built without
        ``named_parameters``: stock ``hvd.DistributedOptimizer`` passes the names it uses."""
        raise NotImplementedError

    def use_shards(self, local: Dict[str, torch.Tensor]) -> None:
        """Under FSDP each rank compresses its own shard of each parameter: ``local`` ({name:
        this rank's shard}) replaces the whole parameters it was built with, under the same
        names, and their settings are checked against the shards."""
        raise NotImplementedError

    def write_results_into_gradients(self) -> None:
        """Said by an integration that replaces each gradient with its exchange's result (every
        one does: stock Horovod's optimizer, hvd_compress's, DDP, FSDP and DiLoCo; ``Binding``):
        from then on a result may be made in its gradient's memory, which its exchange has
        finished reading by then, as Horovod's all-reduce and torch's DDP hooks do. A fresh
        gradient-sized result per layer costs a CPU its first-touch page faults, more than its
        writes (docs/benchmarks/codec-cost.md), and a GPU a second gradient at the step's
        peak. Not said (``hvd.allreduce(tensor, compression=...)``, tests), results are new
        tensors and gradients stay as they were."""
        raise NotImplementedError

    def serve(self, owner: Any, role: str, argument: str = "compression") -> None:
        """Records that ``owner`` (an optimizer, a DDP hook's or an HSDP model's state, a
        ``DiLoCo``: any object a weak reference can point to) drives the steps of this
        compression and of a controller's wrapped compressor. ``role`` says what ``owner`` is
        and ``argument`` which of its arguments took this object, for the error. An owner that
        is garbage-collected frees it.

        Raises ``ValueError`` (nothing recorded) where another owner that is still alive already
        serves it, or its wrapped compressor, unless ``shareable``: its per-parameter state, its
        non-finite rollback and a controller's schedule all count the steps of one owner, and
        two owners step at different times. Serving the same owner again does nothing."""
        chain = []
        compression: Optional[GradientCompression] = self
        while compression is not None:
            chain.append(compression)
            compression = compression.wrapped
        for compression in chain:
            compression._check_free_for(owner, role, argument)
        for compression in chain:
            if not compression.shareable:
                compression._owner = (weakref.ref(owner), role)

    def _owner_is_gone_or(self, owner):
        current = self._owner[0]()
        return current is None or current is owner

    def _check_free_for(self, owner, role, argument):
        if self.shareable or self._owner is None:
            return
        if not self._owner_is_gone_or(owner):
            gc.collect()  # a dropped owner in a reference cycle frees the compression only here
        if self._owner_is_gone_or(owner):
            return
        cls = type(self).__name__
        raise ValueError(
            f"{argument}: this {cls} object already serves {self._owner[1]} and cannot also serve "
            f"{role}. One compressor or controller serves one optimizer or model: its "
            f"per-parameter state (error feedback, warm starts, settings), its step and a "
            f"controller's schedule are one owner's, and two owners step at different times. "
            f"Build one per optimizer or model, or give the other a copy: "
            f"{argument}=copy.deepcopy({argument}). "
            f"(FP16 and NoCompression keep no state and may be shared.)"
        )

    def use_process_set(self, process_set: Any) -> None:
        """The ranks the exchange runs among, as the integration names them (a Horovod
        ``ProcessSet``), for whatever talks to other ranks outside the rounds (L-GreCo's decision
        service). Compressors need nothing but ``bind_world``."""

    def prepare_compiled(self, shapes: Optional[Dict[str, Shape]] = None) -> bool:
        """Compiles the kernels the compression runs compiled (``compiled=True`` in its
        configuration) on the gradients' ``shapes`` ({name: shape}; None: its parameters'),
        before the first collective, so that no rank compiles while the others wait in one;
        returns whether they compiled (True where none are asked for). The binding calls it
        before the cross-rank configuration check, and hands every rank's answer to
        ``use_compiled``."""
        return True

    def use_compiled(self, ready: Sequence[bool]) -> None:
        """Every rank's ``prepare_compiled`` answer, in rank order: where any is False, every
        rank runs its kernels eagerly from now on (one log line), so that all round alike."""

    def begin(self, name: str, grad: torch.Tensor) -> Round:
        """Starts the exchange of ``grad``, the gradient of parameter ``name``."""
        if not self._observers:  # unobserved: nothing in the way
            return self._begin_exchange(name, grad)
        begin = functools.partial(self._begin_exchange, name, grad)
        for observer in self._observers:
            begin = functools.partial(observer.observe_begin, name, grad, begin)
        return begin()

    def _begin_exchange(self, name: str, grad: torch.Tensor) -> Round:
        """``begin``'s work: the first round of ``grad``'s exchange."""
        raise NotImplementedError

    #: Whether ``begin_many`` does better than one ``begin`` per gradient (same-shape layers in
    #: one batched call): the integrations then begin a fusion bucket's gradients together, when
    #: its last one is ready (``RoundDriver.hold``), instead of each as it is ready.
    batches_layers = False

    def begin_many(self, items: Sequence[Tuple[str, torch.Tensor]]) -> List[Round]:
        """``begin`` of each (name, gradient) of ``items``, in order, their first rounds in a list;
        a compression that ``batches_layers`` works on same-shape ones together. Observers see
        each ``begin`` as it is: with any, the gradients are begun one at a time."""
        if self._observers:
            return [self.begin(name, grad) for name, grad in items]
        return self._begin_many(items)

    def _begin_many(self, items: Sequence[Tuple[str, torch.Tensor]]) -> List[Round]:
        """``begin_many``'s work: one ``_begin_exchange`` each, unless a subclass batches."""
        return [self._begin_exchange(name, grad) for name, grad in items]

    def reject_step(self) -> None:
        """The integration found this step non-finite where the compression cannot see it (under
        HSDP, another replicate group's shards): ``end_step`` drops the step as if one of its
        aggregates were non-finite. Called before ``end_step``, on every rank."""
        raise NotImplementedError

    def end_step(self, comm_seconds: Optional[float] = None) -> None:
        """Called once per optimizer step after every gradient landed; ``comm_seconds``: how
        long the step waited for communication, where measured."""
        self._end_step(comm_seconds)
        for observer in self._observers:
            observer.step_ended(comm_seconds)

    def _end_step(self, comm_seconds: Optional[float]) -> None:
        """``end_step``'s work."""
        raise NotImplementedError

    def add_observer(self, observer: StepObserver) -> None:
        """``observer`` sees every ``begin`` and ``end_step`` from now on, in this process only:
        a copy, a pickled or a checkpointed compression has no observers."""
        if any(seen is observer for seen in self._observers):
            raise ValueError(f"{type(self).__name__}.add_observer: {type(observer).__name__} already observes it")
        self._observers = self._observers + (observer,)

    def remove_observer(self, observer: StepObserver) -> None:
        self._observers = tuple(seen for seen in self._observers if seen is not observer)

    def setting(self, name: str) -> Any:
        raise NotImplementedError

    def next_payload_bytes(self, name: str, shape: Shape) -> int:
        """Bytes of the first round ``name``'s gradient sends at the next step: what a fusion
        bucket holds (``comm.fusion``)."""
        raise NotImplementedError

    def schedule_phase(self) -> str:
        """A label for steps whose payloads differ by phase (ACP-SGD: "P" or "Q"), else ""."""
        return ""

    def fixed_payload(self, shape: Shape) -> bool:
        """Whether a gradient of ``shape`` travels in one all-reduce of a payload of its own
        shape at every step, whatever the settings or phase. Only such a payload rides
        Horovod's own all-reduce under the parameter's name, so that Horovod's response cache
        never sees a name change shape (DEVELOPERS.md)."""
        raise NotImplementedError

    def decision_records(self, after_version: int) -> List[Dict[str, Any]]:
        """A controller's decisions newer than ``after_version``, one dict each with its
        ``version`` and what it saw and chose (metrics exporters write them); none by default."""
        return []

    def track(self, scaler: Any) -> "GradientCompression":
        """Follows the loss scale of ``scaler`` (a ``torch.amp.GradScaler``); returns ``self``."""
        raise NotImplementedError

    def describe(self) -> Dict[str, Any]:
        """Everything that must agree on every rank (checked when training starts)."""
        raise NotImplementedError

    # ----- checkpoints and world changes -------------------------------------------------
    #: What error feedback does when the world changes under elastic training
    #: (``hvd_compress.elastic``): "keep" (each surviving process keeps its own residuals, a
    #: joining one starts from zero) or "reset" (every rank starts from zero, as DeepSpeed does).
    feedback_on_world_change = "keep"

    def state_dict(self) -> Dict[str, Any]:
        """This process's state: what every rank holds alike (settings, warm starts, schedules)
        and this rank's own error feedback ("residuals"; a controller nests the wrapped
        compressor's state under "inner")."""
        raise NotImplementedError

    def elastic_state_dict(self) -> Dict[str, Any]:
        """What an elastic commit saves: ``state_dict``, but never waiting (L-GreCo leaves a
        decision in flight out)."""
        return self.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError

    def world_change_state(
        self,
        state_dict: Dict[str, Any],
        *,
        own: Optional[Dict[str, Any]] = None,
        rank: Optional[int] = None,
        size: Optional[int] = None,
    ) -> Dict[str, Any]:
        """``state_dict`` (this compression's, maybe taken by another process) as a world change
        loads it: with no error feedback, or with that of ``own`` (a state this process took),
        and with ``rank`` and ``size`` (both or neither), recorded as taken there, so that
        ``load_state_dict`` keeps the feedback. HSDP and the elastic handlers call this rather
        than edit a layout that is the compression's own."""
        raise NotImplementedError

    def restart_from(self, state_dict: Dict[str, Any], forget: Iterable[str] = ()) -> None:
        """Loads the compressor state of ``state_dict`` (a controller's: its wrapped
        compressor's, per-layer settings included) without the per-parameter state of
        ``forget`` (its shapes, warm starts, error feedback: shards whose shape changed). A
        controller's schedule and statistics are per shard and are not loaded: they restart
        from where this object's stand, a new controller's start when it was just built."""
        raise NotImplementedError

    def __getstate__(self):
        # Observers belong to this process (an exporter's open file), the owner to one
        # integration: copies start unobserved and free to serve another.
        state = dict(self.__dict__)
        state.pop("_observers", None)
        state.pop("_owner", None)
        return state


class Compressor(GradientCompression):
    """Base class of compressors; see the module docstring for the contracts.

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

    def __init__(self, named_parameters: NamedParameters, config: CompressorConfig):
        # Configuration: fixed at construction, agreed by every rank, recorded in checkpoints.
        self.config = config
        self.parameters = (
            {} if named_parameters is None else arguments.named_parameters(type(self).__name__, named_parameters)
        )
        self._check_setting(None, config.default, None)
        # State: what a checkpoint holds, and what a non-finite step leaves as it was.
        self._overrides: Dict[str, Any] = {}
        self.state: Dict[str, Any] = {}
        self._shapes: Dict[str, Shape] = {}  # every gradient seen (or checkpointed), by name
        self.skipped_steps = 0  # non-finite steps, which left no trace in the state
        # Binding, by the integration: the world (bind_world), the loss scale (track) and
        # where results go (write_results_into_gradients).
        self.rank, self.size = 0, 1
        self._bound = False
        self._results_into_gradients = False
        self._expected_world: Optional[Tuple[int, int]] = None  # from a loaded checkpoint
        self._scaler = None
        self.traffic = Traffic()
        # Per-step scratch, emptied by end_step.
        self.last_step_finite = True
        self._guard = StepGuard()  # the non-finite rule (compressors.rollback)
        self._step_scale: Optional[float] = None
        # The compiled path: asked for, and not given up (use_compiled, a failed compile).
        self.compiles = config.compiled and bool(self.compiled_kernels)
        self.compile_seconds = 0.0  # spent in prepare_compiled
        self._compile_error: Optional[str] = None

    # ----- settings, addressable by parameter name ---------------------------------------
    def setting(self, name: str) -> Any:
        return self._overrides.get(name, self.config.default)

    def set_setting(self, name: str, value: Any) -> None:
        """Changes one parameter's setting from the next step on. Controllers call this on
        every rank at the same step; a rank-only change makes payload shapes disagree."""
        param = self.parameters.get(name)
        self._check_setting(name, value, None if param is None else param.numel())
        self._overrides[name] = value

    def settings(self) -> Dict[str, Any]:
        """{name: setting} for every known parameter."""
        return {name: self.setting(name) for name in self.parameters}

    def _check_setting(self, name, value, numel):
        raise NotImplementedError

    def adopt_parameters(self, named: Dict[str, torch.nn.Parameter]) -> None:
        if self.parameters:
            raise ValueError(f"{type(self).__name__}: already has its named_parameters")
        for name, shape in sorted(self._shapes.items()):
            param = named.get(name)
            if param is None:
                raise self._error(
                    name,
                    f"is not among the optimizer's parameter names "
                    f"{sorted(named)[:8]}{'...' if len(named) > 8 else ''} (a "
                    f"checkpoint or gradient under another name)",
                )
            if tuple(param.shape) != shape:
                raise self._error(
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
                self._check_setting(name, value, local[name].numel())
        self.parameters.update({name: local[name] for name in self.parameters})  # a controller shares it

    def _error(self, name, message):
        where = f"parameter {name!r}: " if name is not None else ""
        return ValueError(f"{type(self).__name__}: {where}{message}")

    # ----- the exchange -------------------------------------------------------------------
    def bind_world(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.traffic.world_size = size
        self._bound = True
        if self._expected_world is not None:
            self._check_world(self._expected_world)
            self._expected_world = None

    def write_results_into_gradients(self) -> None:
        self._results_into_gradients = True

    # ----- the compiled path (config.compiled) -------------------------------------------
    def prepare_compiled(self, shapes: Optional[Dict[str, Shape]] = None) -> bool:
        if not self.compiles:
            return True
        # Parameters know their device; gradients of given shapes are taken to be on the CPU.
        devices = {name: param.device for name, param in self.parameters.items()}
        if shapes is None:
            shapes = {name: tuple(param.shape) for name, param in self.parameters.items()}
        layers = {
            (math.prod(shape), self.setting(name), devices.get(name, torch.device("cpu")))
            for name, shape in shapes.items()
            if self.compresses(shape, self.setting(name))
        }

        def warm():
            for numel, setting, device in sorted(layers, key=str):
                self._warm_up(numel, setting, device)

        seconds, self._compile_error = timed_warm_up(warm)
        self.compile_seconds += seconds
        if self._compile_error is None:
            logger.info(
                "%s: compiled kernels ready for %d layer sizes in %.1f s (%d graphs)",
                type(self).__name__,
                len(layers),
                seconds,
                graphs(self.compiled_kernels),
            )
        return self._compile_error is None

    def _warm_up(self, numel: int, setting: Any, device: torch.device) -> None:
        """Runs each compiled kernel once on a flat gradient of ``numel`` entries at ``setting``,
        touching no state (``prepare_compiled``)."""
        raise NotImplementedError

    def use_compiled(self, ready: Sequence[bool]) -> None:
        if self.compiles and not all(ready):
            self._fall_back(
                f"torch.compile failed on rank(s) {[r for r, ok in enumerate(ready) if not ok]}"
                + (f" (here: {self._compile_error})" if self._compile_error else "")
            )

    def _fall_back(self, reason: str) -> None:
        self.compiles = False
        logger.warning("%s: compiled=True, but %s; its kernels run eagerly from now on", type(self).__name__, reason)

    def _compiled_or_eager(self, run: Callable[[bool], Any]) -> Any:
        """``run(compiled)`` on the path in force. A compile that fails here, outside
        ``prepare_compiled`` (an unbound compressor, a layer it did not know), falls back to eager
        in this process alone: bound ones compile every layer ahead, where all ranks agree."""
        if self.compiles:
            try:
                return run(True)
            except CompileFailed as error:
                self._fall_back(str(error.__cause__ or error))
        return run(False)

    def _result_memory(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """``grad``'s memory, flat, for its exchange's result where the integration said so
        (``write_results_into_gradients``) and it holds float32 contiguously; else None (the
        result is a new tensor)."""
        if self._results_into_gradients and grad.dtype == torch.float32 and grad.is_contiguous():
            return grad.view(-1)
        return None

    def _typed_result(self, grad: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` (``grad``'s entries in any float dtype) as ``grad``'s result: cast into
        ``_result_memory`` where there is one, else a new tensor of ``grad``'s dtype and shape."""
        into = self._result_memory(grad)
        if into is None:
            return value.reshape(grad.shape).to(grad.dtype)
        return into.copy_(value.reshape(-1)).view(grad.shape)

    def _zeroed_result(self, grad: torch.Tensor) -> torch.Tensor:
        """A flat float32 zero result for ``grad``'s exchange to scatter into: ``_result_memory``
        zeroed where there is one, else a new tensor."""
        into = self._result_memory(grad)
        return torch.zeros(grad.numel(), device=grad.device) if into is None else into.zero_()

    def _begin_exchange(self, name: str, grad: torch.Tensor) -> Round:
        return self._begin_with(name, grad, self._begin)

    def _begin_many(self, items):
        """Each gradient through ``_begin_with`` (its checks, state and finiteness watch), those that
        ``_batches`` groups compressed by their group's ``add``, each group's shared work done once
        all its members are in (``run``)."""
        batches = self._batches(items)
        rounds = [
            self._begin_with(name, grad, batches[name].add if name in batches else self._begin) for name, grad in items
        ]
        for batch in {id(batch): batch for batch in batches.values()}.values():
            batch.run()
        return rounds

    def _batches(self, items):
        """{name: its group} for the gradients among ``items`` that a batched call compresses
        together; none by default. A group's ``add(name, grad)`` is called by ``_begin_with`` in
        place of ``_begin`` and returns the member's round (its payload memory set aside, filled
        by ``run``); ``run()`` is called once, after every ``add``."""
        return {}

    def _begin_with(self, name, grad, compress):
        """``begin``, with ``compress`` (``_begin`` or a measuring one) making compressed rounds."""
        if not grad.dtype.is_floating_point:
            raise TypeError(
                f"{type(self).__name__}: parameter {name!r}: gradient has dtype "
                f"{grad.dtype}; only floating-point gradients can be compressed"
            )
        self._state_to_device(name, grad.device)
        self._remember_state(name)
        shape = tuple(grad.shape)
        known = self._shapes.setdefault(name, shape) if name is not None else shape  # None: no names
        if known != shape:
            raise self._error(name, f"gradient has shape {shape}, but {known} before (or in the loaded checkpoint)")
        setting = self.setting(name)
        if not self.compresses(grad.shape, setting):
            round_ = self._dense_round_with_residual(name, grad)
        else:
            self._check_setting(name, setting, grad.numel())
            round_ = compress(name, grad)
            if not self.payload_carries_input:
                round_ = _marking_non_finite_input(round_, grad)
        return on_result(round_, functools.partial(self._watch_finite, name))

    def _begin(self, name, grad):
        raise NotImplementedError

    def begin_measured(
        self, name: str, grad: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any], uncompressed: bool = False
    ) -> Tuple[Round, torch.Tensor]:
        """``begin(name, grad)`` (``begin_uncompressed`` if ``uncompressed``) and GraVAC's
        energies of x = gradient plus residual: a float64 tensor on the gradient's device,
        [||x||^2, then ``kept_energies(name, x, settings, memo)``], made without waiting for the
        device. A compressor whose compression already selects or projects x at one of
        ``settings`` derives them from that work (``_begin_measured``); otherwise, and for
        gradients sent dense, they are measured apart (``measured_energies``)."""
        if uncompressed or not self.compresses(grad.shape, self.setting(name)):
            energies = self.measured_energies(name, grad, settings, memo)
            return (self.begin_uncompressed(name, grad) if uncompressed else self.begin(name, grad)), energies
        found = []

        def compress(name, grad):
            round_, energies = self._begin_measured(name, grad, settings, memo)
            found.append(energies)
            return round_

        return self._begin_with(name, grad, compress), found[0]

    def _begin_measured(self, name, grad, settings, memo):
        """(``_begin``'s round, ``begin_measured``'s energies); by default measured apart."""
        return self._begin(name, grad), self.measured_energies(name, grad, settings, memo)

    def measured_energies(
        self, name: str, grad: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any]
    ) -> torch.Tensor:
        """``begin_measured``'s energies measured on their own: x is built apart from the
        compression's, in float32 whatever the gradient's dtype (float16 energies overflow),
        with the residual in the gradient's units (``track``)."""
        x = grad.detach().float()
        residual = self.residual(name, grad.device)
        if residual is not None:
            x = torch.add(x, residual.view(grad.shape), alpha=self.loss_scale())
        return torch.cat([error_maths.squared_norm(x.reshape(-1)), self.kept_energies(name, x, settings, memo)])

    def begin_uncompressed(self, name: str, grad: torch.Tensor) -> Round:
        """Sends ``grad`` plus its residual whole, in one all-reduce, and the residual becomes
        zero (GraVAC's scale-down to dense, line 23 of its Algorithm 1)."""
        self._remember_state(name)
        return on_result(self._dense_round_with_residual(name, grad), functools.partial(self._watch_finite, name))

    def _dense_round_with_residual(self, name, grad):
        """A layer sent whole (a setting that does not compress it, or GraVAC's dense phase)
        takes what error feedback still holds for it along, once: a residual left behind would
        never reach the weights."""
        residual = self.residual(name, grad.device)
        if residual is None:
            return dense_round(grad)
        self.clear_residual(name)
        return dense_round(torch.add(grad, residual.view(grad.shape), alpha=self.loss_scale()).to(grad.dtype))

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

    def _state_to_device(self, name, device):
        """Per-parameter state loaded from a checkpoint mapped to another device
        (``map_location="cpu"``) moves to the gradient's, once (error feedback moves itself)."""
        st = self.state.get(name)
        for key, value in ({} if st is None else vars(st)).items():
            if torch.is_tensor(value) and value.device != device:
                setattr(st, key, value.to(device))

    def _remember_state(self, name):
        """Called first thing for every gradient of a step."""
        self._guard.remember(name, self.state)
        if self.feedback is not None:
            self.feedback.loss_scale = self.loss_scale()

    def reject_step(self) -> None:
        self._guard.reject()

    def _watch_finite(self, name, gradient):
        """Every aggregated gradient returned, for the step's verdict (``StepGuard.watch``)."""
        self._guard.watch(name, gradient)

    def _result_bounded_by(self, name: Optional[str], aggregate: torch.Tensor, growth: float) -> None:
        """Said by a final continuation: ``name``'s result is at most ``growth`` times the largest
        magnitude of ``aggregate`` (``StepGuard.bound_by``)."""
        self._guard.bound_by(name, aggregate, growth)

    def _end_step(self, comm_seconds: Optional[float]) -> None:
        """Keeps the step's state updates if every aggregated gradient was finite; otherwise
        puts the state back as it was before the step (one host synchronisation per step)."""
        self.last_step_finite = self._guard.finish(self.state)
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

    def tunable(self, shape: Sequence[int]) -> bool:
        """Whether some setting compresses a gradient of ``shape``: 1-D gradients (biases,
        norms), those under ``min_numel`` and empty ones (nothing to compress) are a tiny share
        of the bytes, and go dense."""
        return len(shape) >= 2 and math.prod(shape) >= max(self.config.min_numel, 1)

    def fixed_payload(self, shape: Shape) -> bool:
        return not self.tunable(shape)

    def compresses(self, shape: Sequence[int], setting: Any) -> bool:
        """Whether a gradient of ``shape`` is compressed at ``setting`` (else sent dense)."""
        return self.tunable(shape) and self._worth_compressing(shape, setting)

    def _worth_compressing(self, shape, setting):
        return True

    def payload_bytes(self, shape: Sequence[int], setting: Any) -> int:
        """Bytes handed to collectives per step for a float32 gradient of ``shape`` at
        ``setting``: what L-GreCo's size table counts (indices and norms included)."""
        if not self.compresses(shape, setting):
            return 4 * math.prod(shape)
        return self._compressed_bytes(shape, setting) + (0 if self.payload_carries_input else MARKER_BYTES)

    def _compressed_bytes(self, shape, setting):
        raise NotImplementedError

    def next_payload_bytes(self, name: str, shape: Shape) -> int:
        return self.payload_bytes(shape, self.setting(name))

    # ----- the controller protocol (see the module docstring) -----------------------------
    def _not_controllable(self):
        return NotImplementedError(f"{type(self).__name__} has no per-parameter setting that a controller can tune")

    def check_value(self, value: Any, label: str) -> None:
        raise self._not_controllable()

    def setting_for_value(self, shape: Sequence[int], value: Any) -> Any:
        return value

    def resolve(self, shape: Sequence[int], setting: Any) -> Any:
        return setting

    def candidates(self, shape: Sequence[int], default: Any, values: Optional[Sequence[Any]] = None) -> List[Any]:
        raise self._not_controllable()

    def errors(self, gradient: torch.Tensor, settings: Sequence[Any]) -> torch.Tensor:
        """The compression error (L2 norm, no error feedback) of ``gradient`` at each of
        ``settings``, as a float64 tensor on its device, read by nothing on the host."""
        raise self._not_controllable()

    def errors_of_layers(self, layers: Dict[str, Tuple[torch.Tensor, Sequence[Any]]]) -> Dict[str, torch.Tensor]:
        """``errors`` of every layer of a decision, {name: (gradient, settings)}: one call per
        layer here; compressors whose rows batch over layers of one shape override it."""
        return {name: self.errors(gradient, settings) for name, (gradient, settings) in layers.items()}

    def setting_for_factor(self, shape: Sequence[int], factor: float) -> Any:
        raise self._not_controllable()

    def kept_energies(self, name: str, x: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any]) -> torch.Tensor:
        """||C(x)||^2 of ``x`` (gradient plus residual, shaped like the gradient) for each of
        ``settings``, nested from the least to the most compressed, as a float64 tensor on
        ``x``'s device, computed without waiting for the device (called per layer and step).
        ``memo``: the caller's per-parameter scratch space, kept between calls (warm starts)."""
        raise self._not_controllable()

    def residual(self, name: str, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """``name``'s error-feedback residual (unscaled), or None; with ``device``, on it (a
        checkpoint loaded with ``map_location="cpu"`` resumes on the GPU)."""
        return None if self.feedback is None else self.feedback.residual(name, device)

    def clear_residual(self, name: str) -> None:
        if self.feedback is not None:
            self.feedback.clear(name)

    def metrics(self) -> Dict[str, float]:
        """This process's numbers after the last step, as one flat dict of numbers (bytes sent,
        ratio, skipped non-finite steps; codec seconds where ``hvd_compress.metrics`` times
        them). Reads no tensor: free to call every step."""
        numbers = dict(self.traffic.metrics(), skipped_steps=self.skipped_steps)
        if self.config.compiled:  # graphs: this process's, for the kernels this class runs
            numbers.update(
                compiled=float(self.compiles),
                compiled_graphs=graphs(self.compiled_kernels),
                compile_seconds=self.compile_seconds,
            )
        return numbers

    # ----- configuration, checkpointing -------------------------------------------------------
    def describe(self) -> Dict[str, Any]:
        return {
            "compressor": type(self).__name__,
            "config": self.config.describe(),
            "settings": dict(sorted(self._overrides.items())),
        }

    def state_dict(self) -> Dict[str, Any]:
        """Everything that determines future outputs, with what it was taken from (the class,
        configuration, parameter shapes, and this process's rank and world size: error feedback
        is per rank, and a checkpoint loaded on another rank or world size starts it from zero).
        Tensors are copied, since state is updated in place. Only tensors, numbers,
        strings, lists and dicts: ``torch.load(path, weights_only=True)`` reads it."""
        residuals = {} if self.feedback is None else self.feedback.state_dict()
        return {
            **checkpoint_header(type(self).__name__, self.config),
            "rank": self.rank,
            "world_size": self.size,
            "shapes": {name: list(shape) for name, shape in sorted(self._shapes.items())},
            "settings": dict(self._overrides),
            "state": {
                name: {key: value.clone() if torch.is_tensor(value) else value for key, value in vars(st).items()}
                for name, st in self.state.items()
            },
            "residuals": residuals,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a ``state_dict``. Everything is checked before anything changes: a mismatch
        (class, configuration, a parameter's shape, a setting out of range) raises one
        ``ValueError`` naming it, and leaves this object as it was. Taken on another rank or
        world size (checked once the rank is known), all but the error feedback is restored."""
        cls = type(self).__name__
        check_checkpoint(
            cls,
            state_dict,
            ("rank", "world_size", "shapes", "settings", "state", "residuals", "skipped_steps"),
            self.config,
        )
        shapes = {name: tuple(shape) for name, shape in state_dict["shapes"].items()}
        for name, shape in shapes.items():
            param = self.parameters.get(name)
            if self.parameters and param is None:
                raise self._error(name, "is in the checkpoint but is not one of the named_parameters")
            if param is not None and tuple(param.shape) != shape:
                raise self._error(name, f"has shape {tuple(param.shape)} here but {shape} in the checkpoint")
            seen = self._shapes.get(name)
            if param is None and seen is not None and seen != shape:
                raise self._error(name, f"had gradients of shape {seen} here but {shape} in the checkpoint")
        for name, value in state_dict["settings"].items():
            shape = shapes.get(name) or (tuple(self.parameters[name].shape) if name in self.parameters else None)
            self._check_setting(name, value, None if shape is None else math.prod(shape))
        for name, residual in state_dict["residuals"].items():
            if self.feedback is None or name not in shapes or residual.numel() != math.prod(shapes[name]):
                raise self._error(name, "the checkpoint's error feedback does not fit this compressor")
        try:
            state = {
                name: self._new_state_from(
                    {key: value.clone() if torch.is_tensor(value) else value for key, value in values.items()}
                )
                for name, values in state_dict["state"].items()
            }
        except TypeError as error:
            raise ValueError(
                f"{cls}.load_state_dict: the checkpoint's per-parameter state does not fit {cls}: {error}"
            ) from None
        # Checked: now change everything, a step cut off midway (elastic restore) included.
        self._guard, self._step_scale = StepGuard(), None
        self._overrides = dict(state_dict["settings"])
        self.state = state
        self._shapes = dict(shapes)
        if self.feedback is not None:
            self.feedback.load_state_dict(state_dict["residuals"])
        self.skipped_steps = state_dict["skipped_steps"]
        expected_world = (state_dict["rank"], state_dict["world_size"])
        if self._bound:
            self._check_world(expected_world)
        else:  # checked when the integration binds it
            self._expected_world = expected_world

    def world_change_state(
        self,
        state_dict: Dict[str, Any],
        *,
        own: Optional[Dict[str, Any]] = None,
        rank: Optional[int] = None,
        size: Optional[int] = None,
    ) -> Dict[str, Any]:
        changed: Dict[str, Any] = {"residuals": {} if own is None else own["residuals"]}
        if rank is not None:
            changed.update(rank=rank, world_size=size)
        return dict(state_dict, **changed)

    def restart_from(self, state_dict: Dict[str, Any], forget: Iterable[str] = ()) -> None:
        forget = set(forget)
        self.load_state_dict(
            dict(
                state_dict,
                **{
                    key: {name: value for name, value in state_dict[key].items() if name not in forget}
                    for key in ("shapes", "state", "residuals")
                },
            )
        )

    def _check_world(self, expected):
        """Error feedback is per rank: a checkpoint from another rank, or another world size,
        brings everything but it (the residuals start from zero, as after a reset)."""
        rank, size = expected
        if (rank, size) != (self.rank, self.size) and self.feedback is not None:
            logger.warning(
                "%s: the checkpoint was taken on rank %d of %d, but this is rank %d "
                "of %d; its error feedback is not this rank's and starts from zero",
                type(self).__name__,
                rank,
                size,
                self.rank,
                self.size,
            )
            self.feedback.load_state_dict({})

    def _new_state_from(self, values):
        raise NotImplementedError

    def __getstate__(self):
        # Traffic counts this process's steps; a restored compressor starts counting afresh.
        state = super().__getstate__()
        state["traffic"] = Traffic(world_size=self.size)
        return state


# The float32 marker of a compressed gradient's input (see the module docstring).
MARKER_BYTES = 4


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


def check_positive_int(compressor, name, label, value, upper=None):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise compressor._error(name, f"{label} must be a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise compressor._error(name, f"{label}={value} is outside (0, {upper}]")


def check_candidate(compressor, value, label, ok, kind):
    """Raises ValueError naming ``label`` unless ``ok``: a controller's value for ``compressor``."""
    if not ok:
        raise ValueError(f"{label} must be {kind} for {type(compressor).__name__}, got {value!r}")

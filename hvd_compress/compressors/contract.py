"""The contract an integration sees: ``GradientCompression``, and the ``StepObserver`` that
watches one.

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

What a compressor adds for controllers is in ``compressors.base`` (``Compressor``) and
``compressors.tuning``; nothing here knows Horovod.
"""

import functools
import gc
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from hvd_compress.comm.rounds import Round, Traffic

Shape = Tuple[int, ...]


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
            _check_free_for(compression, owner, role, argument)
        for compression in chain:
            if not compression.shareable:
                compression._owner = (weakref.ref(owner), role)

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
    #: What takes a compressor's checkpoints (``compressors.checkpoint.Checkpoint``, made for
    #: each call from the compressor it serves); controllers override the methods below instead.
    checkpoint_class: Optional[Callable[["GradientCompression"], Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        """This process's state: what every rank holds alike (settings, warm starts, schedules)
        and this rank's own error feedback ("residuals"; a controller nests the wrapped
        compressor's state under "inner")."""
        return self.checkpoint_class(self).state_dict()

    def elastic_state_dict(self) -> Dict[str, Any]:
        """What an elastic commit saves: ``state_dict``, but never waiting (L-GreCo leaves a
        decision in flight out)."""
        return self.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a ``state_dict``; raises ``ValueError`` naming what does not fit, before
        anything changes."""
        self.checkpoint_class(self).load_state_dict(state_dict)

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
        return self.checkpoint_class(self).world_change_state(state_dict, own=own, rank=rank, size=size)

    def restart_from(self, state_dict: Dict[str, Any], forget: Iterable[str] = ()) -> None:
        """Loads the compressor state of ``state_dict`` (a controller's: its wrapped
        compressor's, per-layer settings included) without the per-parameter state of
        ``forget`` (its shapes, warm starts, error feedback: shards whose shape changed). A
        controller's schedule and statistics are per shard and are not loaded: they restart
        from where this object's stand, a new controller's start when it was just built."""
        self.checkpoint_class(self).restart_from(state_dict, forget)

    def __getstate__(self):
        # Observers belong to this process (an exporter's open file), the owner to one
        # integration: copies start unobserved and free to serve another.
        state = dict(self.__dict__)
        state.pop("_observers", None)
        state.pop("_owner", None)
        return state


def _owner_is_gone_or(compression, owner):
    current = compression._owner[0]()
    return current is None or current is owner


def _check_free_for(compression, owner, role, argument):
    """``serve``'s check of one compression of the chain (see there)."""
    if compression.shareable or compression._owner is None:
        return
    if not _owner_is_gone_or(compression, owner):
        gc.collect()  # a dropped owner in a reference cycle frees the compression only here
    if _owner_is_gone_or(compression, owner):
        return
    cls = type(compression).__name__
    raise ValueError(
        f"{argument}: this {cls} object already serves {compression._owner[1]} and cannot also serve "
        f"{role}. One compressor or controller serves one optimizer or model: its "
        f"per-parameter state (error feedback, warm starts, settings), its step and a "
        f"controller's schedule are one owner's, and two owners step at different times. "
        f"Build one per optimizer or model, or give the other a copy: "
        f"{argument}=copy.deepcopy({argument}). "
        f"(FP16 and NoCompression keep no state and may be shared.)"
    )

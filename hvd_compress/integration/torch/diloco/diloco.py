"""``hvd_compress.DiLoCo``: local steps, then an outer step on compressed pseudo-gradients.

DiLoCo (Douillard et al., 2023) trains each replica alone for ``inner_steps`` steps, then
averages the pseudo-gradients (the weights at the start of the period minus the weights now)
and applies an outer optimizer (Nesterov momentum SGD) to the start-of-period weights. Here the
pseudo-gradients travel through any hvd_compress compressor or controller, on the same round
driver and backends as gradients: Horovod's collectives (``horovodrun``/``mpirun``) or
``torch.distributed``'s (``torchrun``).

Why each rule is what it is:

* The outer optimizer works on copies of the weights ("anchors"), one per parameter, and the
  model's parameters are overwritten with them after each outer step: the anchors are the
  shared, replicated model; the parameters are this rank's local exploration.
* The first ``step()`` broadcasts rank 0's anchors (and, at the start of a period, its weights)
  after checking that every rank runs the same configuration, so replicas start identical
  whatever each rank initialised. Collective, hence at the first step and not at construction.
* A non-finite averaged pseudo-gradient (an Inf or NaN on any rank reaches the average, which
  every rank holds alike, so all ranks agree without an extra collective) skips the outer step
  on every rank: the weights go back to the period's start, the anchors, the outer optimizer
  and the compressor stay as they were (the compressor rolls its own step back), and a new
  period begins. This is what torchft's DiLoCo does when a step may not commit (it restores the
  saved parameters and skips the outer optimizer). The inner optimizer's state is the user's
  and is left alone: copying it every period would cost another copy of its state.
* Under elastic Horovod the wrapper is a ``TorchState`` keyword with a handler of its own
  (``integration.horovod.elastic.DiLoCoStateHandler``, the compressors' handler told where the
  compression's state sits), registered ahead of Horovod's optimizer handler.
* Nothing here imports Horovod: under ``torchrun`` torch alone is enough.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from hvd_compress import arguments
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.compressors.cast import NoCompression
from hvd_compress.compressors.config import MethodConfig, check_checkpoint, checkpoint_header, option
from hvd_compress.integration import amp
from hvd_compress.integration.binding import Binding, group_of
from hvd_compress.integration.names import parameter_names
from hvd_compress.maths.finite import all_finite, extremes, stacked

logger = logging.getLogger(__name__)

# The module of Horovod's distributed optimizers, and of hvd_compress.DistributedOptimizer's
# (``integration/horovod/optimizer.py``): compared by name, so that no Horovod is imported to check.
HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"

OuterOptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]


def nesterov_outer(params: List[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9 at learning rate 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig(MethodConfig):
    """What must agree on every rank and with a checkpoint: the period, the outer optimizer's
    class and the parameters' names and shapes."""

    inner_steps: int = option(check=arguments.integer, low=1)
    outer_optimizer: str
    parameters: Dict[str, List[int]]


class DiLoCo(torch.optim.Optimizer):
    """Wraps a local (inner) optimizer: ``step()`` steps it, and every ``inner_steps`` steps
    averages the pseudo-gradients through ``compression`` and takes an outer step.

    ::

        hvd.init()  # or torch.distributed.init_process_group(...) under torchrun
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = hvd_compress.DiLoCo(inner, model.named_parameters(), hvd_compress.QSGD(bits=4),
                                    inner_steps=100)
        for x, y in batches:
            outer.zero_grad()
            loss_fn(model(x), y).backward()
            outer.step()

    The model must not be wrapped in DDP, nor the optimizer in ``hvd.DistributedOptimizer``:
    between outer steps nothing is exchanged. Every rank runs the same number of steps.

    * ``inner_steps`` (H): local steps per outer step; communication falls H-fold. DiLoCo used
      500 and Streaming DiLoCo 100 on language models of 150 M parameters and up; on small
      models and few steps start lower (10-50) and raise it while quality holds. Larger H also
      drifts the replicas further apart (more so with a large inner learning rate).
    * ``compression``: any hvd_compress compressor or controller (default ``NoCompression``);
      its error feedback, if any, holds pseudo-gradient residuals, and L-GreCo decides on
      pseudo-gradients (its ``decide_every`` counts outer steps). Do not ``track`` a loss scaler
      with it: pseudo-gradients are not loss-scaled.
    * ``outer_optimizer``: a factory, given the anchors (a list of tensors, one per parameter),
      returning a ``torch.optim.Optimizer``; default :func:`nesterov_outer` (SGD, Nesterov
      momentum 0.9, learning rate 0.7, as in DiLoCo). ``lambda p: torch.optim.SGD(p, lr=1.0)``
      is plain model averaging (local SGD).
    * ``process_set``: the ranks to average over: a Horovod ``ProcessSet`` or a
      ``torch.distributed`` process group; None: every rank, on ``torch.distributed`` if it is
      initialised and Horovod is not (torchrun), else on Horovod.

    Memory: two extra copies of the weights (the anchors and the outer momentum), plus the
    compressor's state. Buffers (BatchNorm statistics) are not exchanged.

    An ``Optimizer`` so that learning-rate schedulers and ``GradScaler.step`` take it: its
    ``param_groups`` and ``state`` are the inner optimizer's (a scheduler sets the inner learning
    rate), while ``state_dict`` is DiLoCo's own, below.

    Checkpoints: ``state_dict()`` holds the anchors, the outer optimizer's state, the step
    within the period and the compressor's state (this rank's error feedback included); save
    the model and the inner optimizer as usual, beside it. Loading all three resumes exactly,
    mid-period included. ``load_state_dict`` checks everything before changing anything.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
        compression: Optional[GradientCompression] = None,
        *,
        inner_steps: int,
        outer_optimizer: OuterOptimizerFactory = nesterov_outer,
        process_set: Any = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"DiLoCo: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if type(optimizer).__module__ == HOROVOD_OPTIMIZER_MODULE:
            raise ValueError(
                "DiLoCo: optimizer must be the local optimizer, not a distributed "
                "one (between outer steps nothing is exchanged)"
            )
        if named_parameters is None:
            raise ValueError(
                "DiLoCo: named_parameters is required (model.named_parameters()): "
                "names key the compressor's state and the checkpoints"
            )
        compression = NoCompression() if compression is None else compression
        if not isinstance(compression, GradientCompression):
            raise ValueError(
                f"DiLoCo: compression must be an hvd_compress compressor or "
                f"controller, got {type(compression).__name__}"
            )
        if not callable(outer_optimizer):
            raise ValueError(
                f"DiLoCo: outer_optimizer must be a callable that builds a "
                f"torch.optim.Optimizer from a list of tensors, got "
                f"{type(outer_optimizer).__name__}"
            )
        compression.serve(self, "a DiLoCo")
        # Not Optimizer.__init__: the parameter groups are the inner optimizer's own objects.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.compression = compression
        self.process_set = process_set
        self._outer_factory = outer_optimizer
        names = parameter_names(optimizer.param_groups, named_parameters)
        self._named = {name: p for p, name in names.items() if p.requires_grad}
        self._anchors, self._outer = self._build_outer({name: p.detach() for name, p in self._named.items()})
        self.config = DiLoCoConfig(
            owner="DiLoCo",
            inner_steps=inner_steps,
            outer_optimizer=type(self._outer).__name__,
            parameters={name: list(p.shape) for name, p in self._named.items()},
        )
        self.step_in_period = 0
        self.outer_steps = 0
        self.skipped_outer_steps = 0  # non-finite pseudo-gradients: periods thrown away
        self.rank, self.size = 0, 1  # this rank in the averaging group, once bound
        self._binding: Optional[Binding] = None  # made at the first step, anew after an elastic reset

    def _build_outer(self, values):
        """Anchors holding ``values`` (copied) and an outer optimizer over them."""
        anchors = {
            name: torch.nn.Parameter(values[name].to(p.device, p.dtype).clone(), requires_grad=True)
            for name, p in self._named.items()
        }
        outer = self._outer_factory(list(anchors.values()))
        if not isinstance(outer, torch.optim.Optimizer):
            raise ValueError(f"DiLoCo: outer_optimizer must return a torch.optim.Optimizer, got {type(outer).__name__}")
        return anchors, outer

    # ----- the optimizer interface ------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's (what ``GradScaler.unscale_`` and clipping read)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Dict[Any, Any]:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise ValueError(
            "DiLoCo: add_param_group: the parameters are fixed at construction (each "
            "has its outer-start copy); build the inner optimizer with every group"
        )

    # GradScaler.step calls step() even when this rank's gradients overflowed (integration.amp):
    # a step it skipped must still count in the period, or the ranks' outer steps (collectives)
    # fall out of step.
    _step_supports_amp_scaling = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One inner step; at the end of a period, the outer step (collective).

        Every call counts in the period, whether or not the inner optimizer stepped, so that
        every rank takes its outer steps at the same calls. Under ``torch.amp.GradScaler``
        (``scaler.step(outer)``), a step whose gradients overflowed on this rank skips the inner
        optimizer on this rank only and still counts; otherwise the gradients are unscaled
        (unless ``scaler.unscale_`` already did) and the inner optimizer steps, as GradScaler
        would have done itself."""
        if self._binding is None or self._binding.stale():
            self._bind()  # the first step, or an elastic reset re-formed the world
        found_inf, grad_scale = amp.scaler_call(self)
        if found_inf is None:
            loss = self.optimizer.step(closure)
        elif bool(found_inf):  # one host read per step, as GradScaler's own
            loss = None
        else:
            amp.unscale((p for group in self.param_groups for p in group["params"]), grad_scale)
            loss = self.optimizer.step(closure)
        self._inner_step_done()
        return loss

    def _inner_step_done(self):
        """Counts the inner step in the period; at its end, the outer step."""
        self.step_in_period += 1
        if self.step_in_period == self.inner_steps:
            self._outer_step()

    # ----- the world --------------------------------------------------------------------------
    def _bind(self):
        """At the first step, and after an elastic reset: the binding (Horovod or
        torch.distributed, as ``process_set`` says), the configuration check, rank 0's anchors."""
        binding = Binding(self.compression, group_of(self.process_set, "DiLoCo"), described=self)
        self.rank, self.size = binding.group.rank, binding.group.size
        if binding.active:
            shapes = {name: tuple(p.shape) for name, p in reversed(self._named.items())}
            self._scheduler = FusionScheduler(self.compression, shapes, ScaledFusion(), self.rank)
            binding.check_configuration(shapes)
            self._broadcast_anchors(binding.driver.backend)
        self._binding = binding

    @property
    def inner_steps(self) -> int:
        return self.config.inner_steps

    def describe(self) -> Dict[str, Any]:
        """What must agree on every rank (the cross-rank check's format): the configuration, the
        step within the period and the compression's own description."""
        return {
            "compressor": "DiLoCo",
            "settings": {},
            "config": {
                **self.config.describe(),
                "step_in_period": self.step_in_period,
                "inner": self.compression.describe(),
            },
        }

    def _broadcast_anchors(self, backend):
        """Rank 0's anchors everywhere; at a period's start, its weights too (they are equal)."""
        handles = {
            name: backend.start(
                f"hvd_compress.diloco.anchor.{name}", Round(anchor.detach(), Collective.BROADCAST, None)
            )
            for name, anchor in self._anchors.items()
        }
        with torch.no_grad():
            for name, handle in handles.items():
                self._anchors[name].copy_(backend.wait(handle))
                if self._weights_are_anchors():
                    self._named[name].copy_(self._anchors[name])

    def _weights_are_anchors(self) -> bool:
        """Whether this rank's weights equal the anchors now (so rank 0's may replace them)."""
        return self.step_in_period == 0

    # ----- the outer step ---------------------------------------------------------------------
    def _outer_step(self):
        with torch.no_grad():
            deltas = {name: self._anchors[name] - p for name, p in self._named.items()}
            averaged = self._exchange(deltas) if self._binding.active else deltas
            found = [e for delta in averaged.values() for e in extremes(delta)]
            finite = not found or bool(all_finite(stacked(found)))
            if finite:
                for name, anchor in self._anchors.items():
                    anchor.grad = averaged[name].to(anchor.dtype)
                self._outer.step()
                self._outer.zero_grad(set_to_none=True)
                self.outer_steps += 1
            else:
                self.skipped_outer_steps += 1
                logger.warning(
                    "DiLoCo: non-finite pseudo-gradient on some rank; outer step skipped, "
                    "the weights go back to the period's start (%d such steps so far)",
                    self.skipped_outer_steps,
                )
            for name, p in self._named.items():
                p.copy_(self._anchors[name])
        self.step_in_period = 0

    def _exchange(self, deltas):
        """Averages the pseudo-gradients through the compression, fused as gradients are."""
        # Its end_step gets no communication time, so the clock waits for no device.
        results, _ = self._binding.exchange(deltas, self._scheduler.plan(), device=None)
        self.compression.end_step()
        return results

    # ----- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The anchors, the outer optimizer's state, the step within the period and the
        compression's state (this rank's error feedback included). Tensors are copies; only
        tensors, numbers, strings, lists and dicts (``torch.load(weights_only=True)``)."""
        return self._state(self.compression.state_dict())

    def elastic_state_dict(self) -> Dict[str, Any]:
        """What an elastic commit saves: ``state_dict``, never waiting (L-GreCo leaves a decision
        in flight out)."""
        return self._state(self.compression.elastic_state_dict())

    def _state(self, compression_state):
        return {
            **checkpoint_header("DiLoCo", self.config),
            "step_in_period": self.step_in_period,
            "outer_steps": self.outer_steps,
            "skipped_outer_steps": self.skipped_outer_steps,
            "anchors": {name: anchor.detach().clone() for name, anchor in self._anchors.items()},
            "outer_optimizer": _copied(self._outer.state_dict()),
            "compression": compression_state,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a ``state_dict``. Everything is checked before anything changes: a mismatch
        raises one ``ValueError`` naming it and leaves this object as it was."""
        check_checkpoint(
            "DiLoCo",
            state_dict,
            ("step_in_period", "outer_steps", "skipped_outer_steps", "anchors", "outer_optimizer", "compression"),
            self.config,
        )
        step = state_dict["step_in_period"]
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.inner_steps:
            raise ValueError(
                f"DiLoCo.load_state_dict: step_in_period must lie in [0, {self.inner_steps}), got {step!r}"
            )
        anchors = state_dict["anchors"]
        for name, p in self._named.items():
            value = anchors.get(name)
            if not torch.is_tensor(value) or tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"DiLoCo.load_state_dict: anchor of parameter {name!r} is missing "
                    f"or has the wrong shape in the checkpoint"
                )
        extra = sorted(set(anchors) - set(self._named))
        if extra:
            raise ValueError(f"DiLoCo.load_state_dict: anchors {extra} are not parameters here")
        new_anchors, new_outer = self._build_outer(anchors)
        try:
            new_outer.load_state_dict(_copied(state_dict["outer_optimizer"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"DiLoCo.load_state_dict: outer_optimizer state does not fit: {error}") from None
        self.compression.load_state_dict(state_dict["compression"])  # checks its own part; last to raise
        self._anchors, self._outer = new_anchors, new_outer
        self.step_in_period = step
        self.outer_steps = state_dict["outer_steps"]
        self.skipped_outer_steps = state_dict["skipped_outer_steps"]


def _copied(value):
    """Tensors cloned, containers rebuilt: a torch optimizer's state dict shares its tensors."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return value

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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from hvd_compress import arguments
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.compressors.cast import NoCompression
from hvd_compress.compressors.chunked_topk import ChunkedTopK
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


class SparseLoCo(DiLoCo):
    """DiLoCo whose outer momentum is error feedback over sparse pseudo-gradients: SparseLoCo
    (Sarfi et al. 2025, arXiv 2508.15706, section 3).

    Every ``inner_steps`` steps each rank adds its pseudo-gradient to its decayed residual,
    e = beta * e + delta, sends the top ``density`` of each chunk of e in ``bits`` bits
    (:class:`ChunkedTopK`), keeps what it did not send in e, and every rank applies the mean of
    what was sent with plain SGD at ``outer_lr``: theta = theta - outer_lr * mean. The decayed
    residual stands in for DiLoCo's Nesterov momentum, which is dropped; so the outer step adds
    no state beyond the residual.

    ::

        outer = hvd_compress.SparseLoCo(inner, model.named_parameters(), inner_steps=30)

    * ``density`` (default 0.02), ``chunk`` (4096 entries, 64 x 64 in the paper) and ``bits``
      (2): the paper's 1-3% of each chunk in 2 bits, about 85x fewer bytes than float32 per
      outer step at 2% (``ChunkedTopK``), on top of DiLoCo's ``inner_steps``-fold fewer steps.
    * ``feedback_decay`` (beta, default 0.95) and ``outer_lr`` (default 1.0): the paper's
      settings, as we read them; docs/benchmarks/diloco-local-steps-and-compressed-pseudo-gradients.md says what they
      give on this project's workloads.
    * ``min_numel`` (default 1024): smaller pseudo-gradients, and every 1-D one, are averaged
      dense.

    Everything else (checkpoints, the non-finite rule, elastic Horovod, ``process_set``) is
    DiLoCo's; the residual is the compression's state, in ``state_dict()["compression"]``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
        *,
        inner_steps: int,
        density: float = 0.02,
        chunk: int = 4096,
        bits: int = 2,
        feedback_decay: float = 0.95,
        outer_lr: float = 1.0,
        min_numel: int = 1024,
        process_set: Any = None,
    ):
        outer_lr = arguments.real("SparseLoCo", "outer_lr", outer_lr, low=0, low_open=True)
        compression = ChunkedTopK(
            density=density, chunk=chunk, bits=bits, feedback_decay=feedback_decay, min_numel=min_numel
        )
        super().__init__(
            optimizer,
            named_parameters,
            compression,
            inner_steps=inner_steps,
            outer_optimizer=lambda anchors: torch.optim.SGD(anchors, lr=outer_lr),
            process_set=process_set,
        )
        # Checked across ranks and against checkpoints with the rest: a rank with another
        # outer learning rate would move its copy of the shared weights apart.
        self.config = dataclasses.replace(self.config, outer_optimizer=f"SGD(lr={outer_lr})")


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCoConfig(DiLoCoConfig):
    """DiLoCo's, and the fragments, the delay (inner steps) and the mixing factor."""

    fragments: int = 1
    delay: int = 0
    mixing: float = 0.0


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, sections 2.2-2.4): the model's
    parameters in ``fragments`` groups that take their outer steps at staggered points of the
    period, so that one fragment's pseudo-gradients travel at a time, each overlapped with the
    ``delay`` inner steps that follow it, and merged into the local weights with ``mixing``.

    ::

        outer = hvd_compress.StreamingDiLoCo(inner, model.named_parameters(), hvd_compress.QSGD(bits=4),
                                             inner_steps=100, fragments=4, delay=5, mixing=0.5)

    * ``fragments`` (F): consecutive parameters (in ``named_parameters`` order, so layers stay
      together), about n/F entries each. Fragment p exchanges at step (p+1)H/F of each period
      (its first period is shorter), so each exchange carries about 1/F of DiLoCo's bytes and
      the peak bandwidth falls F-fold.
    * ``delay`` (tau, fewer than H/F steps): the exchange starts at the fragment's step and its
      result is applied tau inner steps later, while those steps compute; the outer optimizer
      then steps the fragment's anchors with the pseudo-gradient of when the exchange started.
    * ``mixing`` (alpha in [0, 1)): the fragment's local weights become
      alpha x local + (1 - alpha) x the new anchors; 0 (default) replaces them, as DiLoCo does.
      With alpha > 0, or tau > 0, the ranks' local weights differ after an outer step (the
      anchors never do).

    ``outer_steps`` counts each fragment's outer step (F a period). F = 1, tau = 0 and alpha = 0
    is DiLoCo, bit for bit. ``state_dict`` while an exchange is in
    flight waits for it on this rank alone (every rank started it, and each completes it at its
    next step), and keeps its result for the step it applies at, so a resumed run applies the
    same result at the same step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
        compression: Optional[GradientCompression] = None,
        *,
        inner_steps: int,
        fragments: int = 2,
        delay: int = 0,
        mixing: float = 0.0,
        outer_optimizer: OuterOptimizerFactory = nesterov_outer,
        process_set: Any = None,
    ):
        super().__init__(
            optimizer,
            named_parameters,
            compression,
            inner_steps=inner_steps,
            outer_optimizer=outer_optimizer,
            process_set=process_set,
        )
        owner, names = "StreamingDiLoCo", list(self._named)
        fragments = arguments.integer(owner, "fragments", fragments, low=1, high=min(self.inner_steps, len(names)))
        delay = arguments.integer(owner, "delay", delay, low=0, high=self.inner_steps // fragments - 1)
        mixing = arguments.real(owner, "mixing", mixing, low=0, high=1)
        if mixing == 1:
            raise ValueError(f"{owner}: mixing must be below 1 (1 would never take the shared weights), got 1")
        self.config = StreamingDiLoCoConfig(
            owner=owner,
            inner_steps=self.inner_steps,
            outer_optimizer=self.config.outer_optimizer,
            parameters=self.config.parameters,
            fragments=fragments,
            delay=delay,
            mixing=mixing,
        )
        self.fragment_names = _fragments(self._named, fragments)
        # Fragment p exchanges at the end of step (p + 1) H / F of the period.
        self._sync_at = {(p + 1) * self.inner_steps // fragments: p for p in range(fragments)}
        self._pending: Optional[Dict[str, Any]] = None  # the exchange in flight or waiting to apply
        self._loaded = False  # from a checkpoint: the weights are this rank's own, not the anchors

    def _bind(self):
        super()._bind()
        if self._binding.active:
            self._schedulers = [
                FusionScheduler(
                    self.compression,
                    {name: tuple(self._named[name].shape) for name in reversed(names)},
                    ScaledFusion(),
                    self.rank,
                )
                for names in self.fragment_names
            ]

    def _inner_step_done(self):
        self.step_in_period += 1
        if self._binding.active:
            self._binding.driver.poll()
        if self._pending is not None and self._pending["apply_at"] == self.step_in_period:
            self._apply()
        fragment = self._sync_at.get(self.step_in_period)
        if fragment is not None:
            self._start(fragment)
            if self.config.delay == 0:
                self._apply()
        if self.step_in_period == self.inner_steps:
            self.step_in_period = 0

    def _start(self, fragment):
        with torch.no_grad():
            deltas = {name: self._anchors[name] - self._named[name] for name in self.fragment_names[fragment]}
        apply_at = (self.step_in_period + self.config.delay - 1) % self.inner_steps + 1
        self._pending = {
            "fragment": fragment,
            "apply_at": apply_at,
            "results": None if self._binding.active else deltas,
        }
        if self._binding.active:
            self._binding.driver.use_plan(self._schedulers[fragment].plan())
            for name, delta in deltas.items():
                self._binding.start(name, delta)

    def _finish(self):
        """The pending exchange's results, waited for here if they are still in flight."""
        if self._pending["results"] is None:
            self._pending["results"], _ = self._binding.finish(device=None)
            self.compression.end_step()
        return self._pending["results"]

    def _apply(self):
        averaged, fragment = self._finish(), self._pending["fragment"]
        self._pending = None
        names = self.fragment_names[fragment]
        with torch.no_grad():
            found = [e for name in names for e in extremes(averaged[name])]
            if not found or bool(all_finite(stacked(found))):
                for name in names:
                    self._anchors[name].grad = averaged[name].to(self._anchors[name].dtype)
                self._outer.step()  # anchors without a gradient (other fragments) stay put
                self._outer.zero_grad(set_to_none=True)
                self.outer_steps += 1
                alpha = self.config.mixing
                for name in names:
                    if alpha == 0:  # DiLoCo's replacement, bit for bit
                        self._named[name].copy_(self._anchors[name])
                    else:
                        self._named[name].mul_(alpha).add_(self._anchors[name], alpha=1 - alpha)
            else:
                self.skipped_outer_steps += 1
                logger.warning(
                    "StreamingDiLoCo: non-finite pseudo-gradient of fragment %d on some rank; its outer "
                    "step skipped, its weights go back to its anchors (%d such steps so far)",
                    fragment,
                    self.skipped_outer_steps,
                )
                for name in names:
                    self._named[name].copy_(self._anchors[name])

    def state_dict(self) -> Dict[str, Any]:
        """``DiLoCo.state_dict``, and the exchange waiting to apply (waited for here if it is in
        flight, so that the compression's state includes it)."""
        if self._pending is not None:
            self._finish()
        return super().state_dict()

    def elastic_state_dict(self) -> Dict[str, Any]:
        if self._pending is not None:
            self._finish()
        return super().elastic_state_dict()

    def _state(self, compression_state):
        pending = self._pending
        return dict(
            super()._state(compression_state),
            pending=None
            if pending is None
            else {
                "fragment": pending["fragment"],
                "apply_at": pending["apply_at"],
                "results": {name: value.detach().clone() for name, value in pending["results"].items()},
            },
        )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As ``DiLoCo.load_state_dict``, and the exchange waiting to apply, if any."""
        pending = state_dict.get("pending")
        if pending is not None and (
            pending.get("fragment") not in range(len(self.fragment_names))
            or set(pending.get("results", {})) != set(self.fragment_names[pending["fragment"]])
        ):
            raise ValueError("StreamingDiLoCo.load_state_dict: the pending exchange does not fit these fragments")
        super().load_state_dict(state_dict)
        self._pending = None if pending is None else dict(pending, results=dict(pending["results"]))
        self._loaded = True

    def _weights_are_anchors(self) -> bool:
        # Mixing and delays leave each rank's weights apart from the anchors after the first
        # outer step: only a fresh start has them equal.
        return not self._loaded and self.outer_steps == 0 and self._pending is None and self.step_in_period == 0


def _fragments(named: Dict[str, torch.nn.Parameter], count: int) -> List[List[str]]:
    """``named``'s names in order, cut into ``count`` consecutive non-empty groups of about equal
    entries: each group ends where the running total first reaches its share."""
    names = list(named)
    total = sum(p.numel() for p in named.values())
    groups, current, seen = [], [], 0
    for index, name in enumerate(names):
        current.append(name)
        seen += named[name].numel()
        groups_left, names_left = count - len(groups) - 1, len(names) - index - 1
        if groups_left and (seen * count >= total * (len(groups) + 1) or names_left == groups_left):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def _copied(value):
    """Tensors cloned, containers rebuilt: a torch optimizer's state dict shares its tensors."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return value

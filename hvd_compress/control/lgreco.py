"""L-GreCo (Markov et al., MLSys 2024): per-layer compression settings chosen by dynamic
programming under an error budget, decided on rank 0 and applied by every rank at one step."""

import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Union

import numpy as np
import torch

from hvd_compress import arguments
from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.config import MethodConfig, check_checkpoint, checkpoint_header, configured, option
from hvd_compress.compressors.feedback import StagedSums
from hvd_compress.control.service import DecisionService, Postponed
from hvd_compress.control.solver import solve
from hvd_compress.control.wrapping import Controller

logger = logging.getLogger(__name__)

OBJECTIVES = ("size", "time", "accordion")
ERROR_SOURCES = ("sent", "raw")
REFERENCE_ACCUMULATE_STEPS = 10  # the authors' code averages the last 10 steps before a decision
# The time objective's model is fitted to the last this many steps: a fixed window, so state
# and checkpoints stay bounded however long training runs.
TIME_SAMPLES = 512
DECISIONS_KEPT = 64
# apply_delay="auto": the first decision's delay in steps (later ones follow from how long the
# last decision took), and the safety factor on that measured time.
FIRST_DELAY = 10
DELAY_MARGIN = 1.5
STEP_TIME_SMOOTHING = 0.1  # weight of the newest step in rank 0's running step time
# Keys of the window's mean norms among the accumulated sums ("<name>\0gradient_norm"): kept
# with the sums, they stage, roll back, clear and checkpoint with them.
NORM_KEY = "\0"


@dataclass
class Decision:
    version: int
    decided_at: int  # the step whose accumulated gradients were analysed
    effective_step: int  # the first step that runs with these settings
    settings: dict  # parameter name -> setting of the wrapped compressor
    total_bytes: int
    uniform_bytes: int
    total_error: float
    budget: float
    objective: str
    seconds: float = 0.0
    step_seconds: float = 0.0  # rank 0's running step time when the decision was submitted
    notes: list = field(default_factory=list)
    # What the solver saw, per layer it decided: "options", "bytes" and "errors" (its rows of
    # the tables), "chosen" and "default" (indices into them), and the window's mean per-step
    # "gradient_norm" and "residual_norm" (unscaled; the residual before each step's compression).
    layers: dict = field(default_factory=dict)


@dataclass
class Accordion:
    """Accordion's critical-regime rule (Agarwal et al., 2021): a layer whose accumulated
    gradient norm changed by at least ``threshold`` (relative) since the last decision is in a
    critical regime and gets the ``critical`` default (less compression); others get ``normal``.
    L-GreCo then distributes that error budget over layers (the paper's best, Table 4)."""

    critical: object
    normal: object
    threshold: float = 0.5


@dataclass(frozen=True, kw_only=True)
class LGreCoConfig(MethodConfig):
    """L-GreCo's configuration (see its tuning guide). ``decide_every`` is in steps once made
    ("epoch" becomes ``steps_per_epoch``, which need not agree: ``decide_every`` does);
    candidates and Accordion's values are checked against the wrapped compressor by
    ``check_for``, ``transport`` and ``timeout`` by the decision service."""

    candidates: Optional[tuple] = None
    dense_candidates: bool = option(False, arguments.flag)
    decide_every: Union[int, str] = 1000
    steps_per_epoch: Optional[int] = option(None, agreed=False)
    warmup_steps: int = option(1000, arguments.integer, low=0)
    start_step: int = option(0, arguments.integer, low=0)
    apply_delay: Union[int, str] = "auto"
    accumulate_steps: Optional[int] = REFERENCE_ACCUMULATE_STEPS
    error_source: str = option("sent", arguments.choice, options=ERROR_SOURCES)
    objective: str = option("size", arguments.choice, options=OBJECTIVES)
    accordion: Optional[Accordion] = None
    time_buckets: int = option(4, arguments.integer, low=1)
    discretization: int = option(10000, arguments.integer, low=1)
    transport: str = option("auto", agreed=False)
    timeout: float = option(60.0, agreed=False)

    def check(self, owner):
        """The fields whose check takes another field or a word besides a number: decide_every
        ("epoch": steps_per_epoch), apply_delay ("auto"), accumulate_steps (None), accordion and
        candidates."""
        if self.decide_every == "epoch":
            self._keep(
                "decide_every",
                arguments.integer(owner, "steps_per_epoch (with decide_every='epoch')", self.steps_per_epoch, low=1),
            )
        arguments.integer(owner, "decide_every", self.decide_every, low=1)
        if self.accumulate_steps is not None:
            arguments.integer(owner, "accumulate_steps (or None)", self.accumulate_steps, low=1)
        if self.apply_delay != "auto":
            arguments.integer(owner, 'apply_delay (or "auto")', self.apply_delay, low=1)
            if self.apply_delay >= self.decide_every:
                raise ValueError(
                    f"{owner}: apply_delay ({self.apply_delay}) must be smaller than decide_every ({self.decide_every})"
                )
        if (self.objective == "accordion") != (self.accordion is not None):
            raise ValueError(f"{owner}: objective='accordion' and accordion=Accordion(...) go together")
        if self.accordion is not None and not isinstance(self.accordion, Accordion):
            raise ValueError(f"{owner}: accordion must be an Accordion(critical, normal), got {self.accordion!r}")
        candidates = self.candidates
        if candidates is not None and (isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__")):
            raise ValueError(f"{owner}: candidates must be a list of settings, got {candidates!r}")
        if candidates is not None:
            self._keep("candidates", tuple(candidates))
        if self.candidates == ():
            raise ValueError(f"{owner}: candidates must not be empty (None: the paper's range)")
        if self.accordion is not None:
            arguments.real(owner, "accordion.threshold", self.accordion.threshold, low=0, low_open=True)

    def check_for(self, compressor: Compressor, owner: str) -> None:
        """Raises ``ValueError`` naming the value unless every candidate and Accordion's values
        are valid settings of ``compressor`` (the wrapped one, known only to the controller)."""
        for value in self.candidates or []:
            compressor.tuning.check_value(value, f"{owner}: every candidate")
        if self.accordion is not None:
            compressor.tuning.check_value(self.accordion.critical, f"{owner}: accordion.critical")
            compressor.tuning.check_value(self.accordion.normal, f"{owner}: accordion.normal")


class LGreCo(Controller):
    """Wraps PowerSGD, ACPSGD, TopK or QSGD and owns each layer's setting.

    Until ``start_step`` nothing is compressed (every gradient is sent whole, no error is
    accumulated). From then on every layer runs at the wrapped compressor's uniform default
    until the first decision, ``warmup_steps`` later, and then every ``decide_every`` steps
    rank 0 builds error(layer, candidate) (the L2 norm of the compression error) and
    size(layer, candidate) (bytes actually sent) tables, and solves min total size s.t. total
    error <= the uniform default's error, in a background thread. The decision reaches every
    rank ``apply_delay`` steps later, is checked to be identical everywhere, and takes effect on
    every rank at that same step. A decision due while the previous one has not yet taken
    effect is skipped (its gradients go to the next one).

    The error table is measured, as in the authors' reference, on what each layer actually
    compresses (``error_source="sent"``: its gradient plus its error-feedback residual),
    averaged over the last ``accumulate_steps`` (10) steps before each decision. A layer that
    was cut too far shows a growing residual, so the next decision gives it back bytes.

    Tuning guide:
      * The wrapped compressor's default (e.g. ``PowerSGD(rank=32)``, ``TopK(density=0.01)``,
        ``QSGD(bits=4)``) is the anchor: a uniform setting known to keep accuracy, whose total
        error L-GreCo matches with fewer bytes. Pick the most aggressive uniform setting that
        stays within your quality tolerance (with the same ``start_step``); L-GreCo cannot
        repair an anchor that already loses quality.
      * ``start_step``: uncompressed steps first; set it to the end of the learning-rate
        warm-up (the reference's ``start_powerSGD_iter``). Early gradients change fast and
        are a poor guide to the later ones.
      * ``warmup_steps``: steps at the uniform default after ``start_step`` before the first
        decision, so residuals have built up; the reference uses one period
        (``warmup_steps=decide_every``).
      * ``decide_every``: steps between decisions, or "epoch" with ``steps_per_epoch``; the
        paper decides once an epoch (some 5-20 decisions a run).
      * ``candidates``: settings to search (ranks, densities for TopK, bits). Default: the
        paper's ranges, [D/2, 2D] for ranks and bits (the reference hook's), [D/10, 10D] in
        steps of D/10 for density. The authors' Transformer-XL run searches ranks D/4 to 4D:
        ``candidates=range(max(1, D // 4), 4 * D + 1)``.
      * ``dense_candidates``: as in the reference (False, the default), only settings that
        compress a layer are candidates, and a layer the default does not compress is left out
        of the problem (it keeps its setting). True also offers "send it whole", scored at
        error 0 (an ablation: it spends bytes on small layers and raises the budget's reach).
      * ``accumulate_steps``: the steps before each decision whose tensors are averaged into
        the error table (default 10, the reference's); None averages every step since the
        last decision. Rank 0 pays a pass over the model's gradients only on those steps.
      * ``error_source``: "sent" (default, the reference) measures gradient plus residual;
        "raw" measures the gradients alone, blind to the residuals of layers it cut (the
        earlier behaviour of this class, with ``accumulate_steps=None``; kept to measure the
        difference).
      * ``objective``: "size" (default), "time" (sizes weighted by per-bucket seconds per byte
        from a linear model of measured communication time), or "accordion" (pass
        ``accordion=Accordion(critical, normal)``).
      * ``apply_delay``: "auto" (default) never stalls training: the first decision is due 10
        steps after it was submitted (``decide_every - 1`` if fewer), each later one after
        1.5x the last decision's time in steps (rank 0's running step time, agreed through the
        decision), and if rank 0 is still computing when one is due, it names a later step
        instead of making every rank wait.
        Which step a decision takes effect at then depends on timing, so a run resumed from a
        checkpoint can apply it at another step. An int fixes the delay: every rank waits at
        that step for rank 0 (bit-for-bit repeatable runs); it must be below ``decide_every``.
      * ``timeout``: seconds a rank waits for rank 0 before failing loudly, and the longest a
        decision may compute, postponed or not.

    Rank 0 logs each decision at INFO (logger ``hvd_compress.control.lgreco``).
    """

    def __init__(self, compressor: Compressor, *, config: Optional[LGreCoConfig] = None, **options: Any):
        """``options``: ``LGreCoConfig``'s fields; or pass ``config``, an ``LGreCoConfig``."""
        super().__init__(compressor)
        self.config = config = configured(LGreCoConfig, type(self).__name__, config, options)
        config.check_for(self.inner, type(self).__name__)
        self.service = DecisionService(config.transport, config.timeout)
        self.step = 0
        self.version = 0
        self.decisions = deque(maxlen=DECISIONS_KEPT)  # the latest, oldest first
        self._next_decision = config.start_step + config.warmup_steps
        self._pending = None  # (version, decided_at, effective_step)
        self._bound_world = None
        # Agreed by all ranks. "auto" starts within one period: a short schedule's first
        # decision is then not skipped for want of a measured time.
        self._delay = (
            min(FIRST_DELAY, max(1, config.decide_every - 1)) if config.apply_delay == "auto" else config.apply_delay
        )
        self._step_seconds = 0.0  # rank 0's running step time; 0 until measured
        self._step_ended = None
        self._sums = StagedSums()  # rank 0: gradients accumulated since the last decision
        self._shapes = {}  # in the order gradients first arrived (about backward order)
        self._previous_norms = {}
        self._time_samples = deque(maxlen=TIME_SAMPLES)  # (bytes per time bucket, seconds)
        self._step_bucket_bytes = None

    def metrics(self):
        """Adds the version of the decision in force and each layer's setting
        (``setting/<name>``, resolved: Top-K's k, ranks, bits)."""
        numbers = dict(super().metrics(), lgreco_version=self.version, lgreco_step=self.step)
        for name, shape in self._shapes.items():
            if self.inner.tuning.tunable(shape):
                setting = self.inner.tuning.resolve(shape, self.inner.setting(name))
                if isinstance(setting, (int, float)):
                    numbers[f"setting/{name}"] = setting
        return numbers

    def decision_records(self, after_version):
        """Each decision newer than ``after_version`` still kept, as a dict (``Decision``'s
        fields: the per-layer tables the solver saw are under "layers")."""
        return [asdict(d) for d in self.decisions if d.version > after_version]

    def use_process_set(self, process_set):
        super().use_process_set(process_set)
        self.service.use_process_set(process_set)

    @property
    def times_communication(self) -> bool:
        """The time objective fits seconds per byte to each step's ``comm_seconds``."""
        return self.config.objective == "time"

    @property
    def decision_in_flight(self) -> Optional[int]:
        """The version of the decision submitted but not yet exchanged, or None."""
        return None if self._pending is None else self._pending[0]

    def bind_world(self, rank, size):
        """Binding to another world (an elastic reset) drops a decision in flight, on every rank
        alike: the old world's rank 0 may be gone. The next one comes at the next period."""
        previous, self._bound_world = self._bound_world, (rank, size)
        super().bind_world(rank, size)
        if previous is None:
            return
        if previous != (rank, size):
            self._drop_decision_in_flight()
        else:  # rebound after an elastic reset that kept the rank and size: a new transport
            self.service.reconnect()

    def _drop_decision_in_flight(self):
        if self._pending is not None:
            logger.warning(
                "L-GreCo: decision %d (gradients up to step %d) dropped: the world changed while it was in flight",
                self._pending[0],
                self._pending[1],
            )
        self._pending = None
        self._sums.clear()
        self.service.rejoin()

    @property
    def batches_layers(self):
        return self.inner.batches_layers

    def _begin_exchange(self, name, grad):
        return self._begin_many([(name, grad)])[0]

    def _begin_many(self, items):
        for name, grad in items:
            self._shapes.setdefault(name, tuple(grad.shape))
        if self.step < self.config.start_step:
            return [self.inner.begin_uncompressed(name, grad) for name, grad in items]
        if self.rank == 0 and self._accumulating():
            for name, grad in items:
                if self.inner.tuning.tunable(self._shapes[name]):
                    self._accumulate(name, grad)
        rounds = self.inner.begin_many(items)
        if self.config.objective == "time":
            for (name, _), round_ in zip(items, rounds):
                self._count_bucket_bytes(name, round_.payload)
        return rounds

    def next_payload_bytes(self, name, shape):
        if self.step < self.config.start_step:
            return 4 * math.prod(shape)
        return self.inner.next_payload_bytes(name, shape)

    def _window(self):
        """Steps averaged into the error table before each decision."""
        return min(self.config.accumulate_steps or self.config.decide_every, self.config.decide_every)

    def _accumulating(self):
        return self._next_decision - self.step <= self._window()

    def _accumulate(self, name, grad):
        """Adds this step's share of the window's mean, in unscaled units. Staged, without a
        gradient-sized allocation per layer and step; kept at end_step only if the step was
        finite. "sent": the residual this step's compression adds to the gradient, read before
        the compressor replaces it."""
        share = 1.0 / self._window()
        scale = self.inner.loss_scale()
        self._sums.add(name, grad.detach(), value_weight=share / scale)
        residual = self.inner.residual(name, grad.device)
        if residual is not None and self.config.error_source == "sent":
            self._sums.add(name, residual.view(grad.shape), value_weight=share)
        # Read on the host only when the decision is made: no wait per layer and step.
        self._sums.add(
            name + NORM_KEY + "gradient_norm", grad.detach().float().norm().reshape(1), value_weight=share / scale
        )
        if residual is not None:
            self._sums.add(name + NORM_KEY + "residual_norm", residual.norm().reshape(1), value_weight=share)

    # ----- the schedule ---------------------------------------------------------------------
    def _end_step(self, comm_seconds):
        self._time_step()
        self.inner.end_step()
        if not self.inner.last_step_finite:  # as if the step had never happened
            self._sums.rollback()
            self._step_bucket_bytes = None
            return
        self._sums.commit()
        if comm_seconds is not None and self._step_bucket_bytes is not None:
            self._time_samples.append((self._step_bucket_bytes, comm_seconds))
        self._step_bucket_bytes = None
        self.step += 1
        if self.step == self._next_decision:
            self._next_decision += self.config.decide_every
            if self._pending is None:  # else skipped: its gradients go to the next decision
                self._submit()
        if self._pending is not None and self.step == self._pending[2]:
            self._exchange()

    def _time_step(self):
        now = time.monotonic()
        if self._step_ended is not None:
            seconds = now - self._step_ended
            self._step_seconds = (
                seconds
                if self._step_seconds == 0
                else (1 - STEP_TIME_SMOOTHING) * self._step_seconds + STEP_TIME_SMOOTHING * seconds
            )
        self._step_ended = now

    def _submit(self):
        self.version += 1
        self._pending = (self.version, self.step, self.step + self._delay)
        if self.rank == 0:
            # The thread gets snapshots: training goes on mutating the live state.
            sums = {name: value for name, value in self._sums.committed.items() if NORM_KEY not in name}
            norms = {name: value for name, value in self._sums.committed.items() if NORM_KEY in name}
            self._sums.clear()
            shapes, samples = dict(self._shapes), list(self._time_samples)
            pending, step_seconds = self._pending, self._step_seconds
            self.service.submit(lambda: self._decide(sums, norms, shapes, samples, *pending, step_seconds))

    def _exchange(self):
        version, decided_at, effective = self._pending
        adaptive = self.config.apply_delay == "auto"
        result = self.service.exchange(version, effective, self._postpone if adaptive else None)
        if isinstance(result, Postponed):
            self._pending = (version, decided_at, result.step)
            return
        self._pending = None
        decision = replace(result, effective_step=self.step)
        if adaptive:
            self._delay = next_delay(decision)
        self._apply(decision)

    def _postpone(self, elapsed):
        """Rank 0, still computing when a decision is due: the step to exchange at instead.
        Expects what remains of 1.5x the last decision's time, and at least as long again as
        it has run (so a first decision, with nothing to go by, needs few exchanges)."""
        if self._step_seconds == 0:
            return self.step + FIRST_DELAY
        previous = self.decisions[-1].seconds if self.decisions else 0.0
        remaining = max(DELAY_MARGIN * previous - elapsed, elapsed)
        return self.step + max(1, math.ceil(remaining / self._step_seconds))

    def _apply(self, decision):
        for name, value in decision.settings.items():
            self.inner.set_setting(name, value)
        self.decisions.append(decision)
        if self.rank == 0:
            logger.info("%s", format_decision(decision, self.inner))

    # ----- the decision (rank 0, background thread) -----------------------------------------
    def _defaults(self, sums):
        """Each layer's default setting, whose total error is the budget: the wrapped
        compressor's uniform default, or Accordion's choice (densities become k for TopK)."""
        if self.config.objective != "accordion":
            return {name: self.inner.config.default for name in sums}
        shapes = self._shapes
        defaults = {}
        for name, gradient in sums.items():
            norm = gradient.norm().item()
            before = self._previous_norms.get(name)
            critical = before is None or abs(norm - before) >= self.config.accordion.threshold * before
            value = self.config.accordion.critical if critical else self.config.accordion.normal
            defaults[name] = self.inner.tuning.setting_for_value(shapes[name], value)
            self._previous_norms[name] = norm
        return defaults

    def _decide(self, sums, norms, shapes, samples, version, decided_at, effective_step, step_seconds):
        start = time.perf_counter()
        notes = []
        defaults = self._defaults(sums)
        names = sorted(
            name
            for name in sums
            if self.config.dense_candidates or self.inner.tuning.compresses(shapes[name], defaults[name])
        )
        weights = self._time_weights(names, shapes, samples, notes) if self.config.objective == "time" else None
        candidates = {}
        for name in names:
            options = self.inner.tuning.candidates(shapes[name], defaults[name], self.config.candidates)
            if not self.config.dense_candidates:
                options = [o for o in options if self.inner.tuning.compresses(shapes[name], o)]
            candidates[name] = options
        # All layers at once: the compressor batches layers of one shape (low-rank's svdvals).
        computed = self.inner.tuning.errors_of_layers({name: (sums[name], candidates[name]) for name in names})
        # One device-to-host transfer for the whole table and the window's norms.
        read = read_rows({**computed, **norms})
        rows = []
        for name in names:
            shape, options = shapes[name], candidates[name]
            errors = [0.0 if not self.inner.tuning.compresses(shape, o) else e for o, e in zip(options, read[name])]
            sizes = [self.inner.tuning.payload_bytes(shape, o) for o in options]
            rows.append((options, sizes, errors, options.index(self.inner.tuning.resolve(shape, defaults[name]))))
        width = max((len(options) for options in candidates.values()), default=0)
        size_table = np.full((len(names), width), np.inf)
        error_table = np.full((len(names), width), np.inf)
        for i, (options, sizes, errors, _) in enumerate(rows):
            size_table[i, : len(options)] = sizes
            error_table[i, : len(options)] = errors
        defaults_at = [row[3] for row in rows]
        budget = float(sum(error_table[i, d] for i, d in enumerate(defaults_at)))
        uniform_bytes = int(sum(size_table[i, d] for i, d in enumerate(defaults_at)))
        cost = size_table if weights is None else size_table * weights[:, None]
        # The uniform default meets the budget exactly; the solver, which rounds errors up to
        # stay feasible, can miss it by up to one step per layer. Keep whichever costs less.
        uniform = np.array(defaults_at)
        choice, total_error = uniform, budget
        try:
            solved, _, solved_error = solve(cost, error_table, budget, self.config.discretization)
            if cost[np.arange(len(names)), solved].sum() < cost[np.arange(len(names)), uniform].sum():
                choice, total_error = solved, solved_error
        except ValueError as error:
            notes.append(f"kept the defaults: {error}")
        settings = {name: options[c] for name, (options, _, _, _), c in zip(names, rows, choice)}
        total_bytes = int(sum(size_table[i, c] for i, c in enumerate(choice)))
        layers = {}
        for name, (options, sizes, errors, default_at), chosen in zip(names, rows, choice):
            layers[name] = {
                "options": list(options),
                "bytes": [int(b) for b in sizes],
                "errors": [float(e) for e in errors],
                "chosen": int(chosen),
                "default": int(default_at),
            }
            for kind in ("gradient_norm", "residual_norm"):
                layers[name][kind] = read.get(name + NORM_KEY + kind, [0.0])[0]
        return Decision(
            version,
            decided_at,
            effective_step,
            settings,
            total_bytes,
            uniform_bytes,
            float(total_error),
            budget,
            self.config.objective,
            time.perf_counter() - start,
            step_seconds,
            notes,
            layers,
        )

    # ----- the time objective -------------------------------------------------------------
    def _bucket_of(self, name, shapes):
        """Layers split into ``time_buckets`` consecutive groups in the order gradients arrive."""
        order = list(shapes)
        return min(self.config.time_buckets - 1, order.index(name) * self.config.time_buckets // len(order))

    def _count_bucket_bytes(self, name, payload):
        if self._step_bucket_bytes is None:
            self._step_bucket_bytes = [0] * self.config.time_buckets
        bucket = self._bucket_of(name, self._shapes)
        self._step_bucket_bytes[bucket] += payload.numel() * payload.element_size()

    def _time_weights(self, names, shapes, samples, notes):
        coefficients = fit_bucket_seconds_per_byte(samples, self.config.time_buckets)
        if coefficients is None:
            notes.append(f"time model not identifiable from {len(samples)} samples; optimised size instead")
            return None
        return np.array([coefficients[self._bucket_of(name, shapes)] for name in names])

    # ----- checkpointing ----------------------------------------------------------------------
    def state_dict(self):
        """Everything that determines future settings: the wrapped compressor's checkpoint, the
        schedule, the decision in flight (rank 0 waits for its computation to finish), rank 0's
        accumulated gradients, Accordion's norms and the time samples. Readable with
        ``torch.load(weights_only=True)``."""
        outcome = self.service.finished_outcome() if self._pending is not None else None
        if outcome is not None and outcome[0] == "ok":
            outcome = ["ok", asdict(outcome[1])]
        return self._state(self._pending, outcome, self.inner.state_dict())

    def elastic_state_dict(self):
        """As ``state_dict``, without waiting: a decision in flight is left out (dropped if
        this state is restored, as on any world change) and so are the gradients it was given."""
        return self._state(None, None, self.inner.elastic_state_dict())

    def _state(self, pending, outcome, inner):
        return {
            **checkpoint_header("LGreCo", self.config),
            "inner": inner,
            "step": self.step,
            "version": self.version,
            "next_decision": self._next_decision,
            "delay": self._delay,
            "pending": None if pending is None else list(pending),
            "outcome": None if outcome is None else list(outcome),
            "shapes": [[name, list(shape)] for name, shape in self._shapes.items()],
            "sums": {name: value.clone() for name, value in self._sums.committed.items()},
            "decisions": [asdict(d) for d in self.decisions],
            "previous_norms": dict(self._previous_norms),
            "time_samples": [[list(b), s] for b, s in self._time_samples],
        }

    def load_state_dict(self, state_dict):
        """Restores the wrapped compressor (so the current per-layer settings), the schedule and
        a decision in flight, so that training resumes exactly. Checked before anything changes:
        a mismatch raises ``ValueError`` and leaves this object as it was."""
        check_checkpoint(
            "LGreCo",
            state_dict,
            (
                "inner",
                "step",
                "version",
                "next_decision",
                "delay",
                "pending",
                "outcome",
                "shapes",
                "sums",
                "decisions",
                "previous_norms",
                "time_samples",
            ),
            self.config,
        )
        decisions = [Decision(**d) for d in state_dict["decisions"]]
        outcome = state_dict["outcome"]
        if outcome is not None and outcome[0] == "ok":
            outcome = ("ok", Decision(**outcome[1]))
        self.inner.load_state_dict(state_dict["inner"])  # checks its own part; last to raise
        self.step, self.version = state_dict["step"], state_dict["version"]
        self._next_decision, self._delay = state_dict["next_decision"], state_dict["delay"]
        self._pending = None if state_dict["pending"] is None else tuple(state_dict["pending"])
        self.service.restore(None if outcome is None else tuple(outcome))
        self._shapes = {name: tuple(shape) for name, shape in state_dict["shapes"]}
        self._sums.clear()
        self._sums.committed.update({name: value.clone() for name, value in state_dict["sums"].items()})
        self.decisions = deque(decisions, maxlen=DECISIONS_KEPT)
        self._previous_norms = dict(state_dict["previous_norms"])
        self._time_samples = deque(((tuple(b), s) for b, s in state_dict["time_samples"]), maxlen=TIME_SAMPLES)


def read_rows(rows):
    """{key: 1-D tensor} as {key: list of floats}, in one device-to-host transfer."""
    if not rows:
        return {}
    device = next(iter(rows.values())).device
    flat = torch.cat([row.reshape(-1).to(device, torch.float64) for row in rows.values()]).tolist()
    read, start = {}, 0
    for key, row in rows.items():
        read[key], start = flat[start : start + row.numel()], start + row.numel()
    return read


def next_delay(decision):
    """apply_delay="auto": steps from the next decision's submission to its exchange, 1.5x the
    steps this one took to compute (the same on every rank: it follows from the agreed decision)."""
    if decision.step_seconds == 0:
        return FIRST_DELAY
    return max(1, math.ceil(DELAY_MARGIN * decision.seconds / decision.step_seconds))


def fit_bucket_seconds_per_byte(samples, buckets):
    """Least squares fit of seconds = a + sum_b t_b * bytes_b over measured steps: the paper's
    per-bucket time coefficients. None while the samples cannot identify every t_b > 0."""
    if len(samples) < buckets + 2:
        return None
    x = np.array([[1.0] + list(b) for b, _ in samples])
    y = np.array([s for _, s in samples])
    if np.linalg.matrix_rank(x) < buckets + 1:
        return None
    coefficients = np.linalg.lstsq(x, y, rcond=None)[0][1:]
    if not np.all(coefficients > 0):
        return None
    return coefficients


def format_decision(decision, inner):
    label = inner.setting_name
    lines = [
        f"L-GreCo decision {decision.version} ({decision.objective}; gradients up to step "
        f"{decision.decided_at}, effective from step {decision.effective_step}, computed in "
        f"{decision.seconds:.2f} s): {decision.total_bytes} bytes/step vs "
        f"{decision.uniform_bytes} uniform ({decision.uniform_bytes / max(decision.total_bytes, 1):.2f}x "
        f"fewer); error {decision.total_error:.4g} of budget {decision.budget:.4g}"
    ]
    lines += [f"  {note}" for note in decision.notes]
    lines += [f"  {name}: {label} {value}" for name, value in sorted(decision.settings.items())]
    return "\n".join(lines)

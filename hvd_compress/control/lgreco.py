"""L-GreCo (Markov et al., MLSys 2024): per-layer compression settings chosen by dynamic
programming under an error budget, decided on rank 0 and applied by every rank at one step.
Its configuration is in ``lgreco_config``, the decision itself in ``decision``."""

import logging
import math
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Any, Optional

from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.config import check_checkpoint, checkpoint_header, configured
from hvd_compress.compressors.feedback import StagedSums
from hvd_compress.control.decision import (
    NORM_KEY,
    Decision,
    bucket_of,
    decide,
    format_decision,
)
from hvd_compress.control.lgreco_config import LGreCoConfig
from hvd_compress.control.service import DecisionService, Postponed
from hvd_compress.control.wrapping import Controller

logger = logging.getLogger(__name__)

# The time objective's model is fitted to the last this many steps: a fixed window, so state
# and checkpoints stay bounded however long training runs.
TIME_SAMPLES = 512
DECISIONS_KEPT = 64
# apply_delay="auto": the first decision's delay in steps (later ones follow from how long the
# last decision took), and the safety factor on that measured time.
FIRST_DELAY = 10
DELAY_MARGIN = 1.5
STEP_TIME_SMOOTHING = 0.1  # weight of the newest step in rank 0's running step time


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

    # ----- the decision (rank 0, background thread: ``decision.decide``) ---------------------
    def _decide(self, sums, norms, shapes, samples, version, decided_at, effective_step, step_seconds):
        pending = (version, decided_at, effective_step)
        norms_before = self._previous_norms  # Accordion's, updated by the decision
        return decide(self.inner, self.config, norms_before, sums, norms, shapes, samples, pending, step_seconds)

    def _count_bucket_bytes(self, name, payload):
        """The time objective: this step's bytes, per bucket of layers (``decision.bucket_of``)."""
        if self._step_bucket_bytes is None:
            self._step_bucket_bytes = [0] * self.config.time_buckets
        bucket = bucket_of(name, self._shapes, self.config.time_buckets)
        self._step_bucket_bytes[bucket] += payload.numel() * payload.element_size()

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


def next_delay(decision):
    """apply_delay="auto": steps from the next decision's submission to its exchange, 1.5x the
    steps this one took to compute (the same on every rank: it follows from the agreed decision)."""
    if decision.step_seconds == 0:
        return FIRST_DELAY
    return max(1, math.ceil(DELAY_MARGIN * decision.seconds / decision.step_seconds))

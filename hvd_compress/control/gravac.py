"""GraVAC (Tyagi and Sharma, 2023): the compression factor adapts to compression gain and
throughput. Policy (Algorithm 1, pure) apart from mechanism (gains measured on real gradients,
agreed across ranks)."""

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import carrying
from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.config import MethodConfig, check_checkpoint, checkpoint_header, configured, option
from hvd_compress.control.wrapping import Controller

DENSE = 1.0
# ``history`` keeps the latest steps only, so state and checkpoints stay bounded.
HISTORY_KEPT = 1000
POLICIES = ("exponential", "geometric")


@dataclass(frozen=True, kw_only=True)
class GraVACConfig(MethodConfig):
    """GraVAC's configuration (see its tuning guide); ``smoothing=None``: the paper's N / 100."""

    theta_min: float = option(10.0, arguments.real, low=1)
    theta_max: float = 1000.0  # checked by ``check``: at least theta_min
    epsilon: float = option(0.7, arguments.real, low=0, high=1, low_open=True)
    omega: float = option(0.01, arguments.real, low=0)
    window: int = option(500, arguments.integer, low=1)
    policy: str = option("exponential", arguments.choice, options=POLICIES)
    smoothing: Optional[float] = None
    scale_down_to: str = option("min", arguments.choice, options=("min", "dense"))

    def check(self, owner):
        """theta_max, bounded by theta_min, and smoothing, which may be None."""
        self._keep("theta_max", arguments.real(owner, "theta_max", self.theta_max, low=self.theta_min))
        if self.smoothing is not None:
            self._keep("smoothing", arguments.real(owner, "smoothing", self.smoothing, low=0, high=1, low_open=True))


def smoothing_for(config: GraVACConfig, world_size: int) -> float:
    """The EWMA factor: the configured one, or the paper's N / 100 for a world of N."""
    return min(1.0, world_size / 100) if config.smoothing is None else config.smoothing


class GraVACPolicy:
    """Algorithm 1 of the paper on global numbers: no tensors, no communication.

    Compression gain of a factor (CF) is EWMA-smoothed kept energy, sum ||C(g+e)||^2 over
    sum ||g+e||^2 across all compressed layers and ranks. Compression throughput of a CF is its
    measured system throughput (1 / step seconds) times its gain, EWMA-smoothed. Every
    ``window`` steps the candidate CF moves up the scaling policy's sequence (exponential:
    theta_min * 2^1, 2^2, 2^4, 2^8, ...; geometric: theta_min * 2, 4, 8, ...; capped at
    theta_max); theta_min rises to the candidate when their gains are within ``omega``
    (relative); once the two best throughputs are within ``omega`` the lower of their CFs is
    kept for good.
    """

    def __init__(self, config: GraVACConfig, world_size: int = 1):
        """``world_size`` sets the smoothing where ``config.smoothing`` is None (N / 100)."""
        # Fixed; everything else below is the policy's state (``state``/``load``).
        self.config = config
        self.theta_min = config.theta_min
        self.smoothing = smoothing_for(config, world_size)
        self.exponent = 0  # the candidate is config.theta_min * 2^(sequence[exponent])
        self.candidate = self._next_candidate()
        self.gain_min = self.gain_candidate = None
        self.throughput = {}  # CF -> EWMA compression throughput
        self.settled = False
        self.steps = 0

    def _next_candidate(self):
        self.exponent += 1
        power = 2 ** (self.exponent - 1) if self.config.policy == "exponential" else self.exponent
        return min(self.config.theta_min * 2.0**power, self.config.theta_max)

    def choose(self) -> float:
        """The CF to send at the next step (Algorithm 1, lines 11-25, on the smoothed gains)."""
        epsilon = self.config.epsilon
        if self.gain_candidate is None or self.gain_candidate >= epsilon:
            return self.candidate if self.gain_candidate is not None else self.theta_min
        if self.gain_min >= epsilon:
            return self.theta_min
        return self.theta_min if self.config.scale_down_to == "min" else DENSE

    def observe(self, cf: float, gain_min: float, gain_candidate: float, seconds: Optional[float] = None) -> float:
        """One step's global measurements: ``cf``, the factor it sent, and the gains measured on
        its gradients (lines 7 and 9, EWMA-smoothed); ``seconds``, its duration, when already
        known (UpdateStep, lines 28-30). A step's duration is often known only later: then pass
        ``seconds=None`` and hand it to ``record_time`` with the gain this returns, the smoothed
        gain of ``cf`` at this step (1 for dense, as line 25)."""
        a = self.smoothing
        self.gain_min = gain_min if self.gain_min is None else (1 - a) * self.gain_min + a * gain_min
        self.gain_candidate = (
            gain_candidate if self.gain_candidate is None else (1 - a) * self.gain_candidate + a * gain_candidate
        )
        gain = self.gain_of(cf)
        if seconds is not None:
            self.record_time(cf, gain, seconds)
        self.steps += 1
        if self.steps % self.config.window == 0 and not self.settled:
            self._check()
        return gain

    def gain_of(self, cf: float) -> float:
        """The smoothed gain of ``cf``: theta_min's or the candidate's, 1 for dense."""
        return {self.candidate: self.gain_candidate, self.theta_min: self.gain_min}.get(cf, 1.0)

    def record_time(self, cf: float, gain: float, seconds: float) -> None:
        """UpdateStep (lines 28-30) for a step that sent ``cf``, whose smoothed gain was ``gain``
        (what ``observe`` returned for it) and which took ``seconds``: its compression throughput,
        system throughput times gain, is smoothed into ``cf``'s. System throughput is N b / t_iter;
        N b is the same for every step and CF, so 1 / seconds ranks CFs alike. A duration that is
        not known (``seconds <= 0``) is skipped."""
        if seconds > 0:
            a = self.smoothing
            value = gain / seconds
            before = self.throughput.get(cf)
            self.throughput[cf] = value if before is None else (1 - a) * before + a * value

    def _check(self):
        """CheckGraVAC: scale up, raise theta_min, or settle on a saturated throughput."""
        evaluated, omega, theta_max = self.candidate, self.config.omega, self.config.theta_max
        if abs(self.gain_min - self.gain_candidate) <= omega * self.gain_min:
            self.theta_min = evaluated
        if evaluated < theta_max:
            self.candidate = self._next_candidate()
            while self.candidate <= self.theta_min and self.candidate < theta_max:
                self.candidate = self._next_candidate()
        best = sorted(self.throughput.items(), key=lambda item: item[1])
        if len(best) >= 2 and abs(best[-1][1] - best[-2][1]) <= omega * best[-2][1]:
            self.candidate = min(best[-1][0], best[-2][0])
            self.theta_min = min(self.theta_min, self.candidate)
            self.settled = True

    def use_world_size(self, size: int) -> None:
        """A new world: the smoothing follows its size where the configuration leaves it None."""
        self.smoothing = smoothing_for(self.config, size)

    def state(self):
        return {key: value for key, value in vars(self).items() if key != "config"}

    def load(self, state):
        # Only the state: checkpoints from before the configuration moved out also hold its values.
        self.__dict__.update({key: state[key] for key in self.state()})


class GraVAC(Controller):
    """Wraps TopK (its k), PowerSGD/ACPSGD (rank) or QSGD (bits) and chooses one compression
    factor for the whole model every step, by the paper's Algorithm 1 (see GraVACPolicy).

    Gain: kept energy ||C(x)||^2 / ||x||^2 with x = gradient + error feedback, summed over layers
    before dividing. We use squared norms, as the paper's Algorithm 1 does; the published code
    sums unsquared per-layer norms, which are not additive over layers (the norm of the whole
    gradient is not the sum of its layers' norms), so the threshold epsilon would mean a
    different thing for every model. For the projections Top-K and low-rank, kept energy equals
    1 - ||x - C(x)||^2 / ||x||^2; for QSGD (unbiased, ||C(x)|| >= ||x||) we use that second form,
    with the expected error in closed form. Energies are computed in float32 whatever the
    gradient's dtype (those of float16 gradients overflow float16), on x in the gradient's units
    (under ``track``, the residual is scaled by the loss scale as the compressor does).

    Multi-level: the candidate CF's gain is measured by compressing theta_min's output further
    (top-k within theta_min's selection; the best lower rank of theta_min's projection).

    Decisions are global: each compressed gradient's payload carries its layer's energies and
    the rank's last step time, so the collective that aggregates the gradient also sums them,
    and every rank feeds identical numbers to an identical policy: all switch at the same step.
    (The published code decides on each rank from local norms, which can mismatch collectives.)
    Every tunable layer carries them whatever its payload (compressed or dense, any dtype; see
    ``_carrying``), so the policy is fed every step, also while it sends dense.

    Step time: a step's duration ends after its collectives, so it travels in the next step's
    payloads. The factor and gains of a step are kept until then, and its throughput (gain /
    seconds) is credited to the factor that step sent; ``history`` gets its entry
    (cf, gain_min, gain_candidate, seconds) at that point, one step late. The gains themselves
    reach the policy at once, so each decision uses the gains of the step just ended. Durations
    run from one ``end_step`` to the next (forward, backward, compression and communication);
    the first step after construction or loading has none (0 in ``history``). A non-finite
    step leaves no trace: the step before it is paired with its own duration one step later.

    Tuning guide: Top-K with theta_min=10, theta_max=1000, epsilon 0.7-0.9 (higher keeps more
    information), window 500-2000 steps (too small exhausts the candidates while gradients are
    still volatile), omega 1%. ``scale_down_to="dense"`` sends uncompressed when even theta_min
    loses too much.
    """

    # Where step times come from (tests script it per instance).
    clock = staticmethod(time.perf_counter)

    def __init__(self, compressor: Compressor, *, config: Optional[GraVACConfig] = None, **options: Any):
        """``options``: ``GraVACConfig``'s fields; or pass ``config``, a ``GraVACConfig``."""
        super().__init__(compressor)
        self.config = configured(GraVACConfig, type(self).__name__, config, options)
        self.policy = GraVACPolicy(self.config)
        self.cf = self.policy.choose()
        # Per step, one step late (when its duration arrives): (cf, gain_min, gain_candidate, seconds).
        self.history = deque(maxlen=HISTORY_KEPT)
        self._factor_sum, self._factor_count = 0.0, 0  # over every step, for average_cf
        # The last finite step's (cf, gain_min, gain_candidate, smoothed gain of cf), waiting for
        # its duration, which the next step's payloads bring.
        self._pending = None
        self._memos = {}  # per parameter: the compressor's scratch for gains (warm starts)
        self._step_memos = {}
        self._shapes = {}  # compressed parameters seen so far
        self._step_stats = {}  # name -> this step's stats, averaged over ranks
        self._last_end = None
        self._last_seconds = 0.0  # the pending step's duration on this rank, 0 if unknown

    def bind_world(self, rank, size):
        super().bind_world(rank, size)
        self.policy.use_world_size(size)

    def metrics(self):
        """Adds the compression factor in force, its running mean, and theta_min."""
        return dict(
            super().metrics(),
            gravac_factor=self.cf,
            gravac_average_factor=self.average_cf,
            gravac_theta_min=self.policy.theta_min,
            gravac_settled=float(self.policy.settled),
        )

    @property
    def average_cf(self) -> float:
        """Mean compression factor over the steps so far (1 for dense steps)."""
        total, count = self._factor_sum, self._factor_count
        if self._pending:
            total, count = total + self._pending[0], count + 1
        return total / count if count else self.cf

    # ----- the exchange ------------------------------------------------------------------------
    def _begin_exchange(self, name, grad):
        shape = tuple(grad.shape)
        if not self.inner.tuning.tunable(shape):
            return self.inner.begin(name, grad)
        if name not in self._shapes:
            self._shapes[name] = shape
            self._apply_factor(name)
        # The candidate compresses further than theta_min: nested settings, multi-level gains.
        settings = [
            self.inner.tuning.setting_for_factor(shape, cf) for cf in (self.policy.theta_min, self.policy.candidate)
        ]
        # Warm starts are updated in a copy, kept only if the step turns out finite.
        memo = self._step_memos[name] = dict(self._memos.get(name, {}))
        # The energies come from the compression's own work where the compressor can (they
        # then cost no second pass over the gradient), and on dense steps are measured apart.
        round_, energies = self.inner.tuning.begin_measured(name, grad, settings, memo, uncompressed=self.cf == DENSE)
        # float32, on the gradient's device, made there without waiting for it: the stats
        # travel appended to the payload, and reach the host once per step (end_step).
        stats = torch.cat([energies, energies.new_full((1,), self._last_seconds)]).float()
        return self._carrying(name, round_, stats)

    def _carrying(self, name, round_, stats):
        """Appends ``stats`` (float32) to the payload (``comm.rounds.carrying``): the collective
        that aggregates the gradient averages them over ranks too, at no extra collective.
        A float16 all-reduce (a dense float16 gradient, sent by ``scale_down_to="dense"`` or by a
        low-rank compressor's dense warm-up or dense layers) then travels as float32: the
        layer's payload doubles in those rounds only, and the result, summed in float32 and
        rounded, is identical on every rank. Otherwise the stats cost their own 4 values per
        tunable layer and step (16 bytes; 32 in a float64 payload); in an all-to-all
        (QuantizedAllReduce), once per row."""
        return carrying(round_, stats, lambda mean: self._step_stats.__setitem__(name, mean))

    # ----- the step -------------------------------------------------------------------------
    def _end_step(self, comm_seconds):
        # The step's one wait for the device (its finiteness check) comes first, so that on a
        # GPU the clock reads when the step's work is done, not when it was launched.
        self.inner.end_step()
        stats, self._step_stats = self._step_stats, {}
        memos, self._step_memos = self._step_memos, {}
        totals = None
        if stats and self.inner.last_step_finite:
            # Summed in name order: gradients land in different orders on different ranks, and
            # the totals must agree to the last bit for every rank to take the same decision.
            totals = torch.stack([stats[name] for name in sorted(stats)]).double().sum(dim=0).tolist()
        now = self.clock()
        started, self._last_end = self._last_end, now
        if totals is None:
            # No trace: the pending step, and its duration, still wait for the next step.
            return
        self._memos.update(memos)
        total, kept_min, kept_candidate, seconds = totals
        seconds /= len(stats)  # every layer carried the same per-rank duration of the pending step
        if self._pending is not None:  # the previous step's duration has arrived: pair them
            cf, gain_min, gain_candidate, gain = self._pending
            self.history.append((cf, gain_min, gain_candidate, seconds))
            self._factor_sum, self._factor_count = self._factor_sum + cf, self._factor_count + 1
            self.policy.record_time(cf, gain, seconds)
        self._pending = None
        self._last_seconds = 0.0 if started is None else now - started
        if total <= 0:  # no gradient energy anywhere: no gains to learn from this step
            return
        gain_min, gain_candidate = kept_min / total, kept_candidate / total
        gain = self.policy.observe(self.cf, gain_min, gain_candidate)
        self._pending = (self.cf, gain_min, gain_candidate, gain)
        self.cf = self.policy.choose()
        # Applied now, not at the next begin, so that a fusion plan made before the next
        # step's first gradient already sees the new settings.
        for name in self._shapes:
            self._apply_factor(name)

    def _apply_factor(self, name):
        if self.cf != DENSE:
            self.inner.set_setting(name, self.inner.tuning.setting_for_factor(self._shapes[name], self.cf))

    def state_dict(self):
        """The policy, the wrapped compressor's checkpoint, the bounded history, warm starts and
        the step waiting for its duration. Readable with ``torch.load(weights_only=True)``."""
        return {
            **checkpoint_header("GraVAC", self.config),
            "inner": self.inner.state_dict(),
            "policy": self.policy.state(),
            "cf": self.cf,
            "history": list(self.history),
            "factor_sum": self._factor_sum,
            "factor_count": self._factor_count,
            "memos": {name: dict(memo) for name, memo in self._memos.items()},
            "shapes": {name: list(shape) for name, shape in self._shapes.items()},
            "pending": None if self._pending is None else list(self._pending),
            "last_seconds": self._last_seconds,
        }

    def load_state_dict(self, state_dict):
        """Checked before anything changes: a mismatch raises ``ValueError`` and leaves this
        object as it was. A step's duration does not span a reload."""
        check_checkpoint(
            "GraVAC",
            state_dict,
            (
                "inner",
                "policy",
                "cf",
                "history",
                "factor_sum",
                "factor_count",
                "memos",
                "shapes",
                "pending",
                "last_seconds",
            ),
            self.config,
        )
        self.inner.load_state_dict(state_dict["inner"])  # checks its own part; last to raise
        self.policy.load(state_dict["policy"])
        self.cf = state_dict["cf"]
        self.history = deque((tuple(h) for h in state_dict["history"]), maxlen=HISTORY_KEPT)
        self._factor_sum, self._factor_count = state_dict["factor_sum"], state_dict["factor_count"]
        self._memos = {name: dict(memo) for name, memo in state_dict["memos"].items()}
        self._shapes = {name: tuple(shape) for name, shape in state_dict["shapes"].items()}
        pending = state_dict["pending"]
        self._pending = None if pending is None else tuple(pending)
        self._last_seconds = state_dict["last_seconds"]
        self._last_end = None

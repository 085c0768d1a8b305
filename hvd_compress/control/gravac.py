"""GraVAC (Tyagi and Sharma, 2023): the compression factor adapts to compression gain and
throughput. Policy (Algorithm 1, pure) apart from mechanism (gains measured on real gradients,
agreed across ranks)."""
import time
from typing import Optional

import torch

from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import Compressor
from hvd_compress.control.wrapping import Controller

DENSE = 1.0
POLICIES = ("exponential", "geometric")


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

    def __init__(self, theta_min: float = 10.0, theta_max: float = 1000.0, epsilon: float = 0.7,
                 omega: float = 0.01, window: int = 500, policy: str = "exponential",
                 smoothing: float = 0.1, scale_down_to: str = "min"):
        checks = [("theta_min", theta_min >= 1), ("theta_max", theta_max >= theta_min),
                  ("epsilon", 0 < epsilon <= 1), ("omega", omega >= 0),
                  ("window", isinstance(window, int) and window >= 1),
                  ("policy", policy in POLICIES), ("smoothing", 0 < smoothing <= 1),
                  ("scale_down_to", scale_down_to in ("min", "dense"))]
        for label, ok in checks:
            if not ok:
                raise ValueError(f"GraVAC: invalid {label}: theta_min >= 1, theta_max >= theta_min, "
                                 f"epsilon in (0, 1], omega >= 0, window >= 1, policy in {POLICIES}, "
                                 f"smoothing in (0, 1], scale_down_to 'min' or 'dense'")
        self.initial_min, self.theta_min, self.theta_max = float(theta_min), float(theta_min), float(theta_max)
        self.epsilon, self.omega, self.window, self.policy = epsilon, omega, window, policy
        self.smoothing, self.scale_down_to = smoothing, scale_down_to
        self.exponent = 0  # the candidate is initial_min * 2^(sequence[exponent])
        self.candidate = self._next_candidate()
        self.gain_min = self.gain_candidate = None
        self.throughput = {}  # CF -> EWMA compression throughput
        self.settled = False
        self.steps = 0

    def _next_candidate(self):
        self.exponent += 1
        power = 2 ** (self.exponent - 1) if self.policy == "exponential" else self.exponent
        return min(self.initial_min * 2.0 ** power, self.theta_max)

    def choose(self) -> float:
        """The CF to send at the next step (Algorithm 1, lines 11-25, on the smoothed gains)."""
        if self.gain_candidate is None or self.gain_candidate >= self.epsilon:
            return self.candidate if self.gain_candidate is not None else self.theta_min
        if self.gain_min >= self.epsilon:
            return self.theta_min
        return self.theta_min if self.scale_down_to == "min" else DENSE

    def observe(self, cf: float, gain_min: float, gain_candidate: float, seconds: float) -> None:
        """One step's global measurements; ``cf`` is the factor that step sent."""
        a = self.smoothing
        self.gain_min = gain_min if self.gain_min is None else (1 - a) * self.gain_min + a * gain_min
        self.gain_candidate = (gain_candidate if self.gain_candidate is None
                               else (1 - a) * self.gain_candidate + a * gain_candidate)
        if seconds > 0:
            gain = {self.candidate: self.gain_candidate, self.theta_min: self.gain_min}.get(cf, 1.0)
            value = gain / seconds
            before = self.throughput.get(cf)
            self.throughput[cf] = value if before is None else (1 - a) * before + a * value
        self.steps += 1
        if self.steps % self.window == 0 and not self.settled:
            self._check()

    def _check(self):
        """CheckGraVAC: scale up, raise theta_min, or settle on a saturated throughput."""
        evaluated = self.candidate
        if abs(self.gain_min - self.gain_candidate) <= self.omega * self.gain_min:
            self.theta_min = evaluated
        if evaluated < self.theta_max:
            self.candidate = self._next_candidate()
            while self.candidate <= self.theta_min and self.candidate < self.theta_max:
                self.candidate = self._next_candidate()
        best = sorted(self.throughput.items(), key=lambda item: item[1])
        if len(best) >= 2 and abs(best[-1][1] - best[-2][1]) <= self.omega * best[-2][1]:
            self.candidate = min(best[-1][0], best[-2][0])
            self.theta_min = min(self.theta_min, self.candidate)
            self.settled = True

    def state(self):
        return dict(vars(self))

    def load(self, state):
        self.__dict__.update(state)


class GraVAC(Controller):
    """Wraps TopK (its k), PowerSGD/ACPSGD (rank) or QSGD (bits) and chooses one compression
    factor for the whole model every step, by the paper's Algorithm 1 (see GraVACPolicy).

    Gain: kept energy ||C(x)||^2 / ||x||^2 with x = gradient + error feedback, summed over layers
    before dividing. We use squared norms, as the paper's Algorithm 1 does; the published code
    sums unsquared per-layer norms, which are not additive over layers (the norm of the whole
    gradient is not the sum of its layers' norms), so the threshold epsilon would mean a
    different thing for every model. For the projections Top-K and low-rank, kept energy equals
    1 - ||x - C(x)||^2 / ||x||^2; for QSGD (unbiased, ||C(x)|| >= ||x||) we use that second form,
    with the expected error in closed form.

    Multi-level: the candidate CF's gain is measured by compressing theta_min's output further
    (top-k within theta_min's selection; the best lower rank of theta_min's projection).

    Decisions are global: each compressed gradient's payload carries its layer's energies and
    the rank's last step time, so the collective that aggregates the gradient also sums them,
    and every rank feeds identical numbers to an identical policy: all switch at the same step.
    (The published code decides on each rank from local norms, which can mismatch collectives.)

    Tuning guide: Top-K with theta_min=10, theta_max=1000, epsilon 0.7-0.9 (higher keeps more
    information), window 500-2000 steps (too small exhausts the candidates while gradients are
    still volatile), omega 1%. ``scale_down_to="dense"`` sends uncompressed when even theta_min
    loses too much.
    """

    def __init__(self, compressor: Compressor, *, theta_min: float = 10.0, theta_max: float = 1000.0,
                 epsilon: float = 0.7, omega: float = 0.01, window: int = 500,
                 policy: str = "exponential", smoothing: Optional[float] = None,
                 scale_down_to: str = "min"):
        super().__init__(compressor)
        self._smoothing = smoothing
        self.policy = GraVACPolicy(theta_min, theta_max, epsilon, omega, window, policy,
                                   smoothing or 0.1, scale_down_to)
        self.cf = self.policy.choose()
        self.history = []  # per step: (cf, gain_min, gain_candidate, seconds)
        self._memos = {}  # per parameter: the compressor's scratch for gains (warm starts)
        self._step_memos = {}
        self._shapes = {}  # compressed parameters seen so far
        self._step_stats = {}  # name -> this step's stats, averaged over ranks
        self._last_end = None
        self._last_seconds = 0.0

    def bind_world(self, rank, size):
        super().bind_world(rank, size)
        if self._smoothing is None:  # the paper: EWMA factor N / 100
            self.policy.smoothing = min(1.0, size / 100)

    def config(self):
        p = self.policy
        return {"inner": self.inner.describe(), "theta_min": p.initial_min, "theta_max": p.theta_max,
                "epsilon": p.epsilon, "omega": p.omega, "window": p.window, "policy": p.policy,
                "smoothing": self._smoothing, "scale_down_to": p.scale_down_to}

    @property
    def average_cf(self) -> float:
        """Mean compression factor over the steps so far (1 for dense steps)."""
        return sum(h[0] for h in self.history) / len(self.history) if self.history else self.cf

    # ----- the exchange ------------------------------------------------------------------------
    def begin(self, name, grad):
        shape = tuple(grad.shape)
        if not self.inner.tunable(shape):
            return self.inner.begin(name, grad)
        if name not in self._shapes:
            self._shapes[name] = shape
            self._apply_factor(name)
        x = grad.detach().float()
        residual = self.inner.residual(name)
        if residual is not None:
            x = x + residual.view(shape)
        # The candidate compresses further than theta_min: nested settings, multi-level gains.
        settings = [self.inner.setting_for_factor(shape, cf)
                    for cf in (self.policy.theta_min, self.policy.candidate)]
        # Warm starts are updated in a copy, kept only if the step turns out finite.
        memo = self._step_memos[name] = dict(self._memos.get(name, {}))
        kept = self.inner.kept_energies(name, x, settings, memo)
        # On the gradient's device: it travels appended to the payload.
        stats = torch.tensor([x.square().sum().item(), *kept, self._last_seconds], device=x.device)
        if self.cf == DENSE:
            round_ = self.inner.begin_uncompressed(name, grad)
        else:
            round_ = self.inner.begin(name, grad)
        return self._carrying(name, round_, stats)

    def _carrying(self, name, round_, stats):
        """Appends ``stats`` to the first round's payload; the collective that aggregates the
        gradient then averages them over ranks too."""
        payload, collective = round_.payload, round_.collective
        if collective is Collective.ALLREDUCE and payload.dtype == torch.float32:
            carried = torch.cat([payload.reshape(-1), stats.float()])

            def then(result):
                self._step_stats[name] = result[-stats.numel():]
                return round_.then(result[:-stats.numel()].view(payload.shape))
        elif collective is Collective.ALLGATHER and payload.dtype == torch.uint8:
            carried = torch.cat([payload, stats.float().view(torch.uint8)])
            tail = 4 * stats.numel()

            def then(rows):
                self._step_stats[name] = rows[:, -tail:].contiguous().view(torch.float32).mean(dim=0)
                return round_.then(rows[:, :-tail].contiguous())
        else:  # e.g. a float16 dense payload: nothing to learn from it anyway
            return round_
        return Round(carried, collective, then, round_.last, round_.root)

    # ----- the step -------------------------------------------------------------------------
    def end_step(self, comm_seconds=None):
        self.inner.end_step()
        now = time.perf_counter()
        self._last_seconds = 0.0 if self._last_end is None else now - self._last_end
        self._last_end = now
        stats, self._step_stats = self._step_stats, {}
        memos, self._step_memos = self._step_memos, {}
        if not stats or not self.inner.last_step_finite:
            return
        self._memos.update(memos)
        # Summed in name order: gradients land in different orders on different ranks, and the
        # totals must agree to the last bit for every rank to take the same decision.
        total, kept_min, kept_candidate, seconds = torch.stack(
            [stats[name] for name in sorted(stats)]).double().sum(dim=0).tolist()
        seconds /= len(stats)  # every layer carried the same per-rank step time
        if total <= 0:
            return
        gain_min, gain_candidate = kept_min / total, kept_candidate / total
        self.history.append((self.cf, gain_min, gain_candidate, seconds))
        self.policy.observe(self.cf, gain_min, gain_candidate, seconds)
        self.cf = self.policy.choose()
        # Applied now, not at the next begin, so that a fusion plan made before the next
        # step's first gradient already sees the new settings.
        for name in self._shapes:
            self._apply_factor(name)

    def _apply_factor(self, name):
        if self.cf != DENSE:
            self.inner.set_setting(name, self.inner.setting_for_factor(self._shapes[name], self.cf))

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "policy": self.policy.state(), "cf": self.cf,
                "history": list(self.history), "memos": {name: dict(memo) for name, memo in self._memos.items()}}

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict["inner"])
        self.policy.load(state_dict["policy"])
        self.cf, self.history = state_dict["cf"], list(state_dict["history"])
        self._memos = {name: dict(memo) for name, memo in state_dict["memos"].items()}

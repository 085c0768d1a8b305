"""State, checks and the controller protocol shared by the low-rank compressors (PowerSGD, ACP-SGD)."""

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvd_compress import arguments
from hvd_compress.compressors.base import Compressor, NamedParameters, dense_round
from hvd_compress.compressors.config import CompressorConfig, configured, option
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.compressors.tuning import LowRankTuning
from hvd_compress.maths import lowrank


@dataclass
class LowRankState:
    p: torch.Tensor  # n x r, warm start for ACP-SGD's Q steps
    q: torch.Tensor  # m x r, warm start for the next P = M Q
    step: int = 0


@dataclass(frozen=True, kw_only=True)
class LowRankConfig(CompressorConfig):
    """PowerSGD's and ACP-SGD's configuration (``default``: the rank); see their tuning guides."""

    default: int = 4
    min_compression_rate: float = option(2.0, arguments.real, low=0, low_open=True)
    start_step: int = option(0, arguments.integer, low=0)
    error_feedback: bool = option(True, arguments.flag)
    warm_start: bool = option(True, arguments.flag)
    seed: int = option(0, arguments.integer)


class LowRankCompressor(Compressor):
    setting_name = "rank"
    controllable = True
    # Every round's payload is a product with M: an Inf or NaN of M reaches it (base's docstring).
    payload_carries_input = True
    tuning_class = LowRankTuning
    state_type = LowRankState

    def __init__(
        self,
        named_parameters: NamedParameters = None,
        rank: int = LowRankConfig.default,
        *,
        config: Optional[LowRankConfig] = None,
        **options: Any,
    ):
        """``rank`` (the configuration's ``default``) and ``options`` are ``LowRankConfig``'s
        fields; or pass ``config``, a ``LowRankConfig``."""
        config = configured(LowRankConfig, type(self).__name__, config, options, default=rank)
        self.feedback = ErrorFeedback(enabled=config.error_feedback)
        super().__init__(named_parameters, config)

    # ----- the exchange -------------------------------------------------------------------
    def _prepare(self, name, grad):
        """Returns (state, M, rank) with M = gradient + error feedback as an n x m float32
        matrix, or None while the dense warm-up (``start_step``) lasts."""
        n, m, r = lowrank.factor_shapes(grad.shape, self.setting(name))
        st = self.state.get(name)
        if st is None:
            device = grad.device
            st = LowRankState(
                p=lowrank.seeded_normal(n, r, self.config.seed, name, "p").to(device),
                q=lowrank.seeded_normal(m, r, self.config.seed, name, "q").to(device),
            )
            self.state[name] = st
        if st.q.shape[1] != r:
            st.p = lowrank.resize_columns(st.p, r, self.config.seed, f"{name}.p")
            st.q = lowrank.resize_columns(st.q, r, self.config.seed, f"{name}.q")
        st.step += 1
        if st.step <= self.config.start_step:
            return None
        # M is built in the error-feedback buffer itself, and ``_remember`` leaves the new
        # residual there: no gradient-sized allocation per step.
        return st, self.feedback.compensated(name, grad.reshape(n, m)), r

    def _remember(self, matrix, p, q):
        """Error feedback: what this rank failed to send, M - P Q^T, stays in M's buffer and is
        added to its next gradient. Nothing reads M afterwards."""
        if self.config.error_feedback:
            matrix.addmm_(p, q.t(), alpha=-1)

    def _decompressed(self, p, q, grad):
        """P Q^T shaped and typed as ``grad``, in its memory where ``ResultMemory.memory`` allows."""
        into = self.results.memory(grad)
        if into is None:
            return (p @ q.t()).view(grad.shape).to(grad.dtype)
        return torch.mm(p, q.t(), out=into.view(p.shape[0], q.shape[0])).view(grad.shape)

    def _reused(self, st, name, which):
        """The factor (``"p"`` or ``"q"``) to start this step from: last step's (warm start), or
        without warm start a fresh random one, identical on every rank."""
        factor = getattr(st, which)
        if self.config.warm_start:
            return factor
        return lowrank.seeded_normal(*factor.shape, self.config.seed, name, f"{which}{st.step}").to(factor)

    def _begin(self, name, grad):
        prepared = self._prepare(name, grad)
        if prepared is None:
            return dense_round(grad)
        return self._rounds(name, grad, *prepared)

    def _rounds(self, name, grad, st, matrix, r):
        raise NotImplementedError

    # ----- same-shape layers in one batched call (``batches_layers``) ----------------------
    def _batches(self, items):
        """Groups of two or more gradients compressed this step whose matrices share a shape and
        a rank (and whatever ``_batch_key`` adds), each ``_new_batch``'s. A gradient still in
        the dense warm-up or without state yet (its first step) goes alone, as does everything
        without error feedback (its sums are fresh copies, which a batch would copy again)."""
        if not (self.batches_layers and self.config.error_feedback):
            return {}
        groups = {}
        for name, grad in items:
            st = self.state.get(name)
            setting = self.setting(name)
            if st is None or st.step + 1 <= self.config.start_step or not self.tuning.compresses(grad.shape, setting):
                continue
            key = (*lowrank.factor_shapes(tuple(grad.shape), setting), grad.device, self._batch_key(st))
            groups.setdefault(key, []).append(name)
        batches = {}
        for (n, m, r, device, _), names in groups.items():
            if len(names) > 1:
                batch = self._new_batch(names, n, m, r, device)
                batches.update(dict.fromkeys(names, batch))
        return batches

    def _batch_key(self, st):
        """What else a batch's members must share (ACP-SGD: the half-step they take)."""
        return None

    def _new_batch(self, names, n, m, r, device):
        raise NotImplementedError


def factor_bytes(shape, rank, factors):
    """float32 bytes of ``factors`` ("pq", "p" or "q") for a gradient of ``shape`` at ``rank``."""
    n, m, r = lowrank.factor_shapes(shape, rank)
    return 4 * r * sum(n if f == "p" else m for f in factors)

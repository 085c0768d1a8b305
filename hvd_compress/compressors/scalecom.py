"""ScaleCom (Chen et al., NeurIPS 2020): cyclic local top-k, so sparse payloads all-reduce."""

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import NamedParameters, dense_round
from hvd_compress.compressors.config import configured, option
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.compressors.topk import KSparse, KSparseConfig
from hvd_compress.maths.chunked_topk import chunked_topk_indices


@dataclass(frozen=True, kw_only=True)
class ScaleComConfig(KSparseConfig):
    beta: float = option(1.0, arguments.real, low=0, high=1, low_open=True)
    chunks: int = option(64, arguments.integer, low=1)
    warmup_steps: int = option(0, arguments.integer, low=0)


@dataclass
class ScaleComState:
    step: int = 0


class ScaleCom(KSparse):
    """Cyclic local top-k (CLT-k) with a low-pass filter on error feedback.

    At step t the leader is rank t mod W. The leader selects the top-k indices of its
    (memory + gradient) and broadcasts them; every rank then all-reduces its own values at those
    indices. Because every rank sends the same indices, the compressed payloads sum: the sum of
    compressed vectors equals the compression of the sum (the commutative property, section 2 of
    the paper), and the all-reduce carries 4k bytes whatever W is, where Top-K's all-gather grows
    with W. Bytes per rank: a 4k-byte broadcast of indices plus a 4k-byte all-reduce.

    Error feedback is low-pass filtered: m <- (1 - beta) m + beta (m + g - C(m + g)); beta = 1 is
    plain error feedback (the paper's choice at standard batch sizes; 0.1 for large batches).

    Tuning guide: ``density`` 0.01-0.04 (25-100x); ``warmup_steps`` dense steps first (the paper
    uses 1-5 epochs); ``chunks`` for the chunk-wise selection. Per-layer rates from FLOPs per
    gradient element: :meth:`set_rates_from_flops`.

    Memory: the residual and the buffer the next one is built in (float32, per compressed
    parameter); on CPU the leader's selection also keeps one float32 per entry of the largest
    gradient it has selected from, per thread, between steps.
    """

    state_type = ScaleComState

    def __init__(
        self,
        named_parameters: NamedParameters = None,
        density: float = ScaleComConfig.density,
        *,
        config: Optional[ScaleComConfig] = None,
        **options: Any,
    ):
        """``density`` and ``options`` are ``ScaleComConfig``'s fields; or pass ``config``, a
        ``ScaleComConfig``."""
        config = configured(ScaleComConfig, type(self).__name__, config, options, density=density)
        self.feedback = ErrorFeedback()  # low-pass filtered, below
        super().__init__(named_parameters, config)

    def leader(self, step: int) -> int:
        """The rank whose indices everyone uses at (1-based) step ``step``."""
        return (step - 1) % self.size

    def _begin(self, name, grad):
        shape, dtype, n = grad.shape, grad.dtype, grad.numel()
        st = self.state.setdefault(name, ScaleComState())
        st.step += 1
        if st.step <= self.config.warmup_steps:
            return dense_round(grad)
        k = self.k_for(self.setting(name), n)
        # Built in the next residual's buffer; the residual the filter below needs stays as it was.
        acc = self.feedback.compensated(name, grad.reshape(-1))
        leader = self.leader(st.step)
        if self.rank == leader:
            indices = chunked_topk_indices(acc, k, self.config.chunks).to(torch.int32)
        else:
            indices = torch.zeros(k, dtype=torch.int32, device=grad.device)

        def after_indices(leader_indices):
            chosen = leader_indices.long()
            values = acc.index_select(0, chosen)
            # m + g - C(m + g), where acc was; index_fill_, since assigning a Python 0 waits for a
            # GPU per layer
            acc.index_fill_(0, chosen, 0)
            if self.config.beta != 1.0:
                acc.mul_(self.config.beta)
                previous = self.feedback.residual(name, acc.device)  # None at first: zero; unscaled
                if previous is not None:
                    acc.add_(previous, alpha=(1 - self.config.beta) * self.loss_scale())

            def after_values(mean_values):
                out = self.results.zeroed(grad)
                out[chosen] = mean_values
                return out.view(shape).to(dtype)

            return Round(values, Collective.ALLREDUCE, after_values, last=True)

        return Round(indices, Collective.BROADCAST, after_indices, root=leader)

    def set_rates_from_flops(
        self, flops: Dict[str, float], numels: Dict[str, int], per_worker_batch: int = 32, reference_batch: int = 32
    ) -> Dict[str, int]:
        """The paper's engineering rule: FLOPs per gradient element >= 196 -> 25x, [128, 196) ->
        50x, below -> 400x, at a per-worker batch of 32 (vision and speech). ``flops`` and
        ``numels`` map parameter names to one step's forward FLOPs and gradient sizes; the ratio
        is scaled to ``reference_batch`` so the rule follows the batch size."""
        rates = {}
        for name, layer_flops in flops.items():
            ratio = layer_flops / numels[name] * reference_batch / per_worker_batch
            rate = 25 if ratio >= 196 else 50 if ratio >= 128 else 400
            self.set_setting(name, max(1, math.ceil(numels[name] / rate)))
            rates[name] = rate
        return rates

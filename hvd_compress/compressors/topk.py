"""Top-K sparsification with error feedback."""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import Compressor, NamedParameters
from hvd_compress.compressors.config import CompressorConfig, configured, option
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.compressors.tuning import SparseTuning, check_positive_int, nested_ks
from hvd_compress.maths import error_tables as error_maths
from hvd_compress.maths import sparsify
from hvd_compress.maths.sparsify import topk_indices


@dataclass(frozen=True, kw_only=True)
class KSparseConfig(CompressorConfig):
    """``density``: the share of entries sent where a parameter's setting (k) is None."""

    density: float = option(0.01, arguments.real, low=0, high=1, low_open=True)


@dataclass(frozen=True, kw_only=True)
class TopKConfig(KSparseConfig):
    error_feedback: bool = option(True, arguments.flag)


class KSparse(Compressor):
    """What compressors that send k values and their int32 indices per gradient share: the
    setting is k, or None for ``density`` of the gradient's entries."""

    setting_name = "k"
    tuning_class = SparseTuning

    def k_for(self, setting: Optional[int], numel: int) -> int:
        """k at ``setting``; None means ``density`` of the gradient."""
        return setting if setting is not None else max(1, math.ceil(self.config.density * numel))

    def _compressed_bytes(self, shape, setting):
        return 8 * self.k_for(setting, math.prod(shape))


class TopKTuning(SparseTuning):
    """Top-K's energies come from its own selection (``TopK._compress``)."""

    def compress_measured(self, name, grad, settings, memo):
        return self.compressor._compress(name, grad, nested_ks(settings))


class TopK(KSparse):
    """Each rank sends its k largest-magnitude entries of (gradient + error feedback) as
    float32 values and int32 indices; what it did not send is fed back next step.

    Aggregation: ranks choose different indices, so payloads cannot be summed by all-reduce;
    they are all-gathered (8k bytes per rank) and each rank scatter-adds them in rank order,
    which makes the result bit-identical everywhere. Bytes on the wire grow with W, so Top-K
    pays off when (W-1) * 8k is well below the 8n(W-1)/W of a float32 ring all-reduce, that is
    at densities below about 1/W. (ScaleCom's cyclic local top-k removes this limit.)

    Tuning guide: ``density`` 0.01 (1%) is the common default; per-parameter ``k`` via
    ``set_setting(name, k)``. Selection estimates a threshold from a sample and sorts only
    the candidates above it, which is exact and much faster than ``torch.topk`` at low density.

    Memory: the residual and the buffer the next one is built in (float32, per compressed
    parameter); on CPU the selection also keeps one byte per entry of the largest gradient it
    has selected from, per thread, between steps.
    """

    controllable = True
    tuning_class = TopKTuning
    compiled_kernels = sparsify.COMPILED_KERNELS
    # An Inf or NaN magnitude ranks above every finite one (torch.topk, and the sampled
    # threshold's candidates, which keep NaN), so a non-finite input is always among the k sent.
    payload_carries_input = True

    def __init__(
        self,
        named_parameters: NamedParameters = None,
        density: float = TopKConfig.density,
        *,
        config: Optional[TopKConfig] = None,
        **options: Any,
    ):
        """``density`` and ``options`` are ``TopKConfig``'s fields; or pass ``config``, a
        ``TopKConfig``."""
        config = configured(TopKConfig, type(self).__name__, config, options, density=density)
        self.feedback = ErrorFeedback(enabled=config.error_feedback)
        super().__init__(named_parameters, config)

    def _begin(self, name, grad):
        return self._compress(name, grad, None)[0]

    def _warm_up(self, numel, setting, device):
        sparsify.warm_up(numel, device)

    def _compress(self, name, grad, nested):
        """(the round, GraVAC's energies at the k's ``nested``, or None without them). The
        energies come from this compression's own work: x is the accumulator it selects from,
        and its selection holds the energy of the k it sends and, when that is nested[0]
        (theta_min), of every nested k (top-k within it); the others are measured on the
        accumulator before the selection is zeroed."""
        shape, dtype, n = grad.shape, grad.dtype, grad.numel()
        k = self.k_for(self.setting(name), n)
        check_positive_int(self, name, "k", k, upper=n)
        # Gradient plus residual, built in the residual's buffer; zeroing what is sent leaves
        # the next residual there.
        acc = self.feedback.compensated(name, grad.reshape(-1))
        indices = self.compiled_path.run(lambda compiled: topk_indices(acc, k, compiled))
        values = acc.index_select(0, indices)
        energies = None
        if nested is not None:
            if k == nested[0]:
                kept = error_maths.kept_within_selection(values, nested)
            elif k == nested[-1]:  # the selection holds the last k's energy; the others are measured
                kept = torch.cat(
                    [error_maths.topk_kept_energies(acc, nested[:-1]), values.double().square().sum().reshape(1)]
                )
            else:
                kept = error_maths.topk_kept_energies(acc, nested)
            energies = torch.cat([error_maths.squared_norm(acc), kept])
        acc.index_fill_(0, indices, 0)
        payload = torch.cat([values.view(torch.uint8), indices.to(torch.int32).view(torch.uint8)])

        def after_gather(rows):
            # An entry sums at most one value from each rank before the mean divides it.
            self.guard.bound_by(name, rows[:, : 4 * k].view(torch.float32), rows.shape[0])
            total = self.results.zeroed(grad)
            for row in rows:
                total.index_add_(0, row[4 * k :].view(torch.int32).long(), row[: 4 * k].view(torch.float32))
            if rows.shape[0] > 1:  # dividing by one would only cost a pass
                total.div_(rows.shape[0])
            return total.view(shape).to(dtype)

        return Round(payload, Collective.ALLGATHER, after_gather), energies

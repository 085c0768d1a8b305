"""EF-SignSGD with majority vote: one bit per entry, error feedback on every rank."""

import math
from typing import Any, Optional

import torch

from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import Compressor, NamedParameters
from hvd_compress.compressors.config import CompressorConfig, configured
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.maths import signs

# The scale's slot in a payload: its float32 and 4 zero bytes. The packed signs are a multiple
# of 8 bytes, so every gathered row stays 8-byte aligned.
SCALE_BYTES = 8


class SignSGD(Compressor):
    """EF-SignSGD (Karimireddy et al., 2019) aggregated by majority vote (Bernstein et al.,
    2019): each rank sends one bit per entry and one float32 scale.

    On each rank, with p = g + e (the gradient plus the error feedback) of d entries, the rank
    sends delta = (||p||_1 / d) * sign(p) and keeps e = p - delta for its next gradient.
    sign(0) = +1: bit 1 means p >= 0, in the payload and in the residual alike, so one bit is
    enough. The scale ||p||_1 / d is summed in float64; an Inf or NaN entry on any rank makes
    its scale, and so the whole aggregate, non-finite everywhere (the step is skipped).

    Aggregation: each entry is the sign of the sum of the W ranks' signs (the majority), times
    the mean of their scales; a tie (an even W split evenly) gives 0. Horovod's all-reduce
    takes no uint8, so the packed rows are all-gathered and every rank decodes them in rank
    order: the result is bit-identical on every rank. The error feedback corrects each rank's
    own compression, not the vote: an outvoted rank's residual holds its own scaled sign's error.

    Tuning guide: there is no per-parameter setting. A payload is d / 8 bytes (rounded up to
    8) plus 8 for the scale, 32x fewer than float32. All-gather bytes grow with W: a rank sends
    (W-1) * d / 8 bytes where a float32 ring all-reduce sends 8d(W-1)/W, a 64/W-fold saving
    (8x at W = 8, 2x at W = 32), so SignSGD pays off while W < 64; beyond that, prefer a
    compressor that all-reduces (PowerSGD, ScaleCom). With error feedback the scaled sign
    converges at SGD's rate (Karimireddy et al.), so keep the uncompressed run's learning rate,
    schedule and momentum (the optimizer applies momentum to the voted aggregate). The small,
    Adam-like learning rates of plain signSGD and Signum (Bernstein et al., who vote on each
    worker's momentum) are for unscaled, unit-magnitude updates and do not apply here. An even
    W zeroes the tied entries of a step; an odd W has no ties. 1-D gradients and those under
    ``min_numel`` entries go dense. Memory: two float32 buffers per compressed parameter (the
    error feedback).
    """

    setting_name = None
    controllable = False

    def __init__(
        self, named_parameters: NamedParameters = None, *, config: Optional[CompressorConfig] = None, **options: Any
    ):
        """``options``: ``CompressorConfig``'s fields (``min_numel``); or pass ``config``."""
        config = configured(CompressorConfig, type(self).__name__, config, options)
        self.feedback = ErrorFeedback()
        super().__init__(named_parameters, config)

    def _compressed_bytes(self, shape, setting):
        return signs.packed_size(math.prod(shape)) + SCALE_BYTES

    def _begin(self, name, grad):
        shape, dtype, n = grad.shape, grad.dtype, grad.numel()
        # p = g + e, built in the residual's buffer; subtracting delta leaves the next residual.
        p = self.feedback.compensated(name, grad.reshape(-1))
        scale = signs.mean_magnitude(p)
        bits = signs.nonnegative(p)
        p.sub_(signs.scaled_signs(bits, scale))
        code_bytes = signs.packed_size(n)
        slot = torch.nn.functional.pad(scale.reshape(1), (0, 1))
        payload = torch.cat([signs.pack_signs(bits), slot.view(torch.uint8)])

        def after_gather(rows):
            votes = signs.majority_vote([row[:code_bytes] for row in rows], n)
            total = None  # the scales' sum, in rank order
            for row in rows:
                row_scale = row[code_bytes : code_bytes + 4].view(torch.float32).double()
                total = row_scale if total is None else total.add_(row_scale)
            mean_scale = total.div_(rows.shape[0]).to(torch.float32)
            return votes.mul_(mean_scale).view(shape).to(dtype)

        return Round(payload, Collective.ALLGATHER, after_gather)

"""Chunked top-k with low-bit values and decaying error feedback: SparseLoCo's compressor."""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import Compressor, NamedParameters
from hvd_compress.compressors.config import CompressorConfig, configured, option
from hvd_compress.compressors.feedback import ErrorFeedback
from hvd_compress.maths import binned, packing

# Chunk positions travel as int16: a chunk holds at most this many entries.
MAX_CHUNK = 1 << 15


@dataclass(frozen=True, kw_only=True)
class ChunkedTopKConfig(CompressorConfig):
    """``density``: the share of each chunk's entries sent; ``chunk``: entries per chunk;
    ``bits``: per value sent (1, 2, 4 or 8, the sign included); ``feedback_decay``: the factor
    on the residual before the next input is added (1: plain error feedback)."""

    density: float = option(0.02, arguments.real, low=0, high=1, low_open=True)
    chunk: int = option(4096, arguments.integer, low=1, high=MAX_CHUNK)
    bits: int = option(2, arguments.integer)
    feedback_decay: float = option(1.0, arguments.real, low=0, high=1)

    def check(self, owner: str) -> None:
        if self.bits not in binned.BITS:
            raise ValueError(f"{owner}: bits must be one of {binned.BITS}, got {self.bits!r}")


class ChunkedTopK(Compressor):
    """Top-k within chunks, each value sent as its sign and a magnitude bin, with error feedback
    whose residual decays: the compressor of SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706,
    section 3), which replaces DiLoCo's outer momentum by this error feedback on the
    pseudo-gradients (``hvd_compress.SparseLoCo``); it compresses gradients step by step as well.

    A gradient of n entries (plus the decayed residual: x = g + beta * e) is cut into
    c = ceil(n / chunk) chunks of ``chunk`` entries (the last one zero-padded); each chunk sends
    its k = ceil(density * chunk) largest magnitudes: their positions in the chunk (int16), and
    their values in ``bits`` bits with the chunk's bin means (``maths.binned``: 2 bits are the
    sign and one of two magnitudes, each the mean of the magnitudes it stands for). What was not
    sent, and the rounding of what was, is the next residual e = x - C(x).

    Aggregation: ranks choose different positions, so payloads are all-gathered and each rank
    adds the W decoded rows in rank order and divides by W: bit-identical on every rank. A rank
    sends c * (2k + bits * k / 8 + 4 * 2^(bits-1)) bytes (packed codes rounded up to 8), about
    2.25 k + 8 bytes per chunk at 2 bits, a 4 * chunk / (2.25 k + 8) saving over float32 (about
    85x at 2% of 4,096) that the all-gather spends (W-1) times.

    Tuning guide: SparseLoCo sends 1-3% of each chunk of 4096 (64 x 64 in the paper) at 2 bits,
    with ``feedback_decay`` 0.95 over DiLoCo's pseudo-gradients: the decayed residual is the
    momentum. Per step, as a gradient compressor, keep ``feedback_decay`` 1. 1-D gradients and
    those under ``min_numel`` entries go dense. Memory: two float32 buffers per compressed
    parameter (the residual), and a padded copy of the largest gradient during the call.
    """

    setting_name = None
    controllable = False
    # A NaN or Inf magnitude ranks above every finite one in torch.topk, and its chunk's bin
    # means are then non-finite (maths.binned).
    payload_carries_input = True

    def __init__(
        self,
        named_parameters: NamedParameters = None,
        density: float = ChunkedTopKConfig.density,
        *,
        config: Optional[ChunkedTopKConfig] = None,
        **options: Any,
    ):
        """``density`` and ``options`` are ``ChunkedTopKConfig``'s fields; or pass ``config``, a
        ``ChunkedTopKConfig``."""
        config = configured(ChunkedTopKConfig, type(self).__name__, config, options, density=density)
        self.feedback = ErrorFeedback(decay=config.feedback_decay)
        super().__init__(named_parameters, config)

    def _layout(self, n):
        """(chunks, entries per chunk, values sent per chunk) for a gradient of ``n`` entries."""
        width = min(self.config.chunk, n)
        return -(-n // width), width, max(1, math.ceil(self.config.density * width))

    def _compressed_bytes(self, shape, setting):
        chunks, _, k = self._layout(math.prod(shape))
        count = chunks * k
        bits = self.config.bits
        return 4 * chunks * binned.bins_for_bits(bits) + packing.packed_size(count, bits) + _position_bytes(count)

    def _begin(self, name, grad):
        n, bits = grad.numel(), self.config.bits
        chunks, width, k = self._layout(n)
        count = chunks * k
        # x = g + beta * e, built in the residual's buffer; what is left there is the next residual.
        x = self.feedback.compensated(name, grad.reshape(-1))
        rows = torch.zeros(chunks * width, device=x.device)
        rows[:n] = x
        rows = rows.view(chunks, width)
        positions = rows.abs().topk(k, dim=1, sorted=False).indices
        values = rows.gather(1, positions)
        codes, means = binned.encode(values, bits)
        rows.scatter_(1, positions, values.sub_(binned.decode(codes, means, bits)))
        x.copy_(rows.view(-1)[:n])
        payload = torch.cat(
            [
                means.view(-1).view(torch.uint8),
                packing.pack_fields(codes.view(-1), bits),
                positions.to(torch.int16).view(-1).view(torch.uint8),
                torch.zeros(_position_bytes(count) - 2 * count, dtype=torch.uint8, device=x.device),
            ]
        )
        means_end = 4 * means.numel()
        codes_end = means_end + packing.packed_size(count, bits)

        def after_gather(gathered):
            all_means = gathered[:, :means_end].view(torch.float32)
            # An entry sums at most one value from each rank before the mean divides it.
            self.guard.bound_by(name, all_means, gathered.shape[0])
            total = torch.zeros(chunks, width, device=gathered.device)
            for row, row_means in zip(gathered, all_means):
                row_codes = packing.unpack_fields(row[means_end:codes_end], bits, count).view(chunks, k)
                row_positions = row[codes_end:].view(torch.int16)[:count].to(torch.int64).view(chunks, k)
                total.scatter_add_(1, row_positions, binned.decode(row_codes, row_means.view(chunks, -1), bits))
            if gathered.shape[0] > 1:  # dividing by one would only cost a pass
                total.div_(gathered.shape[0])
            return self.results.typed(grad, total.view(-1)[:n])

        return Round(payload, Collective.ALLGATHER, after_gather)


def _position_bytes(count):
    """Bytes of ``count`` int16 positions, rounded up to 8 so that a gathered row's length keeps
    its float32 means readable in place."""
    return -(-2 * count // 8) * 8

"""Stateless compressors: 16-bit casts, and the uncompressed baseline.

FP16 all-reduces in float16; Horovod has no bf16, so BF16 reduce-scatters."""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.comm.twohop import chunk_length, padded_chunks, two_hop
from hvd_compress.compressors.base import Compressor, NamedParameters
from hvd_compress.compressors.config import CompressorConfig, configured
from hvd_compress.compressors.tuning import Tuning


@dataclass(frozen=True, kw_only=True)
class CastConfig(CompressorConfig):
    """A cast sends every entry, so it applies to gradients of any size."""

    min_numel: int = 0


class CastTuning(Tuning):
    """A cast compresses every gradient with an entry, whatever its shape."""

    def tunable(self, shape):
        return math.prod(shape) >= max(self.compressor.config.min_numel, 1)


class UncompressedTuning(Tuning):
    """Nothing is compressed."""

    def tunable(self, shape):
        return False


class _Settingless(Compressor):
    """No per-parameter setting and no state; applies to every gradient with an entry, whatever
    its shape (an empty one travels as it is)."""

    payload_carries_input = True  # a cast keeps infinities and NaN, and every entry travels
    tuning_class = CastTuning

    def __init__(
        self, named_parameters: NamedParameters = None, *, config: Optional[CastConfig] = None, **options: Any
    ):
        """``options``: ``CastConfig``'s fields (``min_numel``); or pass ``config``."""
        super().__init__(named_parameters, configured(CastConfig, type(self).__name__, config, options))


class FP16(_Settingless):
    """Sends gradients as float16 through an all-reduce and casts the mean back to the
    gradient's dtype. Halves bytes at any W. Each rank's payload is divided by W before the
    float16 sum, as torch's ``fp16_compress_hook`` does (``comm.rounds.divides_first``), so a
    mean up to 65504 survives where the sum would not; an entry above 65504 on any rank still
    overflows at the cast, and entries below 6.1e-5 times W lose bits to the division: prefer
    BF16 for gradients with a wide range (or bf16 training)."""

    needs_parameter_names = False
    shareable = True  # nothing kept between steps, nothing that depends on the world

    def _compressed_bytes(self, shape, setting):
        return 2 * math.prod(shape)

    def _begin(self, name, grad):
        return Round(
            grad.to(torch.float16, memory_format=torch.contiguous_format),
            Collective.ALLREDUCE,
            lambda mean: self.results.typed(grad, mean),
            last=True,
        )

    def fixed_payload(self, shape):
        return True  # every gradient, as float16


class BF16(_Settingless):
    """Sends gradients as bfloat16 while summing in float32, each rank's entry divided by W
    first (as the float16 all-reduce: ``comm.rounds.divides_first``), so a mean near
    bfloat16's largest value (3.4e38) survives where the float32 sum would overflow.

    Horovod's collectives have no bf16, and summing bf16 bit patterns as integers would be
    wrong, so BF16 runs the two halves of a ring all-reduce itself (``comm.twohop``): an
    all-to-all hands rank j the j-th chunk of every rank's bf16 gradient (as int16 bits), rank
    j divides its chunk by W, sums it in float32 and rounds the mean to bf16, and an all-gather
    returns the chunks.
    Bytes per rank: 4n(W-1)/W, half of float32's ring all-reduce, with bf16's range.
    The result is bit-identical on every rank."""

    def _compressed_bytes(self, shape, setting):
        # The all-to-all carries every chunk, the all-gather one chunk per rank.
        chunk = chunk_length(math.prod(shape), self.size)
        return 2 * chunk * (self.size + 1)

    def _begin(self, name, grad):
        n, w = grad.numel(), self.size
        flat = grad.reshape(-1).to(torch.bfloat16)
        chunks = padded_chunks(flat, w, chunk_length(n, w)).view(torch.int16)

        def after_gather(rows):
            return self.results.typed(grad, rows.view(torch.bfloat16).reshape(-1)[:n])

        return two_hop(
            chunks,
            lambda received: received.view(torch.bfloat16).float(),
            lambda mean: mean.to(torch.bfloat16).view(torch.int16),
            after_gather,
        )


class NoCompression(_Settingless):
    """The uncompressed baseline: every gradient is all-reduced as it is (bf16 as float32)."""

    needs_parameter_names = False
    shareable = True
    tuning_class = UncompressedTuning

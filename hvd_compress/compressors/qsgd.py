"""QSGD: unbiased stochastic quantisation to a few bits per entry."""

import math
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.base import Compressor, NamedParameters
from hvd_compress.compressors.config import CompressorConfig, configured, option
from hvd_compress.compressors.tuning import QuantizedTuning
from hvd_compress.maths import error_tables as error_maths
from hvd_compress.maths import quantize

MIN_BITS, MAX_BITS = 2, 8


@dataclass(frozen=True, kw_only=True)
class QSGDConfig(CompressorConfig):
    """``default``: the bits per entry."""

    default: int = 4
    bucket_size: int = option(512, arguments.integer, low=1)
    seed: int = option(0, arguments.integer)


@dataclass
class QSGDState:
    step: int = 0


class QSGDTuning(QuantizedTuning):
    """QSGD's bits, ``MIN_BITS`` to ``MAX_BITS``: errors and energies in closed form over its
    buckets (``maths.error_tables``)."""

    bits = range(MIN_BITS, MAX_BITS + 1)
    setting_rule = f"an integer in [{MIN_BITS}, {MAX_BITS}]"
    value_rule = f"[{MIN_BITS}, {MAX_BITS}]"

    def setting_for_factor(self, shape, factor):
        return min(MAX_BITS, max(MIN_BITS, round(32 / factor)))

    def errors(self, gradient, settings):
        return error_maths.qsgd_errors(gradient.flatten(), settings, self.compressor.config.bucket_size)

    def kept_energies(self, name, x, settings, memo):
        return error_maths.qsgd_kept_energies(x.reshape(-1), settings, self.compressor.config.bucket_size)


class QSGD(Compressor):
    """QSGD (Alistarh et al., 2017) with ``bits`` per entry (sign included, s = 2^(bits-1) - 1
    levels) and one float32 norm per bucket of ``bucket_size`` entries. Stochastic rounding
    makes it unbiased, so it needs no error feedback.

    Aggregation: all-gather. Codes from different ranks are scaled by different norms, so
    Horovod's all-reduce cannot sum them; each rank gathers every rank's packed codes and norms
    and decodes them in rank order (bit-identical results everywhere, no second quantisation
    error). A scatter-reduce-allgather would keep bytes flat in W but re-quantises partial sums,
    adding variance; with all-gather a rank sends (W-1) * n * bits / 8 bytes, which beats a
    float32 ring all-reduce (8n(W-1)/W) when bits < 64 / W.

    Tuning guide: 4 bits with buckets of 512 is close to full precision on most models; 2 bits
    (ternary) needs smaller buckets. Per-parameter bits: ``set_setting(name, bits)``.
    """

    setting_name = "bits"
    controllable = True
    tuning_class = QSGDTuning
    state_type = QSGDState
    compiled_kernels = quantize.COMPILED_KERNELS
    # A bucket holding an Inf or NaN travels a non-finite norm (quantize.bucket_norms), and every
    # entry of that bucket decodes non-finite on every rank.
    payload_carries_input = True

    def __init__(
        self,
        named_parameters: NamedParameters = None,
        bits: int = QSGDConfig.default,
        *,
        config: Optional[QSGDConfig] = None,
        **options: Any,
    ):
        """``bits`` (the configuration's ``default``) and ``options`` are ``QSGDConfig``'s
        fields; or pass ``config``, a ``QSGDConfig``."""
        super().__init__(named_parameters, configured(QSGDConfig, type(self).__name__, config, options, default=bits))

    def _compressed_bytes(self, shape, setting):
        numel = math.prod(shape)
        buckets = -(-numel // self.config.bucket_size)
        return quantize.packed_size(numel, setting) + 4 * (buckets + buckets % 2)

    def _rounding_key(self, name):
        """Rounding noise differs per rank (so it averages out) and is reproducible from
        (seed, rank, parameter, step) whatever order gradients arrive in: the seed of the step's
        generator."""
        st = self.state.setdefault(name, QSGDState())
        st.step += 1
        return zlib.crc32(f"{self.config.seed}:{self.rank}:{name}:{st.step}".encode())

    def _payload(self, n, bits, device):
        """(payload, its codes, its norms) for ``n`` entries at ``bits``: codes first and an even
        number of norms keep every gathered row 8-byte aligned; the padding norm is zero."""
        code_bytes = quantize.packed_size(n, bits)
        buckets = -(-n // self.config.bucket_size)
        payload = torch.empty(code_bytes + 4 * (buckets + buckets % 2), dtype=torch.uint8, device=device)
        norms = payload[code_bytes:].view(torch.float32)
        norms[buckets:] = 0
        return payload, payload[:code_bytes], norms[:buckets]

    def _encode(self, x, bits, key, codes, norms, compiled):
        quantize.encode(
            x,
            bits,
            self.config.bucket_size,
            torch.Generator(device=x.device).manual_seed(key),
            codes,
            norms,
            compiled=compiled,
        )

    def _decode_mean(self, rows, n, bits, out, compiled):
        """The mean of the gathered ``rows`` (one payload a rank), into ``out`` where given."""
        code_bytes = quantize.packed_size(n, bits)
        buckets = -(-n // self.config.bucket_size)
        return quantize.decode_mean(
            rows[:, :code_bytes],
            rows[:, code_bytes:].view(torch.float32)[:, :buckets],
            bits,
            self.config.bucket_size,
            n,
            out=out,
            compiled=compiled,
        )

    def _warm_up(self, numel, setting, device):
        payload, codes, norms = self._payload(numel, setting, device)
        self._encode(torch.zeros(numel, device=device), setting, 0, codes, norms, True)
        # Gathered rows as the collective returns them (contiguous), so that no stride differs.
        self._decode_mean(payload.repeat(self.size, 1), numel, setting, None, True)

    def _begin(self, name, grad):
        shape, dtype, n = grad.shape, grad.dtype, grad.numel()
        bits = self.setting(name)
        payload, codes, norms = self._payload(n, bits, grad.device)
        x, key = grad.reshape(-1).float(), self._rounding_key(name)
        self.compiled_path.run(lambda compiled: self._encode(x, bits, key, codes, norms, compiled))

        def after_gather(rows):
            # No entry decodes above its bucket's norm, and the mean adds one per rank, then divides.
            code_bytes, buckets = codes.numel(), norms.numel()
            self.guard.bound_by(name, rows[:, code_bytes : code_bytes + 4 * buckets].view(torch.float32), rows.shape[0])
            out = self.results.memory(grad)
            mean = self.compiled_path.run(lambda compiled: self._decode_mean(rows, n, bits, out, compiled))
            return mean.view(shape).to(dtype)

        return Round(payload, Collective.ALLGATHER, after_gather)

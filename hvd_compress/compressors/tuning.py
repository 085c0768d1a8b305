"""The controller protocol: what a controller (L-GreCo, GraVAC) may ask of a compressor about
its per-parameter settings, through ``compressor.tuning``, and nothing else of its internals.

A tuning object answers for one compressor, per family of compressors: ``Tuning`` (no setting
a controller can tune: the casts, SignSGD, ChunkedTopK), ``LowRankTuning`` (the rank),
``SparseTuning`` (k) and ``QuantizedTuning`` (bits); a compressor names its class in
``tuning_class``. A controller that needs a new quantity adds it here, to the base and to the
families it differs in, not to every compressor. The settings themselves stay with the
compressor (``setting``, ``set_setting``), and so does how it sends them (its payload's bytes,
``_compressed_bytes``).

=============================================  =================================================
``compressor.controllable``                    whether the protocol below is implemented
``compressor.setting_name``                    what a setting is ("rank", "k", "bits"), for logs
``compressor.config.default``                  the uniform setting (L-GreCo's budget)
``tunable(shape)``                             whether any setting compresses such a gradient
``compresses(shape, setting)``                 whether ``setting`` compresses it (else dense)
``check_setting(name, value, numel)``          a setting is valid, or ``ValueError``
``check_value(value, label)``                  a user-facing value (a candidate, an Accordion
                                               setting) is valid, or ``ValueError``
``setting_for_value(shape, value)``            that value as a setting (Top-K: density -> k)
``resolve(shape, setting)``                    the concrete setting (Top-K: ``None`` -> its k)
``candidates(shape, default, values)``         the settings L-GreCo searches for one layer
``errors(gradient, settings)``                 compression error norms, one per setting
``errors_of_layers(layers)``                   ``errors`` of a decision's layers at once
``payload_bytes(shape, setting)``              bytes handed to collectives per step
``setting_for_factor(shape, factor)``          the setting that compresses about ``factor``-fold
``kept_energies(name, x, settings, memo)``     ||C(x)||^2 for nested settings (GraVAC's gains)
``begin_measured(name, grad, settings, memo,   ``begin`` (or ``begin_uncompressed``) and, from the
uncompressed)``                                same work where it can, ||x||^2 and ``kept_energies``
=============================================  =================================================

Besides, a controller reads and drives the compressor itself: ``setting``/``set_setting``,
``residual(name)`` (the error feedback waiting for ``name``), ``begin_uncompressed`` (send a
gradient plus its residual whole), ``loss_scale()`` and ``last_step_finite``.
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hvd_compress.comm.rounds import Round
from hvd_compress.compressors.config import parameter_error
from hvd_compress.maths import error_tables as error_maths
from hvd_compress.maths import lowrank

# The float32 marker of a compressed gradient's input (``compressors.base``'s docstring).
MARKER_BYTES = 4


class Tuning:
    """The controller protocol of ``compressor``, for a compressor with no setting a controller
    can tune: the settings are None, and only which gradients it compresses and their bytes are
    answered. ``ValueError``s name the compressor's class and the parameter."""

    def __init__(self, compressor: Any):
        self.compressor = compressor

    def _not_controllable(self):
        return NotImplementedError(
            f"{type(self.compressor).__name__} has no per-parameter setting that a controller can tune"
        )

    # ----- settings -------------------------------------------------------------------------
    def check_setting(self, name: Optional[str], value: Any, numel: Optional[int]) -> None:
        """Raises ``ValueError`` naming parameter ``name`` unless ``value`` is a valid setting
        for it (``numel``: its entries, None where unknown)."""
        if value is not None:
            raise parameter_error(
                self.compressor, name, f"{type(self.compressor).__name__} has no per-parameter setting"
            )

    def check_value(self, value: Any, label: str) -> None:
        raise self._not_controllable()

    def setting_for_value(self, shape: Sequence[int], value: Any) -> Any:
        return value

    def resolve(self, shape: Sequence[int], setting: Any) -> Any:
        return setting

    def candidates(self, shape: Sequence[int], default: Any, values: Optional[Sequence[Any]] = None) -> List[Any]:
        raise self._not_controllable()

    def setting_for_factor(self, shape: Sequence[int], factor: float) -> Any:
        raise self._not_controllable()

    # ----- which gradients are compressed, and their bytes ----------------------------------
    def tunable(self, shape: Sequence[int]) -> bool:
        """Whether some setting compresses a gradient of ``shape``: 1-D gradients (biases,
        norms), those under ``min_numel`` and empty ones (nothing to compress) are a tiny share
        of the bytes, and go dense."""
        return len(shape) >= 2 and math.prod(shape) >= max(self.compressor.config.min_numel, 1)

    def compresses(self, shape: Sequence[int], setting: Any) -> bool:
        """Whether a gradient of ``shape`` is compressed at ``setting`` (else sent dense)."""
        return self.tunable(shape) and self.worth_compressing(shape, setting)

    def worth_compressing(self, shape: Sequence[int], setting: Any) -> bool:
        return True

    def payload_bytes(self, shape: Sequence[int], setting: Any) -> int:
        """Bytes handed to collectives per step for a float32 gradient of ``shape`` at
        ``setting``: what L-GreCo's size table counts (indices and norms included)."""
        if not self.compresses(shape, setting):
            return 4 * math.prod(shape)
        marker = 0 if self.compressor.payload_carries_input else MARKER_BYTES
        return self.compressor._compressed_bytes(shape, setting) + marker

    # ----- errors and energies --------------------------------------------------------------
    def errors(self, gradient: torch.Tensor, settings: Sequence[Any]) -> torch.Tensor:
        """The compression error (L2 norm, no error feedback) of ``gradient`` at each of
        ``settings``, as a float64 tensor on its device, read by nothing on the host."""
        raise self._not_controllable()

    def errors_of_layers(self, layers: Dict[str, Tuple[torch.Tensor, Sequence[Any]]]) -> Dict[str, torch.Tensor]:
        """``errors`` of every layer of a decision, {name: (gradient, settings)}: one call per
        layer here; families whose rows batch over layers of one shape override it."""
        return {name: self.errors(gradient, settings) for name, (gradient, settings) in layers.items()}

    def kept_energies(self, name: str, x: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any]) -> torch.Tensor:
        """||C(x)||^2 of ``x`` (gradient plus residual, shaped like the gradient) for each of
        ``settings``, nested from the least to the most compressed, as a float64 tensor on
        ``x``'s device, computed without waiting for the device (called per layer and step).
        ``memo``: the caller's per-parameter scratch space, kept between calls (warm starts)."""
        raise self._not_controllable()

    def begin_measured(
        self, name: str, grad: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any], uncompressed: bool = False
    ) -> Tuple[Round, torch.Tensor]:
        """``begin(name, grad)`` (``begin_uncompressed`` if ``uncompressed``) and GraVAC's
        energies of x = gradient plus residual: a float64 tensor on the gradient's device,
        [||x||^2, then ``kept_energies(name, x, settings, memo)``], made without waiting for the
        device. A compressor whose compression already selects or projects x at one of
        ``settings`` derives them from that work (``compress_measured``); otherwise, and for
        gradients sent dense, they are measured apart (``measured_energies``)."""
        compressor = self.compressor
        if uncompressed or not self.compresses(grad.shape, compressor.setting(name)):
            energies = self.measured_energies(name, grad, settings, memo)
            begun = compressor.begin_uncompressed(name, grad) if uncompressed else compressor.begin(name, grad)
            return begun, energies
        found = []

        def compress(name, grad):
            round_, energies = self.compress_measured(name, grad, settings, memo)
            found.append(energies)
            return round_

        return compressor._begin_exchange(name, grad, compress), found[0]

    def compress_measured(
        self, name: str, grad: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any]
    ) -> Tuple[Round, torch.Tensor]:
        """(the compressor's ``_begin`` round, ``begin_measured``'s energies); by default
        measured apart."""
        return self.compressor._begin(name, grad), self.measured_energies(name, grad, settings, memo)

    def measured_energies(
        self, name: str, grad: torch.Tensor, settings: Sequence[Any], memo: Dict[str, Any]
    ) -> torch.Tensor:
        """``begin_measured``'s energies measured on their own: x is built apart from the
        compression's, in float32 whatever the gradient's dtype (float16 energies overflow),
        with the residual in the gradient's units (``track``)."""
        x = grad.detach().float()
        residual = self.compressor.residual(name, grad.device)
        if residual is not None:
            x = torch.add(x, residual.view(grad.shape), alpha=self.compressor.loss_scale())
        return torch.cat([error_maths.squared_norm(x.reshape(-1)), self.kept_energies(name, x, settings, memo)])


class LowRankTuning(Tuning):
    """The rank of PowerSGD and ACP-SGD (Vogels et al. 2019; Zhang et al. 2023)."""

    def check_setting(self, name, value, numel):
        check_positive_int(self.compressor, name, "rank", value)

    def worth_compressing(self, shape, setting):
        n, m, r = lowrank.factor_shapes(shape, setting)
        return lowrank.worth_compressing(n, m, r, self.compressor.config.min_compression_rate)

    def check_value(self, value, label):
        check_candidate(
            self.compressor,
            value,
            label,
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            "a positive rank",
        )

    def candidates(self, shape, default, values=None):
        """``values``, or the L-GreCo paper's range [D/2, 2D] around the default rank D."""
        if values is not None:
            return sorted(set(values) | {default})
        return list(range(max(1, default // 2), 2 * default + 1))

    def setting_for_factor(self, shape, factor):
        return lowrank.rank_for_factor(shape, factor)

    def errors(self, gradient, settings):
        return error_maths.lowrank_errors(gradient.reshape(lowrank.matrix_shape(gradient.shape)), settings)

    def errors_of_layers(self, layers):
        """Layers of one matrix shape and one candidate list share a batched call: a decision's
        svdvals (a device wait on a GPU) and operators grow with distinct shapes, not layers."""
        groups = {}
        for name, (gradient, settings) in layers.items():
            matrix = gradient.reshape(lowrank.matrix_shape(gradient.shape))
            groups.setdefault((tuple(matrix.shape), tuple(settings)), []).append((name, matrix))
        rows = {}
        for (_, settings), members in groups.items():
            stacked = torch.stack([matrix for _, matrix in members])
            batch = error_maths.lowrank_errors_of_batch(stacked, list(settings))
            rows.update(zip((name for name, _ in members), batch.unbind(0)))
        return rows

    def kept_energies(self, name, x, settings, memo):
        """Multi-level: one warm-started power step at the first (largest) rank, whose
        projection's singular values give every smaller rank's kept energy."""
        matrix = x.reshape(lowrank.matrix_shape(x.shape))
        top = lowrank.effective_rank(settings[0], *matrix.shape)
        energies, memo["q"] = error_maths.lowrank_kept_energies(
            matrix, memo.get("q"), [min(top, s) for s in settings], self.compressor.config.seed, name
        )
        return energies


class SparseTuning(Tuning):
    """k, the values sent per gradient (Top-K, ScaleCom): user-facing values are densities, and
    a setting of None is ``density`` of the gradient's entries (``compressor.k_for``)."""

    def check_setting(self, name, value, numel):
        if value is not None:  # None: k follows ``density``
            check_positive_int(self.compressor, name, "k", value, upper=numel)

    def check_value(self, value, label):
        check_candidate(
            self.compressor,
            value,
            label,
            isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1,
            "a density in (0, 1]",
        )

    def setting_for_value(self, shape, value):
        numel = math.prod(shape)
        return max(1, min(numel, math.ceil(value * numel)))

    def resolve(self, shape, setting):
        return self.compressor.k_for(setting, math.prod(shape))

    def candidates(self, shape, default, values=None):
        """k for ``values`` (densities), or for the L-GreCo paper's [D/10, 10D] in steps of
        D/10 around the default density D; the default's k among them."""
        numel = math.prod(shape)
        density = self.compressor.config.density if default is None else default / numel
        densities = values if values is not None else [density * i / 10 for i in range(1, 101)]
        return sorted({self.setting_for_value(shape, d) for d in densities} | {self.resolve(shape, default)})

    def setting_for_factor(self, shape, factor):
        return max(1, math.ceil(math.prod(shape) / factor))

    def errors(self, gradient, settings):
        return error_maths.topk_errors(gradient.flatten(), settings)

    def kept_energies(self, name, x, settings, memo):
        return error_maths.topk_kept_energies(x.reshape(-1), nested_ks(settings))


def nested_ks(settings: Sequence[int]) -> List[int]:
    """GraVAC's k's, each within the first (theta_min's): multi-level, the candidate selects
    from theta_min's selection."""
    return [min(settings[0], k) for k in settings]


class QuantizedTuning(Tuning):
    """Bits per entry, among ``bits`` (QSGD, QuantizedAllReduce); a subclass gives the errors
    and energies of its quantiser, and how a factor becomes bits."""

    bits: Sequence[int] = ()
    #: ``bits`` in words, for messages: "an integer in [2, 8]" and "[2, 8]" style.
    setting_rule = ""
    value_rule = ""

    def check_setting(self, name, value, numel):
        if isinstance(value, bool) or not isinstance(value, int) or value not in self.bits:
            raise parameter_error(self.compressor, name, f"bits must be {self.setting_rule}, got {value!r}")

    def check_value(self, value, label):
        check_candidate(
            self.compressor,
            value,
            label,
            isinstance(value, int) and not isinstance(value, bool) and value in self.bits,
            f"bits in {self.value_rule}",
        )

    def candidates(self, shape, default, values=None):
        """``values``, or the L-GreCo paper's [D/2, 2D] around the default D, among ``bits``."""
        if values is not None:
            return sorted(set(values) | {default})
        return [bits for bits in self.bits if default // 2 <= bits <= 2 * default]


def check_positive_int(compressor: Any, name: Optional[str], label: str, value: Any, upper: Optional[int] = None):
    """Raises ``ValueError`` naming ``compressor``'s parameter ``name`` unless ``value`` is a
    positive integer, at most ``upper`` where given."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise parameter_error(compressor, name, f"{label} must be a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise parameter_error(compressor, name, f"{label}={value} is outside (0, {upper}]")


def check_candidate(compressor: Any, value: Any, label: str, ok: bool, kind: str) -> None:
    """Raises ValueError naming ``label`` unless ``ok``: a controller's value for ``compressor``."""
    if not ok:
        raise ValueError(f"{label} must be {kind} for {type(compressor).__name__}, got {value!r}")

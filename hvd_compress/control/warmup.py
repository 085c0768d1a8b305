"""A dense warm-up around any compressor: every gradient whole for the first steps, and some
parameters' gradients whole always."""

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

from hvd_compress import arguments
from hvd_compress.comm.rounds import Round
from hvd_compress.compressors.base import Compressor, Shape
from hvd_compress.compressors.config import MethodConfig, check_checkpoint, checkpoint_header, option
from hvd_compress.control.wrapping import Wrapper


@dataclass(frozen=True, kw_only=True)
class DenseWarmupConfig(MethodConfig):
    """``warmup_steps``: steps sent whole before compression starts; ``dense``: parameter
    names always sent whole (sorted)."""

    warmup_steps: int = option(0, arguments.integer, low=0)
    dense: List[str]

    def check(self, owner: str) -> None:
        if not all(isinstance(name, str) for name in self.dense):
            raise ValueError(f"{owner}: dense must be parameter names (strings), got {self.dense!r}")
        self._keep("dense", sorted(set(self.dense)))


class DenseWarmup(Wrapper):
    """Sends every gradient whole (all-reduced in float32) for the first ``warmup_steps`` steps,
    and the gradients of the parameters named in ``dense`` at every step; the others go through
    ``compressor``.

    Why: compressors that start from random projections or empty residuals are at their worst
    in the first steps, when gradients change fastest. A dense warm-up is the common remedy:
    PowerSGD's paper (Vogels et al. 2019, section 5) and ScaleCom (Chen et al. 2020, section 4,
    1-5 epochs) run the first steps uncompressed; L-GreCo's protocol warms its baseline up the
    same way. Leaving embeddings dense is the usual exception for sparse methods on language
    models (their rows are updated by a few tokens each step).

    ::

        compression = hvd_compress.DenseWarmup(hvd_compress.TopK(named, density=0.01),
                                               warmup_steps=1000, dense=["embedding.weight"])

    Only steps whose aggregate was finite count towards ``warmup_steps``: a skipped step leaves
    no trace, as in every compressor. Every rank must agree on both options (the cross-rank
    check and checkpoints hold them). The wrapped compressor's error feedback starts empty when
    compression starts: dense steps send everything. ``state_dict`` holds the steps counted
    and the compressor's own checkpoint.
    """

    def __init__(self, compressor: Compressor, warmup_steps: int = 0, dense: Iterable[str] = ()):
        super().__init__(compressor)
        if isinstance(dense, str):
            raise ValueError(f"DenseWarmup: dense must be a list of parameter names, got the string {dense!r}")
        self.config = DenseWarmupConfig(owner="DenseWarmup", warmup_steps=warmup_steps, dense=list(dense))
        self._dense = frozenset(self.config.dense)
        self.steps = 0  # finite steps so far

    def _sent_whole(self, name: Optional[str]) -> bool:
        return self.steps < self.config.warmup_steps or name in self._dense

    def _begin_exchange(self, name: str, grad: torch.Tensor) -> Round:
        return self.inner.begin_uncompressed(name, grad) if self._sent_whole(name) else self.inner.begin(name, grad)

    def _end_step(self, comm_seconds: Optional[float]) -> None:
        self.inner.end_step(comm_seconds)
        if self.inner.last_step_finite:
            self.steps += 1

    def next_payload_bytes(self, name: str, shape: Shape) -> int:
        return 4 * math.prod(shape) if self._sent_whole(name) else self.inner.next_payload_bytes(name, shape)

    def fixed_payload(self, shape: Shape) -> bool:
        # A shape the compressor never compresses is sent whole before the warm-up ends and
        # after alike; any other changes payload when it ends (or is one of ``dense``).
        return self.inner.fixed_payload(shape) and not self._dense

    def metrics(self) -> Dict[str, float]:
        """The wrapped compressor's metrics, and whether the warm-up is still on (1.0) or over."""
        return dict(self.inner.metrics(), dense_warmup=float(self.steps < self.config.warmup_steps))

    def state_dict(self) -> Dict[str, Any]:
        return self._state(self.inner.state_dict())

    def elastic_state_dict(self) -> Dict[str, Any]:
        return self._state(self.inner.elastic_state_dict())

    def _state(self, inner: Dict[str, Any]) -> Dict[str, Any]:
        return {**checkpoint_header("DenseWarmup", self.config), "steps": self.steps, "inner": inner}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Checked before anything changes: a mismatch raises ``ValueError`` naming it."""
        check_checkpoint("DenseWarmup", state_dict, ("steps", "inner"), self.config)
        steps = state_dict["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"DenseWarmup.load_state_dict: steps must be a non-negative integer, got {steps!r}")
        self.inner.load_state_dict(state_dict["inner"])  # checks its own part; last to raise
        self.steps = steps

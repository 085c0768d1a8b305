"""Streaming DiLoCo's fragments: the model's parameters in groups whose outer steps fall at
staggered steps of the period, each exchange overlapped with the inner steps that follow it
(Douillard et al. 2025, arXiv 2501.18512, sections 2.2-2.4)."""

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from hvd_compress import arguments
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.integration.torch.diloco.diloco import DiLoCo, DiLoCoConfig, OuterOptimizerFactory, nesterov_outer
from hvd_compress.maths.finite import all_finite, extremes, stacked

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCoConfig(DiLoCoConfig):
    """DiLoCo's, and the fragments, the delay (inner steps) and the mixing factor."""

    fragments: int = 1
    delay: int = 0
    mixing: float = 0.0


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, sections 2.2-2.4): the model's
    parameters in ``fragments`` groups that take their outer steps at staggered points of the
    period, so that one fragment's pseudo-gradients travel at a time, each overlapped with the
    ``delay`` inner steps that follow it, and merged into the local weights with ``mixing``.

    ::

        outer = hvd_compress.StreamingDiLoCo(inner, model.named_parameters(), hvd_compress.QSGD(bits=4),
                                             inner_steps=100, fragments=4, delay=5, mixing=0.5)

    * ``fragments`` (F): consecutive parameters (in ``named_parameters`` order, so layers stay
      together), about n/F entries each. Fragment p exchanges at step (p+1)H/F of each period
      (its first period is shorter), so each exchange carries about 1/F of DiLoCo's bytes and
      the peak bandwidth falls F-fold.
    * ``delay`` (tau, fewer than H/F steps): the exchange starts at the fragment's step and its
      result is applied tau inner steps later, while those steps compute; the outer optimizer
      then steps the fragment's anchors with the pseudo-gradient of when the exchange started.
    * ``mixing`` (alpha in [0, 1)): the fragment's local weights become
      alpha x local + (1 - alpha) x the new anchors; 0 (default) replaces them, as DiLoCo does.
      With alpha > 0, or tau > 0, the ranks' local weights differ after an outer step (the
      anchors never do).

    ``outer_steps`` counts each fragment's outer step (F a period). F = 1, tau = 0 and alpha = 0
    is DiLoCo, bit for bit. ``state_dict`` while an exchange is in
    flight waits for it on this rank alone (every rank started it, and each completes it at its
    next step), and keeps its result for the step it applies at, so a resumed run applies the
    same result at the same step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
        compression: Optional[GradientCompression] = None,
        *,
        inner_steps: int,
        fragments: int = 2,
        delay: int = 0,
        mixing: float = 0.0,
        outer_optimizer: OuterOptimizerFactory = nesterov_outer,
        process_set: Any = None,
    ):
        super().__init__(
            optimizer,
            named_parameters,
            compression,
            inner_steps=inner_steps,
            outer_optimizer=outer_optimizer,
            process_set=process_set,
        )
        owner, names = "StreamingDiLoCo", list(self._named)
        fragments = arguments.integer(owner, "fragments", fragments, low=1, high=min(self.inner_steps, len(names)))
        delay = arguments.integer(owner, "delay", delay, low=0, high=self.inner_steps // fragments - 1)
        mixing = arguments.real(owner, "mixing", mixing, low=0, high=1)
        if mixing == 1:
            raise ValueError(f"{owner}: mixing must be below 1 (1 would never take the shared weights), got 1")
        self.config = StreamingDiLoCoConfig(
            owner=owner,
            inner_steps=self.inner_steps,
            outer_optimizer=self.config.outer_optimizer,
            parameters=self.config.parameters,
            fragments=fragments,
            delay=delay,
            mixing=mixing,
        )
        self.fragment_names = _fragments(self._named, fragments)
        # Fragment p exchanges at the end of step (p + 1) H / F of the period.
        self._sync_at = {(p + 1) * self.inner_steps // fragments: p for p in range(fragments)}
        self._pending: Optional[Dict[str, Any]] = None  # the exchange in flight or waiting to apply
        self._loaded = False  # from a checkpoint: the weights are this rank's own, not the anchors

    def _bind(self):
        super()._bind()
        if self._binding.active:
            self._schedulers = [
                FusionScheduler(
                    self.compression,
                    {name: tuple(self._named[name].shape) for name in reversed(names)},
                    ScaledFusion(),
                    self.rank,
                )
                for names in self.fragment_names
            ]

    def _inner_step_done(self):
        self.step_in_period += 1
        if self._binding.active:
            self._binding.driver.poll()
        if self._pending is not None and self._pending["apply_at"] == self.step_in_period:
            self._apply()
        fragment = self._sync_at.get(self.step_in_period)
        if fragment is not None:
            self._start(fragment)
            if self.config.delay == 0:
                self._apply()
        if self.step_in_period == self.inner_steps:
            self.step_in_period = 0

    def _start(self, fragment):
        with torch.no_grad():
            deltas = {name: self._anchors[name] - self._named[name] for name in self.fragment_names[fragment]}
        apply_at = (self.step_in_period + self.config.delay - 1) % self.inner_steps + 1
        self._pending = {
            "fragment": fragment,
            "apply_at": apply_at,
            "results": None if self._binding.active else deltas,
        }
        if self._binding.active:
            self._binding.driver.use_plan(self._schedulers[fragment].plan())
            for name, delta in deltas.items():
                self._binding.start(name, delta)

    def _finish(self):
        """The pending exchange's results, waited for here if they are still in flight."""
        if self._pending["results"] is None:
            self._pending["results"], _ = self._binding.finish(device=None)
            self.compression.end_step()
        return self._pending["results"]

    def _apply(self):
        averaged, fragment = self._finish(), self._pending["fragment"]
        self._pending = None
        names = self.fragment_names[fragment]
        with torch.no_grad():
            found = [e for name in names for e in extremes(averaged[name])]
            if not found or bool(all_finite(stacked(found))):
                for name in names:
                    self._anchors[name].grad = averaged[name].to(self._anchors[name].dtype)
                self._outer.step()  # anchors without a gradient (other fragments) stay put
                self._outer.zero_grad(set_to_none=True)
                self.outer_steps += 1
                alpha = self.config.mixing
                for name in names:
                    if alpha == 0:  # DiLoCo's replacement, bit for bit
                        self._named[name].copy_(self._anchors[name])
                    else:
                        self._named[name].mul_(alpha).add_(self._anchors[name], alpha=1 - alpha)
            else:
                self.skipped_outer_steps += 1
                logger.warning(
                    "StreamingDiLoCo: non-finite pseudo-gradient of fragment %d on some rank; its outer "
                    "step skipped, its weights go back to its anchors (%d such steps so far)",
                    fragment,
                    self.skipped_outer_steps,
                )
                for name in names:
                    self._named[name].copy_(self._anchors[name])

    def state_dict(self) -> Dict[str, Any]:
        """``DiLoCo.state_dict``, and the exchange waiting to apply (waited for here if it is in
        flight, so that the compression's state includes it)."""
        if self._pending is not None:
            self._finish()
        return super().state_dict()

    def elastic_state_dict(self) -> Dict[str, Any]:
        if self._pending is not None:
            self._finish()
        return super().elastic_state_dict()

    def _state(self, compression_state):
        pending = self._pending
        return dict(
            super()._state(compression_state),
            pending=None
            if pending is None
            else {
                "fragment": pending["fragment"],
                "apply_at": pending["apply_at"],
                "results": {name: value.detach().clone() for name, value in pending["results"].items()},
            },
        )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As ``DiLoCo.load_state_dict``, and the exchange waiting to apply, if any."""
        pending = state_dict.get("pending")
        if pending is not None and (
            pending.get("fragment") not in range(len(self.fragment_names))
            or set(pending.get("results", {})) != set(self.fragment_names[pending["fragment"]])
        ):
            raise ValueError("StreamingDiLoCo.load_state_dict: the pending exchange does not fit these fragments")
        super().load_state_dict(state_dict)
        self._pending = None if pending is None else dict(pending, results=dict(pending["results"]))
        self._loaded = True

    def _weights_are_anchors(self) -> bool:
        # Mixing and delays leave each rank's weights apart from the anchors after the first
        # outer step: only a fresh start has them equal.
        return not self._loaded and self.outer_steps == 0 and self._pending is None and self.step_in_period == 0


def _fragments(named: Dict[str, torch.nn.Parameter], count: int) -> List[List[str]]:
    """``named``'s names in order, cut into ``count`` consecutive non-empty groups of about equal
    entries: each group ends where the running total first reaches its share."""
    names = list(named)
    total = sum(p.numel() for p in named.values())
    groups, current, seen = [], [], 0
    for index, name in enumerate(names):
        current.append(name)
        seen += named[name].numel()
        groups_left, names_left = count - len(groups) - 1, len(names) - index - 1
        if groups_left and (seen * count >= total * (len(groups) + 1) or names_left == groups_left):
            groups.append(current)
            current = []
    groups.append(current)
    return groups

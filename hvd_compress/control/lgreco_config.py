"""L-GreCo's configuration (``LGreCoConfig``) and Accordion's rule (``Accordion``), checked
when they are made; ``check_for`` checks them against the wrapped compressor."""

from dataclasses import dataclass
from typing import Optional, Union

from hvd_compress import arguments
from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.config import MethodConfig, option

OBJECTIVES = ("size", "time", "accordion")
ERROR_SOURCES = ("sent", "raw")
REFERENCE_ACCUMULATE_STEPS = 10  # the authors' code averages the last 10 steps before a decision


@dataclass
class Accordion:
    """Accordion's critical-regime rule (Agarwal et al., 2021): a layer whose accumulated
    gradient norm changed by at least ``threshold`` (relative) since the last decision is in a
    critical regime and gets the ``critical`` default (less compression); others get ``normal``.
    L-GreCo then distributes that error budget over layers (the paper's best, Table 4)."""

    critical: object
    normal: object
    threshold: float = 0.5


@dataclass(frozen=True, kw_only=True)
class LGreCoConfig(MethodConfig):
    """L-GreCo's configuration (see its tuning guide). ``decide_every`` is in steps once made
    ("epoch" becomes ``steps_per_epoch``, which need not agree: ``decide_every`` does);
    candidates and Accordion's values are checked against the wrapped compressor by
    ``check_for``, ``transport`` and ``timeout`` by the decision service."""

    candidates: Optional[tuple] = None
    dense_candidates: bool = option(False, arguments.flag)
    decide_every: Union[int, str] = 1000
    steps_per_epoch: Optional[int] = option(None, agreed=False)
    warmup_steps: int = option(1000, arguments.integer, low=0)
    start_step: int = option(0, arguments.integer, low=0)
    apply_delay: Union[int, str] = "auto"
    accumulate_steps: Optional[int] = REFERENCE_ACCUMULATE_STEPS
    error_source: str = option("sent", arguments.choice, options=ERROR_SOURCES)
    objective: str = option("size", arguments.choice, options=OBJECTIVES)
    accordion: Optional[Accordion] = None
    time_buckets: int = option(4, arguments.integer, low=1)
    discretization: int = option(10000, arguments.integer, low=1)
    transport: str = option("auto", agreed=False)
    timeout: float = option(60.0, agreed=False)

    def check(self, owner):
        """The fields whose check takes another field or a word besides a number: decide_every
        ("epoch": steps_per_epoch), apply_delay ("auto"), accumulate_steps (None), accordion and
        candidates."""
        if self.decide_every == "epoch":
            self._keep(
                "decide_every",
                arguments.integer(owner, "steps_per_epoch (with decide_every='epoch')", self.steps_per_epoch, low=1),
            )
        arguments.integer(owner, "decide_every", self.decide_every, low=1)
        if self.accumulate_steps is not None:
            arguments.integer(owner, "accumulate_steps (or None)", self.accumulate_steps, low=1)
        if self.apply_delay != "auto":
            arguments.integer(owner, 'apply_delay (or "auto")', self.apply_delay, low=1)
            if self.apply_delay >= self.decide_every:
                raise ValueError(
                    f"{owner}: apply_delay ({self.apply_delay}) must be smaller than decide_every ({self.decide_every})"
                )
        if (self.objective == "accordion") != (self.accordion is not None):
            raise ValueError(f"{owner}: objective='accordion' and accordion=Accordion(...) go together")
        if self.accordion is not None and not isinstance(self.accordion, Accordion):
            raise ValueError(f"{owner}: accordion must be an Accordion(critical, normal), got {self.accordion!r}")
        candidates = self.candidates
        if candidates is not None and (isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__")):
            raise ValueError(f"{owner}: candidates must be a list of settings, got {candidates!r}")
        if candidates is not None:
            self._keep("candidates", tuple(candidates))
        if self.candidates == ():
            raise ValueError(f"{owner}: candidates must not be empty (None: the paper's range)")
        if self.accordion is not None:
            arguments.real(owner, "accordion.threshold", self.accordion.threshold, low=0, low_open=True)

    def check_for(self, compressor: Compressor, owner: str) -> None:
        """Raises ``ValueError`` naming the value unless every candidate and Accordion's values
        are valid settings of ``compressor`` (the wrapped one, known only to the controller)."""
        for value in self.candidates or []:
            compressor.tuning.check_value(value, f"{owner}: every candidate")
        if self.accordion is not None:
            compressor.tuning.check_value(self.accordion.critical, f"{owner}: accordion.critical")
            compressor.tuning.check_value(self.accordion.normal, f"{owner}: accordion.normal")

"""Local methods as advise candidates: DiLoCo, SparseLoCo and Streaming DiLoCo, each at the
periods and codecs this project measured to target (the evidence's ``"diloco/qsgd"``,
``"H=50,bits=4"``), projected on the launched ranks' links.

A local method trains ``H`` inner steps on each rank, then exchanges one pseudo-gradient (the
size of a gradient) through its codec: DiLoCo (Douillard et al. 2023, algorithm 1) and
SparseLoCo (arXiv 2508.15706, algorithm 1) between inner steps, so all of the exchange is
exposed; Streaming DiLoCo (arXiv 2501.18512, section 2.2) one fragment of ``1/F`` of the
weights every ``H/F`` steps, overlapped with the next ``delay`` inner steps, so only what
outlasts them is exposed. Per step-equivalent, a local method's codec, bytes and exposed
communication are its exchange's over ``H``; its compute is a step's. Its steps to target come
from the evidence, as a per-step method's do."""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from hvd_compress.advise.evidence import PICK_SEEDS, WORTH_IT, describe
from hvd_compress.advise.projection import Candidate, Link

LOCAL_KINDS = ("diloco", "sparseloco", "streaming")
# The setting keys of a local method's schedule; the rest are its codec's registry keywords.
PERIOD, FRAGMENTS, DELAY, MIXING, OUTER = "H", "F", "delay", "mixing", "outer"
STREAMING_DELAY = 5  # Streaming DiLoCo's default overlap (tau), where the evidence names none


@dataclass(frozen=True)
class LocalPoint:
    """One measured local setting: ``method`` "diloco/qsgd", ``setting`` as the evidence names
    it, ``compressor`` and ``options`` its codec's registry name and keywords."""

    method: str
    setting: str
    compressor: str
    options: Dict[str, Any]
    period: int
    fragments: int = 1
    delay: int = 0


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def local_points(evidence: Dict[str, Any], kinds: Sequence[str] = LOCAL_KINDS) -> List[LocalPoint]:
    """Every local setting of ``kinds`` with steps to target in ``evidence``, in its order."""
    points = []
    for method, settings in evidence.get("steps_to_target", {}).get("methods", {}).items():
        kind, _, compressor = method.partition("/")
        if kind not in kinds:
            continue
        for setting in settings:
            fields = dict(item.split("=", 1) for item in setting.split(",") if item)
            schedule = {key: fields.pop(key) for key in (PERIOD, FRAGMENTS, DELAY, MIXING, OUTER) if key in fields}
            streaming = kind == "streaming"
            points.append(
                LocalPoint(
                    method,
                    setting,
                    compressor,
                    {key: _value(value) for key, value in fields.items()},
                    int(schedule[PERIOD]),
                    int(schedule.get(FRAGMENTS, 1)),
                    int(schedule.get(DELAY, STREAMING_DELAY if streaming else 0)),
                )
            )
    return points


def _exchange_s(messages: Dict[str, Tuple[int, float]], links: Dict[str, Link], share: float) -> float:
    return sum(count * links[collective].seconds(share * each) for collective, (count, each) in messages.items())


def project_local(candidate: Candidate, point: LocalPoint, links: Dict[str, Link], compute_s: float) -> None:
    """Fills in a local candidate measured as one exchange of its codec (``measure_codec``):
    per step-equivalent, its bytes, codec and communication over ``H``, and its step: compute
    plus the exposed part of the exchange over ``H`` (the module docstring)."""
    share = 1 / point.fragments
    fragment_s = _exchange_s(candidate.messages, links, share) + _exchange_s(candidate.serial_messages, links, share)
    exposed = point.fragments * max(0.0, fragment_s - point.delay * compute_s)
    candidate.wire_bytes /= point.period
    candidate.codec_ms /= point.period
    candidate.communication_ms = 1e3 * point.fragments * fragment_s / point.period
    candidate.step_ms = 1e3 * (compute_s + exposed / point.period) + candidate.codec_ms
    candidate.period = point.period


def local_advice(candidates: Sequence[Candidate]) -> str:
    """Which local setting reaches uncompressed's quality soonest (on ``PICK_SEEDS`` seeds or
    more), set against the best per-step method's time to target; or why none is advised."""
    local = [c for c in candidates if c.period > 1]
    if not local:
        return ""
    measured = [c for c in local if c.steps_seeds >= PICK_SEEDS and c.to_target is not None]
    reached = [c for c in measured if not math.isinf(c.to_target)]
    if not reached:
        return (
            f"across sites: no local setting measured here reached uncompressed's quality on {PICK_SEEDS} seeds "
            f"or more ({len(measured)} measured on that many), so none is advised"
        )
    best = min(reached, key=lambda c: c.to_target)
    per_step = [c for c in candidates if c.period == 1 and c.to_target is not None and c.steps_seeds >= PICK_SEEDS]
    line = (
        f"across sites: {describe(best)} is projected to reach uncompressed's quality in {best.to_target:.2f}x "
        f"its time, sending {best.wire_bytes / 1e6:.3g} MB a step ({best.steps_evidence})"
    )
    if per_step:
        rival = min(per_step, key=lambda c: c.to_target)
        name = "uncompressed per-step training" if rival.method == "none" else f"the per-step {describe(rival)}"
        if rival.to_target * WORTH_IT <= best.to_target:
            return line + f"; {name} is sooner here ({rival.to_target:.2f}x): train with it"
        return line + f"; sooner than {name} ({rival.to_target:.2f}x), the soonest per-step"
    return line

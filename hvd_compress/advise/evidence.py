"""What this project measured of each setting's quality and steps to target
(``data/quality_evidence.json``, from ``docs/benchmarks/quality-against-bytes.md`` and
``docs/benchmarks/time_to_quality.json``), and the one line of advice it
rests on (the package docstring's rule)."""

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from hvd_compress.advise.projection import Candidate

# A setting is recommended only if this project measured no larger loss for it: perplexity up
# by at most this many percent, accuracy down by at most this many points.
QUALITY_LIMITS = {"%": 5.0, "points": 1.0}
WORTH_IT = 1.05  # a projected speed-up below this is not worth compression's risks
# The fewest seeds a steps-to-target factor must rest on for advise to pick by it: the time-to-train
# rules (MLPerf, AlgoPerf) score no point on fewer, and one seed of a method here was a third
# slower than the next (PowerSGD rank 8: 4,152 and 5,764 steps).
PICK_SEEDS = 3
EVIDENCE = Path(__file__).parents[1] / "data" / "quality_evidence.json"


def shipped_evidence() -> Dict[str, Any]:
    """The evidence shipped with the package (``EVIDENCE``), or none where it is missing."""
    return json.loads(EVIDENCE.read_text()) if EVIDENCE.exists() else {}


def _loss_of(delta: str) -> Optional[Tuple[float, str]]:
    """ "+2.7%" -> (2.7, "%"); "-0.84 points" -> (0.84, "points"): how much worse, in its unit."""
    match = re.fullmatch(r"([+-]?[0-9.]+)\s*(%|points)", delta.strip())
    if not match:
        return None
    value, unit = float(match.group(1)), match.group(2)
    return (value if unit == "%" else -value), unit


def evidence_for(method: str, setting: str, evidence: Dict[str, Any]) -> Tuple[str, Optional[bool]]:
    """(what this project measured for the setting, whether every loss is within QUALITY_LIMITS)."""
    records = evidence.get("methods", {}).get(method, {}).get(setting)
    if not records:
        return "none held", None
    texts, ok = [], True
    for record in records:
        metric = evidence["workloads"].get(record["workload"], "quality")
        seeds = f", {record['seeds']} seeds" if record["seeds"] > 1 else ""
        texts.append(f"{record['workload']}: {metric} {record['value']} ({record['delta']}{seeds})")
        loss = _loss_of(record["delta"])
        if loss is not None and loss[0] > QUALITY_LIMITS[loss[1]]:
            ok = False
    return "; ".join(texts), ok


def steps_for(method: str, setting: str, evidence: Dict[str, Any]) -> Tuple[str, Optional[float]]:
    """(what this project measured of the setting's steps to target, the factor: its steps over
    uncompressed's, inf if it did not reach the target, None if not measured)."""
    steps = evidence.get("steps_to_target")
    if method == "none":
        return ("the target is its quality", 1.0) if steps else ("", None)
    record = _steps_record(method, setting, evidence)
    if not record:
        return "", None
    seeds = f"{record['reached']} of {record['seeds']} seeds reached it"
    if record["factor"] is None:
        return f"not reached ({seeds}; {steps['workload']})", math.inf
    return f"{record['factor']:.2f}x the steps ({seeds}; {steps['workload']})", record["factor"]


def steps_seeds(method: str, setting: str, evidence: Dict[str, Any]) -> int:
    """The seeds the setting's steps-to-target factor rests on (uncompressed's: the target's, so
    never too few), 0 where none was measured."""
    if method == "none":
        return PICK_SEEDS if evidence.get("steps_to_target") else 0
    record = _steps_record(method, setting, evidence)
    return record["seeds"] if record else 0


def _steps_record(method: str, setting: str, evidence: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    return evidence.get("steps_to_target", {}).get("methods", {}).get(method, {}).get(setting)


def recommend(candidates: Sequence[Candidate]) -> str:
    """The one line of advice (the package docstring's rule)."""
    baseline = next(c for c in candidates if c.method == "none")
    projected = [c for c in candidates if c.to_target is not None and c.method != "none"]
    measured = [c for c in projected if c.steps_seeds >= PICK_SEEDS]
    if measured:
        best = min(measured, key=lambda c: c.to_target)
        if best.to_target > 1 / WORTH_IT:
            line = (
                f"do not compress: no measured setting is projected to reach uncompressed's quality "
                f"{WORTH_IT:.2f}x sooner (the best, {describe(best)}: {factor_text(best.to_target)} "
                f"its time)"
            )
        else:
            line = (
                f"compress with {describe(best)}: projected to reach uncompressed's quality in "
                f"{best.to_target:.2f}x its time ({best.speedup:.2f}x faster a step as "
                f"{'projected' if best.timed_step_ms is None else 'timed'}, {best.steps_evidence})"
            )
        thin = [c for c in projected if c.steps_seeds < PICK_SEEDS and c.to_target < min(best.to_target, 1.0)]
        if thin:
            sooner = min(thin, key=lambda c: c.to_target)
            line += (
                f". Projected sooner but on fewer than {PICK_SEEDS} seeds, not picked: {describe(sooner)}, "
                f"{sooner.to_target:.2f}x its time ({sooner.steps_evidence})"
            )
        # A setting whose steps to target were never measured may still be the one to try.
        unmeasured = [
            c
            for c in candidates
            if c.steps_factor is None and c.quality_ok is not False and c.speedup * min(best.to_target, 1.0) > WORTH_IT
        ]
        if unmeasured:
            fastest = max(unmeasured, key=lambda c: c.speedup)
            line += (
                f". Not measured to target but {fastest.speedup:.2f}x faster a step: {describe(fastest)}, "
                f"which pays if it needs under {fastest.speedup * min(best.to_target, 1.0):.2f}x the steps"
            )
        return line
    line = recommend_by_step(candidates, baseline)
    if projected:
        return line + (
            f"; steps to target measured on fewer than {PICK_SEEDS} seeds only, so this rests on step time alone"
        )
    return line + "; steps to target not measured for any setting here, so this rests on step time alone"


def recommend_by_step(candidates: Sequence[Candidate], baseline: Candidate) -> str:
    """The advice by projected step time and the quality limits."""
    # By speed-up, not step: a timed candidate's is against uncompressed's timed step.
    fastest = max(candidates, key=lambda c: c.speedup)
    safe = [c for c in candidates if c.method != "none" and c.quality_ok]
    best = max(safe, key=lambda c: c.speedup) if safe else None
    if best is None or best.speedup < WORTH_IT:
        if fastest.method == "none" or fastest.speedup < WORTH_IT:
            return (
                f"do not compress: the link is fast enough (uncompressed {baseline.expected_step_ms:.1f} ms a "
                f"step; no method is projected {WORTH_IT:.2f}x faster)"
            )
        return (
            f"do not compress: only {describe(fastest)} is projected faster ({fastest.speedup:.2f}x), "
            f"and this project measured a quality loss for it beyond the limits (or holds no evidence)"
        )
    line = (
        f"compress with {describe(best)}: {baseline.expected_step_ms:.1f} -> {best.expected_step_ms:.1f} ms a step "
        f"({best.speedup:.2f}x); quality measured here: {best.evidence}"
    )
    if fastest is not best and fastest.method != "none":
        line += f". Faster but with a larger or unmeasured quality loss: {describe(fastest)} ({fastest.speedup:.2f}x)"
    return line


def describe(candidate: Candidate) -> str:
    return candidate.method + (f" {candidate.setting}" if candidate.setting else "")


def factor_text(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "not reached" if math.isinf(value) else f"{value:.2f}x"

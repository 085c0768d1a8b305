"""``advise()``: every method measured and projected on the launched ranks, as one ``Advice``,
and ``format_advice``, the table rank 0 prints."""

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hvd_compress.advise.check import check_by_timing, slowest_median, time_steps
from hvd_compress.advise.evidence import (
    PICK_SEEDS,
    evidence_for,
    factor_text,
    recommend,
    shipped_evidence,
    steps_for,
    steps_seeds,
)
from hvd_compress.advise.local import LOCAL_KINDS, local_advice, local_points, project_local
from hvd_compress.advise.measure import (
    decided_settings,
    gradients_of,
    measure_codec,
    measure_compute,
    measure_links,
    slowest_codec,
)
from hvd_compress.advise.projection import Candidate, Link, hop_latency, project, scaled_link, setting_label
from hvd_compress.advise.ranks import LaunchedRanks, launched_ranks
from hvd_compress.registry import COMPRESSORS, controllable

# The settings tried per method (the registry's constructor keyword: values), from the least
# to the most compressed; methods without a setting are tried once.
SETTINGS = {"rank": (16, 8, 4), "density": (0.1, 0.01, 0.001), "bits": (8, 4, 2)}
# Controllers projected from one decision on this model's gradients. GraVAC is not: its factor
# follows the compression gain it measures over training's windows, which one gradient cannot show.
PROJECTED_CONTROLLERS = ("lgreco",)


@dataclass
class Advice:
    world_size: int
    parameters: int
    compute_ms: float
    backward_ms: float
    links: Dict[str, Link]
    candidates: List[Candidate]
    recommendation: str
    steps_workload: str = ""  # where the steps-to-target factors shown were measured
    across_sites: str = ""  # the local methods' line (``local.local_advice``), where any was measured
    measured_world: int = 0  # the ranks the links were measured on, where world_size is projected
    hop_s: float = 0.0  # a hop's latency (``projection.hop_latency``) the projection added per message in turn


def settings_of(method: str) -> List[Dict[str, Any]]:
    keys = [key for key in COMPRESSORS[method].defaults if key in SETTINGS]
    if not keys:
        return [{}]
    key = keys[0]
    return [{key: value} for value in SETTINGS[key]]


def controlled(methods: Sequence[str], evidence: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """(``"<controller>/<compressor>"``, the compressor's setting) for each controller of
    ``methods`` over each compressor of ``methods`` it can wrap, at the settings of ``SETTINGS``
    this project measured it at (its quality or its steps to target: the anchors a user would
    start from; a projection elsewhere would rest on nothing measured)."""
    measured = {**evidence.get("methods", {})}
    for method, settings in evidence.get("steps_to_target", {}).get("methods", {}).items():
        measured[method] = {**measured.get(method, {}), **settings}
    pairs = []
    for controller in (m for m in methods if m in PROJECTED_CONTROLLERS):
        for compressor in (m for m in methods if m in controllable()):
            key = f"{controller}/{compressor}"
            pairs += [
                (key, setting) for setting in settings_of(compressor) if setting_label(setting) in measured.get(key, {})
            ]
    return pairs


def every_rank(ranks, mine):
    """Every rank's ``mine``, in rank order; rank 0's alone for a stand-in without ``gather``."""
    return ranks.gather(mine) if hasattr(ranks, "gather") else [ranks.agree(mine)]


def advise(
    model: torch.nn.Module,
    loss_of: Optional[Callable] = None,
    *,
    compute_ms: Optional[float] = None,
    methods: Optional[Sequence[str]] = None,
    ranks: Optional[LaunchedRanks] = None,
    codec_steps: int = 6,
    compute_steps: int = 6,
    repeats: int = 3,
    timed_steps: int = 30,
    world: Optional[int] = None,
) -> Advice:
    """Measures and projects every method (``methods``: registry names, default all) for
    ``model`` on the launched ranks; every rank must call it. ``compute_ms``: forward plus
    backward of one step, when ``loss_of`` is not given (backward taken as two thirds of it).
    ``ranks``: the launched ones by default; a stand-in has ``rank``, ``size``, ``run``,
    ``barrier``, ``agree`` and optionally ``gather`` (without it, rank 0's codec times count).
    ``codec_steps``, ``compute_steps``: timed steps (after an untimed one) whose median counts; with
    two, four ranks sharing two cores gave Top-K 1% a codec of 6 ms in one run and 12.5 in the
    next, and the pick at r = 3 flipped between Top-K 1% and FP16. ``timed_steps``: real training
    steps timed per setting that could be picked (``check.py``; needs ``loss_of`` and Horovod's
    ranks; 0: projections alone). ``world``: project to this many ranks instead of the launched
    ones (codec, bytes and messages measured as one of ``world`` ranks, the links measured on
    the launched ranks scaled by ``scaled_link``; no timed check); raises ValueError under 2."""
    device = next(model.parameters()).device
    ranks = ranks or launched_ranks(device)
    methods = list(methods or [*COMPRESSORS, *PROJECTED_CONTROLLERS, *LOCAL_KINDS])
    unknown = sorted(set(methods) - set(COMPRESSORS) - set(PROJECTED_CONTROLLERS) - set(LOCAL_KINDS))
    if unknown:
        raise ValueError(
            f"methods: {unknown} are not registered compressors, projected controllers or local methods; known: "
            f"{sorted(COMPRESSORS)}, {list(PROJECTED_CONTROLLERS)} and {list(LOCAL_KINDS)}"
        )
    if "none" not in methods:
        methods.insert(0, "none")
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 2):
        raise ValueError(f"world must be a whole number of ranks, 2 or more, to project to; got {world!r}")
    if world is not None and world != ranks.size and ranks.size < 2:
        raise ValueError(
            f"world: projecting to {world} ranks scales links measured over the launched ranks, and "
            f"{ranks.size} was launched; launch 2 or more (4 or more to estimate a hop's latency) under "
            "mpirun, horovodrun or torchrun"
        )
    world = ranks.size if world is None else world
    if timed_steps < 0:
        raise ValueError(f"timed_steps must be 0 (projections alone) or more, got {timed_steps!r}")
    if loss_of is None and compute_ms is None:
        raise ValueError(
            "compute_ms: give the compute time of one step (forward + backward, ms), or a loss_of(model) to measure it"
        )
    if loss_of is not None:
        ranks.barrier()
        # A step waits for the slowest rank's backward, as for the codec below.
        forward_s, backward_s = max(every_rank(ranks, measure_compute(model, loss_of, compute_steps)), key=sum)
    else:
        if compute_ms <= 0:
            raise ValueError(f"compute_ms must be positive, got {compute_ms!r}")
        forward_s, backward_s = compute_ms / 3e3, 2 * compute_ms / 3e3
    grads = gradients_of(model, loss_of)
    named = [(name, p) for name, p in model.named_parameters() if name in grads]
    evidence = shipped_evidence()
    candidates = []
    for method in (m for m in methods if m in COMPRESSORS):
        for setting in settings_of(method):
            ranks.barrier()  # every rank's codec runs at once, as in training
            mine = measure_codec(method, setting, grads, named, ranks.rank, world, codec_steps)
            candidates.append(slowest_codec(every_rank(ranks, mine)))
    for method, setting in controlled(methods, evidence):
        # Rank 0 decides, as in training, and every rank runs its decision.
        layer_settings = ranks.agree(decided_settings(method, setting, grads, named) if ranks.rank == 0 else None)
        ranks.barrier()
        mine = measure_codec(method, setting, grads, named, ranks.rank, world, codec_steps, layer_settings)
        candidates.append(slowest_codec(every_rank(ranks, mine)))
    # The advice and its timed check are per-step methods' (stock hvd.DistributedOptimizer
    # times them); the local methods get their own line.
    per_step = list(candidates)
    local = []  # (candidate, its point): one exchange of its codec, measured as a step's
    for point in local_points(evidence, [m for m in methods if m in LOCAL_KINDS]):
        ranks.barrier()
        mine = measure_codec(point.compressor, point.options, grads, named, ranks.rank, world, codec_steps)
        candidate = slowest_codec(every_rank(ranks, mine))
        candidate.method, candidate.setting = point.method, point.setting
        local.append((candidate, point))
        candidates.append(candidate)
    largest = {}
    for candidate in candidates:
        for collective, (_, per_message) in [*candidate.messages.items(), *candidate.serial_messages.items()]:
            largest[collective] = max(largest.get(collective, 0.0), per_message)
    links = measure_links(ranks, largest, device, repeats)
    hop_s = 0.0
    if world != ranks.size:
        hop_s = hop_latency(links, ranks.size)
        links = {
            collective: scaled_link(link, collective, ranks.size, world, hop_s) for collective, link in links.items()
        }
    for candidate in per_step:
        project(candidate, links, forward_s + backward_s, backward_s)
    for candidate, point in local:
        project_local(candidate, point, links, forward_s + backward_s)
    for candidate in candidates:
        candidate.evidence, candidate.quality_ok = evidence_for(candidate.method, candidate.setting, evidence)
    baseline = next(c for c in candidates if c.method == "none")
    for candidate in candidates:
        candidate.steps_evidence, candidate.steps_factor = steps_for(candidate.method, candidate.setting, evidence)
        candidate.steps_seeds = steps_seeds(candidate.method, candidate.setting, evidence)
        candidate.set_speedup(baseline.step_ms / candidate.step_ms)
    baseline.quality_ok = True
    hvd = getattr(ranks, "horovod", None)
    if timed_steps and loss_of is not None and hvd is not None and world == ranks.size:

        def time_one(candidate: Candidate) -> float:
            ranks.barrier()
            mine = time_steps(model, loss_of, candidate, timed_steps, hvd)
            return slowest_median(every_rank(ranks, mine))

        check_by_timing(per_step, time_one, PICK_SEEDS)
    return Advice(
        world,
        sum(g.numel() for g in grads.values()),
        1e3 * (forward_s + backward_s),
        1e3 * backward_s,
        links,
        candidates,
        recommend(per_step),
        steps_workload=evidence.get("steps_to_target", {}).get("workload", "")
        if any(c.steps_factor is not None for c in candidates if c.method != "none")
        else "",
        across_sites=local_advice(candidates),
        measured_world=ranks.size,
        hop_s=hop_s,
    )


def format_advice(advice: Advice) -> str:
    """The table and the recommendation, as printed."""
    lines = [
        f"hvd_compress.advise: {advice.parameters:,} parameters, {advice.world_size} ranks, "
        f"compute {advice.compute_ms:.1f} ms a step (backward {advice.backward_ms:.1f} ms)",
        "links (latency, bandwidth as each rank contributes bytes):",
    ]
    if advice.measured_world not in (0, advice.world_size):
        hop = (
            f"a hop's latency {1e6 * advice.hop_s:.0f} us"
            if advice.hop_s > 0
            else "no hop latency added: not told from noise on these ranks"
        )
        lines[1:] = [
            f"projected to {advice.world_size} ranks, not launched: links measured on {advice.measured_world} and "
            f"scaled as the ring algorithms scale ({hop}); codec, bytes and messages as one of "
            f"{advice.world_size} ranks; compute as measured; no timed check",
            f"links scaled to {advice.world_size} ranks (latency, bandwidth as each rank contributes bytes):",
        ]
    for collective, link in advice.links.items():
        bandwidth = "-" if math.isinf(link.bytes_per_s) else f"{8 * link.bytes_per_s / 1e9:.2f} Gbit/s"
        lines.append(f"  {collective:9} {1e6 * link.latency_s:8.0f} us  {bandwidth}")
    header = (
        "method",
        "setting",
        "MB/step",
        "codec ms",
        "comm ms",
        "step ms",
        "timed ms",
        "speed-up",
        "steps",
        "time to target",
        "quality evidence",
    )
    dense = next((c.wire_bytes for c in advice.candidates if c.method == "none"), math.inf)
    rows = [
        (
            c.method,
            c.setting or "-",
            f"{c.wire_bytes / 1e6:.2f}" + ("*" if c.wire_bytes > dense else ""),
            f"{c.codec_ms:.1f}",
            f"{c.communication_ms:.1f}",
            f"{c.step_ms:.1f}",
            "-" if c.timed_step_ms is None else f"{c.timed_step_ms:.1f}",
            f"{c.speedup:.2f}x",
            factor_text(c.steps_factor),
            factor_text(c.to_target),
            c.evidence,
        )
        for c in sorted(advice.candidates, key=lambda c: c.expected_step_ms)
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    if any(c.wire_bytes > dense for c in advice.candidates):
        lines.append(
            f"* sends more bytes per step than uncompressed at {advice.world_size} ranks: an "
            f"all-gather's bytes grow with the ranks, an all-reduce's stay under twice the gradient's"
        )
    if any(c.period > 1 for c in advice.candidates):
        lines.append("local methods (setting H=...): bytes, codec and communication per step, their exchange's over H")
    if advice.steps_workload:
        lines.append(f"steps and time to target (relative to uncompressed) measured on: {advice.steps_workload}")
    lines.append(f"advice: {advice.recommendation}")
    if advice.across_sites:
        lines.append(f"advice {advice.across_sites}")
    return "\n".join(lines)

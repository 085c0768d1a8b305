"""advise's model of a step: the links as measured (``Link``, ``fit_link``), the messages stock
``hvd.DistributedOptimizer`` issues for a method's rounds (``stock_messages``), and the
projected step (``project``; the package docstring says why each rule is what it is)."""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvd_compress.comm.rounds import Collective

FUSION_BYTES = 64 << 20  # Horovod's default fusion buffer (HOROVOD_FUSION_THRESHOLD)


@dataclass
class Link:
    """One collective as the ranks see it: seconds = latency + bytes / bandwidth (bytes: what
    each rank contributes)."""

    latency_s: float
    bytes_per_s: float
    measured: Dict[int, float] = field(default_factory=dict)  # bytes -> median seconds

    def seconds(self, nbytes: float) -> float:
        """Interpolated between the measured sizes (the package docstring); latency + bytes /
        bandwidth when fewer than two were measured."""
        points = sorted((int(n), s) for n, s in self.measured.items())
        if len(points) < 2:
            return self.latency_s + nbytes / self.bytes_per_s
        if nbytes <= points[0][0]:
            return points[0][1]
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if nbytes <= n1:
                return s0 + (s1 - s0) * (nbytes - n0) / (n1 - n0)
        return points[-1][1] + (nbytes - points[-1][0]) / self.bytes_per_s

    @property
    def intercept_s(self) -> float:
        """The latency a message of no bytes would see: the smallest probe's time less its bytes
        at the bandwidth (``latency_s`` is that probe's time, bytes and all), at least 0."""
        if len(self.measured) < 2 or math.isinf(self.bytes_per_s):
            return self.latency_s
        nbytes = min(int(n) for n in self.measured)
        return max(0.0, self.latency_s - nbytes / self.bytes_per_s)


def setting_label(setting: Dict[str, Any]) -> str:
    """A setting as advise's table and the evidence name it: {"rank": 8} -> "rank=8"."""
    return ",".join(f"{key}={value}" for key, value in setting.items())


@dataclass
class Candidate:
    method: str
    setting: str  # "rank=8", or "" for a method without one
    wire_bytes: float  # what one rank sends per step (ring model, as Traffic counts)
    codec_ms: float
    messages: Dict[str, Tuple[int, float]]  # collective -> (messages, bytes each): first rounds
    communication_ms: float = 0.0
    step_ms: float = 0.0
    speedup: float = 1.0
    evidence: str = ""
    quality_ok: Optional[bool] = None  # None: no evidence held
    # Measured steps to the uncompressed run's quality over uncompressed's: None where not
    # measured, inf where the setting did not reach it; to_target: projected time to target
    # over uncompressed's (step time x steps).
    steps_factor: Optional[float] = None
    steps_evidence: str = ""
    steps_seeds: int = 0  # the seeds the factor rests on
    to_target: Optional[float] = None
    # Rounds that follow another, one gradient after another: collective -> (messages, bytes each)
    serial_messages: Dict[str, Tuple[int, float]] = field(default_factory=dict)
    codec_step_ms: List[float] = field(default_factory=list)  # per timed step
    options: Dict[str, Any] = field(default_factory=dict)  # the registry's keywords, as ``setting`` says
    # A controller's candidate ("lgreco/topk"): each layer's setting as it decided from this model's gradients
    layer_settings: Dict[str, Any] = field(default_factory=dict)
    # A real training step's time where advise timed one (``check.py``); speedup and to_target
    # then come from it.
    timed_step_ms: Optional[float] = None
    # Steps per exchange: 1 for a per-step method, H for a local one (``local.py``), whose bytes,
    # codec and communication are then per step-equivalent.
    period: int = 1

    def set_speedup(self, speedup: float) -> None:
        """Its speed-up over uncompressed a step, and with it its time to target (where its
        steps to target were measured): the one place the two are tied."""
        self.speedup = speedup
        if self.steps_factor is not None:
            self.to_target = self.steps_factor / speedup

    @property
    def expected_step_ms(self) -> float:
        """The timed step where there is one, else the projected."""
        return self.step_ms if self.timed_step_ms is None else self.timed_step_ms


_FUSED_BY_HOROVOD = (Collective.ALLREDUCE, Collective.ALLGATHER)


def stock_messages(
    rounds: Sequence[Tuple[int, Collective, int]],
) -> Tuple[Dict[str, Tuple[int, float]], Dict[str, Tuple[int, float]]]:
    """The messages stock ``hvd.DistributedOptimizer`` issues for one step's ``rounds`` ((round
    index within its gradient, collective, bytes) each), as (first rounds, following
    rounds), each collective -> (messages, bytes per message). First rounds are submitted
    during backward: Horovod fuses the all-reduces and all-gathers among them into buffers of
    up to ``FUSION_BYTES``, the others go one per gradient. A following round is submitted when
    its gradient's previous one lands, and once the step synchronises the driver finishes them
    gradient after gradient (``comm/driver.py``): one message each."""
    fused_bytes, alone, serial = {}, {}, {}
    for index, collective, nbytes in rounds:
        if index == 0 and collective in _FUSED_BY_HOROVOD:
            fused_bytes[collective.value] = fused_bytes.get(collective.value, 0) + nbytes
        else:
            into = alone if index == 0 else serial
            count, total = into.get(collective.value, (0, 0))
            into[collective.value] = (count + 1, total + nbytes)
    first = {}
    for collective, nbytes in fused_bytes.items():
        first[collective] = (max(1, math.ceil(nbytes / FUSION_BYTES)), nbytes)
    for collective, (count, nbytes) in alone.items():
        fused, total = first.get(collective, (0, 0))
        first[collective] = (fused + count, total + nbytes)
    return (
        {collective: (count, nbytes / count) for collective, (count, nbytes) in first.items()},
        {collective: (count, nbytes / count) for collective, (count, nbytes) in serial.items()},
    )


def fit_link(measured: Dict[int, float]) -> Link:
    """The link of these probe times (bytes -> seconds): latency from the smallest probe,
    bandwidth from the two largest (the large messages' rate, past any burst the link lets
    through at memory speed); :meth:`Link.seconds` interpolates between the probes."""
    points = sorted((int(n), s) for n, s in measured.items())
    if len(points) == 1:
        ((nbytes, seconds),) = points
        return Link(seconds, float("inf"), dict(measured))
    (n0, s0), (n1, s1) = points[-2:]
    slope = (s1 - s0) / (n1 - n0)
    return Link(points[0][1], 1 / slope if slope > 0 else float("inf"), dict(measured))


HOP_MIN_WORLD = 4  # launched ranks from which a hop's latency is estimated (W - 1 hops of difference)


def hop_latency(links: Dict[str, Link], world: int) -> float:
    """Seconds each message a rank sends in turn adds to a collective's latency, from links
    measured over ``world`` ranks: an all-reduce sends ``world - 1`` more in turn than an
    all-gather, so the difference of their latencies over that is a hop's, and the rest of a
    latency a fixed cost (a collective's start, Horovod's cycle). 0 where either was not
    measured, the all-reduce's latency is no larger, or under ``HOP_MIN_WORLD`` ranks: at 2 the
    difference is one message against probes' noise of a millisecond, and it read 0 in 5 runs
    of 6 and 5.4 ms in the sixth."""
    if "allreduce" not in links or "allgather" not in links or world < HOP_MIN_WORLD:
        return 0.0
    return max(0.0, (links["allreduce"].intercept_s - links["allgather"].intercept_s) / (world - 1))


def scaled_link(link: Link, collective: str, measured_world: int, world: int, hop_s: float = 0.0) -> Link:
    """``link``, measured for ``collective`` over ``measured_world`` ranks, as the ring
    algorithms scale it to ``world`` ranks (the alpha-beta model of Thakur et al. 2005, as
    ``Collective.wire_bytes`` counts bytes): ``hop_s`` (``hop_latency``) more latency for each
    further message a rank sends in turn, and each measured time's part above the latency
    (``Link.intercept_s``) scaled by the bytes a rank sends. Raises ValueError where either
    world is under 2 ranks (a link of one rank carries nothing to scale)."""
    if min(world, measured_world) < 2:
        raise ValueError(f"world: links scale between worlds of 2 ranks or more, not {measured_world} -> {world}")
    ring = Collective(collective)
    intercept = link.intercept_s + hop_s * (ring.ring_messages(world) - ring.ring_messages(measured_world))
    probe = 1 << 20  # bytes: the ratio of wire bytes at any size, up to the padding of shards
    wire = ring.wire_bytes(probe, world) / ring.wire_bytes(probe, measured_world)
    return Link(
        intercept + (link.latency_s - link.intercept_s) * wire,
        link.bytes_per_s / wire,
        {n: intercept + (s - link.intercept_s) * wire for n, s in link.measured.items()},
    )


def project(candidate: Candidate, links: Dict[str, Link], compute_s: float, backward_s: float) -> None:
    """Fills in the candidate's communication and step time (the package docstring's model)."""
    communication, last = 0.0, 0.0
    for collective, (count, per_message) in candidate.messages.items():
        seconds = links[collective].seconds(per_message)
        communication += count * seconds
        last = max(last, seconds)
    serial = sum(
        count * links[collective].seconds(per_message)
        for collective, (count, per_message) in candidate.serial_messages.items()
    )
    exposed = max(communication - backward_s, last) + serial
    candidate.communication_ms = 1e3 * (communication + serial)
    candidate.step_ms = 1e3 * (compute_s + exposed) + candidate.codec_ms

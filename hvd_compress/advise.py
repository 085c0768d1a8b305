"""Does gradient compression pay for this model, on these ranks and links, and at what setting?
Run it before choosing a method, under the launcher and on the ranks that will train:

    mpirun -np 4 python -m hvd_compress.advise --model examples.models:charlm
    horovodrun -np 16 python -m hvd_compress.advise --model mypackage.models:resnet --json advice.json

``--model module:function``: ``function()`` returns the model, or ``(model, loss_of)`` where
``loss_of(model)`` is the loss of one fresh batch of this rank (then compute is measured);
without ``loss_of`` give ``--compute-ms`` (forward + backward of one step on one rank).

What it does, on every rank together:

1. **Codec**: every registered compressor at one to three settings (``SETTINGS``) compresses,
   feeds back error and decompresses this model's gradients on this device, each collective
   answered locally as if every rank had sent the same payload. A step waits for the slowest
   rank (ScaleCom's leader, which selects for all, changes every step), so each timed step
   counts the slowest rank's codec. Counted on the way: the bytes
   each collective carries per step and how many rounds follow one another.
2. **Links**: Horovod's all-reduce, all-gather, broadcast and all-to-all, timed over the ranks
   at sizes from 4 KiB up to the largest message a method would send (Horovod fuses what is
   submitted together into buffers of up to 64 MiB). Between two probe sizes a message's time is
   interpolated on the line through them, beyond the largest extrapolated with the bandwidth of
   the two largest, below the smallest taken as the smallest's: one straight line through all
   sizes would be set by the small ones, which a shaped link's burst lets pass at memory speed,
   and would miss the large messages that decide a step.
3. **Compute**: a few forward and backward passes of ``loss_of`` (the first one untimed).
4. **Projection**: a step is compute + codec + exposed communication, with the messages as
   stock ``hvd.DistributedOptimizer`` issues them. Every gradient's first round is submitted
   during backward and Horovod fuses the all-reduces and all-gathers among them into messages
   of up to 64 MiB (broadcasts and all-to-alls go one per gradient); backward hides what it can
   of these, so their exposed part is max(their time - backward, the last message). A round
   that follows another (PowerSGD's Q after P, ScaleCom's all-reduce after its broadcast) runs
   gradient after gradient once the step synchronises, one message each, all exposed.

5. **Time to target**: a user trains to a quality, not for a number of steps. Where this
   project measured how many steps a setting needs to reach the uncompressed run's quality
   (``python -m benchmarks time_to_quality``), its projected time to target is its projected
   step times that factor (uncompressed: 1), relative to uncompressed's.

It prints one table (method, setting, bytes one rank sends per step, codec and communication
time, projected step, speed-up over uncompressed, the steps-to-target factor and projected time
to target where measured, and the quality this project measured for that setting:
``hvd_compress/data/quality_evidence.json``, from ``docs/benchmarks.md``) and one line of
advice. Where any compressed setting has a steps-to-target factor, the advice is the setting
(or uncompressed) with the shortest projected time to target, among those measured, if it beats
uncompressed by ``WORTH_IT``. Otherwise, it is the fastest setting per step whose measured
quality loss stays within ``QUALITY_LIMITS``, said to rest on step time alone; or "do not
compress: the link is fast enough" when nothing beats uncompressed by ``WORTH_IT``.
Controllers (L-GreCo, GraVAC) are not projected: their settings change during training; their
evidence is in ``docs/benchmarks.md``.
"""
import argparse
import importlib
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.optional import import_horovod
from hvd_compress.registry import COMPRESSORS

# The settings tried per method (the registry's constructor keyword: values), from the least
# to the most compressed; methods without a setting are tried once.
SETTINGS = {"rank": (16, 8, 4), "density": (0.1, 0.01, 0.001), "bits": (8, 4, 2)}
FUSION_BYTES = 64 << 20  # Horovod's default fusion buffer (HOROVOD_FUSION_THRESHOLD)
SMALLEST_PROBE = 4 << 10
PROBE_SIZES = 4
# A setting is recommended only if this project measured no larger loss for it: perplexity up
# by at most this many percent, accuracy down by at most this many points.
QUALITY_LIMITS = {"%": 5.0, "points": 1.0}
WORTH_IT = 1.05  # a projected speed-up below this is not worth compression's risks
EVIDENCE = Path(__file__).with_name("data") / "quality_evidence.json"


@dataclass
class Link:
    """One collective as the ranks see it: seconds = latency + bytes / bandwidth (bytes: what
    each rank contributes)."""
    latency_s: float
    bytes_per_s: float
    measured: Dict[int, float] = field(default_factory=dict)  # bytes -> median seconds

    def seconds(self, nbytes: float) -> float:
        """Interpolated between the measured sizes (the module docstring); latency + bytes /
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


@dataclass
class Candidate:
    method: str
    setting: str                     # "rank=8", or "" for a method without one
    wire_bytes: float                # what one rank sends per step (ring model, as Traffic counts)
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
    to_target: Optional[float] = None
    # Rounds that follow another, one gradient after another: collective -> (messages, bytes each)
    serial_messages: Dict[str, Tuple[int, float]] = field(default_factory=dict)
    codec_step_ms: List[float] = field(default_factory=list)  # per timed step


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


# ----- the ranks ------------------------------------------------------------------------------
class HorovodRanks:
    """Collectives through Horovod (``horovodrun`` or ``mpirun``)."""

    def __init__(self):
        hvd = import_horovod("hvd_compress.advise under mpirun or horovodrun (torchrun needs no Horovod)")
        if not hvd.is_initialized():
            hvd.init()
        self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def run(self, collective: str, tensor: torch.Tensor, label: str) -> None:
        hvd = self.hvd
        if collective == "allreduce":
            hvd.allreduce(tensor, name=label)
        elif collective == "allgather":
            hvd.allgather(tensor, name=label)
        elif collective == "broadcast":
            hvd.broadcast(tensor, root_rank=0, name=label)
        else:
            hvd.alltoall(tensor, name=label)

    def barrier(self) -> None:
        self.hvd.allreduce(torch.zeros(1), name="hvd_compress.advise.barrier")

    def agree(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return self.hvd.broadcast_object(obj, root_rank=0, name="hvd_compress.advise.agree")

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        return self.hvd.allgather_object(obj, name="hvd_compress.advise.gather")


class TorchRanks:
    """Collectives through ``torch.distributed`` (``torchrun``), Gloo on CPUs, NCCL on GPUs."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()

    def run(self, collective: str, tensor: torch.Tensor, label: str) -> None:
        dist = self.dist
        if collective == "allreduce":
            dist.all_reduce(tensor)
        elif collective == "allgather":
            dist.all_gather([torch.empty_like(tensor) for _ in range(self.size)], tensor)
        elif collective == "broadcast":
            dist.broadcast(tensor, src=0)
        else:
            dist.all_to_all_single(torch.empty_like(tensor), tensor)

    def barrier(self) -> None:
        self.dist.barrier()

    def agree(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> List[Any]:
        every = [None] * self.size
        self.dist.all_gather_object(every, obj)
        return every


def launched_ranks(device: torch.device):
    """Horovod's ranks, or torch.distributed's under torchrun (its environment names them)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return TorchRanks(device)
    return HorovodRanks()


# ----- measuring ------------------------------------------------------------------------------
def load_model(spec: str) -> Tuple[torch.nn.Module, Optional[Callable]]:
    """``module:function`` -> (model, loss_of or None)."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"--model must be module:function (e.g. examples.models:charlm), got {spec!r}")
    sys.path.insert(0, ".")
    made = getattr(importlib.import_module(module_name), function_name)()
    model, loss_of = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model: {spec}() must return a torch.nn.Module or (module, loss_of), "
                         f"got {type(model).__name__}")
    return model, loss_of


def _settle(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure_compute(model, loss_of, steps: int = 3) -> Tuple[float, float]:
    """Median (forward, backward) seconds of one step of ``loss_of`` on this rank."""
    device = next(model.parameters()).device
    forward, backward = [], []
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        started = _settle(device)
        loss = loss_of(model)
        middle = _settle(device)
        loss.backward()
        ended = _settle(device)
        if step:  # the first: allocations, lazy initialisation
            forward.append(middle - started)
            backward.append(ended - middle)
    return statistics.median(forward), statistics.median(backward)


def gradients_of(model, loss_of) -> Dict[str, torch.Tensor]:
    """This model's gradients: one backward of ``loss_of``, else random ones of its shapes."""
    if loss_of is not None:
        model.zero_grad(set_to_none=True)
        loss_of(model).backward()
    generator = torch.Generator().manual_seed(0)
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
        else:
            grads[name] = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
    return grads


def _answer(round_: Round, world: int) -> torch.Tensor:
    """What the collective would return if every rank had sent this payload."""
    if round_.collective is Collective.ALLGATHER:
        return round_.payload.unsqueeze(0).expand(world, *round_.payload.shape).contiguous()
    return round_.payload


def measure_codec(method: str, setting: Dict[str, Any], grads: Dict[str, torch.Tensor],
                  named, rank: int, world: int, steps: int = 2) -> Candidate:
    """One method at one setting on these gradients: codec seconds per step (median of
    ``steps`` after one untimed), bytes per step and the messages of each collective, counted
    by :func:`stock_messages` on the last step's rounds."""
    compressor = COMPRESSORS[method].build(named, **setting)
    compressor.bind_world(rank, world)
    traffic = compressor.traffic
    device = next(iter(grads.values())).device
    seconds = []
    for step in range(steps + 1):
        started = _settle(device)
        rounds = []  # (gradient's round index, collective, bytes) of this step
        for name, grad in grads.items():
            traffic.add_gradient(grad)
            round_, index = compressor.begin(name, grad), 0
            while isinstance(round_, Round):
                traffic.add_payload(round_.payload, round_.collective)
                rounds.append((index, round_.collective, round_.payload.numel() * round_.payload.element_size()))
                round_, index = round_.then(_answer(round_, world)), index + 1
        compressor.end_step()
        if step:
            seconds.append(_settle(device) - started)
    messages, serial = stock_messages(rounds)
    label = ",".join(f"{key}={value}" for key, value in setting.items())
    return Candidate(method, label, traffic.wire_bytes / max(1, traffic.steps), 1e3 * statistics.median(seconds),
                     messages, serial_messages=serial, codec_step_ms=[1e3 * s for s in seconds])


def slowest_codec(every_rank: Sequence[Candidate]) -> Candidate:
    """The first rank's candidate with its codec time the median over the timed steps of the
    slowest rank's time at each (every rank timed the same steps)."""
    first = every_rank[0]
    per_step = [max(steps) for steps in zip(*(c.codec_step_ms for c in every_rank))]
    if per_step:
        first.codec_ms, first.codec_step_ms = statistics.median(per_step), per_step
    return first


_FUSED_BY_HOROVOD = (Collective.ALLREDUCE, Collective.ALLGATHER)


def stock_messages(rounds: Sequence[Tuple[int, Collective, int]]
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
    return ({collective: (count, nbytes / count) for collective, (count, nbytes) in first.items()},
            {collective: (count, nbytes / count) for collective, (count, nbytes) in serial.items()})


def probe_sizes(largest: float) -> List[int]:
    """``PROBE_SIZES`` sizes from 4 KiB to ``largest`` bytes, geometrically, multiples of 4."""
    largest = max(SMALLEST_PROBE, int(largest))
    if largest == SMALLEST_PROBE:
        return [SMALLEST_PROBE]
    ratio = (largest / SMALLEST_PROBE) ** (1 / (PROBE_SIZES - 1))
    return sorted({4 * max(1, round(SMALLEST_PROBE * ratio ** i / 4)) for i in range(PROBE_SIZES)})


def fit_link(measured: Dict[int, float]) -> Link:
    """The link of these probe times (bytes -> seconds): latency from the smallest probe,
    bandwidth from the two largest (the large messages' rate, past any burst the link lets
    through at memory speed); :meth:`Link.seconds` interpolates between the probes."""
    points = sorted((int(n), s) for n, s in measured.items())
    if len(points) == 1:
        (nbytes, seconds), = points
        return Link(seconds, float("inf"), dict(measured))
    (n0, s0), (n1, s1) = points[-2:]
    slope = (s1 - s0) / (n1 - n0)
    return Link(points[0][1], 1 / slope if slope > 0 else float("inf"), dict(measured))


def measure_links(ranks, largest: Dict[str, float], device: torch.device, repeats: int = 3) -> Dict[str, Link]:
    """Each collective timed over the ranks at ``probe_sizes(largest[collective])``: the median
    of ``repeats`` after one untimed, each started together (a barrier before it)."""
    links = {}
    for collective in sorted(largest):
        measured = {}
        for nbytes in probe_sizes(largest[collective]):
            numel = nbytes // 4
            tensor = torch.ones((ranks.size, max(1, numel // ranks.size)) if collective == "alltoall" else (numel,),
                                device=device)
            seconds = []
            for repeat in range(repeats + 1):
                ranks.barrier()
                started = _settle(device)
                ranks.run(collective, tensor, f"hvd_compress.advise.{collective}.{nbytes}")
                if repeat:
                    seconds.append(_settle(device) - started)
            measured[nbytes] = statistics.median(seconds)
        links[collective] = fit_link(ranks.agree(measured))
    return links


# ----- projecting -----------------------------------------------------------------------------
def project(candidate: Candidate, links: Dict[str, Link], compute_s: float, backward_s: float) -> None:
    """Fills in the candidate's communication and step time (the module docstring's model)."""
    communication, last = 0.0, 0.0
    for collective, (count, per_message) in candidate.messages.items():
        seconds = links[collective].seconds(per_message)
        communication += count * seconds
        last = max(last, seconds)
    serial = sum(count * links[collective].seconds(per_message)
                 for collective, (count, per_message) in candidate.serial_messages.items())
    exposed = max(communication - backward_s, last) + serial
    candidate.communication_ms = 1e3 * (communication + serial)
    candidate.step_ms = 1e3 * (compute_s + exposed) + candidate.codec_ms


def _loss_of(delta: str) -> Optional[Tuple[float, str]]:
    """"+2.7%" -> (2.7, "%"); "-0.84 points" -> (0.84, "points"): how much worse, in its unit."""
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
    record = (steps or {}).get("methods", {}).get(method, {}).get(setting)
    if not record:
        return "", None
    seeds = f"{record['reached']} of {record['seeds']} seeds reached it"
    if record["factor"] is None:
        return f"not reached ({seeds}; {steps['workload']})", math.inf
    return f"{record['factor']:.2f}x the steps ({seeds}; {steps['workload']})", record["factor"]


def recommend(candidates: Sequence[Candidate]) -> str:
    """The one line of advice (the module docstring's rule)."""
    baseline = next(c for c in candidates if c.method == "none")
    measured = [c for c in candidates if c.to_target is not None and c.method != "none"]
    if measured:
        best = min(measured, key=lambda c: c.to_target)
        if best.to_target > 1 / WORTH_IT:
            line = (f"do not compress: no measured setting is projected to reach uncompressed's quality "
                    f"{WORTH_IT:.2f}x sooner (the best, {describe(best)}: {_factor_text(best.to_target)} "
                    f"its time)")
        else:
            line = (f"compress with {describe(best)}: projected to reach uncompressed's quality in "
                    f"{best.to_target:.2f}x its time ({best.speedup:.2f}x faster a step, {best.steps_evidence})")
        # A setting whose steps to target were never measured may still be the one to try.
        unmeasured = [c for c in candidates if c.steps_factor is None and c.quality_ok is not False
                      and c.speedup * min(best.to_target, 1.0) > WORTH_IT]
        if unmeasured:
            fastest = max(unmeasured, key=lambda c: c.speedup)
            line += (f". Not measured to target but {fastest.speedup:.2f}x faster a step: {describe(fastest)}, "
                     f"which pays if it needs under {fastest.speedup * min(best.to_target, 1.0):.2f}x the steps")
        return line
    line = recommend_by_step(candidates, baseline)
    return line + "; steps to target not measured for any setting here, so this rests on step time alone"


def recommend_by_step(candidates: Sequence[Candidate], baseline: Candidate) -> str:
    """The advice by projected step time and the quality limits."""
    fastest = min(candidates, key=lambda c: c.step_ms)
    safe = [c for c in candidates if c.method != "none" and c.quality_ok]
    best = min(safe, key=lambda c: c.step_ms) if safe else None
    if best is None or best.speedup < WORTH_IT:
        if fastest.method == "none" or fastest.speedup < WORTH_IT:
            return (f"do not compress: the link is fast enough (uncompressed {baseline.step_ms:.1f} ms a step; "
                    f"no method is projected {WORTH_IT:.2f}x faster)")
        return (f"do not compress: only {describe(fastest)} is projected faster ({fastest.speedup:.2f}x), "
                f"and this project measured a quality loss for it beyond the limits (or holds no evidence)")
    line = (f"compress with {describe(best)}: {baseline.step_ms:.1f} -> {best.step_ms:.1f} ms a step "
            f"({best.speedup:.2f}x); quality measured here: {best.evidence}")
    if fastest is not best and fastest.method != "none":
        line += (f". Faster but with a larger or unmeasured quality loss: {describe(fastest)} "
                 f"({fastest.speedup:.2f}x)")
    return line


def describe(candidate: Candidate) -> str:
    return candidate.method + (f" {candidate.setting}" if candidate.setting else "")


def _settings_of(method: str) -> List[Dict[str, Any]]:
    keys = [key for key in COMPRESSORS[method].defaults if key in SETTINGS]
    if not keys:
        return [{}]
    key = keys[0]
    return [{key: value} for value in SETTINGS[key]]


# ----- the whole -----------------------------------------------------------------------------
def advise(model: torch.nn.Module, loss_of: Optional[Callable] = None, *, compute_ms: Optional[float] = None,
           methods: Optional[Sequence[str]] = None, ranks=None, codec_steps: int = 2,
           compute_steps: int = 3, repeats: int = 3) -> Advice:
    """Measures and projects every method (``methods``: registry names, default all) for
    ``model`` on the launched ranks; every rank must call it. ``compute_ms``: forward plus
    backward of one step, when ``loss_of`` is not given (backward taken as two thirds of it).
    ``ranks``: the launched ones by default; a stand-in has ``rank``, ``size``, ``run``,
    ``barrier``, ``agree`` and optionally ``gather`` (without it, rank 0's codec times count)."""
    device = next(model.parameters()).device
    ranks = ranks or launched_ranks(device)
    methods = list(methods or COMPRESSORS)
    unknown = sorted(set(methods) - set(COMPRESSORS))
    if unknown:
        raise ValueError(f"methods: {unknown} are not registered; known: {sorted(COMPRESSORS)}")
    if "none" not in methods:
        methods.insert(0, "none")
    if loss_of is None and compute_ms is None:
        raise ValueError("compute_ms: give the compute time of one step (forward + backward, ms), or a "
                         "loss_of(model) to measure it")
    if loss_of is not None:
        ranks.barrier()
        forward_s, backward_s = ranks.agree(measure_compute(model, loss_of, compute_steps))
    else:
        if compute_ms <= 0:
            raise ValueError(f"compute_ms must be positive, got {compute_ms!r}")
        forward_s, backward_s = compute_ms / 3e3, 2 * compute_ms / 3e3
    grads = gradients_of(model, loss_of)
    named = [(name, p) for name, p in model.named_parameters() if name in grads]
    candidates = []
    for method in methods:
        for setting in _settings_of(method):
            ranks.barrier()  # every rank's codec runs at once, as in training
            mine = measure_codec(method, setting, grads, named, ranks.rank, ranks.size, codec_steps)
            every_rank = ranks.gather(mine) if hasattr(ranks, "gather") else [ranks.agree(mine)]
            candidates.append(slowest_codec(every_rank))
    largest = {}
    for candidate in candidates:
        for collective, (_, per_message) in [*candidate.messages.items(), *candidate.serial_messages.items()]:
            largest[collective] = max(largest.get(collective, 0.0), per_message)
    links = measure_links(ranks, largest, device, repeats)
    evidence = json.loads(EVIDENCE.read_text()) if EVIDENCE.exists() else {}
    for candidate in candidates:
        project(candidate, links, forward_s + backward_s, backward_s)
        candidate.evidence, candidate.quality_ok = evidence_for(candidate.method, candidate.setting, evidence)
    baseline = next(c for c in candidates if c.method == "none")
    for candidate in candidates:
        candidate.speedup = baseline.step_ms / candidate.step_ms
        candidate.steps_evidence, candidate.steps_factor = steps_for(candidate.method, candidate.setting, evidence)
        if candidate.steps_factor is not None:
            candidate.to_target = candidate.steps_factor / candidate.speedup
    baseline.quality_ok = True
    return Advice(ranks.size, sum(g.numel() for g in grads.values()), 1e3 * (forward_s + backward_s),
                  1e3 * backward_s, links, candidates, recommend(candidates),
                  steps_workload=evidence.get("steps_to_target", {}).get("workload", "")
                  if any(c.steps_factor is not None for c in candidates if c.method != "none") else "")


def format_advice(advice: Advice) -> str:
    """The table and the recommendation, as printed."""
    lines = [f"hvd_compress.advise: {advice.parameters:,} parameters, {advice.world_size} ranks, "
             f"compute {advice.compute_ms:.1f} ms a step (backward {advice.backward_ms:.1f} ms)",
             "links (latency, bandwidth as each rank contributes bytes):"]
    for collective, link in advice.links.items():
        bandwidth = "-" if math.isinf(link.bytes_per_s) else f"{8 * link.bytes_per_s / 1e9:.2f} Gbit/s"
        lines.append(f"  {collective:9} {1e6 * link.latency_s:8.0f} us  {bandwidth}")
    header = ("method", "setting", "MB/step", "codec ms", "comm ms", "step ms", "speed-up", "steps",
              "time to target", "quality evidence")
    rows = [(c.method, c.setting or "-", f"{c.wire_bytes / 1e6:.2f}", f"{c.codec_ms:.1f}",
             f"{c.communication_ms:.1f}", f"{c.step_ms:.1f}", f"{c.speedup:.2f}x", _factor_text(c.steps_factor),
             _factor_text(c.to_target), c.evidence)
            for c in sorted(advice.candidates, key=lambda c: c.step_ms)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    if advice.steps_workload:
        lines.append(f"steps and time to target (relative to uncompressed) measured on: {advice.steps_workload}")
    lines.append(f"advice: {advice.recommendation}")
    return "\n".join(lines)


def _factor_text(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "not reached" if math.isinf(value) else f"{value:.2f}x"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hvd_compress.advise",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="module:function returning the model, or (model, loss_of)")
    parser.add_argument("--compute-ms", type=float, help="forward + backward ms of one step (without loss_of)")
    parser.add_argument("--methods", help="comma-separated registry names (default: every one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="also write the advice as JSON (rank 0)")
    args = parser.parse_args(argv)
    model, loss_of = load_model(args.model)
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per rank: torchrun's local rank, or Open MPI's
        local_rank = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        device = torch.device("cuda", int(local_rank))
    model.to(device)
    ranks = launched_ranks(device)
    advice = advise(model, loss_of, compute_ms=args.compute_ms, ranks=ranks,
                    methods=args.methods.split(",") if args.methods else None)
    if ranks.rank == 0:
        sys.stdout.write(format_advice(advice) + "\n")  # one write: whole lines under any launcher
        sys.stdout.flush()
        if args.json:
            args.json.write_text(json.dumps(asdict(advice), indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Codec cost: what compressing, error feedback and decompressing cost per training step, on
the gradient shapes of real models, side by side with PyTorch's own PowerSGD comm hook.

Communication is left out: each compressor runs on one rank and every collective's result is
the rank's own payload (what a world of one returns), so the time is encode + error feedback +
decode. Torch's ``powerSGD_hook`` runs in a gloo process group of one over DDP-style buckets
(reverse parameter order, 25 MiB cap); its all-reduces of one rank are part of its time.
Each method runs in a fresh process, so none inherits another's allocator state, in ``--rounds``
rounds over every method (each round's cycles pooled), so that a slow drift of the host hits
every method alike; the floor's rates are measured in every round and the best is kept.

Besides the per-step table the run measures Top-K selection alone (``topk_indices`` against
``torch.topk`` on the same magnitudes) and one memory pass over each shape set (``clone`` and
``sum`` of every gradient), the yardstick for QSGD. Writes ``codec.json`` (raw numbers) and
PNGs under ``<out>/benchmarks/`` and the "Codec cost" page beside them (``codec-cost.md``).

Floor: each codec's step against the least its algorithm must cost on this machine, ``max(bytes
/ bandwidth, flops / GEMM throughput)``, both measured in the same run, in a fresh process with
the codec processes' torch threads (torch's default, not the issue's one thread: a floor at
fewer threads than the codecs had would be too lenient). ``floor_model`` counts, per tensor it
compresses, the gradient read and the result written once (4 bytes an entry each), the residual
read and written once where error feedback is on, and the payload written once and read back
once (``payload_bytes``: factors, values and indices, codes and norms); a tensor sent whole is
read once and written once. Flops: PowerSGD's ``P = M Q``, ``Q = M^T P`` and decompression ``P
Q^T`` (2 n m r each), ACP-SGD's one projection a step and its decompression, and with error
feedback the residual ``M - P Q^T`` (this rank's factor, where the decompression takes the mean:
a product of its own, 2 n m r); orthogonalisation, ``O((n + m) r^2)``, and the element-wise work
are left out (memory-bound, counted as bytes). Bandwidth: the best of several copies of a 256
MiB buffer into another (read + write counted, STREAM's copy); GEMM throughput: the best of
several runs of the three skinny products above on a 2048 x 2048 matrix at the run's rank, in
the forms the codecs compute them (``maths.lowrank``; "Low-rank products by layout"). With
``--device cuda`` both are measured on the GPU. Target: PowerSGD, ACP-SGD, Top-K and QSGD within
1.5x of their floor.
Beside the floor, not in it: QSGD's random draws (``noise_words``: a 64-bit word for four
entries) at the rate one generator fills words in the same run, a bound the bytes do not show;
and the bytes the low-rank codecs' operators move (``OPERATOR_PASSES``: each operator through
memory) at the same bandwidth, how far the code as written can get without fusing operators.
Where one misses it, what bounds it: on CPU each method's process profiles one more step and the
section names the aten operators that took most of it.

``--compiled`` adds, beside each method that has compiled kernels (``config.compiled``; so far
QSGD's encode and decode, Top-K's selection flags), its compiled form as a method of its own
("QSGD compiled"), compiled before its first timed step (``prepare_compiled``; its seconds
recorded per process: the run's first process compiles into an empty inductor cache of its own,
later ones find it there), and
then, per shape set, eager and compiled timed in one fresh process, cycle for cycle in turn, the
comparison that the noise between processes (20-40% here) does not blur: the section's table
"Compiled against eager".

``--operators`` measures instead, and alone, the aten operators a step dispatches (counted under
a ``TorchDispatchMode``) for every compressor, and those of L-GreCo's low-rank error rows one
layer at a time against batched by shape, on each shape set (layers against distinct shapes):
operators should grow with distinct shapes, not layers. Writes ``codec-operators.json`` and the
"## Codec operators per step" section (``--device cuda``: ``codec-operators-cuda.json``, "... on a
GPU"; the GPU's time per operator reads these counts, else the CPU's).

``--device cuda`` runs the same on the GPU (gradients, buckets and selection there; every timing
between two device synchronisations; the hook in an NCCL group of one) against the GPU's
targets, and writes ``codec-cuda.json``, its own PNGs and the "## Codec cost on a GPU" section,
which names the GPU.
"""

import argparse
import functools
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_compress as hc
from benchmarks.harness.jobs import command_line
from benchmarks.harness.machine import OthersShare, describe_machine, gpu_description, machine
from benchmarks.harness.render import (
    DOCS,
    gpu_lines,
    method_bars,
    notes_lines,
    panels,
    save_record,
    stored,
    write_section,
)
from benchmarks.shapes import DESCRIPTIONS, parameter_count, shape_set
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.comm.simulated import run_alone
from hvd_compress.compressors.base import Compressor
from hvd_compress.maths import lowrank
from hvd_compress.maths.lowrank import factor_shapes
from hvd_compress.maths.quantize import draw_noise, noise_words
from hvd_compress.maths.sparsify import topk_indices

logger = logging.getLogger(__name__)

HOOK = "torch powerSGD_hook"
DDP_BUCKET_BYTES = 25 * 1024 * 1024
TOPK_SIZES = [1 << 20, 1 << 22, 25_000_000]
TOPK_REPEATS = 11  # selection takes milliseconds: more repeats steady the median
# Each timed cycle is two steps, so ACP-SGD's P and Q steps weigh equally.
STEPS_PER_CYCLE = 2
WARMUP_STEPS = 2
# Targets: (label, numerator, denominator, limit), the same on both devices.
RATIO_TARGETS = [("ACP-SGD / torch hook", "ACP-SGD", HOOK, 0.5), ("PowerSGD / torch hook", "PowerSGD", HOOK, 0.8)]
# Per device: QSGD's step within this many memory passes, Top-K selection this much faster.
QSGD_LIMIT = {"cpu": 10.0, "cuda": 5.0}
TOPK_SPEEDUP = {"cpu": 10.0, "cuda": 3.0}
# The floor's measurements: a copy far beyond any cache (``--quick``: an eighth), and PowerSGD's
# skinny products on a matrix of this side; the best of this many runs (the machine's best).
COPY_BYTES = 256 << 20
GEMM_SIDE = 2048
THROUGHPUT_REPEATS = 5
GEMM_PRODUCTS = (
    "`M Q` as `project_right` computes it, as `(Q^T M^T)^T` at rank 4 on a CPU; `M^T P` as `(P^T M)^T`; "
    "and `P Q^T` into existing memory"
)
EARLIER_GEMM_PRODUCTS = "`M Q`, `M^T P` and `P Q^T`"  # what the older records' runs timed
# Random 64-bit words per step of a compressed tensor of n entries, for the codecs that draw them:
# QSGD's stochastic rounding. Not part of the floor (bytes and GEMM flops): a bound beside it.
NOISE_WORDS = {"QSGD": noise_words}
FLOOR = "floor throughput"  # measure()'s label for the floor's measurements
RATES = ["bandwidth_bytes_per_s", "gemm_flops_per_s", "random_words_per_s"]  # machine_throughput's rates
# Flops per step of a compressed n x m matrix at rank r, in units of n m r: PowerSGD's two
# projections and decompression, ACP-SGD's one projection a step and decompression (2 n m r each);
# with error feedback on, the residual M - P Q^T as well: it takes this rank's factor where the
# decompression takes the mean, so the two are separate products (RESIDUAL_FLOPS).
LOWRANK_FLOPS = {"PowerSGD": 6, "ACP-SGD": 4}
RESIDUAL_FLOPS = 2
# Gradient-sized passes through memory that the low-rank codecs' operators make per compressed
# tensor with error feedback on, each operator reading its inputs and writing its output: M = G + E
# into the residual's buffer (3), P = M Q (1; ACP-SGD one projection a step), Q = M^T P (1,
# PowerSGD), M -= P Q^T (2), P Q^T into the gradient (1). The floor counts 4 (G and E read, E and
# the result written); only operators fused into one pass could close the difference.
OPERATOR_PASSES = {"PowerSGD": 8, "ACP-SGD": 7}
FLOOR_TARGETS = ["PowerSGD", "ACP-SGD", "TopK", "QSGD"]
BREAKDOWN_OPERATORS = 3  # operators named in "where the step goes"
FLOOR_LIMIT = 1.5
SECTION = {"cpu": "Codec cost", "cuda": "Codec cost on a GPU"}
OPERATORS_SECTION = {"cpu": "Codec operators per step", "cuda": "Codec operators per step on a GPU"}
SUFFIX = {"cpu": "", "cuda": "-cuda"}  # of the JSON and PNG files

# Labels of the registry's methods in the tables and plots, in their order.
LABELS = {
    "powersgd": "PowerSGD",
    "acpsgd": "ACP-SGD",
    "topk": "TopK",
    "qsgd": "QSGD",
    "fp16": "FP16",
    "bf16": "BF16",
    "none": "NoCompression",
}


# The label of a method's compiled form (``--compiled``): "QSGD compiled".
COMPILED = " compiled"
INTERLEAVED = "compiled against eager"  # measure()'s label for the one-process comparison


def compressors(args):
    """(label, factory) for every compressor at the command line's settings; with ``--compiled``,
    then the compiled form of each that has compiled kernels."""
    settings = {
        "powersgd": {"rank": args.rank},
        "acpsgd": {"rank": args.rank},
        "topk": {"density": args.density},
        "qsgd": {"bits": args.bits},
    }
    made = [
        (label, functools.partial(hc.COMPRESSORS[name].build, **settings.get(name, {})))
        for name, label in LABELS.items()
    ]
    if getattr(args, "compiled", False):
        made += [
            (label + COMPILED, functools.partial(hc.COMPRESSORS[name].build, compiled=True, **settings.get(name, {})))
            for name, label in LABELS.items()
            if hc.COMPRESSORS[name].cls.compiled_kernels
        ]
    return made


def base_label(label):
    """The method a label times: "QSGD" for "QSGD compiled"."""
    return label.removesuffix(COMPILED)


def gradients(shapes, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator).to(device) for name, shape in shapes}


def time_cycles(step, cycles):
    """Seconds per step, one value per cycle; ``step()`` runs a training step's codec work and
    returns the seconds that count."""
    for _ in range(WARMUP_STEPS):
        step()
    return [sum(step() for _ in range(STEPS_PER_CYCLE)) / STEPS_PER_CYCLE for _ in range(cycles)]


def settle(device):
    """Waits for the work queued on a GPU, so that a timing covers work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(fn, device="cpu"):
    settle(device)
    start = time.perf_counter()
    fn()
    settle(device)
    return time.perf_counter() - start


def as_integrations_run(make, grads):
    """(refresh, step) of ``make()``'s compressor run as the integrations run it, each result
    made in its gradient's memory, each fusion bucket's gradients begun together (``begin_many``:
    same-shape layers batched where the compressor batches), the buckets planned as
    ``hvd_compress.DistributedOptimizer`` plans them (25 MiB scaled by the compression rate, in
    backward order): ``refresh()`` hands it the gradients anew, copied into memory already
    touched, as backward leaves them (not timed, not counted); ``step()`` is one step's codec
    work on them."""
    compressor = make()
    compressor.write_results_into_gradients()
    work = {name: grad.clone() for name, grad in grads.items()}
    backward = {name: tuple(grad.shape) for name, grad in reversed(grads.items())}
    scheduler = FusionScheduler(compressor, backward, ScaledFusion())

    def refresh():
        for name, grad in grads.items():
            work[name].copy_(grad)

    def step():
        # The results live until the step ends, as the gradients they replace do in training.
        results = []
        for bucket in scheduler.plan().buckets:
            rounds = compressor.begin_many([(name, work[name]) for name in bucket.members])
            results += [run_alone(round_) for round_ in rounds]
        compressor.end_step()  # keeps the step's residuals, as every integration does
        return results

    return refresh, step


def prepared(make, grads, made):
    """A factory of ``make()``'s compressor with its compiled kernels (if any) compiled on the
    gradients' shapes, as a binding has them before the first step; each one made is appended
    to ``made``."""

    def build():
        compressor = make()
        compressor.prepare_compiled({name: tuple(grad.shape) for name, grad in grads.items()})
        made.append(compressor)
        return compressor

    return build


def time_ours(make, grads, cycles, device):
    """{"cycles": seconds per step, one value per cycle; "operators": where one more step's
    time went (``where_time_goes``), on CPU; "compile_seconds" of a compiled one}."""
    made = []
    refresh, step = as_integrations_run(prepared(make, grads, made), grads)

    def timed_step():
        refresh()
        return seconds_of(step, device)

    timed = {"cycles": time_cycles(timed_step, cycles)}
    if made[0].config.compiled:
        timed["compile_seconds"] = made[0].compiled_path.seconds
    if torch.device(device).type == "cpu":
        refresh()
        timed["operators"] = where_time_goes(step)
    return timed


def time_interleaved(makers, grads, cycles, device):
    """Each method of ``makers`` ({label: factory}) eager and compiled in this one process, a
    cycle of each in turn: {label: {"cycles": [...]}}, a compiled one's with its
    "compile_seconds" (this process's, before its first step)."""
    made, runs = [], {}
    for label, make in makers.items():
        runs[label] = as_integrations_run(prepared(make, grads, made), grads)
    compile_seconds = dict(zip(makers, (compressor.compiled_path.seconds for compressor in made)))
    for refresh, step in runs.values():
        for _ in range(WARMUP_STEPS):
            refresh()
            step()
    timed = {label: {"cycles": []} for label in makers}
    for _ in range(cycles):
        for label, (refresh, step) in runs.items():
            seconds = 0.0
            for _ in range(STEPS_PER_CYCLE):
                refresh()
                seconds += seconds_of(step, device)
            timed[label]["cycles"].append(seconds / STEPS_PER_CYCLE)
    for label in makers:
        if label.endswith(COMPILED):
            timed[label]["compile_seconds"] = compile_seconds[label]
    return timed


def where_time_goes(step, largest=BREAKDOWN_OPERATORS):
    """The ``largest`` aten operators by self time over one profiled ``step()``, as
    [operator, share of the step's self time], and the rest's share: what bounds a codec."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        step()
    times = {
        event.key: event.self_cpu_time_total for event in profiled.key_averages() if event.key.startswith("aten::")
    }
    total = sum(times.values()) or 1.0
    ranked = sorted(times.items(), key=lambda item: -item[1])
    return {
        "largest": [[op, t / total] for op, t in ranked[:largest]],
        "rest": sum(t for _, t in ranked[largest:]) / total,
    }


class Bucket:
    """What ``powerSGD_hook`` reads from a ``dist.GradBucket`` (which has no Python
    constructor): a flat buffer, per-parameter views into it, its index, whether it is last."""

    def __init__(self, index, grads, last):
        self._index, self._last = index, last
        self._buffer = torch.empty(sum(g.numel() for g in grads), device=grads[0].device)
        self._views, offset = [], 0
        for grad in grads:
            self._views.append(self._buffer[offset : offset + grad.numel()].view(grad.shape))
            offset += grad.numel()

    def fill(self, grads):
        """DDP copies gradients into the bucket before the hook runs: not part of its cost."""
        for view, grad in zip(self._views, grads):
            view.copy_(grad)

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._views

    def parameters(self):
        return self._views

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def ddp_buckets(grads):
    """Gradients grouped as DDP does by default: reverse parameter order, about 25 MiB each."""
    groups, current, size = [], [], 0
    for grad in reversed(list(grads.values())):
        if current and size + 4 * grad.numel() > DDP_BUCKET_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(grad)
        size += 4 * grad.numel()
    groups.append(current)
    return [(Bucket(i, group, last=i == len(groups) - 1), group) for i, group in enumerate(groups)]


def time_torch_hook(grads, rank, cycles, device):
    """Seconds per step of ``powerSGD_hook`` over every bucket, after its dense start-up."""
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
    )
    buckets = ddp_buckets(grads)
    for _ in range(state.start_powerSGD_iter):
        for bucket, group in buckets:
            bucket.fill(group)
            powerSGD_hook(state, bucket).wait()

    def hooks():
        for bucket, _ in buckets:
            powerSGD_hook(state, bucket).wait()

    def step():
        for bucket, group in buckets:
            bucket.fill(group)
        return seconds_of(hooks, device)

    return time_cycles(step, cycles)


def time_memory_pass(grads, repeats, device):
    """Milliseconds for one pass over every gradient: ``clone`` (read + write) and ``sum`` (read)."""

    def over_all(op):
        return lambda: [op(grad) for grad in grads.values()]

    return {
        "clone_ms": 1e3 * median_seconds(over_all(torch.clone), repeats, device),
        "sum_ms": 1e3 * median_seconds(over_all(torch.sum), repeats, device),
    }


def time_topk_selection(sizes, density, repeats, device, seed=0):
    """``topk_indices`` against ``torch.topk`` (sorted, the default, and unsorted) on the same
    magnitudes of a standard-normal gradient."""
    rows = []
    for numel in sizes:
        magnitudes = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).abs().to(device)
        k = max(1, math.ceil(density * numel))
        timings = {
            label: median_seconds(fn, repeats, device)
            for label, fn in [
                ("torch_topk_ms", lambda: torch.topk(magnitudes, k)),
                ("torch_topk_unsorted_ms", lambda: torch.topk(magnitudes, k, sorted=False)),
                ("ours_ms", lambda: topk_indices(magnitudes, k)),
            ]
        }
        row = {"numel": numel, "k": k, **{key: 1e3 * value for key, value in timings.items()}}
        row["speedup"] = row["torch_topk_ms"] / row["ours_ms"]
        row["speedup_vs_unsorted"] = row["torch_topk_unsorted_ms"] / row["ours_ms"]
        rows.append(row)
    return rows


def median_seconds(fn, repeats, device):
    """Median over ``repeats`` timed calls, after one untimed call."""
    fn()
    return statistics.median(seconds_of(fn, device) for _ in range(repeats))


def floor_model(label: str, compressor: Compressor, shapes: list) -> dict:
    """The least bytes moved and flops per step of ``compressor`` (labelled as in ``LABELS``)
    on ``shapes`` ([(name, shape)]), at its settings; see the module docstring."""
    label = base_label(label)
    feedback = getattr(compressor, "feedback", None)
    with_feedback = feedback is not None and feedback.enabled
    per_entry = 16 if with_feedback else 8
    passes = OPERATOR_PASSES.get(label) if with_feedback else None
    moved = flops = words = compressed = 0
    for name, shape in shapes:
        numel, setting = math.prod(shape), compressor.setting(name)
        if not compressor.tuning.compresses(shape, setting):
            moved += 8 * numel
            continue
        compressed += numel
        moved += per_entry * numel + 2 * compressor.tuning.payload_bytes(shape, setting)
        if label in LOWRANK_FLOPS:
            n, m, r = factor_shapes(shape, setting)
            flops += (LOWRANK_FLOPS[label] + RESIDUAL_FLOPS * with_feedback) * n * m * r
        if label in NOISE_WORDS:
            words += NOISE_WORDS[label](numel)
    model = {"bytes": moved, "flops": flops, "random_words": words}
    if passes:  # the floor's bytes, each compressed entry passed over by the operators instead
        model["operator_bytes"] = moved + 4 * (passes - per_entry // 4) * compressed
    return model


def floor_ms(model: dict, throughput: dict) -> float:
    """The floor in milliseconds: moving the bytes or doing the flops, whichever takes longer."""
    return 1e3 * max(
        model["bytes"] / throughput["bandwidth_bytes_per_s"], model["flops"] / throughput["gemm_flops_per_s"]
    )


def draws_ms(model: dict, throughput: dict) -> float:
    """Milliseconds the model's random words take to draw at the measured rate."""
    return 1e3 * model["random_words"] / throughput["random_words_per_s"]


def machine_throughput(rank: int, device: str, quick: bool = False) -> dict:
    """Memory bandwidth and skinny-GEMM throughput on ``device`` at this process's threads."""
    numel = (COPY_BYTES // 8 if quick else COPY_BYTES) // 4
    source = torch.ones(numel, device=device)
    target = torch.empty_like(source)
    copy_seconds = _best_seconds(lambda: target.copy_(source), device)
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(GEMM_SIDE, GEMM_SIDE, generator=generator).to(device)
    q = torch.randn(GEMM_SIDE, rank, generator=generator).to(device)
    p = matrix @ q
    decompressed = torch.empty_like(matrix)

    def products():
        # In the forms the codecs compute them (maths.lowrank, "Low-rank products by layout"):
        # the CPU's BLAS ran M.T @ P 7x slower than (P^T M)^T.
        return (lowrank.project_right(matrix, q), lowrank.project_left(matrix, p), torch.mm(p, q.T, out=decompressed))

    gemm_seconds = _best_seconds(products, device)
    words = torch.empty(numel // 2, dtype=torch.int64, device=device)
    noise = torch.Generator(device=device).manual_seed(0)
    draw_seconds = _best_seconds(lambda: draw_noise(words, noise), device)
    return {
        "threads": torch.get_num_threads(),
        "copy_bytes": 4 * numel,
        "random_words": words.numel(),
        "random_words_per_s": words.numel() / draw_seconds,
        "bandwidth_bytes_per_s": 2 * 4 * numel / copy_seconds,
        "gemm_shape": [GEMM_SIDE, GEMM_SIDE, rank],
        "gemm_products": GEMM_PRODUCTS,
        "gemm_flops_per_s": 3 * 2 * GEMM_SIDE * GEMM_SIDE * rank / gemm_seconds,
    }


def best_throughput(throughputs: list) -> dict:
    """The machine's best of several rounds' ``machine_throughput``: each rate at its highest
    (the floor is what the machine allows), each round's rates kept beside."""
    best = dict(throughputs[0])
    for key in RATES:
        best[key] = max(t[key] for t in throughputs)
        best[f"{key}_each_round"] = [t[key] for t in throughputs]
    return best


def _best_seconds(fn, device):
    fn()  # first touch of fresh memory is not part of the machine's speed
    return min(seconds_of(fn, device) for _ in range(THROUGHPUT_REPEATS))


def world_of_one(device):
    """A process group of one for the torch hook (gloo; NCCL on a GPU); returns whether this
    call created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def measure(set_name, label, options):
    """Seconds per step, one value per cycle, of method ``label`` on shape set ``set_name``;
    for ``FLOOR``, ``machine_throughput`` (no shape set)."""
    if label == FLOOR:
        return machine_throughput(options.rank, options.device, options.quick)
    grads = gradients(shape_set(set_name), options.device)
    if label == INTERLEAVED:
        makers = dict(compressors(options))
        both = {
            each: makers[each]
            for compiled in makers
            if compiled.endswith(COMPILED)
            for each in (base_label(compiled), compiled)
        }
        return time_interleaved(both, grads, options.repeats * options.rounds, options.device)
    if label == HOOK:
        created = world_of_one(options.device)
        try:
            return {"cycles": time_torch_hook(grads, options.rank, options.repeats, options.device)}
        finally:
            if created:
                dist.destroy_process_group()
    return time_ours(dict(compressors(options))[label], grads, options.repeats, options.device)


def measure_in_fresh_process(*task):
    """``measure(*task)`` in a new interpreter; its result, or its error as a RuntimeError."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_measure_and_exit, args=(sender, task))
    process.start()
    sender.close()
    try:
        outcome, value = receiver.recv()
    except EOFError:  # it died before answering
        outcome, value = "error", None
    process.join()
    if outcome == "error":
        raise RuntimeError(f"measuring {task[:2]} failed: {value or f'exit code {process.exitcode}'}")
    return value


def _measure_and_exit(sender, task):
    try:
        sender.send(("ok", measure(*task)))
    except Exception:  # handed to the parent, which raises it
        sender.send(("error", traceback.format_exc()))
    sender.close()
    # Skip interpreter teardown: gloo's threads can abort it once the process group is gone.
    os._exit(0)


class OperatorCount(TorchDispatchMode):
    """Counts every aten operator dispatched while it is entered (dispatcher overhead on any
    device) and, apart, the views among them (metadata only: no kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))

    def counts(self, per=1):
        return {"all": self.count / per, "not_views": (self.count - self.views) / per}


def operators_per_step(make, grads, steps=STEPS_PER_CYCLE):
    """Aten operators per step of one compressor, after the warm-up steps (ACP-SGD alternates
    its P and Q steps: the mean of a cycle)."""
    refresh, step = as_integrations_run(make, grads)
    for _ in range(WARMUP_STEPS):
        refresh()
        step()
    counter = OperatorCount()
    for _ in range(steps):
        refresh()
        with counter:
            step()
    return counter.counts(steps)


def error_row_operators(make, grads):
    """Aten operators of L-GreCo's low-rank error rows for every layer it would decide at the
    compressor's default rank: one layer at a time (``errors``) and batched by shape
    (``errors_of_layers``, what the decision calls)."""
    compressor = make()
    layers = {}
    for name, grad in grads.items():
        options = [
            o
            for o in compressor.tuning.candidates(grad.shape, compressor.config.default)
            if compressor.tuning.compresses(grad.shape, o)
        ]
        if options:
            layers[name] = (grad, options)
    with OperatorCount() as one_at_a_time:
        for gradient, options in layers.values():
            compressor.tuning.errors(gradient, options)
    with OperatorCount() as batched:
        compressor.tuning.errors_of_layers(layers)
    return {
        "layers": len(layers),
        "distinct_shapes": len({tuple(g.shape) for g, _ in layers.values()}),
        "one_at_a_time": one_at_a_time.counts(),
        "batched": batched.counts(),
    }


def run_operators(args):
    """The operator counts of ``--operators``, per shape set, in this process (counts, not times)."""
    started = time.perf_counter()
    results = {
        "command": command_line("codec"),
        "machine": machine(),
        "torch": torch.__version__,
        "options": {
            "shapes": args.shapes,
            "rank": args.rank,
            "density": args.density,
            "bits": args.bits,
            "device": args.device,
        },
        "operators": {},
    }
    for set_name in args.shapes:
        shapes = shape_set(set_name)
        grads = gradients(shapes, args.device)
        entry = {
            "layers": len(shapes),
            "distinct_shapes": len({shape for _, shape in shapes}),
            "per_step": {},
            "error_rows": {},
        }
        for label, make in compressors(args):
            entry["per_step"][label] = operators_per_step(make, grads)
            logger.info("%s %s: %s operators per step", set_name, label, entry["per_step"][label])
        for label in ("PowerSGD", "ACP-SGD"):
            entry["error_rows"][label] = error_row_operators(dict(compressors(args))[label], grads)
        results["operators"][set_name] = entry
    results["minutes"] = (time.perf_counter() - started) / 60
    return results


def run(args):
    """Every measurement. Each method runs in a fresh process: what one method allocated
    (and the allocator's state it leaves) would otherwise change the next one's page faults
    by tens of percent. ``--quick`` stays in this process, except for torch's hook: gloo's
    threads can abort a process whose group is gone, and the smoke test runs inside pytest."""
    started, others = time.perf_counter(), OthersShare()
    if args.quick:
        args.shapes, args.repeats = ["tiny"], 1
    if args.compiled and not args.quick:  # the run's first compiled process compiles from nothing
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hvd_compress-codec-inductor-")
    results = {
        "command": command_line("codec"),
        "machine": dict(machine(), load_average_start=os.getloadavg()[0]),
        "options": {
            "shapes": args.shapes,
            "rank": args.rank,
            "density": args.density,
            "bits": args.bits,
            "repeats": args.repeats,
            "rounds": 1 if args.quick else args.rounds,
            "device": args.device,
            "results_in_gradients": True,
            "compiled": args.compiled,
        },
        "codec": {},
        "memory_pass": {},
    }
    if args.device == "cuda":
        results["machine"]["gpu"] = gpu_description()
    rounds = 1 if args.quick else args.rounds
    labels = [HOOK] + [label for label, _ in compressors(args)]
    throughputs = []
    timings = {
        (set_name, label): {"cycles": [], "round_ms": [], "compile_seconds": []}
        for set_name in args.shapes
        for label in labels
    }
    # Rounds over every method, so that the host's slow drifts (this one's: 1.3-1.5x within
    # minutes) hit every method alike; each round's cycles are pooled.
    for round_ in range(rounds):
        # Measured like the codecs (a fresh process, except with --quick), before them.
        throughputs.append((measure if args.quick else measure_in_fresh_process)(None, FLOOR, args))
        for set_name in args.shapes:
            for label in labels:
                call = measure if args.quick and label != HOOK else measure_in_fresh_process
                timed, pooled = call(set_name, label, args), timings[set_name, label]
                pooled["cycles"] += timed["cycles"]
                pooled["round_ms"].append(1e3 * statistics.median(timed["cycles"]))
                if "operators" in timed:
                    pooled["operators"] = timed["operators"]
                if "compile_seconds" in timed:
                    pooled["compile_seconds"].append(timed["compile_seconds"])
                logger.info(
                    "round %d/%d %s %s: %.2f ms/step", round_ + 1, rounds, set_name, label, pooled["round_ms"][-1]
                )
    throughput = best_throughput(throughputs)
    results["throughput"] = throughput
    makers = dict(compressors(args))
    for set_name in args.shapes:
        shapes = shape_set(set_name)
        entry = {
            "parameters": parameter_count(shapes),
            "tensors": len(shapes),
            "gradient_bytes": 4 * parameter_count(shapes),
            "methods": {},
        }
        for label in labels:
            timed = timings[set_name, label]
            seconds = statistics.median(timed["cycles"])
            entry["methods"][label] = {
                "step_ms": 1e3 * seconds,
                "gb_per_s": entry["gradient_bytes"] / seconds / 1e9,
                "step_ms_each_cycle": [1e3 * s for s in timed["cycles"]],
                "step_ms_each_round": timed["round_ms"],
            }
            if "operators" in timed:
                entry["methods"][label]["operators"] = timed["operators"]
            if timed["compile_seconds"]:  # in the order the processes ran: the run's first one compiled cold
                entry["methods"][label]["compile_seconds_each_round"] = timed["compile_seconds"]
            floor = ""
            if label in makers:
                model = floor_model(label, makers[label](), shapes)
                model["floor_ms"] = floor_ms(model, throughput)
                model["x_floor"] = 1e3 * seconds / model["floor_ms"]
                if model["random_words"]:
                    model["draws_ms"] = draws_ms(model, throughput)
                entry["methods"][label]["floor"] = model
                floor = f", floor {model['floor_ms']:.2f} ms ({model['x_floor']:.2f}x)"
            print(f"{set_name:>15} {label:>20}: {1e3 * seconds:9.2f} ms/step{floor}", flush=True)
        if args.compiled:
            call = measure if args.quick else measure_in_fresh_process
            entry["interleaved"] = {
                label: dict(timed, step_ms=1e3 * statistics.median(timed["cycles"]))
                for label, timed in call(set_name, INTERLEAVED, args).items()
            }
        results["codec"][set_name] = entry
        results["memory_pass"][set_name] = time_memory_pass(
            gradients(shapes, args.device), max(args.repeats, 3), args.device
        )
    sizes = [1 << 16] if args.quick else TOPK_SIZES
    results["topk_selection"] = time_topk_selection(sizes, args.density, TOPK_REPEATS, args.device)
    results["targets"] = targets(results)
    seconds = time.perf_counter() - started
    results["minutes"] = seconds / 60
    # Other work on the machine distorts every number: say how busy it was.
    results["machine"]["load_average_end"] = os.getloadavg()[0]
    results["machine"]["others_cpu_percent"] = 100 * others.share()
    return results


def targets(results):
    device = results["options"].get("device", "cpu")
    qsgd_limit, topk_speedup = QSGD_LIMIT[device], TOPK_SPEEDUP[device]
    rows = []
    for set_name, entry in results["codec"].items():
        methods = entry["methods"]
        for label, numerator, denominator, limit in RATIO_TARGETS:
            value = methods[numerator]["step_ms"] / methods[denominator]["step_ms"]
            rows.append(
                {"target": f"{label} ({set_name})", "value": value, "limit": f"<= {limit}", "met": value <= limit}
            )
        value = methods["QSGD"]["step_ms"] / results["memory_pass"][set_name]["clone_ms"]
        rows.append(
            {
                "target": f"QSGD / memory pass ({set_name})",
                "value": value,
                "limit": f"<= {qsgd_limit}",
                "met": value <= qsgd_limit,
            }
        )
        for label in FLOOR_TARGETS:
            value = methods[label]["floor"]["x_floor"]
            rows.append(
                {
                    "target": f"{label} / its floor ({set_name})",
                    "value": value,
                    "limit": f"<= {FLOOR_LIMIT}",
                    "met": value <= FLOOR_LIMIT,
                }
            )
    for row in results["topk_selection"]:
        rows.append(
            {
                "target": f"Top-K selection speed-up over torch.topk (n = {row['numel']:,})",
                "value": row["speedup"],
                "limit": f">= {topk_speedup}",
                "met": row["speedup"] >= topk_speedup,
            }
        )
    return rows


def markdown(results, figures, operators=None):
    """The section's body: what was run, where, and every number as a table; on a GPU, with
    ``operators`` (``--operators``' results), the time per operator dispatched."""
    info, options = results["machine"], results["options"]
    sets = list(results["codec"])
    on_gpu = options.get("device") == "cuda"
    group = "an NCCL group of one" if on_gpu else "a gloo group of one"
    lines = [
        f"Command: `{results['command']}` ({results['minutes']:.1f} min)",
        "",
        *gpu_lines(info),
        f"Machine: {describe_machine(info)} Torch ran with {info['torch_threads']} threads "
        f"(its default). Other processes used {_percent(info['others_cpu_percent'])} of "
        f"the CPUs during the run (1-minute load average {info['load_average_start']:.2f} "
        f"at the start, {info['load_average_end']:.2f} at the end).",
        "",
        "Per step: compress + error feedback + decompress of every gradient of the model on "
        "one rank, communication left out (each collective returns the rank's own payload), "
        f"each method in a fresh process{_integration_text(options)}. "
        f"Torch's `powerSGD_hook` runs over DDP-style 25 MiB buckets in {group} "
        f"(its one-rank all-reduces included), after its dense start-up. PowerSGD and ACP-SGD "
        f"rank {options['rank']}, Top-K density {options['density']}, QSGD {options['bits']} "
        f"bits; {_cycles_text(options)}. "
        "Cells: ms per step, gradient GB/s, time relative to the torch hook.",
        "",
        "Shape sets (`benchmarks/shapes.py`, every parameter's gradient, 1-D ones "
        "included): "
        + "; ".join(f"{name}: {DESCRIPTIONS[name]}, {results['codec'][name]['tensors']} tensors" for name in sets)
        + ".",
        "",
        "| method | "
        + " | ".join(f"{name} ({results['codec'][name]['parameters'] / 1e6:.1f} M parameters)" for name in sets)
        + " |",
        "|---" * (len(sets) + 1) + "|",
    ]
    for method in results["codec"][sets[0]]["methods"]:
        cells = []
        for name in sets:
            methods = results["codec"][name]["methods"]
            entry = methods[method]
            cells.append(
                f"{_ms(entry['step_ms'])}, {entry['gb_per_s']:.2f} GB/s, "
                f"{entry['step_ms'] / methods[HOOK]['step_ms']:.2f}x"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += floor_lines(results) + compiled_lines(results)
    if on_gpu and operators:
        lines += per_operator_lines(results, operators)
    lines += [
        "",
        "Top-K selection alone: `topk_indices(m, k)` against `torch.topk(m, k)` on the same "
        "magnitudes `m = x.abs()` of a standard-normal `x` (median of repeats).",
        "",
        "| entries | k | torch.topk | torch.topk(sorted=False) | topk_indices | speed-up (vs unsorted) |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["topk_selection"]:
        lines.append(
            f"| {row['numel']:,} | {row['k']:,} | {_ms(row['torch_topk_ms'])} | "
            f"{_ms(row['torch_topk_unsorted_ms'])} | {_ms(row['ours_ms'])} | "
            f"{row['speedup']:.1f}x ({row['speedup_vs_unsorted']:.1f}x) |"
        )
    lines += [
        "",
        "QSGD against one memory pass over the same gradients: `clone` reads and writes "
        "each once into fresh memory, whose first-touch page faults cost most of its time "
        "(as they do for every codec that returns a new gradient); `sum` only reads.",
        "",
        "| shape set | QSGD step | clone | sum | QSGD / clone |",
        "|---|---|---|---|---|",
    ]
    for name in sets:
        qsgd, memory = results["codec"][name]["methods"]["QSGD"]["step_ms"], results["memory_pass"][name]
        lines.append(
            f"| {name} | {_ms(qsgd)} | {_ms(memory['clone_ms'])} | "
            f"{_ms(memory['sum_ms'])} | {qsgd / memory['clone_ms']:.1f}x |"
        )
    lines += ["", "Targets:", "", "| target | value | limit | met |", "|---|---|---|---|"]
    lines += [
        f"| {row['target']} | {row['value']:.2f} | {row['limit']} | {'yes' if row['met'] else 'no'} |"
        for row in results["targets"]
    ]
    lines += notes_lines(results)
    lines += [""] + [f"![{path.stem}]({path.as_posix()})" for path in figures]
    return "\n".join(lines) + "\n"


def per_operator_lines(results, operators):
    """What bounds a GPU codec far above its floor: each step's time over the aten operators it
    dispatches (counted by ``--operators``, on the GPU where it ran there)."""
    sets = [name for name in results["codec"] if name in operators["operators"]]
    if not sets:
        return []
    counted_on = "the GPU" if operators["options"].get("device", "cpu") == "cuda" else "the CPU"
    lines = [
        "",
        "Time per operator: each step over the aten operators it dispatches, as "
        f"`--operators` counted them on {counted_on} (`{operators['command']}`, torch {operators['torch']}; "
        "views included, then without them). A few microseconds an operator is what the host "
        "takes to dispatch and launch one: where a step costs that much per operator, the host, "
        "not the GPU, bounds it, and only fewer operators (same-shape layers batched) bring it "
        "nearer its floor.",
        "",
        "| shape set | method | step | operators (not views) | us per operator (not views) |",
        "|---|---|---|---|---|",
    ]
    for name in sets:
        counts = operators["operators"][name]["per_step"]
        for label, entry in results["codec"][name]["methods"].items():
            if label not in counts:
                continue
            step_us, count = 1e3 * entry["step_ms"], counts[label]
            lines.append(
                f"| {name} | {label} | {_ms(entry['step_ms'])} | {count['all']:,.0f} "
                f"({count['not_views']:,.0f}) | {step_us / count['all']:.1f} "
                f"({step_us / count['not_views']:.1f}) |"
            )
    return lines


def floor_lines(results):
    """The floor's measurements and a table of each method's floor against its step."""
    machine_speed, rank = results["throughput"], results["options"]["rank"]
    lines = [
        "",
        f"Floor (the model is in `benchmarks/codec.py`'s docstring): memory bandwidth "
        f"{machine_speed['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (best of {THROUGHPUT_REPEATS} "
        f"copies of a {machine_speed['copy_bytes'] >> 20} MiB float32 buffer into another, read + "
        f"write counted), GEMM {machine_speed['gemm_flops_per_s'] / 1e9:.2f} GFLOP/s "
        f"({machine_speed.get('gemm_products', EARLIER_GEMM_PRODUCTS)} of a {GEMM_SIDE} x "
        f"{GEMM_SIDE} `M` at rank {rank}, best of "
        f"{THROUGHPUT_REPEATS}), measured in this run with {machine_speed['threads']} torch "
        f"threads, as the codecs ran. Floor = max(bytes / bandwidth, flops / GEMM throughput); "
        f"target: PowerSGD, ACP-SGD, Top-K and QSGD within {FLOOR_LIMIT}x of it.",
        "",
        "| shape set | method | step | least bytes | least GFLOP | floor | x floor | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["codec"].items():
        for label, method in entry["methods"].items():
            if "floor" not in method:
                continue
            floor = method["floor"]
            verdict = (
                "—"
                if base_label(label) not in FLOOR_TARGETS
                else "met"
                if floor["x_floor"] <= FLOOR_LIMIT
                else "missed"
            )
            lines.append(
                f"| {name} | {label} | {_ms(method['step_ms'])} | {floor['bytes'] / 1e6:.1f} MB | "
                f"{floor['flops'] / 1e9:.2f} | {_ms(floor['floor_ms'])} | "
                f"{floor['x_floor']:.2f}x | {verdict} |"
            )
    # On one rank a collective hands a dense gradient back untouched, so its read + write bounds
    # from above what NoCompression must do: it can run under its "floor".
    return (
        lines
        + [
            "",
            "A tensor sent whole counts as read and written once, what a real all-reduce "
            "does; on one rank NoCompression hands the gradient back as it is and can run "
            "under that.",
        ]
        + draws_lines(results)
        + passes_lines(results)
        + bound_lines(results)
    )


def compiled_lines(results):
    """``--compiled``'s comparison: per shape set, each method eager and compiled in one process,
    against its floor, and the seconds its kernels took to compile in each process."""
    rows = [(name, entry) for name, entry in results["codec"].items() if "interleaved" in entry]
    if not rows:
        return []
    lines = [
        "",
        "Compiled against eager (`--compiled`): each method with compiled kernels "
        "(`compiled=True`: its arithmetic between collectives through `torch.compile`, inductor's C++ "
        "kernels) eager and compiled in one fresh process per shape set, a cycle of each in turn: "
        f"median over {results['options']['repeats'] * results['options']['rounds']} cycles of two "
        f"steps after {WARMUP_STEPS} warm-up steps. x floor: against the floor above. Compile: seconds "
        "`prepare_compiled` took before the first step, in the table's processes in the order they "
        "ran; the run's first compiled process started from an empty inductor cache, later ones "
        "found its graphs on disk.",
        "",
        "| shape set | method | eager | compiled | compiled / eager | eager x floor | compiled x floor | compile (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in rows:
        methods = entry["methods"]
        for label, timed in entry["interleaved"].items():
            if not label.endswith(COMPILED):
                continue
            eager = entry["interleaved"][base_label(label)]
            floor = methods[base_label(label)]["floor"]["floor_ms"]
            compile_seconds = methods.get(label, {}).get("compile_seconds_each_round", []) + [timed["compile_seconds"]]
            lines.append(
                f"| {name} | {base_label(label)} | {_ms(eager['step_ms'])} | {_ms(timed['step_ms'])} | "
                f"{timed['step_ms'] / eager['step_ms']:.2f} | {eager['step_ms'] / floor:.2f}x | "
                f"{timed['step_ms'] / floor:.2f}x | "
                f"{', '.join(f'{seconds:.1f}' for seconds in compile_seconds)} |"
            )
    return lines


def draws_lines(results):
    """The random draws of the codecs that make them, a bound beside the floor: their time at the
    rate measured in this run, and each step against it (where the run measured the rate)."""
    rate = results["throughput"].get("random_words_per_s")
    rows = [
        (name, label, method)
        for name, entry in results["codec"].items()
        for label, method in entry["methods"].items()
        if "draws_ms" in method.get("floor", {})
    ]
    if rate is None or not rows:
        return []
    cells = "; ".join(
        f"{name}: {m['floor']['random_words'] / 1e6:.1f} M words, {_ms(m['floor']['draws_ms'])}, "
        f"step {m['step_ms'] / m['floor']['draws_ms']:.1f}x that"
        for name, _, m in rows
    )
    labels = ", ".join(dict.fromkeys(label for _, label, _ in rows))
    entries_per_word = (1 << 20) // noise_words(1 << 20)
    return [
        "",
        f"Random draws, a bound beside the floor (not in it): {labels} draws a 64-bit word for every "
        f"{entries_per_word} entries, which this run's generator made at {rate / 1e6:.0f} M words/s "
        f"(best of {THROUGHPUT_REPEATS} fills of {results['throughput']['random_words'] / 1e6:.1f} M words "
        f"from one generator, as the codec draws them). {cells}.",
    ]


def passes_lines(results):
    """The low-rank codecs' steps against the bytes their operators move (``OPERATOR_PASSES``) at
    this run's bandwidth: how far the code as written is from its own memory bound, and how far
    that bound is from the algorithm's (the floor)."""
    bandwidth = results["throughput"]["bandwidth_bytes_per_s"]
    rows = [
        (name, label, method["step_ms"], method["floor"])
        for name, entry in results["codec"].items()
        for label, method in entry["methods"].items()
        if "operator_bytes" in method.get("floor", {})
    ]
    if not rows:
        return []
    cells = []
    for name, label, step_ms, floor in rows:
        bound_ms = 1e3 * floor["operator_bytes"] / bandwidth
        cells.append(
            f"{name} {label} {floor['operator_bytes'] / 1e6:.0f} MB, {_ms(bound_ms)} "
            f"({bound_ms / floor['floor_ms']:.2f}x the floor), step {step_ms / bound_ms:.2f}x that"
        )
    passes = ", ".join(f"{label} {count}" for label, count in OPERATOR_PASSES.items())
    return [
        "",
        f"The low-rank codecs' operators, a bound beside the floor (not in it): with error feedback they "
        f"pass over a compressed gradient's size in memory several times a step ({passes}), where the floor "
        f"counts 4 "
        f"(`OPERATOR_PASSES` in `benchmarks/codec.py` lists them); at this run's bandwidth: "
        f"{'; '.join(cells)}. Where that bound is more than {FLOOR_LIMIT}x the floor, no order of these "
        f"operators meets the floor target: only fusing them into fewer passes can.",
    ]


def bound_lines(results):
    """What bounds each floor target: its step's largest operators by self time (one profiled
    step after the timed ones), where the run has them."""
    rows = [
        (name, label, method)
        for name, entry in results["codec"].items()
        for label, method in entry["methods"].items()
        if label in FLOOR_TARGETS and "operators" in method
    ]
    if not rows:
        return []
    lines = [
        "",
        f"Where the step goes: the {BREAKDOWN_OPERATORS} aten operators with the most self "
        "time in one profiled step after the timed ones (share of the step's operator time). "
        "`random_` is QSGD's random draws (a 64-bit word for four codes), `copy_` casts and "
        "chunk copies, `mm`/`addmm` the low-rank products, `nonzero`/`topk` Top-K's selection.",
        "",
        "| shape set | method | x floor | largest operators | the rest |",
        "|---|---|---|---|---|",
    ]
    for name, label, method in rows:
        largest = ", ".join(
            f"`{op.removeprefix('aten::')}` {100 * share:.0f}%" for op, share in method["operators"]["largest"]
        )
        lines.append(
            f"| {name} | {label} | {method['floor']['x_floor']:.2f}x | {largest} | "
            f"{100 * method['operators']['rest']:.0f}% |"
        )
    return lines


def _integration_text(options):
    """How the codecs ran, where the run recorded it: runs before results were made in the
    gradients' memory (the first GPU run) made a fresh result per layer."""
    if not options.get("results_in_gradients"):
        return ""
    return (
        ", run as the integrations run it: each result made in its gradient's memory "
        "(`write_results_into_gradients`), the gradients copied anew, untimed, before each step, as "
        "the torch hook's buckets are filled, and each step ended by `end_step`, as theirs are"
    )


def _cycles_text(options):
    rounds = options.get("rounds", 1)  # one round in the older records
    each = f"{options['repeats']} cycles of two steps after two warm-up steps"
    if rounds == 1:
        return f"median over {each}"
    return (
        f"median over {rounds} rounds of every method in turn, each {each}, pooled; the floor's rates are "
        f"the best round's"
    )


def _percent(value):
    return "an unknown share" if value is None else f"{value:.1f}%"


def _ms(value):
    """Milliseconds with three significant digits, without scientific notation."""
    return f"{value:.{max(0, 2 - math.floor(math.log10(max(value, 1e-3))))}f} ms"


def draw_figures(results, out):
    """Per-step cost per shape set, and Top-K selection time; small PNGs."""
    suffix = SUFFIX[results["options"].get("device", "cpu")]
    sets = list(results["codec"])
    plt, figure, axes = panels(len(sets), 4, 3.2)
    for axis, name in zip(axes, sets):
        methods = results["codec"][name]["methods"]
        method_bars(axis, {label: entry["step_ms"] for label, entry in methods.items()}, HOOK)
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("ms per step", fontsize=8)
        axis.tick_params(labelsize=7)
    figure.suptitle("Codec cost per step (compress + error feedback + decompress)", fontsize=9)
    figure.tight_layout()
    codec_png = out / f"codec_cost{suffix}.png"
    figure.savefig(codec_png, dpi=80)
    plt.close(figure)

    rows = results["topk_selection"]
    figure, axis = plt.subplots(figsize=(5, 3))
    labels = [f"{row['numel']:,}" for row in rows]
    width = 0.27
    for offset, (key, label) in enumerate(
        [
            ("torch_topk_ms", "torch.topk"),
            ("torch_topk_unsorted_ms", "torch.topk(sorted=False)"),
            ("ours_ms", "topk_indices"),
        ]
    ):
        axis.bar([i + (offset - 1) * width for i in range(len(rows))], [row[key] for row in rows], width, label=label)
    axis.set_xticks(range(len(rows)), labels, fontsize=7)
    axis.set_yscale("log")
    axis.set_xlabel("entries", fontsize=8)
    axis.set_ylabel("ms (log)", fontsize=8)
    axis.set_title(f"Top-K selection at density {results['options']['density']}", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    topk_png = out / f"topk_selection{suffix}.png"
    figure.savefig(topk_png, dpi=80)
    plt.close(figure)
    return [codec_png, topk_png]


def operators_markdown(results):
    """The ``--operators`` section: every count as a table, with the command that made it."""
    lines = [
        f"Command: `{results['command']}` ({results['minutes']:.1f} min, torch {results['torch']})",
        "",
        "Aten operators dispatched per step (counted under a `TorchDispatchMode`, after "
        f"{WARMUP_STEPS} warm-up steps, mean of {STEPS_PER_CYCLE}), one rank, communication "
        "left out, as all (not views: on a GPU, those that may launch a kernel). They "
        "should grow with distinct shapes, not layers.",
        "",
    ]
    sets = list(results["operators"])
    lines += ["| | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    entries = [results["operators"][name] for name in sets]
    lines.append("| layers | " + " | ".join(str(e["layers"]) for e in entries) + " |")
    lines.append("| distinct shapes | " + " | ".join(str(e["distinct_shapes"]) for e in entries) + " |")
    for label in entries[0]["per_step"]:
        lines.append(f"| {label} | " + " | ".join(_operators(e["per_step"][label]) for e in entries) + " |")
    lines += [
        "",
        "L-GreCo's low-rank error rows for one decision (every layer the compressor compresses, "
        "candidates around its default rank): operators one layer at a time against batched by "
        "shape (`errors_of_layers`, what the decision calls).",
        "",
        "| shape set | method | layers decided | distinct shapes | one at a time | batched |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in zip(sets, entries):
        for label, row in entry["error_rows"].items():
            lines.append(
                f"| {name} | {label} | {row['layers']} | {row['distinct_shapes']} | "
                f"{_operators(row['one_at_a_time'])} | {_operators(row['batched'])} |"
            )
    return "\n".join(lines + notes_lines(results)) + "\n"


def _operators(counts):
    return f"{counts['all']:,.0f} ({counts['not_views']:,.0f})"


def write_report(results, out):
    """The section and figures of ``results`` under ``out`` (docs/), beside the operator counts
    of ``out/benchmarks/codec-operators.json`` where there are some."""
    device = results["options"].get("device", "cpu")
    # Counted on the device the codecs ran on where there are such counts: QSGD and Top-K take
    # other paths on a GPU (one chunk; torch.topk), so the CPU's counts overstate them there.
    counted = [out / "benchmarks" / f"codec-operators{suffix}.json" for suffix in dict.fromkeys([SUFFIX[device], ""])]
    operators = next((json.loads(path.read_text()) for path in counted if path.exists()), None)
    figures = [path.relative_to(out / "benchmarks") for path in draw_figures(results, out / "benchmarks")]
    write_section(out, SECTION[device], markdown(results, figures, operators))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks codec", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", type=lambda text: text.split(","), default=["resnet50", "bert-base", "transformer-xl"]
    )
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD and ACP-SGD rank")
    parser.add_argument("--density", type=float, default=0.01, help="Top-K density")
    parser.add_argument("--bits", type=int, default=4, help="QSGD bits")
    parser.add_argument("--repeats", type=int, default=3, help="timed two-step cycles per method and round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds over every method (each a fresh process), their cycles pooled"
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where gradients live and the codecs run"
    )
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also time each method with compiled kernels compiled, and against eager in one process",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one cycle: a smoke test")
    parser.add_argument(
        "--operators", action="store_true", help="only count aten operators per step (on --device), not time anything"
    )
    args = parser.parse_args(argv)
    for option, value in [("--repeats", args.repeats), ("--rounds", args.rounds)]:
        if value < 1:
            parser.error(f"{option} must be a positive integer, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    for name in args.shapes:
        try:
            shape_set(name)
        except KeyError as error:
            parser.error(error.args[0])
    return args


def render(out: Path) -> None:
    """Rewrites the pages and figures of each device from the stored JSON."""
    for device, suffix in SUFFIX.items():
        operators = stored(out, f"codec-operators{suffix}")
        if operators is not None:
            write_section(out, OPERATORS_SECTION[device], operators_markdown(operators))
        results = stored(out, f"codec{suffix}")
        if results is not None:
            write_report(results, out)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out / "benchmarks"
    if args.operators:
        if args.quick:
            args.shapes = ["tiny"]
        save_record(out / f"codec-operators{SUFFIX[args.device]}.json", run_operators(args))
        render(args.out)
        return
    results = run(args)
    save_record(out / f"codec{SUFFIX[args.device]}.json", results)
    render(args.out)
    print(f"other processes used {_percent(results['machine']['others_cpu_percent'])} of the CPUs")
    for row in results["targets"]:
        print(f"{'met' if row['met'] else 'NOT met'}: {row['target']} = {row['value']:.3g} ({row['limit']})")

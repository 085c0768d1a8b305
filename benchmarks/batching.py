"""Same-shape batching: what ACP-SGD's low-rank work costs one layer at a
time against one batched call per distinct matrix shape.

Three measurements, each timing the median of ``--repeats`` calls between two device
synchronisations, after one untimed call:

1. Every gradient ACP-SGD compresses at ``--rank`` (``LowRankTuning.compresses``), a P step's
   low-rank work (orthogonalise Q, ``P = M Q``, the residual ``M -= P Q^T``, the decompression
   ``P Q^T``), one group per shape over the whole model: per layer (``maths.lowrank``'s
   ``orthogonalize``, ``project_right``, ``addmm_``, as ``ACPSGD._rounds`` does), batched
   (``orthogonalize_batch``, ``project_right_batch``, ``baddbmm_``, as ``_HalfSteps`` does; the
   decompression per layer either way, each result in its own gradient's memory); the operators
   of one call of each side counted with ``codec.OperatorCount``. The batched side works on
   matrices already stacked per shape, as error feedback stacks a batch's sums
   (``ErrorFeedback.stacked``).
2. The groups ACP-SGD meets in training: each distinct group of two or more same-shape matrices
   within one fusion bucket, both half-steps' QR, projection and residual, per layer and batched.
3. ACP-SGD's whole codec step as the integrations run it, batching off and on, in turn.

Writes ``batching[-cuda].json`` and the section "Same-shape batching" (``... on a GPU``).
"""

import argparse
import logging
import statistics
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import torch

import hvd_compress as hc
from benchmarks.codec import WARMUP_STEPS, OperatorCount, as_integrations_run, gradients, median_seconds, seconds_of
from benchmarks.harness.jobs import command_line
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, save_record, notes_lines, stored, write_section
from benchmarks.shapes import shape_set
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.maths.lowrank import (
    factor_shapes,
    orthogonalize,
    orthogonalize_batch,
    project_right,
    project_right_batch,
    projection_batch_shape,
)

logger = logging.getLogger(__name__)

SECTION = {"cpu": "Same-shape batching", "cuda": "Same-shape batching on a GPU"}
SUFFIX = {"cpu": "", "cuda": "-cuda"}


def compressed_shapes(shapes, rank):
    """{(n, m, r): layers} of the gradients ACP-SGD at ``rank`` compresses."""
    compressor = hc.COMPRESSORS["acpsgd"].build(rank=rank)
    return Counter(factor_shapes(shape, rank) for _, shape in shapes if compressor.tuning.compresses(shape, rank))


def bucket_groups(shapes, rank):
    """[(n, m, r, layers)], sorted: the distinct groups of two or more same-shape matrices ACP-SGD
    at ``rank`` batches within one fusion bucket, the buckets planned as
    ``hvd_compress.DistributedOptimizer`` plans them (25 MiB scaled by the compression rate)."""
    compressor = hc.COMPRESSORS["acpsgd"].build(rank=rank)
    backward = {name: tuple(shape) for name, shape in reversed(shapes)}
    groups = set()
    for bucket in FusionScheduler(compressor, backward, ScaledFusion()).plan().buckets:
        counts = Counter(
            factor_shapes(backward[name], rank)
            for name in bucket.members
            if compressor.tuning.compresses(backward[name], rank)
        )
        groups.update((n, m, r, layers) for (n, m, r), layers in counts.items() if layers > 1)
    return sorted(groups)


def half_steps_per_layer(matrices, qs, ps):
    """Both half-steps' QR, projection and residual, one layer at a time (``ACPSGD._rounds``)."""
    for matrix, q, p in zip(matrices, qs, ps):
        q_hat = orthogonalize(q)
        matrix.addmm_(project_right(matrix, q_hat), q_hat.t(), alpha=-1)
        p_hat = orthogonalize(p)
        matrix.addmm_(p_hat, p_hat.t() @ matrix, alpha=-1)


def half_steps_batched(matrices, qs, ps, p_out, q_out):
    """The same in one call each for the group (``_HalfSteps.run``)."""
    q_hat = orthogonalize_batch(qs)
    matrices.baddbmm_(project_right_batch(matrices, q_hat, p_out), q_hat.transpose(1, 2), alpha=-1)
    p_hat = orthogonalize_batch(ps)
    matrices.baddbmm_(p_hat, torch.bmm(p_hat.transpose(1, 2), matrices, out=q_out), alpha=-1)


def measure_group(n, m, r, layers, repeats, device):
    generator = torch.Generator().manual_seed(0)
    matrices = torch.randn(layers, n, m, generator=generator).to(device)
    qs = torch.randn(layers, m, r, generator=generator).to(device)
    ps = torch.randn(layers, n, r, generator=generator).to(device)
    p_out = torch.empty(projection_batch_shape(layers, n, m, r, device), device=device)
    q_out = torch.empty(layers, r, m, device=device)
    return {
        "n": n,
        "m": m,
        "rank": r,
        "layers": layers,
        "per_layer_ms": 1e3
        * median_seconds(
            partial(half_steps_per_layer, list(matrices.unbind(0)), list(qs.unbind(0)), list(ps.unbind(0))),
            repeats,
            device,
        ),
        "batched_ms": 1e3
        * median_seconds(partial(half_steps_batched, matrices, qs, ps, p_out, q_out), repeats, device),
    }


def whole_steps(set_name, rank, repeats, device):
    """ms of a cycle (a P step and a Q step) of ACP-SGD's whole codec work as the integrations run
    it (``codec.as_integrations_run``: every gradient, error feedback and decompression included,
    each bucket begun together), same-shape batching off (``batches_layers`` False, as stock
    Horovod's optimizer, which hands gradients over one at a time) and on (as ACP-SGD takes
    them on ``device``), a cycle of each in turn ``repeats`` times: {"off_ms", "on_ms"} medians."""
    grads = gradients(shape_set(set_name), device)
    runs = {}
    for side, batches in (("off", False), ("on", True)):

        def make(batches=batches):
            compressor = hc.COMPRESSORS["acpsgd"].build(rank=rank)
            compressor.batches_layers = batches
            return compressor

        runs[side] = as_integrations_run(make, grads)

    def cycle(side):
        refresh, step = runs[side]
        seconds = 0.0
        for _ in range(2):
            refresh()
            seconds += seconds_of(step, device)
        return seconds

    for side in runs:
        for _ in range(WARMUP_STEPS):
            cycle(side)
    samples = {side: [] for side in runs}
    for _ in range(repeats):
        for side in runs:
            samples[side].append(1e3 * cycle(side))
    return {f"{side}_ms": statistics.median(values) for side, values in samples.items()}


def per_layer(matrices, factors):
    for matrix, q in zip(matrices, factors):
        q_hat = orthogonalize(q)
        p = project_right(matrix, q_hat)
        matrix.addmm_(p, q_hat.t(), alpha=-1)
        p @ q_hat.t()


def batched(stacks, factor_stacks, payloads):
    for matrices, qs, out in zip(stacks, factor_stacks, payloads):
        q_hat = orthogonalize_batch(qs)
        p = project_right_batch(matrices, q_hat, out)
        matrices.baddbmm_(p, q_hat.transpose(1, 2), alpha=-1)
        for p_one, q_one in zip(p, q_hat):
            p_one @ q_one.t()


def operators(fn, *args):
    with OperatorCount() as counter:
        fn(*args)
    return counter.counts()["not_views"]


def measure(set_name, rank, repeats, device):
    groups = compressed_shapes(shape_set(set_name), rank)
    generator = torch.Generator().manual_seed(0)
    stacks = [torch.randn(count, n, m, generator=generator).to(device) for (n, m, _), count in groups.items()]
    factor_stacks = [torch.randn(count, m, r, generator=generator).to(device) for (_, m, r), count in groups.items()]
    # The payloads' memory, set aside before the batched call, as a batch's rounds hold it.
    payloads = [
        torch.empty(projection_batch_shape(count, n, m, r, device), device=device)
        for (n, m, r), count in groups.items()
    ]
    matrices = [matrix for stack in stacks for matrix in stack.unbind(0)]
    factors = [q for stack in factor_stacks for q in stack.unbind(0)]
    sides = {"per_layer": (per_layer, (matrices, factors)), "batched": (batched, (stacks, factor_stacks, payloads))}
    row = {"layers": sum(groups.values()), "shapes": len(groups)}
    for side, (fn, args) in sides.items():
        row[f"{side}_ms"] = 1e3 * median_seconds(partial(fn, *args), repeats, device)
        row[f"{side}_operators"] = operators(fn, *args)
    return row


def markdown(results):
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"Machine: {describe_machine(results['machine'])}",
        "",
        f"ACP-SGD rank {results['rank']}, a P step's low-rank work (QR of Q, P = M Q, the residual, "
        f"the decompression) on every matrix it compresses: one layer at a time (`ACPSGD._rounds`: "
        f"stock Horovod's optimizer, which hands gradients over one at a time) against one batched call "
        f"per distinct shape (`_HalfSteps`, on matrices stacked as error feedback stacks a batch's sums; "
        f"the decompression per layer either way). Median of {results['repeats']} calls; operators "
        f"are aten operators that are not views, one call.",
        "",
        "| shapes | layers | distinct shapes | per layer ms | batched ms | per layer / batched | "
        "operators per layer / batched |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results["sets"].items():
        lines.append(
            f"| {name} | {row['layers']} | {row['shapes']} | {row['per_layer_ms']:.2f} | "
            f"{row['batched_ms']:.2f} | {row['per_layer_ms'] / row['batched_ms']:.2f}x | "
            f"{row['per_layer_operators']:,.0f} / {row['batched_operators']:,.0f} |"
        )
    speedups = [row["per_layer_ms"] / row["batched_ms"] for row in results["sets"].values()]
    lines += [
        "",
        f"Batched, this work runs {min(speedups):.2f}-{max(speedups):.2f}x as fast as one layer at a "
        f"time here (below 1: slower), while its operators fall with the distinct shapes. In training a "
        f"batch is a shape's layers within one fusion bucket, fewer than here (the next table), and what "
        f"counts is the whole step (the last). Batching pays most where each operator's launch, not its "
        f"arithmetic, is the cost (a GPU; `ci/gpu/codec.sh` runs this there).",
    ]
    return "\n".join(lines + bucket_lines(results) + whole_step_lines(results) + notes_lines(results)) + "\n"


def whole_step_lines(results):
    """What batching changes in the whole step, where the table's savings must show."""
    steps = results.get("whole_steps", {})
    if not steps:
        return []
    lines = [
        "",
        f"ACP-SGD's whole codec work, a P step and a Q step as the integrations run them (every gradient, "
        f"error feedback and decompression included, `codec.as_integrations_run`), same-shape batching off "
        f"(one gradient at a time) and on (each bucket's same-shape layers batched), a cycle of each in turn, "
        f"median of {results['repeats']}.",
        "",
        "| shapes | off ms | on ms | off / on |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {row['off_ms']:.1f} | {row['on_ms']:.1f} | {row['off_ms'] / row['on_ms']:.2f}x |"
        for name, row in steps.items()
    ]
    return lines


def bucket_lines(results):
    """The table of the groups batching meets in training."""
    rows = [(name, row) for name, group_rows in results.get("bucket_groups", {}).items() for row in group_rows]
    if not rows:
        return []
    lines = [
        "",
        "Within one fusion bucket, as ACP-SGD meets them in training (the buckets as "
        "`hvd_compress.DistributedOptimizer` plans them: 25 MiB scaled by the compression rate): each "
        "distinct group of two or more same-shape matrices, both half-steps' QR, projection and residual, one "
        "layer at a time against one call each for the group.",
        "",
        "| shapes | matrix | layers in the group | per layer ms | batched ms | per layer / batched |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows:
        lines.append(
            f"| {name} | {row['n']} x {row['m']} | {row['layers']} | {row['per_layer_ms']:.3f} | "
            f"{row['batched_ms']:.3f} | {row['per_layer_ms'] / row['batched_ms']:.2f}x |"
        )
    speedups = [row["per_layer_ms"] / row["batched_ms"] for _, row in rows]
    return lines + ["", f"Batched, these groups ran {min(speedups):.2f}-{max(speedups):.2f}x as fast."]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks batching", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", type=lambda text: text.split(","), default=["resnet50", "bert-base", "transformer-xl"]
    )
    parser.add_argument("--rank", type=int, default=4, help="ACP-SGD's rank")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per side")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--quick", action="store_true", help="the tiny shapes, one call: a smoke test")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.quick:
        args.shapes, args.repeats = ["tiny"], 1
    for name in args.shapes:
        try:
            shape_set(name)
        except KeyError as error:
            parser.error(error.args[0])
    if args.rank < 1:
        parser.error(f"--rank must be a positive integer, got {args.rank}")
    return args


def render(out: Path) -> None:
    """Rewrites the page of each device from its stored JSON."""
    for device, suffix in SUFFIX.items():
        results = stored(out, f"batching{suffix}")
        if results is not None:
            write_section(out, SECTION[device], markdown(results))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = {
        "command": command_line("batching"),
        "machine": machine(),
        "rank": args.rank,
        "repeats": args.repeats,
        "device": args.device,
        "sets": {name: measure(name, args.rank, args.repeats, args.device) for name in args.shapes},
        "whole_steps": {name: whole_steps(name, args.rank, args.repeats, args.device) for name in args.shapes},
        "bucket_groups": {
            name: [
                measure_group(*group, args.repeats, args.device) for group in bucket_groups(shape_set(name), args.rank)
            ]
            for name in args.shapes
        },
    }
    save_record(args.out / "benchmarks" / f"batching{SUFFIX[args.device]}.json", results)
    render(args.out)
    for name, row in results["sets"].items():
        logger.info("%s: per layer %.2f ms, batched %.2f ms", name, row["per_layer_ms"], row["batched_ms"])

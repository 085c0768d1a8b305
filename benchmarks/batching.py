"""Same-shape batching, probed before it is built (issue 36, item 2): what ACP-SGD's low-rank
work costs one layer at a time against one batched call per distinct matrix shape.

    python -m benchmarks batching [--shapes resnet50,bert-base,transformer-xl] [--rank 4]
        [--repeats 5] [--device cpu|cuda] [--out docs/] [--quick]

For every gradient ACP-SGD compresses at ``--rank`` (``LowRankCompressor.compresses``), one
training step's low-rank work of a P step: orthogonalise Q (reduced QR), ``P = M Q``, the
residual ``M -= P Q^T``, and the decompression ``P Q^T``; per layer (``mm``, ``addmm_``, one QR
each, as ``compressors/acpsgd.py`` does today) and batched (``bmm``, ``baddbmm_``, one batched QR
per shape). The batched side is timed on matrices already stacked per shape, as they would be if
error feedback were allocated per shape group: the stacking copy, which a real batched path
must avoid, is left out, so the batched column is batching's best case. Error feedback's add,
the collectives and the Q steps are the same either way and are left out. Every timing is the
median of ``--repeats`` calls between two device synchronisations, after one untimed call; the
operators of one call of each side are counted with ``codec.OperatorCount``. Writes
``batching[-cuda].json`` and the section "Same-shape batching, probed" (``... on a GPU``).
"""
import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path

import torch

import hvd_compress as hc
from benchmarks.codec import OperatorCount, median_seconds
from benchmarks.report import DOCS, command_line, describe_machine, machine, write_section
from benchmarks.shapes import shape_set
from hvd_compress.maths.lowrank import factor_shapes, orthogonalize

logger = logging.getLogger(__name__)

SECTION = {"cpu": "Same-shape batching, probed", "cuda": "Same-shape batching, probed on a GPU"}
SUFFIX = {"cpu": "", "cuda": "-cuda"}


def compressed_shapes(shapes, rank):
    """{(n, m, r): layers} of the gradients ACP-SGD at ``rank`` compresses."""
    compressor = hc.COMPRESSORS["acpsgd"].build(rank=rank)
    return Counter(factor_shapes(shape, rank) for _, shape in shapes if compressor.compresses(shape, rank))


def per_layer(matrices, factors):
    for matrix, q in zip(matrices, factors):
        q_hat = orthogonalize(q)
        p = matrix @ q_hat
        matrix.addmm_(p, q_hat.t(), alpha=-1)
        p @ q_hat.t()


def batched(stacks, factor_stacks):
    for matrices, qs in zip(stacks, factor_stacks):
        q_hat = torch.linalg.qr(qs, mode="reduced").Q
        p = torch.bmm(matrices, q_hat)
        matrices.baddbmm_(p, q_hat.transpose(1, 2), alpha=-1)
        torch.bmm(p, q_hat.transpose(1, 2))


def operators(fn, *args):
    with OperatorCount() as counter:
        fn(*args)
    return counter.counts()["not_views"]


def measure(set_name, rank, repeats, device):
    groups = compressed_shapes(shape_set(set_name), rank)
    generator = torch.Generator().manual_seed(0)
    stacks = [torch.randn(count, n, m, generator=generator).to(device) for (n, m, _), count in groups.items()]
    factor_stacks = [torch.randn(count, m, r, generator=generator).to(device) for (_, m, r), count in groups.items()]
    matrices = [matrix for stack in stacks for matrix in stack.unbind(0)]
    factors = [q for stack in factor_stacks for q in stack.unbind(0)]
    layer_ms = 1e3 * median_seconds(lambda: per_layer(matrices, factors), repeats, device)
    batch_ms = 1e3 * median_seconds(lambda: batched(stacks, factor_stacks), repeats, device)
    return {"layers": sum(groups.values()), "shapes": len(groups), "per_layer_ms": layer_ms,
            "batched_ms": batch_ms, "per_layer_operators": operators(per_layer, matrices, factors),
            "batched_operators": operators(batched, stacks, factor_stacks)}


def markdown(results):
    lines = [f"Command: `{results['command']}`", "", f"Machine: {describe_machine(results['machine'])}", "",
             f"ACP-SGD rank {results['rank']}, a P step's low-rank work (QR of Q, P = M Q, the residual, "
             f"the decompression) on every matrix it compresses: one layer at a time, as the compressor "
             f"runs today, against one batched call per distinct shape on matrices already stacked "
             f"(batching's best case: no stacking copy). Median of {results['repeats']} calls; operators "
             f"are aten operators that are not views, one call.", "",
             "| shapes | layers | distinct shapes | per layer ms | batched ms | per layer / batched | "
             "operators per layer / batched |", "|---|---|---|---|---|---|---|"]
    for name, row in results["sets"].items():
        lines.append(f"| {name} | {row['layers']} | {row['shapes']} | {row['per_layer_ms']:.2f} | "
                     f"{row['batched_ms']:.2f} | {row['per_layer_ms'] / row['batched_ms']:.2f}x | "
                     f"{row['per_layer_operators']:,.0f} / {row['batched_operators']:,.0f} |")
    speedups = [row["per_layer_ms"] / row["batched_ms"] for row in results["sets"].values()]
    lines += ["", f"Batched, this work runs {min(speedups):.2f}-{max(speedups):.2f}x as fast as one layer at a "
              f"time here (below 1: slower), while its operators fall with the distinct shapes. The compressors run one layer at a time: batching "
              f"pays only where each operator's launch, not its arithmetic, is the cost (a GPU; "
              f"`ci/gpu/codec.sh` runs this probe there)."]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks batching", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=lambda text: text.split(","),
                        default=["resnet50", "bert-base", "transformer-xl"])
    parser.add_argument("--rank", type=int, default=4, help="ACP-SGD's rank")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per side")
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


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = {"command": command_line("batching"),
               "machine": machine(), "rank": args.rank, "repeats": args.repeats, "device": args.device,
               "sets": {name: measure(name, args.rank, args.repeats, args.device) for name in args.shapes}}
    out = args.out / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"batching{SUFFIX[args.device]}.json").write_text(json.dumps(results, indent=1) + "\n")
    write_section(args.out / "benchmarks.md", SECTION[args.device], markdown(results))
    for name, row in results["sets"].items():
        logger.info("%s: per layer %.2f ms, batched %.2f ms", name, row["per_layer_ms"], row["batched_ms"])


if __name__ == "__main__":
    main()

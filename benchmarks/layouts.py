"""Low-rank products by memory layout: what the BLAS (the CPU's, or with ``--device cuda``
cuBLAS) takes for the skinny products of PowerSGD and ACP-SGD, by the layout of their factors.

For each matrix shape (``SHAPES``: the SmallVGG CNN's fc1, BERT-base's feed-forward pair, its
attention projection and word embedding, and the character LM's four matrices) and rank r:

* ``P = M Q`` with ``Q`` (m x r) row-major, the layout an all-reduced or freshly drawn factor
  has, against column-major, the layout of a QR's Q;
* ``P = M Q`` with ``Q`` column-major against its transposed form ``(Q^T M^T)^T``, and the form
  ``maths.lowrank.project_right`` (the codecs' product) takes at that shape and rank;
* at ``--decompress-rank`` (default 4), ``P Q^T`` written into existing memory three ways:
  ``torch.mm(..., out=)`` (the codecs' decompression), ``zero_()`` then ``addmm_`` onto it, and
  ``addmm_`` onto the memory as it is (the residual's ``M -= P Q^T``, for reference: it does
  the same flops).

Each cell is the median of ``--repeats`` calls after one untimed call, at ``--threads`` torch
threads (1: a DDP or Horovod rank's setting in the benchmarks). Writes ``layouts.json`` and the
section "Low-rank products by layout"; with ``--device cuda``, ``layouts-cuda.json`` and "Low-rank
products by layout on a GPU", where ``project_right`` keeps ``M Q`` until this says otherwise.
"""

import argparse
import logging
import sys
from pathlib import Path

import torch

from benchmarks.codec import median_seconds
from benchmarks.harness.jobs import command_line
from benchmarks.harness.machine import describe_machine, gpu_description, machine
from benchmarks.harness.render import DOCS, save_record, gpu_lines, notes_lines, stored, write_section
from hvd_compress.maths.lowrank import project_right

logger = logging.getLogger(__name__)

SECTION = {"cpu": "Low-rank products by layout", "cuda": "Low-rank products by layout on a GPU"}
SUFFIX = {"cpu": "", "cuda": "-cuda"}  # of the JSON file
SHAPES = {
    "cnn fc1": (1024, 4096),
    "bert-base FFN in": (3072, 768),
    "bert-base FFN out": (768, 3072),
    "bert-base attention": (768, 768),
    "bert-base word embedding": (30522, 768),
    "char LM qkv": (768, 256),
    "char LM MLP in": (1024, 256),
    "char LM MLP out": (256, 1024),
    "char LM projection": (256, 256),
}
QUICK_SHAPES = {"small": (256, 512)}


def median_ms(fn, repeats, device):
    return 1e3 * median_seconds(fn, repeats, device)


def projection_row(matrix, rank, repeats, generator):
    device = matrix.device
    q = torch.randn(matrix.shape[1], rank, generator=generator).to(device)
    column_major_q = q.t().contiguous().t()
    row_major = median_ms(lambda: matrix @ q, repeats, device)
    column_major = median_ms(lambda: matrix @ column_major_q, repeats, device)
    transposed = median_ms(lambda: (column_major_q.t() @ matrix.t()).t(), repeats, device)
    # The transposed form's P is a transposed view: not contiguous (r > 1).
    direct = project_right(matrix, column_major_q).is_contiguous()
    return {
        "rank": rank,
        "row_major_ms": row_major,
        "column_major_ms": column_major,
        "transposed_ms": transposed,
        "codecs_form": "direct" if direct else "transposed",
    }


def decompression_row(matrix, rank, repeats, generator):
    (n, m), device = matrix.shape, matrix.device
    p = torch.randn(n, rank, generator=generator).to(device)
    q = torch.linalg.qr(torch.randn(m, rank, generator=generator), mode="reduced").Q.to(device)
    into = torch.empty(n, m, device=device)
    return {
        "rank": rank,
        "mm_out_ms": median_ms(lambda: torch.mm(p, q.t(), out=into), repeats, device),
        "zero_addmm_ms": median_ms(lambda: into.zero_().addmm_(p, q.t()), repeats, device),
        "addmm_onto_ms": median_ms(lambda: matrix.addmm_(p, q.t(), alpha=-1), repeats, device),
    }


def measure(shapes, ranks, decompress_rank, repeats, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    results = {}
    for label, (n, m) in shapes.items():
        matrix = torch.randn(n, m, generator=generator).to(device)
        results[label] = {
            "shape": [n, m],
            "projection": [projection_row(matrix, r, repeats, generator) for r in ranks],
            "decompression": decompression_row(matrix, decompress_rank, repeats, generator),
        }
        logger.info("%s done", label)
    return results


def markdown(results):
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"Machine: {describe_machine(results['machine'])} "
        f"{results['threads']} torch thread(s); median of {results['repeats']} calls.",
        "",
        *gpu_lines(results["machine"]),
        "`P = M Q`, ms, with `Q` row-major (as all-reduced or drawn) against column-major (a QR's Q):",
        "",
    ]
    lines += projection_table(results, "row_major_ms", "column_major_ms")
    lines += [
        "",
        "`P = M Q` with `Q` column-major, ms, against its transposed form `(Q^T M^T)^T`; in bold the form "
        "`project_right` (the codecs' product) takes:",
        "",
    ]
    lines += projection_table(results, "column_major_ms", "transposed_ms", chosen=True)
    lines += [
        "",
        f"`P Q^T` at rank {results['decompress_rank']} written into existing memory, ms: "
        "`torch.mm(out=)` (the codecs' decompression), `zero_()` then `addmm_`, and `addmm_` onto the "
        "memory as it is (the residual's `M -= P Q^T`: the same flops):",
        "",
        "| matrix | mm(out=) | zero_ + addmm_ | addmm_ onto M |",
        "|---|---|---|---|",
    ]
    for label, shape in results["shapes"].items():
        row = shape["decompression"]
        lines.append(f"| {label} | {row['mm_out_ms']:.3f} | {row['zero_addmm_ms']:.3f} | {row['addmm_onto_ms']:.3f} |")
    return "\n".join(lines + [""] + summary(results) + notes_lines(results)) + "\n"


def projection_table(results, first_key, second_key, chosen=False):
    """Cells ``first / second (first / second)`` of two forms' times by matrix and rank; with
    ``chosen``, the time of the form ``project_right`` takes in bold."""
    lines = [
        "| matrix | n x m | " + " | ".join(f"r = {r}" for r in results["ranks"]) + " |",
        "|---|---|" + "---|" * len(results["ranks"]),
    ]
    for label, shape in results["shapes"].items():
        cells = []
        for row in shape["projection"]:
            first, second = f"{row[first_key]:.3f}", f"{row[second_key]:.3f}"
            if chosen:
                first, second = (f"**{first}**", second) if row["codecs_form"] == "direct" else (first, f"**{second}**")
            cells.append(f"{first} / {second} ({row[first_key] / row[second_key]:.2f}x)")
        lines.append(f"| {label} | {shape['shape'][0]} x {shape['shape'][1]} | " + " | ".join(cells) + " |")
    return lines


def summary(results):
    """What the tables say, from their numbers: the layout's speed-up by rank, and the
    decompression's forms against ``mm(out=)``."""

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}x"

    shapes = list(results["shapes"].values())
    speedups = {
        r: [shape["projection"][i]["row_major_ms"] / shape["projection"][i]["column_major_ms"] for shape in shapes]
        for i, r in enumerate(results["ranks"])
    }
    by_rank = "; ".join(f"r = {r}: {span(values)}" for r, values in speedups.items())
    rows = [row for shape in shapes for row in shape["projection"]]
    chosen = [row["transposed_ms" if row["codecs_form"] == "transposed" else "column_major_ms"] for row in rows]
    best = [min(row["column_major_ms"], row["transposed_ms"]) for row in rows]
    direct = [row["column_major_ms"] for row in rows]
    zeroed = [s["decompression"]["zero_addmm_ms"] / s["decompression"]["mm_out_ms"] for s in shapes]
    onto = [s["decompression"]["addmm_onto_ms"] / s["decompression"]["mm_out_ms"] for s in shapes]
    return [
        f"Column-major `Q` ran this many times as fast as row-major: {by_rank}. The codecs keep `Q` column-major "
        f"at every rank (`project_right`; Q travels as `Q^T`). Over every matrix and rank above, the form "
        f"`project_right` takes ran the products in {sum(chosen):.1f} ms against {sum(direct):.1f} ms for `M Q` "
        f"alone and {sum(best):.1f} ms for the faster form of each cell. Against `mm(out=)`, `zero_()` and "
        f"`addmm_` "
        f"took {span(zeroed)} its time and `addmm_` onto the memory as it is {span(onto)}: the decompression "
        f"stays `mm(out=)`, one operator (a second, the `zero_`, would be one more launch a layer on a GPU)."
    ]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--decompress-rank", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the matrices live")
    parser.add_argument("--quick", action="store_true", help="one small matrix, one call: a smoke test")
    args = parser.parse_args(argv)
    for label, value in [
        ("--ranks", min(args.ranks)),
        ("--decompress-rank", args.decompress_rank),
        ("--threads", args.threads),
        ("--repeats", args.repeats),
    ]:
        if value < 1:
            parser.error(f"{label} must be positive integers, got {value}")
    return args


def render(out: Path) -> None:
    """Rewrites the page of each device from its stored JSON."""
    for device, suffix in SUFFIX.items():
        results = stored(out, f"layouts{suffix}")
        if results is not None:
            write_section(out, SECTION[device], markdown(results))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device).type
    torch.set_num_threads(args.threads)
    shapes, repeats = (QUICK_SHAPES, 1) if args.quick else (SHAPES, args.repeats)
    results = {
        "command": command_line("layouts"),
        "machine": machine(),
        "threads": args.threads,
        "repeats": repeats,
        "ranks": args.ranks,
        "decompress_rank": args.decompress_rank,
        "device": device,
        "shapes": measure(shapes, args.ranks, args.decompress_rank, repeats, device),
    }
    if device == "cuda":
        results["machine"]["gpu"] = gpu_description()
    save_record(args.out / "benchmarks" / f"layouts{SUFFIX[device]}.json", results)
    render(args.out)

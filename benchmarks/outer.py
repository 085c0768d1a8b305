"""DiLoCo against per-step compression: quality against bytes on the character LM.

Each point is one ``mpirun -np W`` job training the quality benchmark's character LM (same
model, data, AdamW and learning-rate schedule, ``benchmarks.quality.LM``) through
``hvd_compress.DiLoCo``: ``inner_steps`` local AdamW steps, then the default Nesterov outer step
on pseudo-gradients averaged through a compressor: uncompressed, FP16, QSGD 4 bits and Top-K
1% with error feedback. Bytes are those the compressor handed to collectives over the whole
run, per rank, on the ring model, as in ``quality``; only outer steps send anything.

Its page (``docs/benchmarks/diloco-local-steps-and-compressed-pseudo-gradients.md``) sets each
point against the per-step points of ``docs/benchmarks/quality.json`` (same workload, world
size and steps, seed 0): which per-step points it dominates (fewer or equal bytes and lower
perplexity) and which dominate it.

Resumes point by point from ``<out>/benchmarks/outer.json``; ``--max-minutes`` stops starting
new points after that long. ``--quick``: 2 ranks, the tiny LM, a few steps, two points.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import horovod.torch as hvd

import hvd_compress as hc
from benchmarks.convergence import QUICK_LM
from benchmarks.quality import LM, LM_STEPS
from benchmarks.harness.jobs import add_job_options, mpirun_job, run_points
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import panels, resumed, save_figure, save_record, stored, write_section
from benchmarks.harness.training import train_workload
from hvd_compress.comm.rounds import Collective

RESULT_PREFIX = "OUTER_RESULT "
SECTION = "DiLoCo: local steps and compressed pseudo-gradients"
# Codec label -> (registry name, settings); the order in which points run.
CODECS = {
    "uncompressed": ("none", {}),
    "Top-K 1% + EF": ("topk", {"density": 0.01}),
    "QSGD 4 bits": ("qsgd", {"bits": 4}),
    "FP16": ("fp16", {}),
}
INNER_STEPS = [10, 50, 100]


def points(inner_steps, quick):
    """Every point, the most telling first: each codec at the middle H, then the rest."""
    codecs = list(CODECS)[:2] if quick else list(CODECS)
    order = sorted(inner_steps, key=lambda h: (h != inner_steps[len(inner_steps) // 2], h))
    return [{"key": f"DiLoCo H={h}, {codec}", "codec": codec, "inner_steps": h} for h in order for codec in codecs]


# ----- one job: runs on every rank ----------------------------------------------------------------
def train_point(spec):
    made, curve = {}, []

    def make_optimizer(model, optimizer):
        name, settings = CODECS[spec["codec"]]
        named = list(model.named_parameters())
        made["dense_bytes"] = 4 * sum(p.numel() for _, p in named)
        made["outer"] = hc.DiLoCo(
            optimizer, named, hc.COMPRESSORS[name].build(**settings), inner_steps=spec["inner_steps"]
        )
        return made["outer"]

    started = time.perf_counter()
    metric = train_workload("charlm", spec, make_optimizer, hvd.rank(), hvd.size(), spec["seed"], curve)
    outer = made["outer"]
    return {
        "key": spec["key"],
        "metric": metric,
        "steps": spec["steps"],
        "world_size": hvd.size(),
        "outer_steps": outer.outer_steps,
        "skipped_outer_steps": outer.skipped_outer_steps,
        "train_seconds": time.perf_counter() - started,
        "curve": curve,
        "wire_bytes": outer.compression.traffic.wire_bytes,
        "dense_wire_bytes": spec["steps"] * Collective.ALLREDUCE.wire_bytes(made["dense_bytes"], hvd.size()),
    }


# ----- the driver -----------------------------------------------------------------------------
def run(args):
    path = args.out / "benchmarks" / "outer.json"
    results = resumed(path)
    results.setdefault("points", {})
    lm = QUICK_LM if args.quick else LM
    results.update(
        machine=machine(),
        np=args.np,
        lm_steps=args.lm_steps,
        lm=lm,
        seed=0,
        command="python -m benchmarks outer " + " ".join(sys.argv[1:]),
    )
    deadline = time.monotonic() + 60 * args.max_minutes
    for spec in points(args.inner_steps, args.quick):
        if spec["key"] in results["points"] or time.monotonic() >= deadline:
            continue
        job = dict(spec, steps=args.lm_steps, lm=lm, seed=0)
        [record] = mpirun_job("outer", job, args.np, args.job_timeout, RESULT_PREFIX, spec["key"], expected=1)
        results["points"][spec["key"]] = {"spec": spec, "record": record}
        save_record(path, results)
        write_report(results, args.out)
        print(
            f"{spec['key']}: perplexity {record['metric']:.3f}, {record['wire_bytes'] / 1e6:,.1f} MB "
            f"sent, {record['job_seconds']:.0f} s",
            flush=True,
        )
    write_report(results, args.out)
    return results


# ----- the report ---------------------------------------------------------------------------------
def per_step_points(out, np, steps):
    """{label: (perplexity, MB sent per rank)} of the quality benchmark's character-LM points at
    seed 0, when it ran at the same world size and steps; else {}."""
    path = out / "benchmarks" / "quality.json"
    if not path.exists():
        return {}
    quality = json.loads(path.read_text())
    if quality.get("np") != np or quality.get("lm_steps") != steps:
        return {}
    return {
        entry["spec"]["label"]: (entry["record"]["metric"], entry["record"]["wire_bytes"] / 1e6)
        for entry in quality["points"].values()
        if entry["spec"]["workload"] == "charlm" and entry["spec"]["seed"] == 0
    }


def write_report(results, out):
    reference = per_step_points(out, results["np"], results["lm_steps"])
    base = reference.get("uncompressed")
    lines = [
        f"`{results['command']}`: the character LM of \"Quality against bytes\" "
        f"({results['lm_steps']:,} AdamW steps, {results['np']} ranks, seed 0) trained through "
        "`hvd_compress.DiLoCo` (default Nesterov outer step, lr 0.7, momentum 0.9): H local "
        "steps, then the pseudo-gradients averaged through the codec. MB sent per rank over the "
        "whole run, ring model; \"fewer bytes\" against a float32 all-reduce on every step. "
        "The last three columns set each point against the per-step points of \"Quality "
        "against bytes\" (seed 0): how many it dominates (they send more bytes and end at a "
        "higher perplexity), the best of those that send no more bytes, and the cheapest of "
        "those that end no higher.",
        "",
        "| H | codec | validation perplexity | \u0394 vs per-step uncompressed | MB sent per rank "
        "| fewer bytes | dominates | best per-step at no more bytes | cheapest per-step at no higher perplexity |",
        "|---" * 9 + "|",
    ]
    rows = sorted(
        results["points"].values(), key=lambda e: (e["spec"]["inner_steps"], list(CODECS).index(e["spec"]["codec"]))
    )
    for entry in rows:
        record, spec = entry["record"], entry["spec"]
        mb, metric = record["wire_bytes"] / 1e6, record["metric"]
        delta = f"{100 * (metric / base[0] - 1):+.1f}%" if base else "-"
        beats = [label for label, (m, sent) in reference.items() if sent >= mb and m > metric]
        cheaper = [(m, label, sent) for label, (m, sent) in reference.items() if sent <= mb]
        better = [(sent, label, m) for label, (m, sent) in reference.items() if m <= metric]
        best = "none" if not cheaper else "{1} ({0:.3f}, {2:,.1f} MB)".format(*min(cheaper))
        cheapest = "none" if not better else "{1} ({2:.3f}, {0:,.1f} MB)".format(*min(better))
        lines.append(
            f"| {spec['inner_steps']} | {spec['codec']} | {metric:.3f} | {delta} | {mb:,.1f} | "
            f"{record['dense_wire_bytes'] / max(record['wire_bytes'], 1):,.0f}x | "
            f"{len(beats)} of {len(reference)} | {best} | {cheapest} |"
        )
    if base:
        lines += ["", f"Per-step uncompressed (seed 0): perplexity {base[0]:.3f} for {base[1]:,.1f} MB."]
    if reference and rows:
        figure = out / "benchmarks" / "outer.png"
        draw_figure(reference, rows, figure)
        lines += ["", f"![DiLoCo against per-step methods]({figure.name})"]
    if results.get("note"):
        lines += ["", f"How it ran: {results['note']}."]
    lines += ["", f"Machine: {describe_machine(results['machine'])}", ""]
    write_section(out, SECTION, "\n".join(lines))


def draw_figure(reference, rows, path):
    """The Pareto picture: every per-step point of "Quality against bytes" (seed 0), its frontier,
    and the DiLoCo points, one marker per codec, labelled with H."""
    _, figure, (axis,) = panels(1, 7, 4.5)
    per_step = sorted(reference.values(), key=lambda point: point[1])
    frontier, best = [], float("inf")
    for metric, mb in per_step:
        if metric < best:
            frontier.append((mb, metric))
            best = metric
    axis.plot(
        [mb for _, mb in per_step],
        [m for m, _ in per_step],
        "o",
        color="0.6",
        markersize=4,
        label="per-step methods (every setting)",
    )
    axis.plot(*zip(*frontier), "-", color="0.4", linewidth=1, label="per-step frontier")
    for codec, marker in zip(CODECS, "s^Dv"):
        points = [
            (e["record"]["wire_bytes"] / 1e6, e["record"]["metric"], e["spec"]["inner_steps"])
            for e in rows
            if e["spec"]["codec"] == codec
        ]
        if not points:
            continue
        axis.plot(
            [mb for mb, _, _ in points],
            [m for _, m, _ in points],
            marker,
            markersize=7,
            linestyle="none",
            label=f"DiLoCo, {codec}",
        )
        for mb, metric, h in points:
            axis.annotate(f"H={h}", (mb, metric), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axis.set_xscale("log")
    axis.set_xlabel("MB sent per rank over the run (log)", fontsize=8)
    axis.set_ylabel("validation perplexity, lower is better", fontsize=8)
    axis.set_title("Character LM: DiLoCo against per-step compression", fontsize=9)
    axis.tick_params(labelsize=7)
    axis.legend(fontsize=6)
    save_figure(figure, path)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks outer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-steps", type=int, default=LM_STEPS)
    parser.add_argument("--inner-steps", type=lambda s: [int(h) for h in s.split(",")], default=INNER_STEPS)
    add_job_options(parser, 1800.0, "2 ranks, 20 LM steps, H = 5", np=4, max_minutes=600.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.np, args.lm_steps, args.inner_steps = 2, 20, [5]
    return args


def render(out: Path) -> None:
    """Rewrites the page and figure from the stored JSON."""
    write_report(stored(out, "outer"), out)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_points(args, train_point, run, args.out / "benchmarks" / "outer.json", RESULT_PREFIX)

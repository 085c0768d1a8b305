"""What watching a compression with a metrics exporter costs per step, on the host.

A world of one rank runs FP16 (the cheapest codec, so the exporter's own work shows) on
``--layers`` 4 x 4 gradients (294: the character LM's tensors), unwatched and watched by a
``JsonLines`` exporter writing every step and every 10 steps. The CPU time of this process
per step (``time.process_time``, so other processes' load counts less than in wall time) is
taken over 5 steps, ``--rounds`` times in turn for each variant; the 25th percentile of each is
compared. The exporter's cost is per layer (two clock reads and a wrapped continuation) plus
one write per written step; it does not grow with the gradients' size.

Writes ``<out>/benchmarks/metrics_overhead.json`` and the "Metrics overhead" page,
``<out>/benchmarks/metrics-overhead.md``.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import hvd_compress as hc
from benchmarks.harness.jobs import command_line, say
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, save_record, stored, write_section
from hvd_compress.comm.simulated import SimulatedWorld

SECTION = "Metrics overhead"
STEPS_PER_ROUND = 5
VARIANTS = {"unwatched": None, "JsonLines every 10": 10, "JsonLines every step": 1}


def measure(layers, rounds):
    """{variant: 25th percentile of CPU ms per step}."""
    torch.set_num_threads(1)
    grads = {f"layer{i}.weight": torch.randn(4, 4) for i in range(layers)}
    worlds = {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant, every in VARIANTS.items():
            compressor = hc.FP16(min_numel=1)
            if every is not None:
                hc.metrics.JsonLines(Path(scratch) / f"{every}.jsonl", every=every).watch(compressor)
            worlds[variant] = SimulatedWorld([compressor])
            worlds[variant].step([grads])  # first-step allocations
        times = {variant: [] for variant in VARIANTS}
        for _ in range(rounds):
            for variant, world in worlds.items():
                started = time.process_time()
                for _ in range(STEPS_PER_ROUND):
                    world.step([grads])
                times[variant].append(1e3 * (time.process_time() - started) / STEPS_PER_ROUND)
    return {variant: sorted(values)[len(values) // 4] for variant, values in times.items()}


def markdown(result, command):
    base = result["ms"]["unwatched"]
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {describe_machine(result['machine'])} Load average at the start: {result['load_average'][0]:.1f}.",
        "",
        f"CPU ms per step of FP16 on {result['layers']} gradients of 4 x 4 (one rank), 25th "
        f"percentile of {result['rounds']} rounds; how it is measured is in "
        "`benchmarks/metrics_overhead.py`.",
        "",
        "| variant | CPU ms per step | added ms per step | added us per layer |",
        "|---|---|---|---|",
    ]
    for variant, ms in result["ms"].items():
        added = ms - base
        lines.append(f"| {variant} | {ms:.3f} | {added:+.3f} | {1e3 * added / result['layers']:+.2f} |")
    return "\n".join(lines) + "\n"


def render(out: Path) -> None:
    """Rewrites the page from the stored JSON."""
    write_section(out, SECTION, markdown(stored(out, "metrics_overhead"), "python -m benchmarks metrics_overhead"))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks metrics_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=294)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    load = os.getloadavg()
    result = {
        "machine": machine(),
        "load_average": load,
        "layers": args.layers,
        "rounds": args.rounds,
        "ms": measure(args.layers, args.rounds),
    }
    save_record(args.out / "benchmarks" / "metrics_overhead.json", result)
    command = command_line("metrics_overhead", dropped=())
    write_section(args.out, SECTION, markdown(result, command))
    say(", ".join(f"{variant}: {ms:.3f} ms" for variant, ms in result["ms"].items()))

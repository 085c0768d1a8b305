"""Projection: step time of every method at 8-64 workers and 1-100 Gbit/s, from an alpha-beta
model fitted to the emulated cluster's measurements.

Model, for W ranks on links of B Gbit/s (the ring algorithms of Horovod's MPI back end):

* all-reduce of n bytes: 2(W-1) alpha + 2(W-1)/W n beta;
* all-gather of n bytes from each rank: (W-1) alpha + (W-1) n beta;
* beta = 8 / (efficiency x B x 1e9) seconds per byte.

alpha and the efficiency are fitted by least squares to the probe jobs of
``python -m benchmarks endtoend`` (Horovod's all-reduce and all-gather of 4 KiB-16 MiB
on the testbed at each rate). A method's communication per step follows from the payload bytes
per collective that its compressor counted during the timed steps (S-SGD: one float32
all-reduce of every gradient); the messages are its fusion buffers: the ones the compressor
counted under ``hvd_compress.DistributedOptimizer`` (Horovod's own fusion off), else Horovod's
64 MiB buffers, which fuse whatever is submitted in one cycle.

Per method, what it waited for beyond compute and compression (its exposed communication) is
fitted over the testbed's rates as kappa x the model's communication + a fixed overhead
(:func:`exposure_fit`): kappa below 1 is overlap with backward, above 1 a transfer slower than
the probes (Horovod's large fused buffers); the overhead is what it pays at any rate (a
controller's own work, Horovod's cycle). A projected step is compute + compression + overhead
+ kappa x the model's communication at W and B. The validation table leaves one testbed rate
out, fits to the others and compares its projection with what was measured there. Compute and
compression are the testbed's (ranks sharing CPU cores, the same
batch per rank at every W), not a GPU's: the projection says where the network decides.

Writes ``<out>/benchmarks/projection.json``, ``projection.png`` and the "Projection" page,
``<out>/benchmarks/projection.md``.
"""

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks.endtoend import WRAPPED
from benchmarks.harness.jobs import command_line
from benchmarks.harness.render import DOCS, panels, save_figure, save_record, stored, write_section
from hvd_compress.comm.rounds import Collective

SECTION = "Projection"
WORKERS = [8, 16, 32, 64]
RATES_GBIT = [1, 10, 25, 100]
HOROVOD_FUSION_BYTES = 64 << 20


def ring_terms(collective, nbytes, world):
    """(alpha coefficient, beta coefficient) of one collective (its name) of ``nbytes`` per
    rank: the messages a rank sends in turn, and the bytes it sends (``Collective.wire_bytes``,
    as ``Traffic`` counts them). A ring all-reduce is a reduce-scatter then an all-gather:
    2(W-1) messages; the others W-1."""
    ring = Collective(collective)
    return ring.ring_messages(world), ring.wire_bytes(nbytes, world)


def fit(probes, world):
    """(alpha seconds, efficiency): least squares over every probe at every rate of
    t = a_coef alpha + b_coef 8 / (eff B 1e9), linear in alpha and 1/eff."""
    rows, times = [], []
    for rate, timings in probes.items():
        for collective, by_size in timings.items():
            for nbytes, seconds in by_size.items():
                a_coef, b_coef = ring_terms(collective, int(nbytes), world)
                rows.append((a_coef, b_coef * 8 / (float(rate) * 1e9)))
                times.append(seconds)
    # Normal equations of the two-parameter fit, weighted by 1/t so small messages count too.
    weights = [1 / t for t in times]
    saa = sum(w * w * a * a for w, (a, _) in zip(weights, rows))
    sab = sum(w * w * a * b for w, (a, b) in zip(weights, rows))
    sbb = sum(w * w * b * b for w, (_, b) in zip(weights, rows))
    sat = sum(w * w * a * t for w, (a, _), t in zip(weights, rows, times))
    sbt = sum(w * w * b * t for w, (_, b), t in zip(weights, rows, times))
    determinant = saa * sbb - sab * sab
    alpha = max(0.0, (sat * sbb - sbt * sab) / determinant)
    inverse_efficiency = (saa * sbt - sab * sat) / determinant
    return alpha, 1 / inverse_efficiency


def communication_seconds(entry, parameters, fused_by_horovod, world, rate_gbit, alpha, efficiency):
    """Seconds of one step's collectives in the alpha-beta model."""
    beta = 8 / (efficiency * rate_gbit * 1e9)
    if entry["traffic"] is None:  # S-SGD: every float32 gradient
        counted = {"allreduce": {"calls": None, "payload_bytes": 4 * parameters}}
    else:
        counted = entry["traffic"]["by_collective"]
    total = 0.0
    for collective, per_step in counted.items():
        nbytes = per_step["payload_bytes"]
        messages = max(1, math.ceil(nbytes / HOROVOD_FUSION_BYTES)) if fused_by_horovod else per_step["calls"]
        a_coef, b_coef = ring_terms(collective, nbytes / messages, world)
        total += messages * (a_coef * alpha + b_coef * beta)
    return total


def exposure_fit(points):
    """(kappa, overhead) of exposed = kappa x modelled communication + overhead, least squares
    over (modelled ms, exposed ms) points, both >= 0: kappa says how much of the model's
    communication a method waits for (below 1: overlapped; above: slower than the probes),
    overhead what it waits for at any rate (a controller's work, Horovod's cycle)."""
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    kappa = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    overhead = mean_y - kappa * mean_x
    if kappa < 0:
        return 0.0, max(0.0, mean_y)
    if overhead < 0:
        return sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0
    return kappa, overhead


class MethodModel:
    """One method on one model: compute + compression as measured (mean over rates) plus the
    exposure fit of its measured exposed communication against the modelled one."""

    def __init__(self, entries, method, parameters, alpha, efficiency, world):
        self.fused_by_horovod = method not in WRAPPED
        self.entry = next(iter(entries.values()))  # its counted traffic is the same at every rate
        self.parameters, self.alpha, self.efficiency = parameters, alpha, efficiency
        floors = {rate: e["compute_ms"] + e["codec_ms"] for rate, e in entries.items()}
        self.floor_ms = sum(floors.values()) / len(floors)
        self.kappa, self.overhead_ms = exposure_fit(
            [
                (self.communication_ms(world, float(rate)), e["step_ms"]["median"] - floors[rate])
                for rate, e in entries.items()
            ]
        )

    def communication_ms(self, world, rate_gbit):
        return 1e3 * communication_seconds(
            self.entry, self.parameters, self.fused_by_horovod, world, rate_gbit, self.alpha, self.efficiency
        )

    def step_ms(self, world, rate_gbit):
        return self.floor_ms + self.overhead_ms + self.kappa * self.communication_ms(world, rate_gbit)


def method_models(measured, alpha, efficiency, rates):
    """{model: {method: MethodModel}} fitted to the measurements at ``rates``."""
    first = measured["rates"][rates[0]]["models"]
    return {
        model: {
            method: MethodModel(
                {rate: measured["rates"][rate]["models"][model][method] for rate in rates},
                method,
                measured["models"][model]["parameters"],
                alpha,
                efficiency,
                measured["np"],
            )
            for method in methods
        }
        for model, methods in first.items()
    }


def project(measured):
    probes = {rate: entry["probe"] for rate, entry in measured["rates"].items()}
    alpha, efficiency = fit(probes, measured["np"])
    rates = list(measured["rates"])
    result = {
        "alpha_us": 1e6 * alpha,
        "efficiency": efficiency,
        "world": measured["np"],
        "rates": rates,
        "validation": [],
        "models": {},
    }
    # Leave one rate out: fit to the others, project to it.
    for held_out in rates:
        fitted = method_models(measured, alpha, efficiency, [rate for rate in rates if rate != held_out])
        for model, methods in fitted.items():
            for method, projected in methods.items():
                result["validation"].append(
                    {
                        "rate": held_out,
                        "model": model,
                        "method": method,
                        "measured_ms": measured["rates"][held_out]["models"][model][method]["step_ms"]["median"],
                        "projected_ms": projected.step_ms(measured["np"], float(held_out)),
                    }
                )
    for model, methods in method_models(measured, alpha, efficiency, rates).items():
        result["models"][model] = {
            "fit": {
                method: {"floor_ms": m.floor_ms, "kappa": m.kappa, "overhead_ms": m.overhead_ms}
                for method, m in methods.items()
            },
            "steps": {
                f"{workers}x{rate}": {method: m.step_ms(workers, rate) for method, m in methods.items()}
                for workers in WORKERS
                for rate in RATES_GBIT
            },
        }
    return result


def markdown(result, command, figure):
    lines = [
        f"Command: `{command}` (from the [end-to-end run](end-to-end.md); seconds)",
        "",
        f"Fit over the probe jobs at every testbed rate ({result['world']} ranks): alpha = "
        f"{result['alpha_us']:.0f} us per message, links deliver {100 * result['efficiency']:.0f}% "
        "of their nominal rate as all-reduce bandwidth. The model and its assumptions are "
        "in `benchmarks/projection.py`'s docstring.",
        "",
        f"![projected step time]({figure})",
        "",
        "Validation: each testbed rate left out of the fit in turn, its projected against "
        "its measured median step (ms).",
        "",
        "| model | rate Gbit/s | method | measured | projected | projected / measured |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["validation"]:
        lines.append(
            f"| {row['model']} | {row['rate']} | {row['method']} | {row['measured_ms']:.1f} | "
            f"{row['projected_ms']:.1f} | {row['projected_ms'] / row['measured_ms']:.2f} |"
        )
    for model, projected in result["models"].items():
        grid = projected["steps"]
        lines += [
            "",
            f"**{model}**: fastest method (projected step ms, speed-up over S-SGD) by workers and link rate.",
            "",
            "| workers | " + " | ".join(f"{rate} Gbit/s" for rate in RATES_GBIT) + " |",
            "|---" * (len(RATES_GBIT) + 1) + "|",
        ]
        for workers in WORKERS:
            cells = []
            for rate in RATES_GBIT:
                steps = grid[f"{workers}x{rate}"]
                best = min(steps, key=steps.get)
                speedup = steps["S-SGD"] / steps[best] if "S-SGD" in steps else float("nan")
                cells.append(f"{best} ({steps[best]:.0f}, {speedup:.1f}x)")
            lines.append(f"| {workers} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def draw_figure(result, path):
    models = list(result["models"])
    _, figure, axes = panels(len(models), 5.5, 3.8)
    workers = 32
    for axis, model in zip(axes, models):
        grid = result["models"][model]["steps"]
        for method in grid[f"{workers}x{RATES_GBIT[0]}"]:
            axis.plot(
                RATES_GBIT,
                [grid[f"{workers}x{rate}"][method] for rate in RATES_GBIT],
                marker="o",
                markersize=3,
                label=method,
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("link rate, Gbit/s", fontsize=8)
        axis.set_ylabel("projected step, ms", fontsize=8)
        axis.set_title(f"{model}, {workers} workers", fontsize=9)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    save_figure(figure, path, dpi="figure")


def render(out: Path) -> None:
    """Rewrites the page and figure from the stored JSON."""
    result = stored(out, "projection")
    draw_figure(result, out / "benchmarks" / "projection.png")
    write_section(out, SECTION, markdown(result, "python -m benchmarks projection", "projection.png"))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks projection", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=DOCS / "benchmarks" / "endtoend.json",
        help="the end-to-end benchmark's JSON",
    )
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.source.exists():
        parser.error(f"--from: {args.source} does not exist; run python -m benchmarks endtoend first")
    measured = json.loads(args.source.read_text())
    if len(measured["rates"]) < 2:
        parser.error(
            f"--from: {args.source} holds one link rate; the exposure fit needs two or more "
            "(python -m benchmarks endtoend --rates ...)"
        )
    result = project(measured)
    save_record(args.out / "benchmarks" / "projection.json", result)
    draw_figure(result, args.out / "benchmarks" / "projection.png")
    command = command_line("projection", dropped=())
    write_section(args.out, SECTION, markdown(result, command, "projection.png"))
    print(f"alpha {result['alpha_us']:.0f} us, efficiency {result['efficiency']:.2f}")

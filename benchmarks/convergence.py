"""Convergence: what each compressor costs in model quality, on two real workloads trained by
real multi-process Horovod jobs, against uncompressed training with the same seed and data.

Workloads: the digits CNN of :mod:`examples.workloads.digits` trained as the multi-rank
convergence test trains it (SGD, lr 0.1, 6 epochs per rank, so about 260 steps at any W; test
accuracy on the held-out split, mean over seeds), and the character transformer of
:mod:`examples.workloads.charlm` on the Python standard library's own source (AdamW;
validation perplexity, exp of the mean cross-entropy).

One ``mpirun -np W`` job per (workload, method), each bounded by ``--job-timeout`` (its whole
process group is killed past it). Every rank uses one torch thread and the stock
``hvd.DistributedOptimizer(optimizer, named_parameters=..., compression=X)``. Rank 0 reports:
the final metric; the bytes the compressor handed to collectives, counted by its ``traffic``
(``hvd_compress.comm.rounds.Traffic``), against those of a float32 ring all-reduce of the same
gradients; the seconds spent training; the optimizer steps, counted as they are taken.

Writes ``<out>/benchmarks/convergence.json`` (every number), ``<out>/benchmarks/convergence.png``
and the "Convergence" page, ``<out>/benchmarks/convergence.md``. ``--quick``: 2 ranks, a few steps
of a tiny model, every method in one job per workload: a smoke test, not a measurement.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import hvd_compress as hc
from benchmarks.harness.jobs import add_job_options, command_line, mpirun_job, names_from
from benchmarks.harness.machine import OthersShare, describe_machine, machine
from benchmarks.harness.render import method_bars, panels, save_figure, save_record, stored, write_section
from benchmarks.harness import methods
from benchmarks.harness.training import StepCounter, horovod_optimizer, train_workload
from examples.workloads import digits
from hvd_compress.comm.rounds import Collective

RESULT_PREFIX = "CONVERGENCE_RESULT "
SECTION = "Convergence"
UNCOMPRESSED = "uncompressed"
LGRECO = "L-GreCo (ACP-SGD)"
GRAVAC = "GraVAC (Top-K)"
METHODS = [UNCOMPRESSED, "FP16", "PowerSGD", "ACP-SGD", LGRECO, GRAVAC, "ScaleCom", "QSGD", "Top-K"]
# GraVAC as the multi-rank test runs it on the digits CNN (docs/methods.md): at epsilon 0.7 it
# never leaves 10x there (Top-K keeps too little of this small CNN's gradient energy above).
GRAVAC_SETTINGS = {"theta_min": 10, "theta_max": 100, "epsilon": 0.5}

# Digits: the settings of the multi-rank convergence test (tests/multirank/helpers.py), small
# enough that every compressor compresses this CNN's few large layers.
# Character LM: each class's documented default.
SETTINGS = {
    "digits": {
        "PowerSGD": {"rank": 2},
        "ACP-SGD": {"rank": 4},
        "ScaleCom": {"density": 0.05},
        "QSGD": {"bits": 4, "bucket_size": 128},
        "Top-K": {"density": 0.05},
    },
    "charlm": {
        "PowerSGD": {"rank": 4},
        "ACP-SGD": {"rank": 4},
        "ScaleCom": {"density": 0.01},
        "QSGD": {"bits": 4, "bucket_size": 512},
        "Top-K": {"density": 0.01},
    },
}
WORKLOADS = {"digits": "Digits CNN", "charlm": "Character LM"}
METRICS = {"digits": "test accuracy", "charlm": "validation perplexity"}

# The full run: 6 digits epochs per rank keep about 260 steps at any W (as the multi-rank test);
# the LM is CharTransformer's default (d_model 128, 2 layers, 64 bytes of context, 0.46 M
# parameters) at 16 sequences per rank and step: about 0.15 s a step with 4 ranks on 2 cores.
DIGITS_EPOCHS_PER_RANK = 6
LM = {"model": {"d_model": 128, "layers": 2, "heads": 4, "context": 64}, "batch_size": 16, "max_chars": 2_000_000}
QUICK_LM = {"model": {"d_model": 32, "layers": 1, "heads": 2, "context": 32}, "batch_size": 4, "max_chars": 200_000}


# ----- one job: runs on every rank ----------------------------------------------------------------
def adaptive_schedule(steps):
    """L-GreCo and GraVAC settings that adapt within a run of ``steps`` steps: L-GreCo decides
    at a third and two thirds of the run; GraVAC's window is a sixth of it, time to try its
    candidate factors 20x, 40x and 100x."""
    decide_every = max(2, steps // 3)
    return {
        "lgreco": {"warmup_steps": decide_every, "decide_every": decide_every, "apply_delay": min(5, decide_every - 1)},
        "gravac": dict(GRAVAC_SETTINGS, window=max(1, steps // 6)),
    }


def build_compression(method, named, settings, steps):
    """The ``compression=`` of ``hvd.DistributedOptimizer`` for ``method``; None for Horovod's
    own uncompressed all-reduce."""
    if method == UNCOMPRESSED:
        return None
    schedule = adaptive_schedule(steps)
    if method == LGRECO:
        return hc.LGreCo(hc.ACPSGD(named, **settings["ACP-SGD"]), **schedule["lgreco"])
    if method == GRAVAC:
        return hc.GraVAC(hc.TopK(named), **schedule["gravac"])
    return methods.build(method, named, **settings.get(method, {}))


def train_with(method, spec):
    """Trains ``spec``'s workload once per seed with ``method``; rank 0's record of it: metric
    per seed, steps, seconds, and the bytes counted by the compressors."""
    import horovod.torch as hvd  # in the job's ranks only: importing this module needs no Horovod

    compressors, counter, dense_bytes = [], StepCounter(), []

    def make_optimizer(model, optimizer):
        wrapped, compression, dense = horovod_optimizer(
            model, optimizer, lambda named: build_compression(method, named, SETTINGS[spec["workload"]], spec["steps"])
        )
        dense_bytes.append(dense)
        compressors.append(compression)
        return counter.wrap(wrapped)

    started = time.perf_counter()
    metrics = [
        train_workload(spec["workload"], spec, make_optimizer, hvd.rank(), hvd.size(), seed) for seed in spec["seeds"]
    ]
    record = {
        "workload": spec["workload"],
        "method": method,
        "metric": sum(metrics) / len(metrics),
        "metric_per_seed": metrics,
        "steps": counter.steps,
        "train_seconds": time.perf_counter() - started,
        "dense_payload_bytes_per_step": dense_bytes[0],
        "world_size": hvd.size(),
    }
    if compressors[0] is not None:
        record.update(traffic_totals(compressors))
    if method == GRAVAC:
        record["gravac_average_factor"] = sum(c.average_cf for c in compressors) / len(compressors)
    if method == LGRECO:
        record["lgreco_decisions"] = [
            {"effective_step": d.effective_step, "bytes": d.total_bytes, "uniform_bytes": d.uniform_bytes}
            for c in compressors
            for d in c.decisions
        ]
    return record


def traffic_totals(compressors):
    """Bytes over every step of every seed; the ratio is dense bytes over bytes sent, both
    summed over the steps (the mean bytes per step of a float32 ring all-reduce over the mean
    bytes per step actually sent, all-gathers counted at their W-fold cost)."""
    steps = sum(c.traffic.steps for c in compressors)
    dense = sum(c.traffic.dense_wire_bytes for c in compressors)
    wire = sum(c.traffic.wire_bytes for c in compressors)
    payload = sum(c.traffic.payload_bytes for c in compressors)
    return {
        "traffic_steps": steps,
        "payload_bytes_per_step": payload / steps,
        "wire_bytes_per_step": wire / steps,
        "dense_wire_bytes_per_step": dense / steps,
        "compression_ratio": dense / wire,
    }


def worker(spec):
    import horovod.torch as hvd

    torch.set_num_threads(1)  # W ranks share the machine's cores
    hvd.init()
    for method in spec["methods"]:
        record = train_with(method, spec)
        if hvd.rank() == 0:
            print(RESULT_PREFIX + json.dumps(record), flush=True)


# ----- the driver -----------------------------------------------------------------------------
def job_specs(args):
    """One spec per job: the workload, its methods, and how long to train."""
    methods = args.methods
    lm = QUICK_LM if args.quick else LM
    epochs = 1 if args.quick else DIGITS_EPOCHS_PER_RANK * args.np
    _, train_labels, _, test_labels = digits.load_digits_split()
    # L-GreCo's and GraVAC's schedules follow the planned steps of one seed (batches of 32).
    digits_steps = epochs * (len(train_labels) // args.np // 32)
    workloads = [
        {
            "workload": "digits",
            "seeds": list(range(args.digits_seeds)),
            "epochs": epochs,
            "steps": digits_steps,
            "train_images": len(train_labels),
            "test_images": len(test_labels),
        },
        {"workload": "charlm", "seeds": [0], "steps": args.lm_steps, "lm": lm},
    ]
    # --quick: every method in one job per workload, so the start-up is paid twice, not 18 times.
    groups = [methods] if args.quick else [[method] for method in methods]
    return [dict(workload, methods=group) for workload in workloads for group in groups]


def run_job(spec, args):
    """Runs one job under mpirun; rank 0's records, or RuntimeError with the job's output."""
    return mpirun_job(
        "convergence",
        spec,
        args.np,
        args.job_timeout,
        RESULT_PREFIX,
        f"{spec['workload']} {', '.join(spec['methods'])}",
        expected=len(spec["methods"]),
    )


def run(args):
    started, others = time.perf_counter(), OthersShare()
    results = {
        "command": command_line("convergence", dropped=()),
        "machine": machine(),
        "np": args.np,
        "settings": {**SETTINGS, "gravac": GRAVAC_SETTINGS},
        "workloads": {},
    }
    specs = job_specs(args)
    for number, spec in enumerate(specs, 1):
        shared = {key: value for key, value in spec.items() if key != "methods"}
        results["workloads"].setdefault(spec["workload"], {"spec": shared, "methods": {}})
        for record in run_job(spec, args):
            record["settings"] = settings_text(spec["workload"], record["method"], spec)
            results["workloads"][spec["workload"]]["methods"][record["method"]] = record
            print(
                f"[{number}/{len(specs)}] {WORKLOADS[spec['workload']]}, {record['method']}: "
                f"{METRICS[spec['workload']]} {record['metric']:.4f}, compression ratio "
                f"{record.get('compression_ratio', 1.0):.1f}x, {record['steps']} steps in "
                f"{record['train_seconds']:.1f} s (job {record['job_seconds']:.1f} s)",
                flush=True,
            )
    results["minutes"] = (time.perf_counter() - started) / 60
    results["machine"]["others_cpu_percent"] = 100 * others.share()
    return results


# ----- the report ---------------------------------------------------------------------------------
def settings_text(workload, method, spec):
    """The method's settings as a table cell."""
    if method == UNCOMPRESSED:
        return "Horovod's float32 all-reduce"
    schedule = adaptive_schedule(spec["steps"])
    if method == LGRECO:
        inner = SETTINGS[workload]["ACP-SGD"]
        return f"ACP-SGD {_options(inner)}; {_options(schedule['lgreco'])}"
    if method == GRAVAC:
        return f"Top-K; {_options(schedule['gravac'])}"
    return _options(SETTINGS[workload].get(method, {})) or "-"


def _options(options):
    return ", ".join(f"{key} {value}" for key, value in options.items())


def metric_text(workload, value):
    return f"{100 * value:.2f}%" if workload == "digits" else f"{value:.3f}"


def delta_text(workload, value, baseline):
    if workload == "digits":
        return f"{100 * (value - baseline):+.2f} points"
    return f"{value - baseline:+.3f} ({100 * (value / baseline - 1):+.1f}%)"


def table(workload, entry):
    methods = entry["methods"]
    baseline = methods[UNCOMPRESSED]["metric"] if UNCOMPRESSED in methods else None
    lines = [
        f"| method | settings | {METRICS[workload]} | \u0394 vs uncompressed | avg compression "
        f"ratio | bytes sent / step | wall s | steps |",
        "|---" * 8 + "|",
    ]
    for method, record in methods.items():
        sent = record.get(
            "wire_bytes_per_step",
            Collective.ALLREDUCE.wire_bytes(record["dense_payload_bytes_per_step"], record["world_size"]),
        )
        lines.append(
            f"| {method} | {record['settings']} | "
            f"{metric_text(workload, record['metric'])} | "
            f"{'-' if baseline is None else delta_text(workload, record['metric'], baseline)} | "
            f"{record.get('compression_ratio', 1.0):.1f}x | "
            f"{sent / 1e3:,.1f} kB | "
            f"{record['train_seconds']:.1f} | {record['steps']} |"
        )
    return lines


def adaptive_notes(entry):
    """What L-GreCo and GraVAC chose, in a sentence each."""
    notes = []
    lgreco = entry["methods"].get(LGRECO)
    if lgreco is not None:
        decisions = lgreco["lgreco_decisions"]
        runs = len(entry["spec"]["seeds"])
        notes.append(
            f"L-GreCo applied {len(decisions) / runs:g} decisions per run"
            + (
                ", the last sending " + f"{decisions[-1]['uniform_bytes'] / decisions[-1]['bytes']:.2f}x "
                "fewer bytes per step than uniform ACP-SGD (solver's count)"
                if decisions
                else ""
            )
        )
    gravac = entry["methods"].get(GRAVAC)
    if gravac is not None:
        notes.append(f"GraVAC's compression factor averaged {gravac['gravac_average_factor']:.1f}x")
    return "; ".join(notes) + "." if notes else ""


def markdown(results, figure):
    info = results["machine"]
    digits, lm = results["workloads"].get("digits"), results["workloads"].get("charlm")
    lines = [
        f"Command: `{results['command']}` ({results['minutes']:.1f} min)",
        "",
        f"Machine: {describe_machine(info)} Other processes used "
        f"{info['others_cpu_percent']:.1f}% of the CPUs during the run.",
        "",
        f"Each (workload, method) is one `mpirun -np {results['np']}` job (ranks oversubscribed "
        f"on {info['cores']} cores, one torch thread each) through the stock "
        "`hvd.DistributedOptimizer(optimizer, named_parameters=..., compression=X)`; same "
        "seed and data for every method. *Avg compression ratio*: the bytes a float32 ring "
        "all-reduce of the same gradients sends over the bytes the compressor handed to "
        "collectives, both summed over every step (`Traffic` of `hvd_compress/comm/rounds.py`, "
        "counted as it ran; an all-gather counts at its (W-1)-fold cost, the dense biases and "
        "norms are included); *bytes sent / step*: per rank, on that ring model. *Wall s*: "
        "rank 0's training time; *steps*: optimizer steps, counted.",
        "",
        "**Each method runs at its default setting, not at equal bytes**: read a row's quality "
        "with its bytes (ACP-SGD at rank 4 sends about half of PowerSGD rank 4's bytes). The "
        "comparison at equal bytes, across each method's range of settings, is the quality "
        "benchmark's (\"Quality against bytes\").",
        "",
        "Settings: digits as in the multi-rank convergence test (`tests/multirank/helpers.py`), "
        "chosen there so that every compressor compresses this small CNN's layers; the LM "
        "with each class's documented defaults (rank 4, density 1%, 4-bit QSGD in buckets of "
        "512). L-GreCo and GraVAC adapt within the run: L-GreCo decides at a third and two "
        "thirds of it, over ACP-SGD's ranks (candidates: half to twice the default); GraVAC "
        "over Top-K with a window of a sixth of the run, theta 10-100x and epsilon 0.5 (at "
        "the documented 0.7 it stays at 10x on the digits CNN, see docs/methods.md).",
        "",
    ]
    if digits is not None:
        spec = digits["spec"]
        lines += [
            f"**{WORKLOADS['digits']}** (`examples/workloads/digits.py`): SGD with momentum, "
            f"lr 0.1 with cosine decay, batch 32 per rank, {spec['epochs']} epochs over each "
            f"rank's 1/{results['np']} of the {spec['train_images']:,} training images; test "
            f"accuracy on the {spec['test_images']} held-out images, mean of "
            f"{len(spec['seeds'])} seeds (steps and wall time: all seeds together).",
            "",
        ]
        lines += table("digits", digits) + ["", adaptive_notes(digits), ""]
    if lm is not None:
        spec, model = lm["spec"], lm["spec"]["lm"]["model"]
        lines += [
            f"**{WORKLOADS['charlm']}** (`examples/workloads/charlm.py`): CharTransformer "
            f"d_model {model['d_model']}, {model['layers']} layers, {model['heads']} heads, "
            f"{model['context']} bytes of context, on the first "
            f"{spec['lm']['max_chars'] / 1e6:g} MB of the Python standard library's source "
            f"(90% train, 10% validation); AdamW, lr 2e-3 with warm-up and cosine decay, "
            f"{spec['lm']['batch_size']} sequences per rank and step, {spec['steps']} steps; "
            "validation perplexity (exp of the mean cross-entropy over 256 fixed windows).",
            "",
        ]
        lines += table("charlm", lm) + ["", adaptive_notes(lm), ""]
    lines.append(f"![convergence]({figure.as_posix()})")
    return "\n".join(lines) + "\n"


def draw_figure(results, path):
    """One panel per workload: the metric per method, each bar labelled with its ratio."""
    workloads = list(results["workloads"])
    _, figure, axes = panels(len(workloads), 5, 3.6)
    for axis, workload in zip(axes, workloads):
        methods = results["workloads"][workload]["methods"]
        scale = 100 if workload == "digits" else 1
        values = {label: scale * record["metric"] for label, record in methods.items()}
        bars = method_bars(axis, values, UNCOMPRESSED)
        axis.bar_label(
            bars, [f"{record.get('compression_ratio', 1.0):.1f}x" for record in methods.values()], padding=3, fontsize=7
        )
        low, high = min(values.values()), max(values.values())
        axis.set_xlim(low - 0.6 * (high - low) - 0.01 * high, high + 0.4 * (high - low) + 0.01 * high)
        axis.set_title(
            f"{WORKLOADS[workload]}: {METRICS[workload]}{' (%)' if workload == 'digits' else ' (lower is better)'}",
            fontsize=9,
        )
        axis.tick_params(labelsize=7)
    figure.suptitle(f"Final quality per method, {results['np']} ranks; labels: average compression ratio", fontsize=9)
    save_figure(figure, path)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks convergence", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", type=names_from(METHODS), default=METHODS, help=f"comma-separated, of: {', '.join(METHODS)}"
    )
    parser.add_argument("--digits-seeds", type=int, default=3, help="digits runs per method (mean)")
    parser.add_argument("--lm-steps", type=int, default=300, help="LM optimizer steps")
    add_job_options(parser, 300, "2 ranks, a few steps of a tiny model: a smoke test", np=4)
    args = parser.parse_args(argv)
    if args.quick:
        args.np, args.digits_seeds, args.lm_steps = 2, 1, 8
    return args


def render(out: Path) -> None:
    """Rewrites the page and figure from the stored JSON."""
    results = stored(out, "convergence")
    draw_figure(results, out / "benchmarks" / "convergence.png")
    write_section(out, SECTION, markdown(results, Path("convergence.png")))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    results = run(args)
    save_record(args.out / "benchmarks" / "convergence.json", results)
    render(args.out)
    print(
        f"{results['minutes']:.1f} min; other processes used "
        f"{results['machine']['others_cpu_percent']:.1f}% of the CPUs"
    )

"""ACP-SGD step time against the fusion buffer size, W ranks on an emulated cluster
(the ACP-SGD paper's Fig. 10).

    python -m benchmarks.fusion [--rate 1] [--np 4] [--steps 20] [--repeats 2] [--out docs/]

For every buffer configuration, short ACP-SGD training jobs of ``--np`` ranks run in an
:mod:`emulated cluster <benchmarks.testbed>` whose links are shaped to ``--rate``
Gbit/s, and rank 0 records each step's time after ``--warmup`` steps. The result is the median
over the steps of ``--repeats`` jobs, run in passes over all configurations, every other pass
in reverse order; the medians of the single jobs show how far runs of one configuration differ.
Configurations: no fusion (``ScaledFusion(1, scaled=False)``); payload buffers from 4 KiB up,
x4 each, until one buffer holds the whole model; the whole model (``ScaledFusion(2**62,
scaled=False)``); and the scaled default, ``ScaledFusion(dense_threshold=N)`` with the paper's
25 MB (PyTorch DDP's ``bucket_cap_mb=25``, i.e. 25 MiB) and with Horovod's 64 MiB.
HOROVOD_FUSION_THRESHOLD=0 on every rank, so Horovod's background cycle does not fuse our
buckets again: the plan is the only fusion.

Workload: the character transformer of :mod:`examples.workloads.charlm`, by default
d_model 256 and 24 layers (19.1 M parameters in 294 tensors, 73 MiB of float32 gradients),
one sequence of 64 tokens per rank and step, ACP-SGD rank 32, SGD with momentum. Why:

* the model must be several times the 25 MiB dense buffer, or the scaled default is just
  "whole model" (here it makes 3 buckets);
* compression and decompression cost about 6nmr flops per n x m matrix against 4nr (or 4mr)
  bytes sent, so narrow matrices (d_model 256) and many layers give the most communication per
  flop, and 294 tensors unfused are 294 small collectives per step: the start-up cost that
  fusion amortises;
* rank 32 (the paper's smaller rank for BERT) sends 7.2 MiB on P steps and 5.7 MiB on Q steps,
  about 90 ms on a 1 Gbit/s ring against roughly 0.4 s of compute per step; at rank 4 there
  would be almost nothing left to overlap;
* 64 tokens per rank keep a step well under a second with 4 ranks on 2 cores.

Writes ``<out>/fusion/fusion.json`` (every run so far, keyed by its settings, so runs with other
knobs accumulate), ``<out>/fusion/fusion.png`` and the results section of ``<out>/fusion.md``
between two markers, keeping the rest of that file. Each job is bounded (``--job-timeout``);
the namespaces are removed at the end, also on errors and Ctrl-C.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.jobs import add_timing_options, checkout_pythonpath, cluster_job, options_argv, undisturbed
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, save_figure
from benchmarks.harness.stats import summarise, timed_step
from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.compressors.acpsgd import ACPSGD
from examples.workloads.charlm import CharTransformer, batches, cross_entropy, load_corpus

WHOLE_MODEL = 2**62
SCALED_DEFAULTS = {"scaled 25 MiB (paper, DDP)": 25 * 2**20, "scaled 64 MiB (Horovod)": 64 * 2**20}
RESULT_PREFIX = "FUSION_RESULT "
BEGIN, END = "<!-- fusion results: begin -->", "<!-- fusion results: end -->"
# The options a configuration's job passes on to its ranks.
WORKER_OPTIONS = ("steps", "warmup", "d_model", "layers", "heads", "context", "batch", "acp_rank")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.0, help="link rate, Gbit/s")
    parser.add_argument("--np", type=int, default=4, help="ranks")
    add_timing_options(parser, 5, 20, max_other_cpu=0.03, repeats=2)
    parser.add_argument("--out", default=str(DOCS))
    parser.add_argument("--cycle-time-ms", type=float, help="HOROVOD_CYCLE_TIME (default: Horovod's)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--acp-rank", type=int, default=32, help="ACP-SGD's rank")
    parser.add_argument("--unpinned", action="store_true", help="leave ranks unbound to cores (noisier: see testbed)")
    parser.add_argument("--job-timeout", type=int, default=120, help="seconds per configuration")
    parser.add_argument("--only", nargs="*", help="run only these configurations (by label)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threshold", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scaled", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args):
    return CharTransformer(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)


def backward_order_shapes(model):
    """{name: shape} in the order DistributedOptimizer plans: the reverse of registration."""
    return {name: tuple(p.shape) for name, p in reversed(list(model.named_parameters()))}


# ----- one rank of one configuration ------------------------------------------------------------
def worker(args):
    import horovod.torch as hvd

    import hvd_compress

    torch.set_num_threads(1)  # W ranks share the machine's cores
    hvd.init()
    torch.manual_seed(0)
    model = build_model(args)
    fusion = ScaledFusion(args.threshold, scaled=args.scaled)
    compressor = ACPSGD(rank=args.acp_rank)
    optimizer = hvd_compress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(), compressor, fusion=fusion
    )
    # The same plans the optimizer makes, read before each step (plans are cached by settings).
    planner = FusionScheduler(compressor, backward_order_shapes(model), fusion)
    train_ids, _ = load_corpus(max_chars=400_000)
    data = batches(train_ids, args.batch, args.context, torch.Generator().manual_seed(hvd.rank()))
    phases, times, losses = {}, {"step": [], "backward": [], "synchronize": []}, []

    def forward_backward():
        optimizer.zero_grad()
        loss = cross_entropy(model, *next(data))
        loss.backward()  # every bucket is submitted from the hooks, during backward
        losses.append(loss.item())

    for step in range(args.warmup + args.steps):
        plan = planner.plan()
        phases[plan.phase] = {
            "threshold": plan.threshold,
            "buckets": len(plan.buckets),
            "payload_bytes": sum(b.nbytes for b in plan.buckets),
        }
        timed = timed_step(optimizer, forward_backward)
        if step >= args.warmup:
            for part, seconds in timed.items():
                times[part].append(seconds)
    if hvd.rank() == 0:
        print(RESULT_PREFIX + json.dumps({"phases": phases, "seconds": times, "final_loss": losses[-1]}), flush=True)


# ----- the sweep --------------------------------------------------------------------------------
def configurations(whole_model_payload):
    """(label, threshold, scaled) from no fusion to the whole model, then the scaled defaults."""
    yield "no fusion", 1, False
    size = 4 * 1024
    while size < whole_model_payload:
        yield f"{_bytes(size)} buffer", size, False
        size *= 4
    yield "whole model", WHOLE_MODEL, False
    for label, dense in SCALED_DEFAULTS.items():
        yield label, dense, True


def model_summary(args):
    """Sizes of the model and of its P-step payloads (the larger half for this model)."""
    with torch.device("meta"):
        shapes = backward_order_shapes(build_model(args))
    unfused = FusionScheduler(ACPSGD(rank=args.acp_rank), shapes, ScaledFusion(1, scaled=False)).plan()
    payloads = [bucket.nbytes for bucket in unfused.buckets]
    return {
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "tensors": len(shapes),
        "dense_bytes": sum(4 * math.prod(s) for s in shapes.values()),
        "p_step_payload_bytes": sum(payloads),
        "smallest_payload_bytes": min(payloads),
    }


def run_configuration(cluster, args, threshold, scaled):
    argv = [sys.executable, "-m", "benchmarks.fusion", "--worker", "--threshold", str(threshold)]
    argv += ["--scaled"] if scaled else []
    argv += options_argv(**{key: getattr(args, key) for key in WORKER_OPTIONS})
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_pythonpath()}
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(args.cycle_time_ms)
    return cluster_job(cluster, argv, env, args.job_timeout, RESULT_PREFIX)


def run_key(args):
    cycle = "default" if args.cycle_time_ms is None else f"{args.cycle_time_ms:g}ms"
    return (
        f"rate {args.rate:g} Gbit/s, np {args.np}, cycle {cycle}, d{args.d_model}x{args.layers}, "
        f"batch {args.batch}x{args.context}, ACP-SGD rank {args.acp_rank}"
        f"{', unpinned' if args.unpinned else ''}"
    )


def sweep(args):
    from benchmarks.testbed import emulated_cluster

    model = model_summary(args)
    command = "python -m benchmarks.fusion " + shlex.join(sys.argv[1:])
    run = {
        "command": command,
        "machine": machine(),
        "load_average_before": os.getloadavg(),
        "model": model,
        "configurations": [],
    }
    selected = [c for c in configurations(model["p_step_payload_bytes"]) if not args.only or c[0] in args.only]
    jobs = {label: [] for label, _, _ in selected}
    started = time.perf_counter()
    with emulated_cluster(args.np, args.rate, pin_ranks=not args.unpinned) as cluster:
        run["testbed"] = cluster.describe()
        for repeat in range(args.repeats):
            # Every other pass in reverse order, so that a drift of the machine does not
            # favour the configurations that come first.
            for label, threshold, scaled in selected[::-1] if repeat % 2 else selected:
                jobs[label].append(undisturbed_job(cluster, args, label, threshold, scaled))
    for label, threshold, scaled in selected:
        run["configurations"].append(pooled_entry(label, threshold, scaled, jobs[label]))
    run["wall_seconds"] = round(time.perf_counter() - started)
    run["load_average_after"] = os.getloadavg()
    return run


def undisturbed_job(cluster, args, label, threshold, scaled):
    return undisturbed(
        lambda: run_configuration(cluster, args, threshold, scaled),
        args.max_other_cpu,
        lambda job: _job_line(label, job),
    )


def pooled_entry(label, threshold, scaled, jobs):
    """One configuration's record: step-time statistics over the steps of all its jobs."""
    pooled = {part: [s for job in jobs for s in job["seconds"][part]] for part in jobs[0]["seconds"]}
    return {
        "label": label,
        "threshold": threshold,
        "scaled": scaled,
        "phases": jobs[0]["phases"],
        **{f"{part}_ms": summarise(seconds) for part, seconds in pooled.items()},
        "median_step_ms_per_job": [round(1000 * statistics.median(job["seconds"]["step"]), 1) for job in jobs],
        "wall_seconds": [round(job["wall_seconds"], 1) for job in jobs],
        "other_cpu_seconds": [round(job["other_cpu_seconds"], 1) for job in jobs],
        "disturbed_attempts": [job["disturbed_attempts"] for job in jobs],
        "final_loss": [job["final_loss"] for job in jobs],
        "step_ms_each": [[round(1000 * s, 1) for s in job["seconds"]["step"]] for job in jobs],
    }


def _job_line(label, job):
    step, sync = (summarise(job["seconds"][part]) for part in ("step", "synchronize"))
    buckets = "/".join(str(phase["buckets"]) for _, phase in sorted(job["phases"].items()))
    return (
        f"{label:28} median step {step['median']:7.1f} ms (p25-p75 {step['p25']:.1f}-"
        f"{step['p75']:.1f}), synchronize {sync['median']:.1f} ms, buckets {buckets}, "
        f"job {job['wall_seconds']:.0f} s, other CPU {job['other_cpu_seconds']:.1f} s"
    )


# ----- outputs ----------------------------------------------------------------------------------
def per_phase(entry, field):
    """'P/Q' values of a plan field; one value when both phases share it."""
    values = [entry["phases"][phase][field] for phase in sorted(entry["phases"])]
    return values[:1] if len(set(values)) == 1 else values


def effective_thresholds(entry):
    return "/".join(_bytes(v) if v < WHOLE_MODEL else "2^62" for v in per_phase(entry, "threshold"))


def plot_position(entry, smallest_payload):
    """x of a configuration: its payload threshold on P steps, kept between the smallest
    payload (below it nothing fuses: no fusion) and the whole model's payload."""
    phase = entry["phases"].get("P") or next(iter(entry["phases"].values()))
    return max(smallest_payload, min(phase["threshold"], phase["payload_bytes"]))


def verdict(run):
    by_label = {e["label"]: e["step_ms"]["median"] for e in run["configurations"]}
    if not {"no fusion", "whole model"} <= set(by_label) or not set(SCALED_DEFAULTS) <= set(by_label):
        return "incomplete run: no verdict"
    best_label = min(by_label, key=by_label.get)
    lines = [f"best: {best_label}, {by_label[best_label]:.1f} ms"]
    for label in SCALED_DEFAULTS:
        ms = by_label[label]
        within = ms <= 1.1 * by_label[best_label]
        beats = ms < by_label["no fusion"] and ms < by_label["whole model"]
        lines.append(
            f"{label}: {ms:.1f} ms, {100 * (ms / by_label[best_label] - 1):+.1f}% vs best "
            f"({'within' if within else 'not within'} 10%), "
            f"{'beats' if beats else 'does not beat'} both extremes "
            f"(no fusion {by_label['no fusion']:.1f} ms, whole model {by_label['whole model']:.1f} ms)"
        )
    gaps = [
        max(e["median_step_ms_per_job"]) - min(e["median_step_ms_per_job"])
        for e in run["configurations"]
        if len(e["median_step_ms_per_job"]) > 1
    ]
    if gaps:
        lines.append(
            f"for scale, the medians of two jobs of one configuration differ by "
            f"{statistics.median(gaps):.1f} ms (median over configurations), "
            f"up to {max(gaps):.1f} ms"
        )
    return "; ".join(lines)


def write_json(path, key, run):
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[key] = run
    path.write_text(json.dumps(runs, indent=1))
    return runs


def write_figure(path, runs, main_key):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=90)
    for key, run in runs.items():
        sweep_points = [e for e in run["configurations"] if not e["scaled"]]
        smallest = run["model"]["smallest_payload_bytes"]
        xs = [plot_position(e, smallest) for e in sweep_points]
        ys = [e["step_ms"]["median"] for e in sweep_points]
        errors = [
            [e["step_ms"]["median"] - e["step_ms"]["p25"] for e in sweep_points],
            [e["step_ms"]["p75"] - e["step_ms"]["median"] for e in sweep_points],
        ]
        line = axes.errorbar(
            xs, ys, yerr=errors, marker="o", markersize=4, capsize=2, linewidth=2.2 if key == main_key else 1, label=key
        )[0]
        for entry in run["configurations"]:
            style = {"no fusion": ("s", "no fusion"), "whole model": ("^", "whole model")}.get(
                entry["label"], ("*", entry["label"].split(" (")[0]) if entry["scaled"] else None
            )
            if style is None:
                continue
            x, y = plot_position(entry, smallest), entry["step_ms"]["median"]
            axes.plot(
                [x],
                [y],
                style[0],
                markersize=11 if style[0] == "*" else 8,
                color=line.get_color(),
                markeredgecolor="black",
            )
            if key == main_key:  # the whole model's label below, clear of the scaled 64 MiB one
                offset = (-30, -16) if entry["label"] == "whole model" else (4, 7)
                axes.annotate(style[1], (x, y), textcoords="offset points", xytext=offset, fontsize=8)
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=4))
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: _bytes(int(x))))
    axes.set_xlabel("payload buffer size on P steps (scaled: effective threshold; no fusion at the smallest payload)")
    axes.set_ylabel("median step time, ms (bars: p25-p75)")
    axes.set_title("ACP-SGD step time vs fusion buffer, emulated cluster", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    save_figure(figure, path, dpi="figure")


def results_section(runs, main_key):
    lines = [
        BEGIN,
        "",
        "## Results",
        "",
        "Written by `python -m benchmarks.fusion`; every run recorded in "
        "[fusion/fusion.json](fusion/fusion.json), the latest of each setting below.",
        "",
        "![step time against fusion buffer size](fusion/fusion.png)",
        "",
    ]
    for key, run in sorted(runs.items(), key=lambda item: item[0] != main_key):
        model = run["model"]
        m = run["machine"]
        lines += [
            f"### {key}",
            "",
            f"    {run['command']}",
            "",
            *([f"Note: {run['note']}.", ""] if "note" in run else []),
            f"{describe_machine(m)} Load average before/after: "
            f"{', '.join(f'{v:.2f}' for v in run['load_average_before'])}"
            f" / {', '.join(f'{v:.2f}' for v in run['load_average_after'])}. "
            f"Testbed: {run['testbed']}. Whole sweep {run['wall_seconds']} s.",
            "",
            f"Model: {model['parameters']:,} parameters in {model['tensors']} tensors "
            f"({_bytes(model['dense_bytes'])} dense), {_bytes(model['p_step_payload_bytes'])} "
            f"of ACP-SGD payload on P steps.",
            "",
            "| configuration | payload threshold (P/Q) | buckets (P/Q) | median step ms | "
            "per job | p25-p75 | min-max | backward ms | synchronize ms | other CPU s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in run["configurations"]:
            s = e["step_ms"]
            lines.append(
                f"| {e['label']} | {effective_thresholds(e)} | "
                f"{'/'.join(map(str, per_phase(e, 'buckets')))} | "
                f"**{s['median']:.1f}** | {', '.join(map(str, e['median_step_ms_per_job']))} | "
                f"{s['p25']:.1f}-{s['p75']:.1f} | {s['min']:.1f}-{s['max']:.1f} | "
                f"{e['backward_ms']['median']:.1f} | {e['synchronize_ms']['median']:.1f} | "
                f"{', '.join(map(str, e['other_cpu_seconds']))}{_reruns(e)} |"
            )
        lines += ["", f"Verdict (computed): {verdict(run)}.", ""]
    return "\n".join(lines + [END])


def write_markdown(path, section):
    text = path.read_text() if path.exists() else "# Fusion buffer size: ACP-SGD step time\n\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def _reruns(entry):
    reruns = sum(entry["disturbed_attempts"])
    return f" ({reruns} disturbed, run again)" if reruns else ""


def _bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    (out / "fusion").mkdir(parents=True, exist_ok=True)
    run = sweep(args)
    key = run_key(args)
    runs = write_json(out / "fusion" / "fusion.json", key, run)
    # The run with default settings leads the figure and the section, once there is one.
    main_key = run_key(parse_args([])) if run_key(parse_args([])) in runs else key
    write_figure(out / "fusion" / "fusion.png", runs, main_key)
    write_markdown(out / "fusion.md", results_section(runs, main_key))
    print(f"verdict: {verdict(run)}")


if __name__ == "__main__":
    main()

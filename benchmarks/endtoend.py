"""End to end: step time of every method on an emulated cluster, split into compute,
compression and exposed communication, with the bytes each rank actually sent.

For every link rate an :mod:`emulated cluster <benchmarks.testbed>` of ``--np`` ranks
is built (one network namespace per rank, ``tc tbf`` both ways), and for every model and method
one job runs under mpirun. A job has three phases, every rank in step with the others, so the
cores are shared the same way in each:

1. compute alone: forward, backward and the optimizer step of a plain local optimizer;
2. training with the method: ``--warmup`` steps, then ``--steps`` timed on rank 0 from
   ``zero_grad`` to the end of ``optimizer.step()``; each rank reads its link's transmitted
   bytes from the kernel (``/sys/class/net/*/statistics/tx_bytes`` inside its namespace)
   before and after, so "sent" counts every byte on the wire, headers and Horovod's own
   negotiation included;
3. compression alone: a copy of the method's compressor, with the settings it ended training
   with, compresses, feeds back error and decompresses the last step's gradients, every
   collective answered by the rank's own payload.

Exposed communication is the median step minus the medians of phases 1 and 3: what the step
waited for the network beyond the work it had to do anyway. A controller's own work (L-GreCo
accumulating gradients on rank 0 between decisions, GraVAC measuring the gain of its candidate
factor) is not in phase 3, so it shows up there too.

Methods (the rank of the low-rank methods is ``--rank``):

* S-SGD: ``hvd.DistributedOptimizer`` with no compression and Horovod's default fusion;
* FP16, PowerSGD, ACP-SGD, ScaleCom: ``compression=`` of stock ``hvd.DistributedOptimizer``
  (single all-reduce payloads such as ACP-SGD's ride Horovod's own fused all-reduce);
* ACP-SGD+fusion, L-GreCo, L-GreCo/4, GraVAC: ``hvd_compress.DistributedOptimizer`` with its
  scaled fusion (``ScaledFusion()``, 25 MiB dense) and ``HOROVOD_FUSION_THRESHOLD=0``; the
  controllers wrap ACP-SGD. L-GreCo runs the default schedule's way (decisions every 1000
  steps, ``apply_delay="auto"``) with its first decision submitted at step 3, so it computes
  and takes effect during the timed steps; L-GreCo/4 decides every 4 steps from step 3 on (a
  short schedule, which exposes a decision's cost). GraVAC has a window of 2 steps, so it has
  settled on a factor before the timed steps: this measures the speed of what it chose, not
  whether it chose well.

A probe job per rate times Horovod's all-reduce and all-gather of 4 KiB to 16 MiB; the
projection (``python -m benchmarks projection``) fits its alpha-beta model to it.
Writes ``<out>/benchmarks/endtoend.json``, ``endtoend.png`` and the "End to end" page
beside them. Each job is bounded (``--job-timeout``); the namespaces are removed
at the end, also on errors and Ctrl-C. Finished jobs are kept in
``<out>/benchmarks/endtoend.progress.json`` until the sweep is complete: rerunning the same
command after a cut-off resumes with the first missing job.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.methods import REGISTERED
from benchmarks.harness.jobs import (
    Progress,
    add_timing_options,
    benchmark_argv,
    checkout_pythonpath,
    cluster_job,
    command_line,
    names_from,
    options_argv,
    undisturbed,
)
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, notes_lines, panels, save_figure, save_record, stored, write_section
from benchmarks.harness.stats import summarise, timed_step
from hvd_compress.comm.simulated import exchange_alone

RESULT_PREFIX = "ENDTOEND_RESULT "
SECTION = "End to end"
PROBE_BYTES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
COMPUTE_STEPS, CODEC_STEPS = 6, 6  # even: ACP-SGD's P and Q steps weigh equally
UNTIMED_STEPS = 2  # before each timed phase: first-touch allocations, lazy initialisation
METHODS = ["S-SGD", "FP16", "PowerSGD", "ACP-SGD", "ACP-SGD+fusion", "L-GreCo", "L-GreCo/4", "GraVAC", "ScaleCom"]
WRAPPED = {"ACP-SGD+fusion", "L-GreCo", "L-GreCo/4", "GraVAC"}  # hvd_compress.DistributedOptimizer + fusion
# Targets at 1 Gbit/s: (method, baseline, least speed-up).
TARGETS = [("L-GreCo", "S-SGD", 2.5), ("L-GreCo", "PowerSGD", 1.2)]


# ----- workloads ------------------------------------------------------------------------------
def charlm(batch_generator):
    """The fusion benchmark's character transformer: d_model 256, 24 layers, 19.1 M parameters,
    one 64-token sequence per rank and step."""
    from examples.workloads.charlm import CharTransformer, batches, cross_entropy, load_corpus

    model = CharTransformer(d_model=256, layers=24, heads=4, context=64)
    train_ids, _ = load_corpus(max_chars=400_000)
    return model, batches(train_ids, 1, 64, batch_generator), cross_entropy


def cnn(batch_generator):
    """SmallVGG on synthetic 32 x 32 images, 16 per rank and step."""
    from torch.nn import functional as F

    from examples.workloads.vgg import SmallVGG, synthetic_batches

    return SmallVGG(), synthetic_batches(16, batch_generator), lambda model, x, y: F.cross_entropy(model(x), y)


WORKLOADS = {"charlm": charlm, "cnn": cnn}


def build_compression(method, rank, named):
    """The compressor of ``method`` for the parameters ``named`` (None: plain Horovod)."""
    import hvd_compress as hc

    if method == "S-SGD":
        return None
    if method in ("L-GreCo", "L-GreCo/4"):
        every = 4 if method == "L-GreCo/4" else 1000
        return hc.LGreCo(hc.ACPSGD(named, rank=rank), warmup_steps=3, decide_every=every)
    if method == "GraVAC":
        return hc.GraVAC(hc.ACPSGD(named, rank=rank), window=2)
    if method not in METHODS:
        raise ValueError(f"endtoend: unknown method {method!r}; known: {', '.join(METHODS)}")
    name = REGISTERED[method.removesuffix("+fusion")]
    settings = {"rank": rank} if "rank" in hc.COMPRESSORS[name].defaults else {}  # low-rank: --rank
    return hc.COMPRESSORS[name].build(named, **settings)


# ----- one rank of one job --------------------------------------------------------------------
def worker(args):
    import horovod.torch as hvd

    import hvd_compress

    torch.set_num_threads(1)  # W ranks share the machine's cores
    hvd.init()
    torch.manual_seed(0)
    model, data, loss_of = WORKLOADS[args.model](torch.Generator().manual_seed(hvd.rank()))

    def forward_backward(optimizer):
        x, y = next(data)
        optimizer.zero_grad()
        loss_of(model, x, y).backward()

    local = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compute = []
    for _ in range(UNTIMED_STEPS + COMPUTE_STEPS):
        started = time.perf_counter()
        forward_backward(local)
        local.step()
        compute.append(time.perf_counter() - started)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    compression = build_compression(args.method, args.rank, list(model.named_parameters()))
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.method in WRAPPED:
        optimizer = hvd_compress.DistributedOptimizer(inner, model.named_parameters(), compression)
    else:
        optimizer = hvd.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(), compression=compression or hvd.Compression.none
        )
    times = {"step": [], "backward": [], "synchronize": []}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sent_before = transmitted_bytes()
            traffic_before = traffic_snapshot(compression)
        timed = timed_step(optimizer, lambda: forward_backward(optimizer))
        if step >= args.warmup:
            for part, seconds in timed.items():
                times[part].append(seconds)
    sent_per_step = (transmitted_bytes() - sent_before) / args.steps
    counted = traffic_per_step(compression, traffic_before, args.steps)
    sent = hvd.allgather_object(sent_per_step)

    codec = codec_seconds(compression, model) if compression is not None else [0.0]
    if hvd.rank() == 0:
        print(
            RESULT_PREFIX
            + json.dumps(
                {
                    "seconds": times,
                    "compute_seconds": compute[UNTIMED_STEPS:],
                    "codec_seconds": codec,
                    "sent_bytes_per_step_per_rank": sent,
                    "traffic": counted,
                    "settings": settings_of(compression),
                }
            ),
            flush=True,
        )


def transmitted_bytes():
    """Bytes this rank's network namespace sent on its links (all but loopback)."""
    root = Path("/sys/class/net")
    return sum(int((root / link / "statistics" / "tx_bytes").read_text()) for link in os.listdir(root) if link != "lo")


def traffic_snapshot(compression):
    if compression is None:
        return None
    traffic = compression.traffic
    return {
        "dense": traffic.dense_wire_bytes,
        "payload": traffic.payload_bytes,
        "wire": traffic.wire_bytes,
        "by_collective": copy.deepcopy(traffic.by_collective),
    }


def traffic_per_step(compression, before, steps):
    """Bytes handed to collectives per step during the timed steps, by collective: what the
    projection scales to other world sizes and link rates."""
    if compression is None:
        return None
    after = traffic_snapshot(compression)
    by_collective = {}
    for name, (calls, nbytes) in after["by_collective"].items():
        calls_before, bytes_before = before["by_collective"].get(name, (0, 0))
        by_collective[name] = {
            "calls": (calls - calls_before) / steps,
            "payload_bytes": (nbytes - bytes_before) / steps,
        }
    return {
        "payload_bytes": (after["payload"] - before["payload"]) / steps,
        "compression_ratio": (after["dense"] - before["dense"]) / max(1, after["wire"] - before["wire"]),
        "by_collective": by_collective,
    }


def settings_of(compression):
    """The compression factor or per-layer settings a controller ended with (None otherwise)."""
    if compression is None or not hasattr(compression, "inner"):
        return None
    settings = compression.inner.settings()
    values = sorted({str(v) for v in settings.values()})
    return {"cf": getattr(compression, "cf", None), "distinct_settings": values}


def codec_seconds(compression, model):
    """Seconds per step of compressing, error feedback and decompressing the last gradients,
    with a copy of the method's compressor (a controller's inner one, at its settings)."""
    import horovod.torch as hvd

    codec = copy.deepcopy(getattr(compression, "inner", compression))
    codec.bind_world(0, 1)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    hvd.allreduce(torch.zeros(1), name="endtoend.codec_phase")  # every rank starts it together
    seconds = []
    for _ in range(UNTIMED_STEPS + CODEC_STEPS):
        started = time.perf_counter()
        for name, grad in grads.items():
            exchange_alone(codec, name, grad)
        codec.end_step()
        seconds.append(time.perf_counter() - started)
    return seconds[UNTIMED_STEPS:]


def probe(args):
    """Rank 0 prints the median seconds of Horovod's all-reduce and all-gather per size."""
    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    timings = {"allreduce": {}, "allgather": {}}
    for nbytes in PROBE_BYTES:
        tensor = torch.ones(nbytes // 4)
        for collective, call in (("allreduce", hvd.allreduce), ("allgather", hvd.allgather)):
            seconds = []
            for repeat in range(6):
                hvd.allreduce(torch.zeros(1), name="probe.barrier")
                started = time.perf_counter()
                call(tensor, name=f"probe.{collective}.{nbytes}")
                seconds.append(time.perf_counter() - started)
            timings[collective][str(nbytes)] = statistics.median(seconds[1:])
    if hvd.rank() == 0:
        print(RESULT_PREFIX + json.dumps(timings), flush=True)


# ----- the sweep ------------------------------------------------------------------------------
def run_job(cluster, args, flags, env=None):
    argv = benchmark_argv("endtoend", *flags)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_pythonpath(), **(env or {})}
    return cluster_job(cluster, argv, env, args.job_timeout, RESULT_PREFIX)


def method_job(cluster, args, model, method, progress):
    flags = [
        "--worker",
        *options_argv(model=model, method=method, rank=args.rank, warmup=args.warmup, steps=args.steps),
    ]
    # Our buckets are the only fusion for the wrapper; stock runs keep Horovod's.
    env = {"HOROVOD_FUSION_THRESHOLD": "0"} if method in WRAPPED else None
    job = undisturbed(
        lambda: run_job(cluster, args, flags, env),
        args.max_other_cpu,
        lambda result: job_line(cluster.rate_gbit, model, method, result),
        show=progress.line,
    )
    return summarise_job(job)


def summarise_job(job):
    step = statistics.median(job["seconds"]["step"])
    compute = statistics.median(job["compute_seconds"])
    codec = statistics.median(job["codec_seconds"])
    return {
        "step_ms": summarise(job["seconds"]["step"]),
        "backward_ms": summarise(job["seconds"]["backward"]),
        "synchronize_ms": summarise(job["seconds"]["synchronize"]),
        "compute_ms": 1e3 * compute,
        "codec_ms": 1e3 * codec,
        "exposed_comm_ms": max(0.0, 1e3 * (step - compute - codec)),
        "sent_bytes_per_step": statistics.mean(job["sent_bytes_per_step_per_rank"]),
        "traffic": job["traffic"],
        "settings": job["settings"],
        "wall_seconds": round(job["wall_seconds"], 1),
        "other_cpu_seconds": round(job["other_cpu_seconds"], 1),
        "disturbed_attempts": job["disturbed_attempts"],
        "step_ms_each": [round(1e3 * s, 1) for s in job["seconds"]["step"]],
    }


def job_line(rate, model, method, job):
    step = statistics.median(job["seconds"]["step"])
    sent = statistics.mean(job["sent_bytes_per_step_per_rank"])
    return (
        f"{rate:g} Gbit/s {model:7} {method:17} median step {1e3 * step:7.1f} ms, compute "
        f"{1e3 * statistics.median(job['compute_seconds']):6.1f} ms, codec "
        f"{1e3 * statistics.median(job['codec_seconds']):6.1f} ms, sent {sent / 2**20:7.2f} MiB/step, "
        f"job {job['wall_seconds']:.0f} s, other CPU {job['other_cpu_seconds']:.1f} s"
    )


def model_summary(model):
    with torch.device("meta"):
        built = WORKLOADS[model](torch.Generator())[0]
    return {"parameters": sum(p.numel() for p in built.parameters()), "tensors": len(list(built.parameters()))}


def sweep(args, progress_path):
    """Runs every job not yet in ``progress_path`` (a sweep cut off resumes job by job; jobs
    from a sweep with other settings are not reused) and saves it there after each job."""
    from benchmarks.testbed import emulated_cluster

    settings = {"np": args.np, "rank": args.rank, "warmup": args.warmup, "steps": args.steps}
    results = json.loads(progress_path.read_text()) if progress_path.exists() else {}
    if {key: results.get(key) for key in settings} != settings:
        results = {**settings, "load_average_before": os.getloadavg(), "minutes": 0.0, "rates": {}}
    results.update(
        command=command_line("endtoend", dropped=()),
        machine=machine(),
        models={model: model_summary(model) for model in args.models},
    )
    started, minutes_before = time.perf_counter(), results["minutes"]

    def save():
        results["minutes"] = round(minutes_before + (time.perf_counter() - started) / 60, 1)
        save_record(progress_path, results)

    def wanted_at(rate):
        entry = results["rates"].get(f"{rate:g}", {})
        return [
            (model, method)
            for model in args.models
            for method in args.methods
            if method not in entry.get("models", {}).get(model, {})
        ]

    progress = Progress(sum(len(wanted_at(rate)) for rate in args.rates), "endtoend")
    for rate in args.rates:
        entry = results["rates"].get(f"{rate:g}", {})
        wanted = wanted_at(rate)
        if not wanted:
            continue
        with emulated_cluster(args.np, rate) as cluster:
            if "probe" not in entry:
                probed = run_job(cluster, args, ["--probe"])
                entry = results["rates"][f"{rate:g}"] = {
                    "testbed": cluster.describe(),
                    "probe": {collective: probed[collective] for collective in ("allreduce", "allgather")},
                    "models": {},
                }
                save()
            for model, method in wanted:
                progress.starting(f"{rate:g} Gbit/s {model} {method}")
                entry["models"].setdefault(model, {})[method] = method_job(cluster, args, model, method, progress)
                progress.finished()
                save()
    # In the order asked for, whichever sweep measured them.
    results["rates"] = {f"{rate:g}": results["rates"][f"{rate:g}"] for rate in args.rates}
    results["load_average_after"] = os.getloadavg()
    results["targets"] = targets(results)
    return results


def targets(results):
    rows = []
    rate = results["rates"].get("1")
    for model, methods in (rate or {}).get("models", {}).items():
        for method, baseline, least in TARGETS:
            if method in methods and baseline in methods:
                speedup = methods[baseline]["step_ms"]["median"] / methods[method]["step_ms"]["median"]
                rows.append(
                    {
                        "target": f"{method} vs {baseline} at 1 Gbit/s ({model})",
                        "value": speedup,
                        "limit": f">= {least}",
                        "met": speedup >= least,
                    }
                )
    return rows


# ----- outputs --------------------------------------------------------------------------------
def markdown(results, figure):
    m = results["machine"]
    lines = [
        f"Command: `{results['command']}` ({results['minutes']} min)",
        "",
        f"Machine: {describe_machine(m)} Load average before/after: "
        f"{', '.join(f'{v:.2f}' for v in results['load_average_before'])} / "
        f"{', '.join(f'{v:.2f}' for v in results['load_average_after'])}.",
        "",
        "Testbed: "
        + "; ".join(f"at {rate} Gbit/s, {entry['testbed']}" for rate, entry in results["rates"].items())
        + ". "
        f"{results['np']} ranks, one torch thread each; "
        f"{results['warmup']} warm-up and {results['steps']} timed steps per job; low-rank "
        f"methods at rank {results['rank']}; how each method is run, and what the columns "
        "mean, in `benchmarks/endtoend.py`'s docstring. *Exposed comm* is the "
        "median step less compute and compression, so it also holds the controllers' own "
        "work (L-GreCo's gradient accumulation on rank 0, GraVAC's gain measurement). "
        "*Sent*: bytes each rank's link transmitted, read from the kernel (headers "
        "included); *ratio*: float32 ring all-reduce bytes over the bytes the compressor "
        "handed to collectives.",
        "",
        "Models: "
        + "; ".join(
            f"{model} ({s['parameters'] / 1e6:.1f} M parameters in "
            f"{s['tensors']} tensors, {4 * s['parameters'] / 2**20:.1f} MiB "
            "of float32 gradients)"
            for model, s in results["models"].items()
        )
        + ".",
        "",
        f"![step time split]({figure})",
        "",
    ]
    for rate, entry in results["rates"].items():
        for model, methods in entry["models"].items():
            baseline = methods.get("S-SGD", {}).get("step_ms", {}).get("median")
            lines += [
                f"**{model}, {rate} Gbit/s**",
                "",
                "| method | median step ms (p25-p75) | vs S-SGD | compute ms | compression ms | "
                "exposed comm ms | sent MiB/step/rank | ratio (counted) | settings |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for method, e in methods.items():
                step = e["step_ms"]
                ratio = f"{e['traffic']['compression_ratio']:.1f}x" if e["traffic"] else "1x"
                versus = f"{baseline / step['median']:.2f}x" if baseline else "-"  # S-SGD not run
                lines.append(
                    f"| {method} | **{step['median']:.1f}** ({step['p25']:.1f}-{step['p75']:.1f}) | "
                    f"{versus} | {e['compute_ms']:.1f} | {e['codec_ms']:.1f} | "
                    f"{e['exposed_comm_ms']:.1f} | {e['sent_bytes_per_step'] / 2**20:.2f} | {ratio} | "
                    f"{describe_settings(e['settings'])}{rerun_note(e)} |"
                )
            lines.append("")
    lines += ["Targets:", "", "| target | value | limit | met |", "|---|---|---|---|"]
    lines += [
        f"| {row['target']} | {row['value']:.2f} | {row['limit']} | {'yes' if row['met'] else 'no'} |"
        for row in results["targets"]
    ]
    lines += notes_lines(results)
    return "\n".join(lines) + "\n"


def describe_settings(settings):
    if settings is None:
        return ""
    chosen = f"cf {settings['cf']:.0f}, " if settings.get("cf") else ""
    return chosen + "settings " + "/".join(settings["distinct_settings"])


def rerun_note(entry):
    return f" (run again {entry['disturbed_attempts']}x: other load)" if entry["disturbed_attempts"] else ""


def draw_figure(results, path):
    """Per model (rows) and rate (columns): each method's step split into its three parts."""
    models = list(next(iter(results["rates"].values()))["models"])
    _, figure, axes = panels(len(results["rates"]), 4.2, 3.4, rows=len(models))
    parts = [
        ("compute_ms", "compute", "#4c72b0"),
        ("codec_ms", "compression", "#dd8452"),
        ("exposed_comm_ms", "exposed communication", "#c44e52"),
    ]
    cells = [(model, rate) for model in models for rate in results["rates"]]
    for axis, (model, rate) in zip(axes, cells):
        methods = results["rates"][rate]["models"][model]
        labels = list(methods)
        bottom = [0.0] * len(labels)
        for key, label, colour in parts:
            values = [methods[m][key] for m in labels]
            axis.bar(range(len(labels)), values, bottom=bottom, color=colour, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        axis.plot(
            range(len(labels)),
            [methods[m]["step_ms"]["median"] for m in labels],
            "k_",
            markersize=14,
            label="median step",
        )
        axis.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        axis.set_title(f"{model}, {rate} Gbit/s", fontsize=9)
        axis.set_ylabel("ms per step", fontsize=8)
    axes[0].legend(fontsize=6)
    save_figure(figure, path, dpi="figure")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks endtoend", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=names_from(list(WORKLOADS)), default=list(WORKLOADS))
    parser.add_argument(
        "--rates",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.5, 1.0, 2.5],
        help="link rates, Gbit/s",
    )
    parser.add_argument("--methods", type=names_from(METHODS), default=METHODS)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rank", type=int, default=4, help="rank of the low-rank methods")
    parser.add_argument("--job-timeout", type=int, default=240)
    add_timing_options(parser, 8, 12)
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def render(out: Path) -> None:
    """Rewrites the page and figure from the stored JSON."""
    results = stored(out, "endtoend")
    draw_figure(results, out / "benchmarks" / "endtoend.png")
    write_section(out, SECTION, markdown(results, "endtoend.png"))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    if args.probe:
        return probe(args)
    out = args.out / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "endtoend.progress.json"
    results = sweep(args, progress)
    save_record(out / "endtoend.json", results)
    progress.unlink()
    render(args.out)
    for row in results["targets"]:
        print(f"{'met' if row['met'] else 'NOT met'}: {row['target']} = {row['value']:.2f} ({row['limit']})")

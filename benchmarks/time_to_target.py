"""Time to target on the emulated cluster: each method's median steps to the uncompressed run's
quality (from ``time_to_quality``) times its mean step time on an emulated cluster, at the two
link settings chosen by r, the ratio of communication to compute.

r is the ring bound of the uncompressed all-reduce, 2(W-1)/W x M / B, over a step's compute,
with B the all-reduce bandwidth measured at the gradient's own size M: so r is the measured time
of one fused all-reduce of the whole fp32 gradient over the measured compute of a step (forward,
backward and AdamW on every rank at once, as in training), both from a probe job on the testbed.
The rate for a setting: probes at two tbf rates fit T(R) = alpha + c / R to the all-reduce time;
the rate is c / (r x compute - alpha); a probe there, and again through the two probes nearest
the wanted r, until one measures r within 10% (at most 6 probes): the methods run at that
probe's rate, and its r is the one reported. Where alpha alone (latency and the software's own
cost) exceeds r x compute, the setting is out of the testbed's reach, and the section says so.

A method's step time: one job per method and setting, on the emulated cluster, running the
method's ``time_to_quality`` job (``build_training`` of its seed-0 spec, with the schedule of its
longest run) at the peak learning rate: ``--warmup`` untimed steps, more where a schedule inside
the method begins later (ScaleCom's dense warm-up, L-GreCo's first decision, GraVAC's first window:
a tenth of the run), then ``--steps`` steps, each timed on rank 0 from ``zero_grad`` to the end of
``step()``. The mean, not the median: DiLoCo's outer step comes once every H steps, and its cost
belongs in the step time (``--steps`` is a multiple of every H run). ``--repeats`` jobs per
method, one round of every method before the next: its step time is the median of the jobs'
means (the means of one method's jobs differed by up to a third). A job during which other
processes took more than ``--max-other-cpu`` of the cores runs again (``jobs.undisturbed``).

Time to target: median steps to target (``time_to_quality.score``) x mean step time; methods
whose median run did not reach the target are listed without one.

advise: at each setting, ``python -m hvd_compress.advise --model examples.models:charlm_ttq`` runs
on the same cluster, as a user runs it (its steps-to-target factors from the package's evidence,
``python -m benchmarks evidence``). Its pick is judged by the measured times to target: within
10% of the fastest, and at r < 1 no more than 5% slower. A pick without a
measured time to target is said to be not validated. The CPU codec's share of a
step is far larger here than on a GPU (see "Time to quality"), so these times are biased against
compression.

``--direct``: at each setting, uncompressed, FP16, the two compressing methods soonest to target
and advise's pick train end to end on the same cluster (seed 0; ``--direct RUNS``: that many jobs
each, one round of every method before the next, their median kept), for the first
length of the evaluation schedule at which their seed 0 reached the target, from the same
``build_training`` and warmup-stable-decay schedule: the sum of their steps' seconds is set
against that length x the method's mean step, and their final loss against the one measured
without the network (the target: the decomposition within 10% of the direct runs).

Resumes job by job from ``<out>/benchmarks/time_to_target.json``; writes the "Time to target"
page, ``<out>/benchmarks/time-to-target.md``. At other ranks than the time-to-quality runs'
(``--np 8``): ``time_to_target_np8.json`` and the page "Time to target at 8 ranks". ``--quick``:
2 ranks, the tiny LM, r = 3 only, a few steps, from a ``time_to_quality --quick`` JSON: a smoke
test.
"""

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from benchmarks import quality
from benchmarks import time_to_quality as ttq
from benchmarks.evidence import advise_name
from hvd_compress.advise.local import LOCAL_KINDS
from benchmarks.harness.jobs import (
    Progress,
    add_job_options,
    add_timing_options,
    benchmark_argv,
    checkout_pythonpath,
    cluster_job,
    undisturbed,
)
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import (
    method_bars,
    notes_lines,
    panels,
    resumed,
    save_figure,
    save_record,
    stored,
    write_section,
)
from examples.workloads import charlm
from hvd_compress.advise.advice import PROJECTED_CONTROLLERS
from hvd_compress.advise.evidence import factor_text, shipped_evidence, steps_for

RESULT_PREFIX = "TTT_RESULT "
SECTION = "Time to target"
PROBE_RATES_GBIT = (0.05, 1.0)  # far apart, so that the fit separates latency from bandwidth
PROBE_REPEATS = 12
RATIO_TOLERANCE, MAX_PROBES = 0.1, 6  # a setting's measured r within 10% of the wanted one
BETWEEN_SITES = 10.0  # from this r on, a setting stands for links between sites: local methods' targets
# Two probes at rates closer than this share differ in time by noise alone: no secant through them.
DISTINCT_RATES = 0.05
SLOWEST_RATE_GBIT, FASTEST_RATE_GBIT = 0.001, 40.0  # what tbf is asked for at most


# ----- one rank of a job ------------------------------------------------------------------------
def probe(spec: Dict[str, Any]) -> None:
    """Rank 0 prints the median seconds of a step's compute (every rank at once) and of one
    all-reduce of the whole gradient's bytes."""
    import horovod.torch as hvd

    lm = spec["lm"]
    model = charlm.CharTransformer(**lm["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=ttq.PEAK_LR)
    train_ids, _ = charlm.load_corpus(lm["max_chars"])
    data = charlm.batches(train_ids, lm["batch_size"], model.context, torch.Generator().manual_seed(hvd.rank()))
    compute = []
    for _ in range(spec["warmup"] + PROBE_REPEATS):
        hvd.allreduce(torch.zeros(1), name="time_to_target.barrier")  # every rank computes at once
        started = time.perf_counter()
        x, y = next(data)
        optimizer.zero_grad()
        charlm.cross_entropy(model, x, y).backward()
        optimizer.step()
        compute.append(time.perf_counter() - started)
    gradient = torch.ones(sum(p.numel() for p in model.parameters()))
    allreduce = []
    for _ in range(spec["warmup"] + PROBE_REPEATS):
        hvd.allreduce(torch.zeros(1), name="time_to_target.barrier")
        started = time.perf_counter()
        hvd.allreduce(gradient, name="time_to_target.gradient")
        allreduce.append(time.perf_counter() - started)
    if hvd.rank() == 0:
        print(
            RESULT_PREFIX
            + json.dumps(
                {
                    "compute_s": statistics.median(compute[spec["warmup"] :]),
                    "allreduce_s": statistics.median(allreduce[spec["warmup"] :]),
                    "gradient_bytes": 4 * gradient.numel(),
                }
            ),
            flush=True,
        )


def time_steps(spec: Dict[str, Any]) -> None:
    """Rank 0 prints the seconds of each timed step of the method's training run."""
    import horovod.torch as hvd

    run = ttq.build_training(spec, spec["schedule_steps"])
    seconds = []
    for _ in range(spec["untimed"] + spec["steps"]):
        started = time.perf_counter()
        ttq.take_step(run, ttq.PEAK_LR)
        seconds.append(time.perf_counter() - started)
    if hvd.rank() == 0:
        print(RESULT_PREFIX + json.dumps({"step_s": seconds[spec["untimed"] :]}), flush=True)


def train_directly(spec: Dict[str, Any]) -> None:
    """Rank 0 prints the seconds of the steps of one whole run of ``spec["length"]`` steps (its
    warm-up, stable phase and cool-down, as ``time_to_quality`` branches it at that length) and
    the validation loss at its end."""
    import horovod.torch as hvd

    length = spec["length"]
    run = ttq.build_training(spec, max(spec["lengths"]))  # as time_to_quality builds it
    seconds = 0.0
    for step in range(length):
        started = time.perf_counter()
        ttq.take_step(run, ttq.PEAK_LR * ttq.lr_factor(step, length, spec["warmup"]))
        seconds += time.perf_counter() - started
    if hvd.rank() == 0:
        print(
            RESULT_PREFIX + json.dumps({"train_s": seconds, "loss": ttq.validation_loss(run, spec["eval_windows"])}),
            flush=True,
        )


def work(spec: Dict[str, Any]) -> None:
    import horovod.torch as hvd

    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()
    {"probe": probe, "steps": time_steps, "direct": train_directly}[spec["kind"]](spec)


# ----- the driver -------------------------------------------------------------------------------
def fitted_rate(probes: List[Dict[str, Any]], ratio: float) -> Tuple[Optional[float], float, float]:
    """(the tbf rate in Gbit/s at which the all-reduce takes ``ratio`` x compute, or None where
    out of reach; alpha; c) from probes at two or more rates, T(R) = alpha + c / R fitted by least
    squares in 1 / R. ``compute`` is the probes' median."""
    xs = [1 / p["rate_gbit"] for p in probes]
    ys = [p["allreduce_s"] for p in probes]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    c = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    alpha = mean_y - c * mean_x
    wanted = ratio * statistics.median(p["compute_s"] for p in probes)
    if c <= 0 or wanted <= alpha:
        return None, alpha, c
    return min(FASTEST_RATE_GBIT, max(SLOWEST_RATE_GBIT, c / (wanted - alpha))), alpha, c


def next_probe(entry: Dict[str, Any], ratio: float) -> Optional[float]:
    """The rate to probe next for ``ratio``, or None once ``entry`` is settled: then it holds
    ``rate_gbit`` (None where r is out of reach) and ``at_rate``, the probe priced. The secant
    runs through the probe nearest the wanted r and the next nearest at a distinct rate, until one
    lands within ``RATIO_TOLERANCE`` or ``MAX_PROBES`` have run."""
    nearest = secant_pair(entry["probes"], ratio)
    rate, alpha, c = fitted_rate(nearest, ratio)
    entry.update(alpha_s=alpha, c_s_gbit=c)
    more = len(entry["probes"]) < MAX_PROBES
    if abs(ratio_of(nearest[0]) / ratio - 1) <= RATIO_TOLERANCE or (rate is not None and not more):
        entry.update(rate_gbit=nearest[0]["rate_gbit"], at_rate=nearest[0])
        return None
    if c <= 0 and more:
        # A slower link cannot make the all-reduce faster: load, not the link, set this pair.
        # A tenth of the slower rate, where the wire outweighs the noise.
        return max(SLOWEST_RATE_GBIT, min(p["rate_gbit"] for p in nearest) / 10)
    if rate is None:
        entry["rate_gbit"] = None
    return rate


def secant_pair(probes: List[Dict[str, Any]], ratio: float) -> List[Dict[str, Any]]:
    """The probe whose r is nearest ``ratio``, and the next nearest at a rate at least
    ``DISTINCT_RATES`` away from its. A step's compute varies by up to a quarter between probe
    jobs, so a probe at the fitted rate can miss r by more than the tolerance and the next fit
    land on nearly the same rate; a secant through those two would read their noise as the link."""
    nearest = sorted(probes, key=lambda p: abs(math.log(ratio_of(p) / ratio)))
    first = nearest[0]
    apart = next(p for p in nearest[1:] if abs(p["rate_gbit"] / first["rate_gbit"] - 1) >= DISTINCT_RATES)
    return [first, apart]


def ratio_of(probe_result: Dict[str, Any]) -> float:
    return probe_result["allreduce_s"] / probe_result["compute_s"]


def untimed_steps(spec: Dict[str, Any], schedule_steps: int, warmup: int) -> int:
    """Steps before timing: ``warmup``, or past the first tenth of the run where a schedule inside
    the method starts there (ScaleCom's dense warm-up, L-GreCo's first decision, GraVAC's window)."""
    controller = spec["controller"] or {}
    late = controller.get("warmup") or controller.get("kind") in ("lgreco", "gravac")
    return max(warmup, schedule_steps // 10 + 10) if late else warmup


# The drop-in wrapper's overlapped path (hvd_compress.DistributedOptimizer) priced for
# the methods "Time to target" found soonest at r = 3: ACP-SGD rank 16 in its first pass, L-GreCo
# over Top-K 10% since. Their steps to target are the stock path's: the same compressor on the
# same gradients (not bit for bit: the wrapper fuses payloads itself, so a sum may round otherwise).
# The two-hop quantized all-reduce too: stock Horovod fuses no all-to-all, so its first hop goes
# one message per gradient there, where the wrapper fuses it.
WRAPPED = (
    "ACP-SGD rank 16",
    "L-GreCo (Top-K) density 0.1",
    "QuantizedAllReduce bits 8",
    "QuantizedAllReduce bits 4",
)
QUICK_WRAPPED, WRAPPER = ("FP16",), " (drop-in wrapper)"


def priced_methods(steps: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """label -> {"spec": seed 0's spec, "score"}, for every method of the time-to-quality results;
    and the drop-in wrapper's path of each of ``WRAPPED`` (``QUICK_WRAPPED`` in a quick run),
    with "stock": the method whose steps to target it takes."""
    goal = ttq.target_of(steps, steps["plan"]["base_seeds"], steps["plan"]["knee_gain"])
    if goal is None:
        raise SystemExit(
            "time_to_target: the time-to-quality results have no target yet (run python -m "
            "benchmarks time_to_quality first)"
        )
    methods = {}
    for label in ttq.labels_in_order(steps):
        spec = next(e["spec"] for e in steps["points"].values() if e["spec"]["label"] == label)
        methods[label] = {"spec": spec, "score": ttq.score(ttq.records_of(steps, label), goal["target"])}
    for wrapped in QUICK_WRAPPED if steps["plan"]["quick"] else WRAPPED:
        if wrapped in methods:
            stock = methods[wrapped]
            label = wrapped + WRAPPER
            methods[label] = dict(stock, spec=dict(stock["spec"], label=label, integration="wrapper"), stock=wrapped)
    return methods


def chosen_methods(methods: Dict[str, Dict[str, Any]], labels: Optional[List[str]]) -> Dict[str, Dict[str, Any]]:
    """``methods`` narrowed to ``labels`` (``--methods``), uncompressed always kept: it is the
    reference every row is set against. Raises SystemExit naming ``--methods`` and the known
    labels for one that is not a priced method."""
    if labels is None:
        return methods
    unknown = [label for label in labels if label not in methods]
    if unknown:
        raise SystemExit(f"time_to_target: --methods {unknown} are not priced methods; known: {sorted(methods)}")
    return {label: m for label, m in methods.items() if label == ttq.UNCOMPRESSED or label in labels}


def stock_label(methods: Dict[str, Dict[str, Any]], label: str) -> str:
    """The label whose time-to-quality points ``label`` stands on: itself, or the wrapped method."""
    return methods[label].get("stock", label)


def run(args) -> Dict[str, Any]:
    from benchmarks.testbed import emulated_cluster

    steps = json.loads(args.ttq.read_text())
    path = args.out / "benchmarks" / f"{record_name(args.np, steps)}.json"
    results = resumed(path)
    # The first run's timing parameters describe the page; a setting timed otherwise keeps its own.
    timing = dict(np=args.np, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    command = quality.command_line("time_to_target")
    for key, value in dict(timing, command=command).items():
        results.setdefault(key, value)
    results["machine"] = machine()
    results.setdefault("settings", {})
    methods = chosen_methods(priced_methods(steps), args.methods)
    progress = Progress(0, "time_to_target")

    def job(cluster, spec, what):
        argv = benchmark_argv("time_to_target", "--worker", json.dumps(spec))
        return undisturbed(
            lambda: cluster_job(cluster, argv, job_environment(spec), args.job_timeout, RESULT_PREFIX),
            args.max_other_cpu,
            lambda r: f"{what}: {json.dumps(summary_of(r))}",
            show=progress.line,
        )

    def probed(rate):
        with emulated_cluster(args.np, rate) as cluster:
            result = job(cluster, {"kind": "probe", "lm": args.lm, "warmup": 2}, f"probe at {rate:g} Gbit/s")
        return dict(result, rate_gbit=rate)

    for ratio in args.ratios:
        entry = results["settings"].setdefault(f"{ratio:g}", {"ratio_wanted": ratio, "probes": [], "methods": {}})
        if any(results[key] != value for key, value in timing.items()):
            entry["timing"] = dict(timing, command=command)
        for rate in PROBE_RATES_GBIT[len(entry["probes"]) :]:
            entry["probes"].append(probed(rate))
            save_record(path, results)
        while "rate_gbit" not in entry:
            rate = next_probe(entry, ratio)
            if rate is not None:
                entry["probes"].append(probed(rate))
            save_record(path, results)
        if entry["rate_gbit"] is None:
            progress.line(f"r = {ratio:g}: out of the testbed's reach (latency floor {1e3 * entry['alpha_s']:.1f} ms)")
            continue
        # Job by job, each method's first job before any method's second.
        wanted = [
            label
            for repeat in range(args.repeats)
            for label, m in methods.items()
            if jobs_of(entry["methods"].get(label)) <= repeat
            and (m["score"]["median"] is not None or label == ttq.UNCOMPRESSED)
        ]
        advise_due = "advise" not in entry or bool(stale_factors(entry["advise"]))
        projections = entry.setdefault("projected", {})
        if advise_due:  # on the factors advise reruns for
            projections.clear()
        worlds = [world for world in args.project_to if str(world) not in projections]
        if wanted or advise_due or worlds:
            progress.add(len(wanted) + advise_due + len(worlds))
            with emulated_cluster(args.np, entry["rate_gbit"]) as cluster:
                if advise_due:
                    progress.starting(f"r = {ratio:g}, advise")
                    entry["advise"] = advised(cluster, args)
                    progress.finished(f"r = {ratio:g}, advise: {entry['advise']['recommendation']}")
                    save_record(path, results)
                for world in worlds:
                    progress.starting(f"r = {ratio:g}, advise --world {world}")
                    projections[str(world)] = advised(cluster, args, world)
                    progress.finished(f"r = {ratio:g}, at {world} ranks: {projections[str(world)]['recommendation']}")
                    save_record(path, results)
                for label in wanted:
                    spec = methods[label]["spec"]
                    schedule = max(spec["lengths"])
                    progress.starting(f"r = {ratio:g}, {label}")
                    job_spec = dict(
                        spec,
                        kind="steps",
                        lm=args.lm,
                        schedule_steps=schedule,
                        steps=args.steps,
                        untimed=untimed_steps(spec, schedule, args.warmup),
                    )
                    result = job(cluster, job_spec, f"r = {ratio:g}, {label}")
                    entry["methods"][label] = pooled(entry["methods"].get(label), summary_of(result))
                    progress.finished()
                    save_record(path, results)
        # Run by run, each label's first run before any label's second.
        done = entry.setdefault("direct", {}) if args.direct else {}
        lengths = direct_runs(entry, methods, steps) if args.direct else {}
        direct = [
            label
            for repeat in range(args.direct)
            for label in lengths
            if len(recorded(done.get(label), "runs")) <= repeat
        ]
        if direct:
            progress.add(len(direct))
            with emulated_cluster(args.np, entry["rate_gbit"]) as cluster:
                for label in direct:
                    length = lengths[label]
                    progress.starting(f"r = {ratio:g}, {label} end to end, {length} steps")
                    job_spec = dict(
                        seed_zero(steps, label)["spec"],
                        kind="direct",
                        lm=args.lm,
                        length=length,
                        warmup=steps["plan"]["warmup"],
                        eval_windows=steps["plan"]["eval_windows"],
                    )
                    result = job(cluster, job_spec, f"r = {ratio:g}, {label} end to end")
                    runs = recorded(done.get(label), "runs") + [
                        {
                            "train_s": result["train_s"],
                            "loss": result["loss"],
                            "wall_seconds": round(result["wall_seconds"], 1),
                            "other_cpu_seconds": round(result["other_cpu_seconds"], 1),
                        }
                    ]
                    done[label] = {
                        "length": length,
                        "runs": runs,
                        "train_s": statistics.median(run["train_s"] for run in runs),
                    }
                    progress.finished(f"{result['train_s']:.1f} s, loss {result['loss']:.4f}")
                    save_record(path, results)
    write_report(results, steps, args.out)
    return results


def seed_zero(steps: Dict[str, Any], label: str) -> Dict[str, Any]:
    """The time-to-quality point of ``label``'s seed 0 ({"spec", "record"})."""
    return next(e for e in steps["points"].values() if e["spec"]["label"] == label and e["spec"]["seed"] == 0)


def direct_runs(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]], steps: Dict[str, Any]) -> Dict[str, int]:
    """The end-to-end runs at a setting, label -> steps: uncompressed, FP16, the two
    compressing methods soonest to target by the decomposition, and advise's pick; each for the
    first length of the evaluation schedule at which its seed 0 reached the target."""
    seconds = {label: value for label, value in times_to_target(entry, methods).items() if value is not None}
    # The wrapper's row is priced only: its end-to-end run would not be the points' bit for bit.
    compressing = sorted(
        (label for label in seconds if label not in (ttq.UNCOMPRESSED, "FP16") and "stock" not in methods[label]),
        key=seconds.get,
    )
    target = ttq.target_of(steps, steps["plan"]["base_seeds"], steps["plan"]["knee_gain"])["target"]
    runs = {}
    for label in dict.fromkeys([ttq.UNCOMPRESSED, "FP16", *compressing[:2], advised_label(entry, methods)]):
        reached = (
            [p["length"] for p in seed_zero(steps, label)["record"]["points"] if p["loss"] <= target]
            if label in seconds
            else []
        )
        if reached:
            runs[label] = reached[0]
    return runs


def job_environment(spec: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """What every job's ranks get: one torch thread each (they share the cores), this checkout;
    on the wrapper's path no Horovod fusion (its own buckets are the only fusion, as in
    ``benchmarks endtoend``)."""
    wrapper = spec is not None and spec.get("integration") == "wrapper"
    return {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": checkout_pythonpath(),
        **({"HOROVOD_FUSION_THRESHOLD": "0"} if wrapper else {}),
    }


def advised(cluster, args, world: Optional[int] = None) -> Dict[str, Any]:
    """advise run on ``cluster`` as a user runs it, on this LM (projected to ``world`` ranks
    where given): its recommendation and, per candidate, the bytes one rank sends a step, the
    projected step and time to target (relative to uncompressed)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "advice.json"
        argv = [
            sys.executable,
            "-m",
            "hvd_compress.advise",
            "--model",
            args.advise_model,
            "--json",
            str(out),
            *(["--methods", args.advise_methods] if args.advise_methods else []),
            *(["--world", str(world)] if world else []),
        ]
        started = time.perf_counter()
        returncode, stdout, stderr = cluster.run(argv, timeout=args.job_timeout, env=job_environment())
        if returncode != 0 or not out.exists():
            raise RuntimeError(f"advise failed (exit {returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
        advice = json.loads(out.read_text())
    command = f"mpirun -np {args.np} python -m hvd_compress.advise " + " ".join(argv[3:5] + argv[7:])
    return {
        "command": command,
        "recommendation": advice["recommendation"],
        "across_sites": advice.get("across_sites", ""),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "compute_ms": advice["compute_ms"],
        "steps_workload": advice["steps_workload"],
        # Each link's (latency s: its smallest probe's time, bytes/s) and, where projected, a hop's latency.
        "hop_s": advice.get("hop_s", 0.0),
        "links": {name: [link["latency_s"], link["bytes_per_s"]] for name, link in advice.get("links", {}).items()},
        "candidates": [
            {
                key: c[key]
                for key in (
                    "method",
                    "setting",
                    "wire_bytes",
                    "step_ms",
                    "timed_step_ms",
                    "speedup",
                    "steps_factor",
                    "to_target",
                )
            }
            for c in advice["candidates"]
        ],
    }


def stale_factors(advice: Dict[str, Any]) -> Dict[Tuple[str, str], Tuple[Optional[float], Optional[float]]]:
    """(method, setting) -> (the steps factor advise ran with, the shipped evidence's now), where
    they differ: time to quality has measured more seeds since, and advise may pick otherwise."""
    shipped = shipped_evidence()
    changed = {}
    for candidate in advice["candidates"]:
        _, now = steps_for(candidate["method"], candidate["setting"], shipped)
        if now != candidate["steps_factor"]:
            changed[(candidate["method"], candidate["setting"])] = (candidate["steps_factor"], now)
    return changed


def advise_names(methods: Dict[str, Dict[str, Any]]) -> Dict[Tuple[str, str], str]:
    """(advise's name, setting) -> label, for the methods advise can name on the stock path:
    compressors and L-GreCo over one (the controllers it projects)."""
    names = {}
    for label, m in methods.items():
        named = advise_name(m["spec"])
        if named is None or "stock" in m:
            continue
        controller, _, _ = named[0].rpartition("/")
        if not controller or controller in PROJECTED_CONTROLLERS:
            names[named] = label
    return names


def advised_label(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """The label of advise's pick at a setting, None where advise has not run or picked a
    method this benchmark did not measure."""
    return advise_names(methods).get(pick_of(entry["advise"]["recommendation"])) if "advise" in entry else None


def pick_of(recommendation: str) -> Tuple[str, str]:
    """advise's pick as (registry name, setting): "none" for "do not compress"."""
    match = re.match(r"compress with (\S+?)(?: (\S+=\S+))?:", recommendation)
    return (match.group(1), match.group(2) or "") if match else ("none", "")


def across_sites_pick(line: str) -> Optional[Tuple[str, str]]:
    """The local method advise's across-sites line advises, (name, setting), as the evidence
    names it; None where it advises none or a per-step method instead."""
    match = re.match(r"across sites: (\S+) (\S+) is projected", line)
    return (match.group(1), match.group(2)) if match and "train with it" not in line else None


def recorded(entry: Optional[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    """What a label's entry at a setting holds under ``key``: its timing jobs ("jobs") or its
    end-to-end runs ("runs"); an entry written before it held a list, without ``key``, is its one
    job or run."""
    return [] if entry is None else entry.get(key, [entry])


def job_means(entry: Dict[str, Any]) -> List[float]:
    return [j["mean_step_ms"] for j in recorded(entry, "jobs")]


def jobs_of(entry: Optional[Dict[str, Any]]) -> int:
    return len(recorded(entry, "jobs"))


def pooled(previous: Optional[Dict[str, Any]], job: Dict[str, Any]) -> Dict[str, Any]:
    """A method's step time over its jobs: the median of the jobs' means (one job's threads land
    on the cores differently from another's: means of one method's jobs differed by up to a
    third), with every job kept."""
    jobs = recorded(previous, "jobs") + [job]
    return {
        "jobs": jobs,
        "mean_step_ms": statistics.median(j["mean_step_ms"] for j in jobs),
        "median_step_ms": statistics.median(j["median_step_ms"] for j in jobs),
    }


def summary_of(result: Dict[str, Any]) -> Dict[str, Any]:
    """A job's result as kept: a probe's medians, or a method's mean step and its spread."""
    if "step_s" not in result:
        return {k: v for k, v in result.items() if k not in ("disturbed_attempts",)}
    step_ms = [1e3 * s for s in result["step_s"]]
    return {
        "mean_step_ms": statistics.fmean(step_ms),
        "median_step_ms": statistics.median(step_ms),
        "steps": len(step_ms),
        "wall_seconds": round(result["wall_seconds"], 1),
        "other_cpu_seconds": round(result["other_cpu_seconds"], 1),
        "disturbed_attempts": result.get("disturbed_attempts", 0),
    }


# ----- the report -------------------------------------------------------------------------------
def times_to_target(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """label -> seconds to target (median steps x mean step), None where not reached."""
    out = {}
    for label, priced in entry["methods"].items():
        median = methods[label]["score"]["median"] if label in methods else None
        out[label] = None if median is None else median * priced["mean_step_ms"] / 1e3
    return out


def setting_table(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]]) -> List[str]:
    seconds = times_to_target(entry, methods)
    base = seconds.get(ttq.UNCOMPRESSED)
    lines = [
        "| method | median steps to target (seeds) | mean step ms: median over jobs (each job's) | "
        "time to target s | x uncompressed (lower is sooner) |",
        "|---|---|---|---|---|",
    ]
    for label, priced in entry["methods"].items():
        score = methods[label]["score"]
        value = seconds[label]
        factor = "-" if value is None or not base else f"{value / base:.2f}"
        lines.append(
            f"| {label} | {ttq.steps_text(score['median'])} ({score['seeds']}) | "
            f"{priced['mean_step_ms']:.1f} ({', '.join(f'{m:.1f}' for m in job_means(priced))}) | "
            f"{'-' if value is None else format(value, '.1f')} | {factor} |"
        )
    return lines + [""]


def targets(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]], ratio: float) -> List[str]:
    """The targets that the measured settings decide."""
    seconds = {k: v for k, v in times_to_target(entry, methods).items() if v is not None}
    if ttq.UNCOMPRESSED not in seconds or len(seconds) < 2:
        return ["Targets: not decided yet (uncompressed and at least one method needed)."]
    fastest = min(seconds, key=seconds.get)
    base = seconds[ttq.UNCOMPRESSED]
    lines = [
        f"Fastest to target: {fastest}, {seconds[fastest]:.1f} s ({base / seconds[fastest]:.2f}x sooner "
        f"than uncompressed, {base:.1f} s)."
    ]
    if ratio >= BETWEEN_SITES:
        lines += between_sites_targets(seconds, methods, base)
    elif ratio >= 1:
        lines.append(
            f"Target, r = 3: the fastest method reaches the target >= 2x sooner than Horovod's plain "
            f"all-reduce: {'met' if base >= 2 * seconds[fastest] else 'missed'} "
            f"({base / seconds[fastest]:.2f}x)."
        )
        others = [label for label in seconds if label not in (ttq.UNCOMPRESSED, "FP16")]
        if "FP16" in seconds and others:
            best = min(others, key=seconds.get)
            lines.append(
                f"Target, r = 3: the fastest compressing method sooner than FP16 ({seconds['FP16']:.1f} s): "
                f"{'met' if seconds[best] < seconds['FP16'] else 'missed'} ({best}, {seconds[best]:.1f} s)."
            )
    lines += advise_verdict(entry, methods, seconds, fastest, ratio)
    return lines


def between_sites_targets(seconds: Dict[str, float], methods: Dict[str, Dict[str, Any]], base: float) -> List[str]:
    """The targets for links between sites: the soonest local method (DiLoCo, SparseLoCo,
    Streaming DiLoCo) reaches the target >= 3x sooner than uncompressed and sooner than the
    soonest per-step method."""
    local = [label for label in seconds if (methods[label]["spec"]["controller"] or {}).get("kind") in LOCAL_KINDS]
    per_step = [label for label in seconds if label not in local and label != ttq.UNCOMPRESSED]
    if not local:
        return ["Targets, r = 30: no local method reached the target, so none is timed."]
    best = min(local, key=seconds.get)
    seeds = methods[best]["score"]["seeds"]
    lines = [
        f"Target, r = 30: the soonest local method ({best}, {seconds[best]:.1f} s, steps from "
        f"{seeds} seed(s)) >= 3x sooner than uncompressed: "
        f"{'met' if base >= 3 * seconds[best] else 'missed'} ({base / seconds[best]:.2f}x)."
    ]
    if per_step:
        rival = min(per_step, key=seconds.get)
        lines.append(
            f"Target, r = 30: sooner than the soonest per-step method ({rival}, {seconds[rival]:.1f} s): "
            f"{'met' if seconds[best] < seconds[rival] else 'missed'} ({seconds[rival] / seconds[best]:.2f}x)."
        )
    return lines


def advise_verdict(
    entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]], seconds: Dict[str, float], fastest: str, ratio: float
) -> List[str]:
    """advise's pick against the measured times to target: within 10% of the fastest, and at
    r < 1 also no more than 5% slower than it."""
    if "advise" not in entry:
        return ["advise: not run at this setting yet."]
    pick = pick_of(entry["advise"]["recommendation"])
    named = advise_names(methods)
    lines = [f"advise (`{entry['advise']['command']}` on the same cluster): \"{entry['advise']['recommendation']}\"."]
    changed = stale_factors(entry["advise"])
    if changed:
        lines.append(
            "advise ran before time to quality's latest seeds, with steps factors the shipped evidence "
            "has since changed ("
            + "; ".join(
                f"{method} {setting or 'default'}: {factor_text(then)} -> {factor_text(now)}"
                for (method, setting), (then, now) in sorted(changed.items())
            )
            + "): its pick below is the one it made then; rerunning the benchmark runs it again."
        )
    # A local method's pick is advise's across-sites line, judged against the fastest of all;
    # its per-step pick is then judged against the fastest per-step method.
    local = {
        label: name
        for label, name in ((label, advise_name(m["spec"])) for label, m in methods.items())
        if name is not None and name[0].split("/")[0] in LOCAL_KINDS
    }
    judged = []
    across = entry["advise"].get("across_sites")
    local_pick = across_sites_pick(across) if across else None
    if across:
        lines.append(f'Its line for the local methods: "{across}".')
    if local_pick is not None:
        judged.append(("pick across sites", next((lab for lab, n in local.items() if n == local_pick), None)))
    label = named.get(pick)
    if label not in seconds:
        lines.append(f"Its pick ({' '.join(filter(None, pick))}) has no measured time to target here: not validated.")
    else:
        judged.insert(0, ("per-step pick" if judged else "pick", label))
    per_step = min((lab for lab in seconds if lab not in local), key=seconds.get, default=None)
    for what, label in judged:
        if label not in seconds:
            lines.append(f"Its {what} has no measured time to target here: not validated.")
            continue
        best = per_step if what == "per-step pick" else fastest
        slower = seconds[label] / seconds[best] - 1
        for bound in (0.10, 0.05) if ratio < 1 else (0.10,):
            lines.append(
                f"Target: advise's {what} ({label}, {seconds[label]:.1f} s) within {bound:.0%} of the fastest "
                f"{'per-step ' if best != fastest else ''}measured ({best}, {seconds[best]:.1f} s): "
                f"{'met' if slower <= bound else 'missed'} ({slower:+.1%})."
            )
    projected = {(c["method"], c["setting"]): c for c in entry["advise"]["candidates"]}
    base = seconds.get(ttq.UNCOMPRESSED)
    labels = {**named, **{key: lab for lab, key in local.items()}}
    pairs = [
        f"{lab}: projected {projected[key]['to_target']:.2f}x"
        f"{' (step timed)' if projected[key].get('timed_step_ms') is not None else ''}, "
        f"measured {seconds[lab] / base:.2f}x"
        for key, lab in labels.items()
        if lab in seconds and key in projected and projected[key]["to_target"] is not None and base
    ]
    if pairs:
        lines.append(
            "advise's projected time to target against the measured (relative to uncompressed; "
            "\"step timed\": from advise's timed training steps, not its model): " + "; ".join(pairs) + "."
        )
    steps_ms = {
        lab: (projected[key]["step_ms"], entry["methods"][lab]["mean_step_ms"])
        for key, lab in labels.items()
        if key in projected and lab in entry["methods"] and projected[key].get("step_ms")
    }
    if steps_ms:
        close = sum(abs(model / measured - 1) <= 0.2 for model, measured in steps_ms.values())
        lines.append(
            "advise's model of a step against the step measured here (ms): "
            + "; ".join(
                f"{lab} {model:.1f} vs {measured:.1f} ({model / measured - 1:+.0%})"
                for lab, (model, measured) in steps_ms.items()
            )
            + f". Within 20%: {close} of {len(steps_ms)}."
        )
    return lines


def markdown(results: Dict[str, Any], steps: Dict[str, Any]) -> str:
    methods = priced_methods(steps)
    lines = [
        f"Command: `{results['command']}` (resumable job by job)",
        "",
        f"Machine: {describe_machine(results['machine'])}",
        "",
        f"Each method's median steps to target from \"Time to quality\", times its mean step time "
        f"on the emulated cluster ({results['np']} ranks, one network namespace each, tc tbf both ways; "
        f"{results['warmup']} untimed steps, a tenth of the run for schedules that start later, then "
        f"{results['steps']} timed; each step time the median of {results.get('repeats', 1)} jobs' means), "
        "at two link settings chosen by r: one fused all-reduce of the whole "
        "fp32 gradient over a step's compute, both measured by a probe job on the testbed (see "
        "\"Time to quality\" for the GPU clusters at each r). Step times are from a CPU codec, "
        "costlier against compute than on a GPU: biased against compression. Every method runs through "
        "stock `hvd.DistributedOptimizer`; a row *(drop-in wrapper)* runs the same method through "
        "`hvd_compress.DistributedOptimizer` (rounds overlapped with backward, its own scaled fusion) "
        "and is priced on the stock path's steps to target.",
        "",
    ]
    if results["np"] != steps["np"]:
        lines += [
            f"The steps to target were measured at {steps['np']} ranks and are assumed the same at "
            f"{results['np']} (the same batch per rank, so {results['np'] / steps['np']:g}x the global batch): "
            "these rows test the step times and advise's model at this size, not quality.",
            "",
        ]
    for key, entry in results["settings"].items():
        probes = entry["probes"]
        probe_text = "; ".join(
            f"{p['rate_gbit']:.3g} Gbit/s: all-reduce {1e3 * p['allreduce_s']:.1f} ms, "
            f"compute {1e3 * p['compute_s']:.1f} ms, r = {ratio_of(p):.2f}"
            for p in probes
        )
        title = f"**r = {key} wanted**"
        if entry.get("rate_gbit") is None and "alpha_s" in entry:
            lines += [
                f"{title}: out of the testbed's reach: the all-reduce's latency floor alone is "
                f"{1e3 * entry['alpha_s']:.1f} ms. Probes: {probe_text}.",
                "",
            ]
            continue
        if "at_rate" not in entry:
            lines += [f"{title}: not measured yet.", ""]
            continue
        if "timing" in entry:
            t = entry["timing"]
            lines += [
                f"{title} was timed otherwise: `{t['command']}` ({t['np']} ranks, {t['warmup']} untimed "
                f"steps, {t['steps']} timed, {t['repeats']} job(s) per method).",
                "",
            ]
        lines += [
            f"{title}: tbf rate {entry['rate_gbit']:.3g} Gbit/s (fit T = {1e3 * entry['alpha_s']:.1f} ms + "
            f"{1e3 * entry['c_s_gbit']:.2f} ms Gbit/s / R), measured there r = {ratio_of(entry['at_rate']):.2f}. "
            f"Probes: {probe_text}.",
            "",
        ]
        lines += setting_table(entry, methods) if entry["methods"] else ["No method timed yet.", ""]
        lines += targets(entry, methods, float(key)) + [""]
        lines += projection_table(entry, methods, results["np"], steps["np"])
        lines += direct_table(entry, steps, methods)
    return "\n".join(lines + notes_lines(results))


def projection_table(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]], np: int, steps_np: int) -> List[str]:
    """advise's projections to more ranks on this setting's links (``--project-to``), beside its
    model and the measurement at the ranks launched: per method timed here, bytes one rank sends,
    step and time to target relative to uncompressed."""
    projected = entry.get("projected", {})
    if not projected or "advise" not in entry:
        return []
    worlds = sorted(projected, key=int)
    named = advise_names(methods)
    by_world = {world: {(c["method"], c["setting"]): c for c in projected[world]["candidates"]} for world in worlds}
    here = {(c["method"], c["setting"]): c for c in entry["advise"]["candidates"]}
    seconds = times_to_target(entry, methods)
    base = seconds.get(ttq.UNCOMPRESSED)
    header = (
        f"| method | step at {np} (ms), measured | advise's model at {np} | "
        + " | ".join(f"MB a rank sends at {w} | step at {w} (ms) | to target at {w}" for w in worlds)
        + f" | to target at {np}, measured |"
    )
    lines = [
        f"Projected to {' and '.join(worlds)} ranks by advise on this setting's links "
        f"(`{projected[worlds[-1]]['command']}`): each codec run as one of W ranks, the links probed on "
        f"{np} ranks scaled as the ring algorithms scale (a hop's latency, the all-reduce's over the "
        "all-gather's, for each further message a rank sends in turn; the rest by its bytes), compute as "
        "measured (the same batch per rank). Time to target is "
        f"relative to uncompressed's at the same W, on the steps to target measured at {steps_np} ranks "
        "(assumed the same at W: a larger global batch may need other steps). Methods that send more "
        "than uncompressed at W are marked *. A hop's latency, as each run of advise estimated it: "
        + ", ".join(f"{1e6 * projected[w].get('hop_s', 0.0):.0f} us (to {w})" for w in worlds)
        + ".",
        "",
        header,
        "|---" * (3 + 3 * len(worlds) + 1) + "|",
    ]
    for key, label in named.items():
        if label not in entry["methods"] or key not in here:
            continue
        cells = [label, f"{entry['methods'][label]['mean_step_ms']:.1f}", f"{here[key]['step_ms']:.1f}"]
        for world in worlds:
            c, dense = by_world[world].get(key), by_world[world][("none", "")]
            if c is None:
                cells += ["-", "-", "-"]
                continue
            mark = "*" if c["wire_bytes"] > dense["wire_bytes"] else ""
            cells += [f"{c['wire_bytes'] / 1e6:.3g}{mark}", f"{c['step_ms']:.1f}", factor_text(c["to_target"])]
        measured = seconds.get(label)
        cells.append("-" if measured is None or not base else f"{measured / base:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    for world in worlds:
        lines += ["", f"advise at {world} ranks: \"{projected[world]['recommendation']}\""]
    return lines + [""]


def direct_table(entry: Dict[str, Any], steps: Dict[str, Any], methods: Dict[str, Dict[str, Any]]) -> List[str]:
    """The end-to-end runs against the decomposition (the same steps x the method's mean step),
    and which of them reached the target soonest."""
    if not entry.get("direct"):
        return []
    lines = [
        "End to end on the same cluster (`--direct`, seed 0; where a method ran more than once, the "
        "median of its runs, each run's in brackets): each method trained for the first length of the "
        "evaluation schedule at which its seed 0 reached the target, its steps' seconds summed "
        "(evaluation apart), against that length x its mean step above.",
        "",
        "| method | steps | loss at the end: end to end / without the network | training s: end to end | "
        "steps x mean step s | end to end / decomposed |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for label, entry_of_label in entry["direct"].items():
        runs = recorded(entry_of_label, "runs")
        length, seconds = entry_of_label["length"], entry_of_label["train_s"]
        offline = next(p["loss"] for p in seed_zero(steps, label)["record"]["points"] if p["length"] == length)
        decomposed = length * entry["methods"][label]["mean_step_ms"] / 1e3
        ratios.append(seconds / decomposed)
        losses = sorted({run["loss"] for run in runs})
        same = " (bit for bit)" if losses == [offline] else ""
        each = " (" + ", ".join(f"{run['train_s']:.1f}" for run in runs) + ")" if len(runs) > 1 else ""
        lines.append(
            f"| {label} | {length} | {', '.join(f'{loss:.4f}' for loss in losses)} / {offline:.4f}{same} | "
            f"{seconds:.1f}{each} | {decomposed:.1f} | {ratios[-1]:.2f} |"
        )
    worst = max(ratios, key=lambda value: abs(value - 1))
    spread = max(
        max(means) / min(means) - 1 for means in (job_means(entry["methods"][label]) for label in entry["direct"])
    )
    return lines + [
        "",
        f"Target: the decomposition agrees with the end-to-end runs within 10%: "
        f"{'met' if abs(worst - 1) <= 0.1 else 'missed'} (end to end / decomposed "
        f"{min(ratios):.2f}-{max(ratios):.2f}). For scale: the slowest of these methods' "
        f"timing jobs was up to {spread:.0%} slower than its fastest.",
        "",
        direct_verdict(entry, methods),
        "",
    ]


def direct_verdict(entry: Dict[str, Any], methods: Dict[str, Dict[str, Any]]) -> str:
    """Which end-to-end run reached the target soonest, and advise's pick against it: the
    decomposition's verdicts, asked again of the runs themselves (seed 0, each at the first
    length of the evaluation schedule that reached the target, so a grid of lengths apart)."""
    seconds = {label: run["train_s"] for label, run in entry["direct"].items()}
    fastest = min(seconds, key=seconds.get)
    ranked = ", ".join(f"{label} {value:.1f} s" for label, value in sorted(seconds.items(), key=lambda kv: kv[1]))
    text = f"End to end, soonest to the target: {fastest} ({ranked})."
    pick = advised_label(entry, methods) if "advise" in entry else None
    if pick in seconds:
        text += (
            f" advise's pick, {pick}, {seconds[pick] / seconds[fastest] - 1:+.1%} against it "
            "(within 10% asked; 5% at r < 1)."
        )
    return text


def draw_figure(results: Dict[str, Any], steps: Dict[str, Any], path: Path) -> None:
    """Per measured setting: the median validation loss against wall-clock (steps x the method's
    mean step there), the target dashed; and the times to target as bars."""
    methods = priced_methods(steps)
    goal = ttq.target_of(steps, steps["plan"]["base_seeds"], steps["plan"]["knee_gain"])
    settings = {key: entry for key, entry in results["settings"].items() if entry.get("methods")}
    plt, figure, axes = panels(2, 6, 4.2, rows=len(settings))
    for row, (key, entry) in enumerate(settings.items()):
        curves, bars = axes[2 * row], axes[2 * row + 1]
        for label, priced in entry["methods"].items():
            curve = ttq.median_curve(ttq.records_of(steps, stock_label(methods, label)))
            seconds = [length * priced["mean_step_ms"] / 1e3 for length in curve]
            curves.plot(seconds, list(curve.values()), marker="o", markersize=3, label=label)
        curves.axhline(goal["target"], color="black", linestyle="--", linewidth=0.8, label="target")
        curves.set_xscale("log")
        curves.set_xlabel(f"seconds on the testbed at r = {key} (log)", fontsize=8)
        curves.set_ylabel("validation loss (median over seeds)", fontsize=8)
        curves.legend(fontsize=6)
        reached = {label: value for label, value in times_to_target(entry, methods).items() if value is not None}
        method_bars(bars, reached, ttq.UNCOMPRESSED)
        bars.set_xlabel(f"seconds to target at r = {key}", fontsize=8)
        for axis in (curves, bars):
            axis.tick_params(labelsize=7)
    save_figure(figure, path)


def record_name(np: int, steps: Dict[str, Any]) -> str:
    """The run's JSON and figure: "time_to_target" at the ranks of the time-to-quality results,
    "time_to_target_np8" at 8 ranks (its page "Time to target at 8 ranks"), beside it."""
    return "time_to_target" if np == steps["np"] else f"time_to_target_np{np}"


def write_report(results: Dict[str, Any], steps: Dict[str, Any], out: Path) -> None:
    name = record_name(results["np"], steps)
    figure = out / "benchmarks" / f"{name}.png"
    text = markdown(results, steps)
    if any(entry.get("methods") for entry in results["settings"].values()):
        draw_figure(results, steps, figure)
        text += f"\n\n![time to target]({figure.name})\n"
    write_section(out, SECTION if name == "time_to_target" else f"{SECTION} at {results['np']} ranks", text)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks time_to_target", description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=lambda text: [float(v) for v in text.split(",")], default=[3.0, 0.3])
    parser.add_argument(
        "--methods",
        type=lambda text: [v.strip() for v in text.split(";") if v.strip()],
        help="time only these labels of the time-to-quality results, ';'-separated (uncompressed always runs)",
    )
    add_timing_options(parser, 20, 100, repeats=3, steps_help="timed steps (a multiple of DiLoCo's H)")
    parser.add_argument(
        "--ttq", type=Path, help="the time-to-quality JSON (default: <out>/benchmarks/time_to_quality.json)"
    )
    add_job_options(parser, 900, "2 ranks, the tiny LM, r = 3, a few steps", job_timeout_help=None, np=4)
    parser.add_argument(
        "--advise-model",
        default="examples.models:charlm_ttq",
        help="advise's --model: this benchmark's LM, as a user would name it",
    )
    parser.add_argument(
        "--project-to",
        type=int,
        nargs="*",
        default=[],
        metavar="W",
        help="also run advise --world W on each setting's cluster: its projection to W ranks, beside the measured",
    )
    parser.add_argument(
        "--direct",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="RUNS",
        help="also train uncompressed, FP16, the two soonest compressing methods and advise's pick "
        "end to end on the cluster, to check the decomposition: RUNS runs each (default 1), "
        "their median kept",
    )
    args = parser.parse_args(argv)
    if args.direct < 0:
        parser.error(f"--direct must be a number of runs, at least 0, got {args.direct}")
    for name in ("np", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if any(r <= 0 for r in args.ratios):
        parser.error(f"--ratios must be positive, got {args.ratios}")
    args.advise_methods = None  # every registered method, as a user runs it
    args.ttq = args.ttq or args.out / "benchmarks" / "time_to_quality.json"
    if args.quick:
        args.np, args.lm, args.ratios, args.warmup, args.steps, args.repeats = 2, ttq.QUICK_LM, [3.0], 2, 10, 1
        args.advise_model, args.advise_methods = "examples.models:charlm_small", "fp16"
    else:
        args.lm = quality.LM
    return args


def render(out: Path) -> None:
    """Rewrites the pages and figures from the stored JSON (one a number of ranks) and
    time_to_quality's."""
    for path in sorted((out / "benchmarks").glob("time_to_target*.json")):
        write_report(json.loads(path.read_text()), stored(out, "time_to_quality"), out)


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        work(json.loads(args.worker))
    else:
        run(args)

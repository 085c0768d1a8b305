"""advise run live on the emulated cluster, against the step times the end-to-end benchmark measured.

For every rate an :mod:`emulated cluster <benchmarks.testbed>` of ``--np`` ranks is built, and
on it, per model, the advise command line runs exactly as a user runs it under ``mpirun``
(``OMP_NUM_THREADS=1``, as in the end-to-end jobs)::

    python -m hvd_compress.advise --model examples.models:<model> --json <file>

Rank 0's printed table and its JSON are kept in ``<out>/benchmarks/advise_live.json``, one
point per (rate, model), saved after each: rerunning the command resumes with the first missing
point.

Each point is then compared with each end-to-end run named by ``--from`` (its JSON; each file
on its own, e.g. the stored run and one made at the same time as advise's) at the same rate and
model, for the methods that benchmark runs with stock ``hvd.DistributedOptimizer`` (S-SGD, FP16,
PowerSGD, ACP-SGD, ScaleCom; ``REGISTERED`` in ``benchmarks/advise_check.py``):

* each method's projected step, in advise's row of the same registry name and the setting the
  end-to-end run used (the low-rank methods at its ``rank``, the others at the registry's
  default), within 20% of the measured median;
* advise's recommendation ("do not compress" is S-SGD): its method's measured median within 10%
  of the fastest measured of those methods. The end-to-end run measured each method at one
  setting, so a recommended setting it did not run is judged by its method at that run's
  setting, and the table says so. Alongside: the fastest of advise's rows at those settings.

A rate an end-to-end file did not measure gets no verdict against it. ``--repeat``: the JSON of
another run of the same points, whose recommendations and projections are shown beside these
(advise's own spread from run to run). Writes the
"advise live on the emulated cluster" page of ``<out>/benchmarks/``.

``--reproject``: no run. The stored points' measurements (compute, codec times, probe times)
are projected again with the current model of :mod:`hvd_compress.advise` (links refitted to
the stored probes, messages recounted on the model's shapes), written to
``<out>/benchmarks/advise_live_reprojected.json`` (the repeat's as ``<its name>_reprojected.json``
there), and the
section says so, with the stored run's own verdicts beside.
"""

import argparse
import copy
import json
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.advise_check import REGISTERED, WITHIN_CHOICE, WITHIN_STEP
from benchmarks.harness.jobs import checkout_pythonpath, command_line, say
from benchmarks.harness.machine import OthersShare, describe_machine, machine
from benchmarks.harness.render import DOCS, save_record, stored, write_section
from benchmarks.testbed import emulated_cluster, run_bounded
from hvd_compress import advise
from hvd_compress.advise.advice import SETTINGS
from hvd_compress.advise.evidence import evidence_for, recommend, shipped_evidence
from hvd_compress.advise.measure import gradients_of, load_model, measure_codec
from hvd_compress.advise.projection import fit_link, project
from hvd_compress.registry import COMPRESSORS

SECTION = "advise live on the emulated cluster"
MODELS = {"charlm": "examples.models:charlm", "cnn": "examples.models:cnn"}
EXAMPLE = ("1", "charlm")  # the point whose table the section shows whole
METHOD_OF = {name: method for method, (name, _) in REGISTERED.items()}
COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall")


# ----- running advise -------------------------------------------------------------------------
def advise_point(cluster, model, timeout):
    """advise's CLI on every rank of ``cluster``: rank 0's table, its JSON, and what the job took."""
    with tempfile.TemporaryDirectory() as scratch:
        advice_path = Path(scratch) / "advice.json"
        argv = [sys.executable, "-m", "hvd_compress.advise", "--model", MODELS[model], "--json", str(advice_path)]
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_pythonpath()}
        load, others, started = os.getloadavg(), OthersShare(), time.perf_counter()
        returncode, stdout, stderr = run_bounded(
            cluster.mpirun_command(argv, env), timeout, cluster.mpirun_environment(env)
        )
        wall, other_seconds = time.perf_counter() - started, others.seconds()
        if returncode != 0 or not advice_path.exists():
            raise RuntimeError(
                f"advise on {model} at {cluster.rate_gbit:g} Gbit/s failed (exit {returncode}):\n"
                f"{stdout[-2000:]}\n{stderr[-4000:]}"
            )
        advice = json.loads(advice_path.read_text())
    return {
        "command": shlex.join(["mpirun", "-np", str(cluster.ranks), *argv[:-1], "advice.json"]),
        "testbed": cluster.describe(),
        "table": stdout.strip("\n"),
        "advice": advice,
        "load_average_before": load,
        "wall_seconds": round(wall, 1),
        "other_cpu_seconds": round(other_seconds, 1),
    }


def sweep(args, path):
    """Every (rate, model) point not yet in ``path``, saved after each."""
    results = json.loads(path.read_text()) if path.exists() else {}
    if results.get("np") != args.np:
        results = {"np": args.np, "points": {}}
    results.update(command=command_line("advise_live", dropped=()), machine=machine(), conditions=args.conditions)

    def missing(rate):
        return [model for model in args.models if f"{rate:g}/{model}" not in results["points"]]

    for rate in args.rates:
        if not missing(rate):
            continue
        with emulated_cluster(args.np, rate) as cluster:
            for model in missing(rate):
                point = advise_point(cluster, model, args.job_timeout)
                results["points"][f"{rate:g}/{model}"] = point
                save_record(path, results)
                say(f"{rate:g} Gbit/s {model}: {point['advice']['recommendation']}")
    return results


# ----- re-projecting the stored measurements --------------------------------------------------
def stored_advice(stored):
    """An :class:`advise.Advice` back from its JSON."""
    links = {name: advise.Link(**link) for name, link in stored["links"].items()}
    candidates = [advise.Candidate(**c) for c in stored["candidates"]]
    return advise.Advice(**{**stored, "links": links, "candidates": candidates})


def messages_on(model, world, labels):
    """{(method, setting): Candidate} counted by advise on ``model``'s shapes (codec times unused)."""
    built, loss_of = load_model(MODELS[model])
    grads = gradients_of(built, loss_of)
    named = [(name, p) for name, p in built.named_parameters() if name in grads]
    counted = {}
    for method, setting in labels:
        settings = {
            key: type(SETTINGS[key][0])(value)
            for key, value in (part.split("=") for part in setting.split(",") if part)
        }
        counted[(method, setting)] = measure_codec(method, settings, grads, named, 0, world, steps=1)
    return counted


def reproject(results):
    """``results`` with every point's projection recomputed from its stored measurements."""
    results = copy.deepcopy(results)
    counted = {}
    evidence = shipped_evidence()
    for key, point in results["points"].items():
        model = key.split("/")[1]
        advice = stored_advice(point["advice"])
        labels = [(c.method, c.setting) for c in advice.candidates]
        if model not in counted:
            counted[model] = messages_on(model, advice.world_size, labels)
        advice.links = {name: fit_link(link.measured) for name, link in advice.links.items()}
        compute_s, backward_s = advice.compute_ms / 1e3, advice.backward_ms / 1e3
        for candidate in advice.candidates:
            recount = counted[model][(candidate.method, candidate.setting)]
            candidate.messages, candidate.serial_messages = recount.messages, recount.serial_messages
            project(candidate, advice.links, compute_s, backward_s)
            candidate.evidence, candidate.quality_ok = evidence_for(candidate.method, candidate.setting, evidence)
        baseline = next(c for c in advice.candidates if c.method == "none")
        baseline.quality_ok = True
        for candidate in advice.candidates:
            candidate.speedup = baseline.step_ms / candidate.step_ms
        advice.recommendation = recommend(advice.candidates)
        point["advice"] = asdict(advice)
        point["table"] = advise.format_advice(advice)
    results["reprojected"] = command_line("advise_live", dropped=())
    return results


def reprojected_note(before, after, sources):
    """The lead of a re-projected section: what it is, and the stored run's own verdicts."""
    lines = [
        f"**Re-projected, not a new run**: `{after['reprojected']}` projected the stored points of "
        "the run below (`benchmarks/advise_live.json`: advise's compute, codec times and probe times "
        "as it measured them) again with the current model of `hvd_compress/advise/` (links "
        "interpolated between the probes, messages counted as stock `hvd.DistributedOptimizer` "
        "issues them), into `benchmarks/advise_live_reprojected.json`; the tables below are those "
        "projections (a `--repeat` run's likewise, in `<its name>_reprojected.json` beside it). "
        "Per rate, the run's own projections against the re-projected ones:",
        "",
        "| against | rate Gbit/s | steps within 20%, as run | re-projected "
        "| recommendation within 10%, as run | re-projected |",
        "|---|---|---|---|---|---|",
    ]
    for number, source in enumerate(sources, 1):
        for rate in dict.fromkeys(key.split("/")[0] for key in after["points"]):
            cells = []
            for results in (before, after):
                comparisons = [
                    p["comparisons"][source["file"]]
                    for key, p in results["points"].items()
                    if key.split("/")[0] == rate
                ]
                steps = [m["met"] for c in comparisons for m in c["methods"] if m["met"] is not None]
                choices = [c["met"] for c in comparisons if "met" in c]
                cells.append(
                    (
                        f"{sum(steps)} of {len(steps)}" if steps else "-",
                        f"{sum(choices)} of {len(choices)}" if choices else "-",
                    )
                )
            lines.append(f"| [{number}] | {rate} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |")
    lines += link_fits(
        before["points"],
        "The run's own link fit (latency + bytes / bandwidth, one line through "
        "all probes weighted by 1/seconds squared)",
        line=True,
    )
    return "\n".join(lines) + "\n\n"


# ----- comparing ------------------------------------------------------------------------------
def endtoend_setting(name, rank):
    """advise's label of the setting the end-to-end run built ``name`` with: ``rank`` for the
    low-rank methods, the registry's default otherwise (as ``endtoend.build_compression``)."""
    defaults = COMPRESSORS[name].defaults
    return ",".join(f"{key}={rank if key == 'rank' else value}" for key, value in defaults.items() if key in SETTINGS)


def recommended(recommendation):
    """(registry name, setting) of advise's advice line; ("none", "") for "do not compress"."""
    match = re.match(r"compress with (\S+)(?: (\S+))?:", recommendation)
    return ("none", "") if match is None else (match.group(1), match.group(2) or "")


def measured_runs(source):
    """An end-to-end JSON file as compared here:
    {"file", "command", "load", "np", "rank", "rates": {rate: {model: {method: run}}}}."""
    data = json.loads(source.read_text())
    return {
        "file": str(source),
        "command": data["command"],
        "load": data["load_average_before"][0],
        "np": data["np"],
        "rank": data["rank"],
        "rates": {rate: entry["models"] for rate, entry in data["rates"].items()},
    }


def compare(point, runs, rank):
    """One point against the measured runs of its rate and model (None: not measured)."""
    rows = {(c["method"], c["setting"]): c for c in point["advice"]["candidates"]}
    compute = point["advice"]["compute_ms"]
    methods = []
    for method, (name, _) in REGISTERED.items():
        setting = endtoend_setting(name, rank)
        row = rows[(name, setting)]
        projected = row["step_ms"]
        entry = {
            "method": method,
            "setting": setting,
            "projected_ms": projected,
            "measured_ms": None,
            "met": None,
            "projected_parts_ms": [compute, row["codec_ms"], projected - compute - row["codec_ms"]],
        }
        if runs and method in runs:
            run = runs[method]
            entry.update(
                measured_ms=run["step_ms"]["median"],
                met=abs(projected / run["step_ms"]["median"] - 1) <= WITHIN_STEP,
                measured_parts_ms=[run["compute_ms"], run["codec_ms"], run["exposed_comm_ms"]],
            )
        methods.append(entry)
    name, setting = recommended(point["advice"]["recommendation"])
    verdict = {
        "methods": methods,
        "recommended": f"{name} {setting}".strip(),
        "recommended_as": METHOD_OF.get(name),
        "projected_fastest": min(methods, key=lambda m: m["projected_ms"])["method"],
    }
    measured = {m["method"]: m["measured_ms"] for m in methods if m["measured_ms"] is not None}
    if len(measured) < len(methods):
        return verdict
    fastest = min(measured, key=measured.get)
    chosen = verdict["recommended_as"]
    verdict.update(
        fastest=fastest,
        setting_measured=chosen is not None and setting == endtoend_setting(name, rank),
        projected_fastest_ratio=measured[verdict["projected_fastest"]] / measured[fastest],
    )
    if chosen is not None:
        verdict["ratio"] = measured[chosen] / measured[fastest]
        verdict["met"] = verdict["ratio"] <= 1 + WITHIN_CHOICE
    return verdict


def compare_all(results, sources):
    """Every point against every source, each on its own: {file: verdict} per point."""
    for key, point in results["points"].items():
        rate, model = key.split("/")
        point["comparisons"] = {
            source["file"]: compare(point, source["rates"].get(rate, {}).get(model), source["rank"])
            for source in sources
        }


# ----- outputs --------------------------------------------------------------------------------
def yes_no(met):
    return "-" if met is None else "yes" if met else "**NO**"


def markdown(results, sources, repeat=None):
    points = results["points"]
    example = "/".join(EXAMPLE) if "/".join(EXAMPLE) in points else next(iter(points))
    loads = "; ".join(
        f"{key} {p['load_average_before'][0]:.2f} ({p['wall_seconds']:.0f} s, other processes "
        f"{p['other_cpu_seconds']} CPU s)"
        for key, p in points.items()
    )
    lines = [
        f"Command: `{results['command']}`; each point runs advise on the testbed's ranks as a user does: "
        f"`{points[example]['command']}` (the testbed's mpirun options, which put rank r in namespace "
        "r and keep Open MPI on the shaped links, in `benchmarks/testbed.py`).",
        "",
        f"Machine: {describe_machine(results['machine'])} Testbed (at the example's rate; the others "
        f"differ only in rate and burst): {points[example]['testbed']}.",
        "",
        f"Each point: load average (1 min) before it, how long it ran, and the CPU seconds other "
        f"processes used meanwhile: {loads}. {results['conditions']}".rstrip(),
        "",
        "Measured: the median step of `python -m benchmarks endtoend` (stock `hvd.DistributedOptimizer`) "
        "for the same rate, model and method, from each file below on its own. advise's compute is "
        "its own: forward and backward of 3 steps on its ranks (the end-to-end step also holds the "
        "optimizer step); its codec and link times are its own too.",
        "",
        f"Targets: each method's projected step within {100 * WITHIN_STEP:.0f}% of the measured one; "
        f"advise's recommendation within {100 * WITHIN_CHOICE:.0f}% of the fastest measured. Where "
        "advise recommends a setting the end-to-end run did not measure, its method is judged at "
        "that run's setting (*setting measured*: no). *Projected fastest*: the fastest of advise's "
        "rows at the end-to-end run's settings.",
        "",
    ]
    for number, source in enumerate(sources, 1):
        lines += verdicts(points, source, number)
    lines += [
        "| rate Gbit/s | model | method | setting | projected ms | "
        + " | ".join(f"measured ms [{n}] | projected / measured [{n}]" for n in range(1, len(sources) + 1))
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(sources),
    ]
    for key, point in points.items():
        rate, model = key.split("/")
        per_source = [point["comparisons"][s["file"]]["methods"] for s in sources]
        for index, m in enumerate(per_source[0]):
            cells = []
            for methods in per_source:
                measured_ms = methods[index]["measured_ms"]
                cells += (
                    ["-", "-"]
                    if measured_ms is None
                    else [f"{measured_ms:.1f}", f"{m['projected_ms'] / measured_ms:.2f}"]
                )
            lines.append(
                f"| {rate} | {model} | {m['method']} | {m['setting'] or '-'} | {m['projected_ms']:.1f} | "
                + " | ".join(cells)
                + " |"
            )
    if repeat is not None:
        lines += repeated(points, repeat, sources)
    lines += parts(points, sources[-1], len(sources)) + link_fits(points)
    rate, model = example.split("/")
    shown = (
        "re-projected (`hvd_compress.advise.format_advice`; as rank 0 printed it in `benchmarks/advise_live.json`)"
        if "reprojected" in results
        else "as rank 0 printed it (every point's in `benchmarks/advise_live.json`)"
    )
    lines += ["", f"advise's table, {model} at {rate} Gbit/s, {shown}:", "", "```", points[example]["table"], "```"]
    return "\n".join(lines) + "\n"


def repeated(points, repeat, sources):
    """This run's points against a repeat of them (``--repeat``): advise's own spread."""
    lines = [
        "",
        f"Repeat: the same points again (`{repeat['command']}`, `{repeat['file']}`); its verdicts: "
        + "; ".join(
            f"against [{n}], {line}"
            for n, source in enumerate(sources, 1)
            for line in per_rate(repeat["points"], source["file"])
        )
        + ".",
        "",
        "| rate Gbit/s | model | advise recommends (this run / repeat) | projected step ms, this run / repeat: "
        + ", ".join(REGISTERED)
        + " |",
        "|---|---|---|---|",
    ]
    for key, point in points.items():
        again = repeat["points"].get(key)
        if again is None:
            continue
        rate, model = key.split("/")
        mine, theirs = (p["comparisons"][sources[0]["file"]] for p in (point, again))
        steps = ", ".join(
            f"{a['projected_ms']:.0f} / {b['projected_ms']:.0f}" for a, b in zip(mine["methods"], theirs["methods"])
        )
        lines.append(f"| {rate} | {model} | {mine['recommended']} / {theirs['recommended']} | {steps} |")
    return lines


def parts(points, source, number):
    """Where projection and measurement part: compute, codec and exposed communication of each
    (advise's exposed communication: its step less its compute and codec)."""
    lines = [
        "",
        f"The step in parts, advise's projection / the end-to-end run [{number}] (`{source['file']}`), ms:",
        "",
        "| rate Gbit/s | model | method | compute | codec | exposed communication |",
        "|---|---|---|---|---|---|",
    ]
    for key, point in points.items():
        rate, model = key.split("/")
        for m in point["comparisons"][source["file"]]["methods"]:
            if m["measured_ms"] is not None:
                cells = " | ".join(
                    f"{mine:.0f} / {theirs:.0f}"
                    for mine, theirs in zip(m["projected_parts_ms"], m["measured_parts_ms"])
                )
                lines.append(f"| {rate} | {model} | {m['method']} | {cells} |")
    return lines


def link_fits(
    points,
    fit="advise's link model (interpolated between its probes, beyond them latency + "
    "bytes / bandwidth of the two largest)",
    line=False,
):
    """advise's link against its own largest probe, per collective and point; ``line``: the
    JSON's latency + bytes / bandwidth (a run of the model before interpolation)."""
    lines = [
        "",
        f"{fit} at its own largest probe, fitted / measured ms:",
        "",
        "| rate Gbit/s | model | " + " | ".join(COLLECTIVES) + " |",
        "|---|---|" + "---|" * len(COLLECTIVES),
    ]
    for key, point in points.items():
        rate, model = key.split("/")
        cells = []
        for collective in COLLECTIVES:
            link = point["advice"]["links"].get(collective)
            if link is None:
                cells.append("-")
                continue
            nbytes, seconds = max(((int(n), s) for n, s in link["measured"].items()))
            fitted = link["latency_s"] + nbytes / link["bytes_per_s"] if line else advise.Link(**link).seconds(nbytes)
            cells.append(f"{1e3 * fitted:.0f} / {1e3 * seconds:.0f} at {nbytes / 1e6:.1f} MB")
        lines.append(f"| {rate} | {model} | " + " | ".join(cells) + " |")
    return lines


def verdicts(points, source, number):
    """The summary table and per-rate verdicts against one end-to-end file."""
    lines = [
        f"[{number}] Against `{source['file']}` (`{source['command']}`, {source['np']} ranks, low-rank methods at "
        f"rank {source['rank']}, load average {source['load']:.2f} before it):",
        "",
        "| rate Gbit/s | model | steps within 20% | met | advise recommends | setting measured | "
        "measured fastest | recommended's step / fastest's | met | projected fastest | "
        "its step / fastest's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, point in points.items():
        rate, model = key.split("/")
        c = point["comparisons"][source["file"]]
        compared = [m for m in c["methods"] if m["met"] is not None]
        if not compared:
            lines.append(
                f"| {rate} | {model} | not measured by end to end | - | {c['recommended']} | - | - | - | - | "
                f"{c['projected_fastest']} | - |"
            )
            continue
        ratio = f"{c['ratio']:.2f}" if "ratio" in c else "its method not measured"
        lines.append(
            f"| {rate} | {model} | {sum(m['met'] for m in compared)} of {len(compared)} | "
            f"{yes_no(all(m['met'] for m in compared))} | {c['recommended']} | "
            f"{'yes' if c['setting_measured'] else 'no'} | {c['fastest']} | {ratio} | {yes_no(c.get('met'))} | "
            f"{c['projected_fastest']} | {c['projected_fastest_ratio']:.2f} |"
        )
    return lines + ["", "Per rate (both models): " + "; ".join(per_rate(points, source["file"])) + ".", ""]


def per_rate(points, file):
    """ "1 Gbit/s: steps NOT met, recommendation met" for each rate, against one end-to-end file."""
    texts = []
    for rate in dict.fromkeys(key.split("/")[0] for key in points):
        comparisons = [p["comparisons"][file] for key, p in points.items() if key.split("/")[0] == rate]
        steps = [m["met"] for c in comparisons for m in c["methods"]]
        choices = [c.get("met") for c in comparisons]
        if None in steps:
            texts.append(f"{rate} Gbit/s: not measured by end to end")
            continue
        texts.append(
            f"{rate} Gbit/s: steps within 20% {'met' if all(steps) else 'NOT met'}, "
            f"recommendation within 10% {'NOT met' if not all(choices) else 'met'}"
        )
    return texts


def options() -> argparse.ArgumentParser:
    """The command's options, as ``main`` reads them and ``render`` reads them back from the record."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks advise_live", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.5, 1.0, 10.0],
        help="link rates, Gbit/s",
    )
    parser.add_argument("--models", type=lambda text: text.split(","), default=list(MODELS))
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument(
        "--from",
        dest="sources",
        type=lambda text: [Path(p) for p in text.split(",")],
        default=[DOCS / "benchmarks" / "endtoend.json"],
        help="end-to-end JSON files, comma-separated, each compared on its own",
    )
    parser.add_argument("--job-timeout", type=int, default=900, help="seconds for one advise run")
    parser.add_argument("--repeat", type=Path, help="another run's advise_live.json: shown beside this one")
    parser.add_argument(
        "--conditions", default="", help="a sentence on the machine's state during the run, for the section"
    )
    parser.add_argument(
        "--reproject",
        action="store_true",
        help="no run: project the stored points' measurements again with the current model",
    )
    parser.add_argument("--out", type=Path, default=DOCS)
    return parser


def render(out: Path) -> None:
    """Rewrites the page from the stored JSON: the re-projected record where there is one, with the
    end-to-end files and the repeat its command named, read from ``out``/benchmarks."""
    results = stored(out, "advise_live_reprojected") or stored(out, "advise_live")
    args = options().parse_args(shlex.split(results.get("reprojected", results["command"]))[4:])
    sources = [dict(measured_runs(out / "benchmarks" / source.name), file=str(source)) for source in args.sources]
    compare_all(results, sources)
    repeat = None
    if args.repeat:
        stem = args.repeat.stem + ("_reprojected" if args.reproject else "")
        repeat = {**stored(out, stem), "file": str(args.repeat)}
        compare_all(repeat, sources)
    text = markdown(results, sources, repeat)
    if args.reproject:
        before = stored(out, "advise_live")
        compare_all(before, sources)
        text = reprojected_note(before, results, sources) + text
    write_section(out, SECTION, text)


def main(argv=None):
    parser = options()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    unknown = [model for model in args.models if model not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    sources = [measured_runs(source) for source in args.sources]
    (args.out / "benchmarks").mkdir(parents=True, exist_ok=True)
    path = args.out / "benchmarks" / "advise_live.json"
    before = None
    if args.reproject:
        before = json.loads(path.read_text())
        compare_all(before, sources)
        results = reproject(before)
        path = path.with_name("advise_live_reprojected.json")
    else:
        results = sweep(args, path)
    compare_all(results, sources)
    save_record(path, results)
    repeat = None
    if args.repeat:
        repeat = {**json.loads(args.repeat.read_text()), "file": str(args.repeat)}
        if args.reproject:
            repeat = {**reproject(repeat), "file": str(args.repeat)}
            save_record(path.parent / (args.repeat.stem + "_reprojected.json"), repeat)
        compare_all(repeat, sources)
    text = markdown(results, sources, repeat)
    if before is not None:
        text = reprojected_note(before, results, sources) + text
    write_section(args.out, SECTION, text)
    for source in sources:
        for line in per_rate(results["points"], source["file"]):
            say(f"against {source['file']}: {line}")

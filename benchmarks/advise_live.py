"""advise run live on the emulated cluster, against the step times the end-to-end benchmark measured.

    python -m benchmarks advise_live [--rates 0.5,1,10] [--models charlm,cnn] [--np 4]
        [--from docs/benchmarks/endtoend.json[,more.json]] [--job-timeout 900] [--out docs/]

For every rate an :mod:`emulated cluster <benchmarks.testbed>` of ``--np`` ranks is built, and
on it, per model, the advise command line runs exactly as a user runs it under ``mpirun``
(``OMP_NUM_THREADS=1``, as in the end-to-end jobs)::

    python -m hvd_compress.advise --model examples.models:<model> --json <file>

Rank 0's printed table and its JSON are kept in ``<out>/benchmarks/advise_live.json``, one
point per (rate, model), saved after each: rerunning the command resumes with the first missing
point.

Each point is then compared with the end-to-end run (``--from``: its JSON files, rates merged
in order) at the same rate and model, for the methods that run measured with stock
``hvd.DistributedOptimizer`` (S-SGD, FP16, PowerSGD, ACP-SGD, ScaleCom; ``benchmarks/advise_check.py``):

* each method's projected step, in advise's row of the same registry name and the setting the
  end-to-end run used (the low-rank methods at its ``rank``, the others at the registry's
  default), within 20% of the measured median;
* advise's recommendation ("do not compress" is S-SGD): its method's measured median within 10%
  of the fastest measured of those methods. The end-to-end run measured each method at one
  setting, so a recommended setting it did not run is judged by its method at that run's
  setting, and the table says so. Alongside: the fastest of advise's rows at those settings.

A rate the end-to-end run did not measure gets advise's tables and no verdict. Writes the
"advise live on the emulated cluster" section of ``<out>/benchmarks.md``.
"""
import argparse
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.advise_check import REGISTERED, WITHIN_CHOICE, WITHIN_STEP
from benchmarks.report import DOCS, OthersShare, checkout_pythonpath, describe_machine, machine, say, write_section
from benchmarks.testbed import emulated_cluster, run_bounded
from hvd_compress import advise
from hvd_compress.registry import COMPRESSORS

SECTION = "advise live on the emulated cluster"
MODELS = {"charlm": "examples.models:charlm", "cnn": "examples.models:cnn"}
EXAMPLE = ("1", "charlm")  # the point whose table the section shows whole
METHOD_OF = {name: method for method, (name, _) in REGISTERED.items()}


# ----- running advise -------------------------------------------------------------------------
def advise_point(cluster, model, timeout):
    """advise's CLI on every rank of ``cluster``: rank 0's table, its JSON, and what the job took."""
    with tempfile.TemporaryDirectory() as scratch:
        advice_path = Path(scratch) / "advice.json"
        argv = [sys.executable, "-m", "hvd_compress.advise", "--model", MODELS[model], "--json", str(advice_path)]
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_pythonpath()}
        load, others = os.getloadavg(), OthersShare()
        returncode, stdout, stderr = run_bounded(cluster.mpirun_command(argv, env), timeout,
                                                 cluster.mpirun_environment(env))
        other_seconds = others.seconds()
        if returncode != 0 or not advice_path.exists():
            raise RuntimeError(f"advise on {model} at {cluster.rate_gbit:g} Gbit/s failed (exit {returncode}):\n"
                               f"{stdout[-2000:]}\n{stderr[-4000:]}")
        advice = json.loads(advice_path.read_text())
    return {"command": shlex.join(["mpirun", "-np", str(cluster.ranks), *argv[:-1], "advice.json"]),
            "testbed": cluster.describe(), "table": stdout.strip("\n"), "advice": advice,
            "load_average_before": load, "other_cpu_seconds": round(other_seconds, 1)}


def sweep(args, path):
    """Every (rate, model) point not yet in ``path``, saved after each."""
    results = json.loads(path.read_text()) if path.exists() else {}
    if results.get("np") != args.np:
        results = {"np": args.np, "points": {}}
    results.update(command=command_line(), machine=machine())

    def missing(rate):
        return [model for model in args.models if f"{rate:g}/{model}" not in results["points"]]

    for rate in args.rates:
        if not missing(rate):
            continue
        with emulated_cluster(args.np, rate) as cluster:
            for model in missing(rate):
                point = advise_point(cluster, model, args.job_timeout)
                results["points"][f"{rate:g}/{model}"] = point
                path.write_text(json.dumps(results, indent=1) + "\n")
                say(f"{rate:g} Gbit/s {model}: {point['advice']['recommendation']}")
    return results


# ----- comparing ------------------------------------------------------------------------------
def endtoend_setting(name, rank):
    """advise's label of the setting the end-to-end run built ``name`` with: ``rank`` for the
    low-rank methods, the registry's default otherwise (as ``endtoend.build_compression``)."""
    defaults = COMPRESSORS[name].defaults
    return ",".join(f"{key}={rank if key == 'rank' else value}" for key, value in defaults.items()
                    if key in advise.SETTINGS)


def recommended(recommendation):
    """(registry name, setting) of advise's advice line; ("none", "") for "do not compress"."""
    match = re.match(r"compress with (\S+)(?: (\S+))?:", recommendation)
    return ("none", "") if match is None else (match.group(1), match.group(2) or "")


def measured_runs(sources):
    """The end-to-end JSON files merged: {"rank", "np", "rates": {rate: {model: {method: run}}}, "files"}."""
    merged = {"rates": {}, "files": []}
    for source in sources:
        data = json.loads(source.read_text())
        for key in ("np", "rank"):
            if merged.setdefault(key, data[key]) != data[key]:
                raise ValueError(f"--from: {source} has {key} {data[key]}, another file {merged[key]}")
        for rate, entry in data["rates"].items():
            merged["rates"].setdefault(rate, {}).update(entry["models"])
        merged["files"].append(str(source))
    return merged


def compare(point, runs, rank):
    """One point against the measured runs of its rate and model (None: not measured)."""
    rows = {(c["method"], c["setting"]): c["step_ms"] for c in point["advice"]["candidates"]}
    methods = []
    for method, (name, _) in REGISTERED.items():
        setting = endtoend_setting(name, rank)
        measured = runs[method]["step_ms"]["median"] if runs and method in runs else None
        projected = rows[(name, setting)]
        methods.append({"method": method, "setting": setting, "projected_ms": projected, "measured_ms": measured,
                        "met": None if measured is None else abs(projected / measured - 1) <= WITHIN_STEP})
    name, setting = recommended(point["advice"]["recommendation"])
    verdict = {"methods": methods, "recommended": f"{name} {setting}".strip(),
               "recommended_as": METHOD_OF.get(name),
               "projected_fastest": min(methods, key=lambda m: m["projected_ms"])["method"]}
    measured = {m["method"]: m["measured_ms"] for m in methods if m["measured_ms"] is not None}
    if len(measured) < len(methods):
        return verdict
    fastest = min(measured, key=measured.get)
    chosen = verdict["recommended_as"]
    verdict.update(fastest=fastest, setting_measured=chosen is not None and setting == endtoend_setting(name, rank),
                   projected_fastest_ratio=measured[verdict["projected_fastest"]] / measured[fastest])
    if chosen is not None:
        verdict["ratio"] = measured[chosen] / measured[fastest]
        verdict["met"] = verdict["ratio"] <= 1 + WITHIN_CHOICE
    return verdict


def compare_all(results, measured):
    for key, point in results["points"].items():
        rate, model = key.split("/")
        point["comparison"] = compare(point, measured["rates"].get(rate, {}).get(model), measured["rank"])


# ----- outputs --------------------------------------------------------------------------------
def yes_no(met):
    return "-" if met is None else "yes" if met else "**NO**"


def markdown(results, measured):
    points = results["points"]
    example = "/".join(EXAMPLE) if "/".join(EXAMPLE) in points else next(iter(points))
    loads = "; ".join(f"{key} {p['load_average_before'][0]:.2f} (other processes {p['other_cpu_seconds']} CPU s)"
                      for key, p in points.items())
    lines = [f"Command: `{results['command']}`; each point runs advise on the testbed's ranks as a user does: "
             f"`{points[example]['command']}` (the testbed's mpirun options, which put rank r in namespace "
             "r and keep Open MPI on the shaped links, in `benchmarks/testbed.py`).", "",
             f"Machine: {describe_machine(results['machine'])} Testbed: {points[example]['testbed']}.", "",
             f"Load average (1 min) before each point, and CPU seconds other processes used during it: {loads}.", "",
             f"Measured: the end-to-end run's median step ({', '.join(measured['files'])}: {measured['np']} ranks, "
             f"low-rank methods at rank {measured['rank']}, stock `hvd.DistributedOptimizer`). advise's "
             "compute is its own: forward and backward of 3 steps on its ranks (the end-to-end step "
             "also holds the optimizer step); its codec and link times are its own too.", "",
             f"Targets: each method's projected step within {100 * WITHIN_STEP:.0f}% of the measured one; "
             f"advise's recommendation within {100 * WITHIN_CHOICE:.0f}% of the fastest measured. Where "
             "advise recommends a setting the end-to-end run did not measure, its method is judged at "
             "that run's setting (*setting measured*: no).", "",
             "| rate Gbit/s | model | steps within 20% | met | advise recommends | setting measured | "
             "measured fastest | recommended's step / fastest's | met | projected fastest (of these) | "
             "its step / fastest's |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, point in points.items():
        rate, model = key.split("/")
        c = point["comparison"]
        compared = [m for m in c["methods"] if m["met"] is not None]
        if not compared:
            lines.append(f"| {rate} | {model} | not measured by end to end | - | {c['recommended']} | - | - | - | - | "
                         f"{c['projected_fastest']} | - |")
            continue
        ratio = f"{c['ratio']:.2f}" if "ratio" in c else "its method not measured"
        lines.append(f"| {rate} | {model} | {sum(m['met'] for m in compared)} of {len(compared)} | "
                     f"{yes_no(all(m['met'] for m in compared))} | {c['recommended']} | "
                     f"{'yes' if c['setting_measured'] else 'no'} | {c['fastest']} | {ratio} | {yes_no(c.get('met'))} | "
                     f"{c['projected_fastest']} | {c['projected_fastest_ratio']:.2f} |")
    lines += ["", "Per rate (both models): " + "; ".join(per_rate(points)) + ".", "",
              "| rate Gbit/s | model | method | setting | measured ms | projected ms | projected / measured |",
              "|---|---|---|---|---|---|---|"]
    for key, point in points.items():
        rate, model = key.split("/")
        for m in point["comparison"]["methods"]:
            measured_ms = "-" if m["measured_ms"] is None else f"{m['measured_ms']:.1f}"
            ratio = "-" if m["measured_ms"] is None else f"{m['projected_ms'] / m['measured_ms']:.2f}"
            lines.append(f"| {rate} | {model} | {m['method']} | {m['setting'] or '-'} | {measured_ms} | "
                         f"{m['projected_ms']:.1f} | {ratio} |")
    rate, model = example.split("/")
    lines += ["", f"advise's table as rank 0 printed it, {model} at {rate} Gbit/s (every point's in "
              "`benchmarks/advise_live.json`):", "", "```", points[example]["table"], "```"]
    return "\n".join(lines) + "\n"


def per_rate(points):
    """"1 Gbit/s: steps NOT met, recommendation met" for each rate."""
    texts = []
    for rate in dict.fromkeys(key.split("/")[0] for key in points):
        comparisons = [p["comparison"] for key, p in points.items() if key.split("/")[0] == rate]
        steps = [m["met"] for c in comparisons for m in c["methods"]]
        choices = [c.get("met") for c in comparisons]
        if None in steps:
            texts.append(f"{rate} Gbit/s: not measured by end to end")
            continue
        texts.append(f"{rate} Gbit/s: steps within 20% {'met' if all(steps) else 'NOT met'}, "
                     f"recommendation within 10% {'NOT met' if not all(choices) else 'met'}")
    return texts


def command_line():
    return " ".join(["python -m benchmarks advise_live"] + [shlex.quote(a) for a in sys.argv[1:]])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks advise_live", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda text: [float(v) for v in text.split(",")], default=[0.5, 1.0, 10.0],
                        help="link rates, Gbit/s")
    parser.add_argument("--models", type=lambda text: text.split(","), default=list(MODELS))
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--from", dest="sources", type=lambda text: [Path(p) for p in text.split(",")],
                        default=[DOCS / "benchmarks" / "endtoend.json"], help="end-to-end JSON files")
    parser.add_argument("--job-timeout", type=int, default=900, help="seconds for one advise run")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    unknown = [model for model in args.models if model not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    measured = measured_runs(args.sources)
    (args.out / "benchmarks").mkdir(parents=True, exist_ok=True)
    path = args.out / "benchmarks" / "advise_live.json"
    results = sweep(args, path)
    compare_all(results, measured)
    path.write_text(json.dumps(results, indent=1) + "\n")
    write_section(args.out / "benchmarks.md", SECTION, markdown(results, measured))
    for line in per_rate(results["points"]):
        say(line)


if __name__ == "__main__":
    main()

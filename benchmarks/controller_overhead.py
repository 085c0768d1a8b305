"""Controller overhead: what L-GreCo's decisions and GraVAC's gain measurements cost, on the
gradient shapes of real models, and whether any rank stalls waiting for a decision.

One process, one torch thread, the local transport (a world of one). Gradients are synthetic
and seeded: each matrix a rank-16 signal with power-law singular values plus noise, so that the
error tables have the spread of real gradients. For each shape set and L-GreCo over PowerSGD
rank 4, ACP-SGD rank 4, Top-K 1% and QSGD 4 bits:

* **decision**: the seconds rank 0's background thread takes for one decision (error tables,
  then the DP), from ``Decision.seconds``; for the low-rank methods also with the exact SVD (the
  error tables before the randomized range finder) and whether both choose the same settings;
* **accumulation**: what rank 0 adds to every step, summing the gradients the next decision
  analyses (``StagedSums``, as ``LGreCo.begin`` does), median of 3 steps;
* **stall**: the longest time ``end_step`` blocked while the decision was due, with training
  emulated as steps of ``--step-ms`` (the main thread sleeps, as a rank whose step runs on a
  GPU leaves its CPU to the decision thread). Four schedules: the default one (decisions every
  ``--decide-every`` steps) with ``apply_delay=10`` (the old default) and ``"auto"`` (the new
  one), and a short one (decisions every 4 steps) with ``apply_delay=1`` and ``"auto"``;
* **overhead**: (accumulation x the steps summed per decision + stall at the default schedule)
  / (decide_every x step): the training time it adds, at L-GreCo's configured default
  ``accumulate_steps`` (the last 10 steps before a decision, as the authors' code). The
  decision's own CPU time runs beside training, not in its way; its share of the same window
  is given too. Also the overhead with ``accumulate_steps=None`` (every step of the period
  summed): the same formula with ``decide_every`` accumulations.

And for GraVAC over Top-K 1%: the per-step cost of its multi-level gain measurement (the
energies at theta_min and the candidate of every tunable layer, ``Tuning.begin_measured``),
next to Top-K 1%'s own codec (compress + error feedback + decompress of every gradient, as
"Codec cost" does, in a world of one) timed in the same run on the same gradients. A step that
sends theta_min or the candidate measures within its compression: the cost is the codec step
with ``begin_measured`` less the same step with ``begin``, at that setting. A dense step
measures apart (``measured_energies`` of every tunable layer). The fastest of 5 interleaved
steps; the target is a measurement no dearer than the codec (ratio <= 1.0x).

Results resume point by point from ``<out>/benchmarks/controller_overhead.json``; the page
"Controller overhead" (``<out>/benchmarks/controller-overhead.md``) is rewritten after each. ``--quick``: the tiny
shape set and 20 ms steps, a smoke test.

``--decision-cost`` (default shapes: bert-base) times only the step that makes L-GreCo's first
decision, at L-GreCo's defaults over PowerSGD rank 4 on seeded normal gradients, against the
same decision with the exact SVD's error rows, the two in turn for ``--rounds`` rounds: wall
and CPU seconds of the decision thread, and the load average, of each. The target is a decision
at most ``DECISION_COST_TARGET`` of the exact one's time. Writes ``decision_cost.json`` and the
section "L-GreCo decision cost".
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shlex
import statistics
import time
from pathlib import Path

import torch

import hvd_compress as hc
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, notes_lines, resumed_section, save_record, stored, write_section
from benchmarks.shapes import DESCRIPTIONS, parameter_count, shape_set
from hvd_compress.comm.simulated import SimulatedWorld, exchange_alone, run_alone
from hvd_compress.compressors.feedback import StagedSums
from hvd_compress.control.lgreco import LGreCoConfig
from hvd_compress.maths import error_tables as error_maths

logger = logging.getLogger(__name__)

SECTION = "Controller overhead"
COST_SECTION = "L-GreCo decision cost"
COST_METHOD = "PowerSGD rank 4"
# The decision with the randomized range finder against the same with the exact SVD's rows.
DECISION_COST_TARGET = 0.12
METHODS = {
    "PowerSGD rank 4": ("powersgd", {"rank": 4}),
    "ACP-SGD rank 4": ("acpsgd", {"rank": 4}),
    "Top-K 1%": ("topk", {"density": 0.01}),
    "QSGD 4 bits": ("qsgd", {"bits": 4}),
}
LOWRANK = {"PowerSGD rank 4", "ACP-SGD rank 4"}
SHORT_EVERY = 4  # the short schedule: a decision every 4 steps (the ResNet-50 run)
SIGNAL_RANK = 16
REPEATS = 3
GRAVAC_REPEATS = 5
# The targets: decision seconds per shape set, and the overhead's share of training time.
DECISION_TARGETS = {"bert-base": 2.0, "transformer-xl": 5.0}
OVERHEAD_TARGET = 0.01
# What L-GreCo sums per decision by default (the overhead column), read from its configuration.
DEFAULT_ACCUMULATION = next(f.default for f in dataclasses.fields(LGreCoConfig) if f.name == "accumulate_steps")


def synthetic_gradients(shapes, seed=0):
    """name -> gradient: matrices (conv kernels flattened to out x rest) a rank-16 signal with
    singular values falling as 1/i plus noise at a tenth of the signal's scale; vectors noise."""
    g = torch.Generator().manual_seed(seed)
    grads = {}
    for name, shape in shapes:
        if len(shape) == 1:
            grads[name] = torch.randn(shape, generator=g)
            continue
        n, m = shape[0], math.prod(shape[1:])
        r = min(SIGNAL_RANK, n, m)
        left = torch.randn(n, r, generator=g) / torch.arange(1, r + 1)
        signal = left @ torch.randn(r, m, generator=g) / math.sqrt(r)
        grads[name] = (signal + 0.1 * torch.randn(n, m, generator=g)).view(shape)
    return grads


def schedules(decide_every):
    """label -> (decide_every, apply_delay)."""
    return {
        "default, apply_delay 10": (decide_every, 10),
        "default, auto": (decide_every, "auto"),
        "short, apply_delay 1": (SHORT_EVERY, 1),
        "short, auto": (SHORT_EVERY, "auto"),
    }


def wrapped(method):
    """A fresh compressor of ``method`` (a METHODS label) for the simulated world."""
    name, settings = METHODS[method]
    return hc.COMPRESSORS[name].build(None, **settings)


def first_decision(method, grads, decide_every, apply_delay, step_seconds, max_steps=2000):
    """(the first Decision, the longest end_step) of L-GreCo over ``method``: one real step
    accumulates the gradients, the decision is submitted at its end, and emulated steps of
    ``step_seconds`` follow until it has taken effect."""
    lgreco = hc.LGreCo(
        wrapped(method), warmup_steps=1, decide_every=decide_every, apply_delay=apply_delay, transport="local"
    )
    SimulatedWorld([lgreco]).step([grads])  # the decision starts in this step's end_step
    longest = 0.0
    for _ in range(max_steps):
        if lgreco.decisions:
            return lgreco.decisions[0], longest
        time.sleep(step_seconds)  # the step's compute, on the accelerator
        started = time.perf_counter()
        lgreco.end_step()
        longest = max(longest, time.perf_counter() - started)
    raise RuntimeError(f"{method}: no decision took effect within {max_steps} steps")


def accumulation_seconds(method, grads):
    """Median seconds per step of rank 0's accumulation of the tunable gradients."""
    inner = wrapped(method)
    tunable = {n: g for n, g in grads.items() if inner.tuning.tunable(tuple(g.shape))}
    sums, times = StagedSums(), []
    for _ in range(REPEATS + 1):  # the first allocates the sums
        started = time.perf_counter()
        for n, g in tunable.items():
            sums.add(n, g)
        sums.commit()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def gravac_seconds(grads):
    """GraVAC over Top-K 1%: {what: median seconds per step} for Top-K 1%'s codec, and for each
    factor GraVAC may send (theta_min, the candidate) the codec at its setting with and without
    the gain measurement; for dense steps the measurement alone."""
    policy = hc.GraVAC(hc.TopK(density=0.01)).policy
    factors = {"theta_min": policy.theta_min, "candidate": policy.candidate}
    reference = hc.TopK(density=0.01)
    tunable = {n: g for n, g in grads.items() if reference.tuning.tunable(tuple(g.shape))}
    levels = {
        n: [reference.tuning.setting_for_factor(g.shape, cf) for cf in factors.values()] for n, g in tunable.items()
    }

    def codec_step(compressor, measure):
        def step():
            for n, g in grads.items():
                if measure and n in tunable:
                    run_alone(compressor.tuning.begin_measured(n, g, levels[n], memos.setdefault(n, {}))[0])
                else:
                    exchange_alone(compressor, n, g)
            compressor.end_step()

        return step

    memos = {}
    steps = {"codec": codec_step(reference, False)}
    for label, index in (("theta_min", 0), ("candidate", 1)):
        at_factor = hc.TopK(density=0.01)
        for n in tunable:
            at_factor.set_setting(n, levels[n][index])
        steps[f"{label} codec"] = codec_step(at_factor, False)
        steps[f"{label} measured"] = codec_step(at_factor, True)
    apart = hc.TopK(density=0.01)
    steps["dense measurement"] = lambda: [
        apart.tuning.measured_energies(n, g, levels[n], memos.setdefault(n, {})) for n, g in tunable.items()
    ]
    times = {label: [] for label in steps}
    for repeat in range(GRAVAC_REPEATS + 1):  # the first allocates buffers and residuals
        for label, step in steps.items():  # interleaved: load on the machine hits all alike
            started = time.perf_counter()
            step()
            if repeat:
                times[label].append(time.perf_counter() - started)
    # The fastest: the measurement is a difference of codec steps, which other processes on
    # the machine only lengthen.
    seconds = {label: min(values) for label, values in times.items()}
    record = {"codec_seconds": seconds["codec"], "dense_measurement_seconds": seconds["dense measurement"]}
    for label in factors:
        record[f"{label}_codec_seconds"] = seconds[f"{label} codec"]
        record[f"{label}_measurement_seconds"] = seconds[f"{label} measured"] - seconds[f"{label} codec"]
    return record


@contextlib.contextmanager
def exact_lowrank_rows():
    """Within: the low-rank error rows by the exact SVD (what the range finder replaces)."""
    randomized = error_maths.lowrank_errors_of_batch
    error_maths.lowrank_errors_of_batch = lambda matrices, ranks: randomized(matrices, ranks, exact=True)
    try:
        yield
    finally:
        error_maths.lowrank_errors_of_batch = randomized


def measure_lgreco(method, grads, args):
    step = args.step_ms / 1000
    record = {"accumulation_seconds": accumulation_seconds(method, grads), "stall_seconds": {}, "delay_steps": {}}
    for label, (every, delay) in schedules(args.decide_every).items():
        decision, stall = first_decision(method, grads, every, delay, step)
        record["stall_seconds"][label] = stall
        record["delay_steps"][label] = decision.effective_step - decision.decided_at
        record.setdefault("decision_seconds", []).append(decision.seconds)
        record.setdefault("settings", decision.settings)
    if method in LOWRANK:
        with exact_lowrank_rows():
            exact, _ = first_decision(method, grads, args.decide_every, 1, step)
        record["exact_decision_seconds"] = exact.seconds
        record["same_settings_as_exact"] = exact.settings == record["settings"]
        differing = [n for n in exact.settings if exact.settings[n] != record["settings"][n]]
        record["differing_layers"] = len(differing)
    record["decision_seconds"] = statistics.median(record["decision_seconds"])
    del record["settings"]
    return record


def random_gradients(shapes, seed=0):
    """name -> seeded standard normal gradient: the decision's cost does not follow the spectrum."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes}


def timed_first_decision(grads, exact):
    """(the first Decision of L-GreCo at its defaults over PowerSGD rank 4, its thread's CPU
    seconds): one step accumulates the gradients and submits it, the next waits for it
    (``apply_delay=1``); ``exact``: the error rows by the exact SVD."""
    # The exact decision outlasts the default timeout on a loaded machine.
    lgreco = hc.LGreCo(wrapped(COST_METHOD), warmup_steps=1, apply_delay=1, transport="local", timeout=3600)
    cpu = []
    submit = lgreco.service.submit

    def timed(compute):
        def run():
            started = time.thread_time()  # one torch thread: all of the decision's CPU is here
            decision = compute()
            cpu.append(time.thread_time() - started)
            return decision

        submit(run)

    lgreco.service.submit = timed
    with exact_lowrank_rows() if exact else contextlib.nullcontext():
        SimulatedWorld([lgreco]).step([grads])
        lgreco.end_step()  # the exchange: waits for the decision
    return lgreco.decisions[0], cpu[0]


def measure_decision_cost(grads, rounds):
    """``rounds`` of L-GreCo's decision and the exact one in turn: seconds, CPU seconds, the
    1-minute load average before each, and whether every round chose the same settings."""
    record = {"lgreco": [], "exact": []}
    settings = {"lgreco": [], "exact": []}
    for _ in range(rounds):
        for kind in ("lgreco", "exact"):  # in turn: other processes' load hits both alike
            load = os.getloadavg()[0]
            decision, cpu = timed_first_decision(grads, kind == "exact")
            record[kind].append({"seconds": decision.seconds, "cpu_seconds": cpu, "load": load})
            settings[kind].append(decision.settings)
            logger.info("%s: %.2f s (CPU %.2f s), load %.2f", kind, decision.seconds, cpu, load)
    record["same_settings_every_round"] = all(s == settings["lgreco"][0] for s in settings["lgreco"])
    differing = [n for n in settings["exact"][0] if settings["exact"][0][n] != settings["lgreco"][0].get(n)]
    record["differing_layers_from_exact"] = len(differing)
    record["layers_decided"] = len(settings["lgreco"][0])
    return record


# ----- the report -----------------------------------------------------------------------------
def overhead(record, args, accumulations=DEFAULT_ACCUMULATION):
    """(share of training time added, background CPU share) at the default schedule, auto,
    with ``accumulations`` steps summed per decision (None: every step of the period)."""
    window = args.decide_every * args.step_ms / 1000
    summed = args.decide_every if accumulations is None else min(accumulations, args.decide_every)
    added = record["accumulation_seconds"] * summed + record["stall_seconds"]["default, auto"]
    return added / window, record["decision_seconds"] / window


def markdown(results, args):
    lines = [
        f"`{results['command']}`",
        "",
        describe_machine(results["machine"])
        + f" One torch thread; steps emulated at {args.step_ms:g} ms, decisions every "
        f"{args.decide_every} steps (default schedule) or {SHORT_EVERY} (short).",
        "",
        "Seconds of one L-GreCo decision on rank 0 (its background thread), rank 0's added "
        "work per step (summing the gradients the next decision analyses), and the longest "
        "wait at a decision's exchange (the stall every rank sees), by schedule; the "
        "overhead is the training time added at the default schedule with "
        "`apply_delay=\"auto\"`, as a share of "
        f"{args.decide_every} steps of {args.step_ms:g} ms (in brackets: the decision's CPU "
        "time, which runs beside training, on the same scale).",
        "",
        "| shapes | L-GreCo over | decision s | exact SVD s (same choice) | accumulate ms/step | "
        "stall s: default, delay 10 | default, auto | short, delay 1 | short, auto (delay steps) | "
        f"overhead (accumulate_steps={DEFAULT_ACCUMULATION}, the default) | overhead, accumulate_steps=None |",
        "|---" * 11 + "|",
    ]
    for key, record in results["points"].items():
        if key.endswith("/GraVAC"):
            continue
        shapes, method = key.split("/")
        stall = record["stall_seconds"]
        exact = "-"
        if "exact_decision_seconds" in record:
            same = "yes" if record["same_settings_as_exact"] else f"{record['differing_layers']} layers differ"
            exact = f"{record['exact_decision_seconds']:.2f} ({same})"
        added, background = overhead(record, args)
        windowed, _ = overhead(record, args, None)
        lines.append(
            f"| {shapes} | {method} | {record['decision_seconds']:.2f} | {exact} | "
            f"{1000 * record['accumulation_seconds']:.1f} | {stall['default, apply_delay 10']:.2f} | "
            f"{stall['default, auto']:.3f} | {stall['short, apply_delay 1']:.2f} | "
            f"{stall['short, auto']:.3f} ({record['delay_steps']['short, auto']}) | "
            f"{100 * added:.2f}% ({100 * background:.2f}%) | {100 * windowed:.2f}% |"
        )
    gravac = {k.split("/")[0]: r for k, r in results["points"].items() if k.endswith("/GraVAC")}
    if gravac:
        lines += [
            "",
            "GraVAC over Top-K 1%: its gain measurement per step (the energies at theta_min and the "
            "candidate of every tunable layer) against Top-K 1%'s codec (compress + error feedback + "
            "decompress of every gradient, a world of one) in the same run. A step sending theta_min "
            "or the candidate derives the energies from its own compression (`begin_measured`): the "
            "cost is that step less the same codec step without them, both at the factor's setting "
            "(whose codec column is given too). A dense step (`scale_down_to=\"dense\"` only) "
            "measures apart. ms/step, the fastest of 5 interleaved steps; ratio: measurement / Top-K 1%'s "
            "codec, target <= 1.0x. A measurement is a difference of codec steps that take seconds at "
            "theta_min's and the candidate's densities (10% and 5%, where Top-K's selection falls "
            "back to `torch.topk`), so it carries their noise: a negative one is smaller than it.",
            "",
            "| shapes | Top-K 1% codec | theta_min: codec / measurement (ratio) | "
            "candidate: codec / measurement (ratio) | dense step: measurement (ratio) | target |",
            "|---|---|---|---|---|---|",
        ]
        for shapes, r in gravac.items():
            codec = r["codec_seconds"]
            cells, ratios = [], []
            for label in ("theta_min", "candidate"):
                ratio = r[f"{label}_measurement_seconds"] / codec
                ratios.append(ratio)
                cells.append(
                    f"{1000 * r[f'{label}_codec_seconds']:.0f} / "
                    f"{1000 * r[f'{label}_measurement_seconds']:.1f} ({ratio:.2f}x)"
                )
            dense = r["dense_measurement_seconds"] / codec
            met = "met" if max(ratios) <= 1.0 else "MISSED"
            lines.append(
                f"| {shapes} | {1000 * codec:.1f} | {cells[0]} | {cells[1]} | "
                f"{1000 * r['dense_measurement_seconds']:.1f} ({dense:.2f}x) | {met}"
                f"{'' if dense <= 1.0 else ' (dense steps: missed)'} |"
            )
    targets = []
    for shapes, limit in DECISION_TARGETS.items():
        measured = [
            (key.split("/")[1], r["decision_seconds"])
            for key, r in results["points"].items()
            if key.startswith(shapes + "/") and "decision_seconds" in r
        ]
        if measured:
            targets.append(
                f"{shapes} decisions under {limit:g} s: "
                + ", ".join(
                    f"{method} {seconds:.2f} s {'met' if seconds < limit else 'MISSED'}" for method, seconds in measured
                )
            )
    measured = [r for r in results["points"].values() if "decision_seconds" in r]
    if measured:
        worst = max(overhead(r, args)[0] for r in measured)
        targets.append(
            f"overhead under {100 * OVERHEAD_TARGET:g}% of training time at the default "
            f"accumulate_steps={DEFAULT_ACCUMULATION}: largest {100 * worst:.2f}%, "
            f"{'met' if worst < OVERHEAD_TARGET else 'MISSED'}"
        )
        stall = max(r["stall_seconds"]["default, auto"] for r in measured)
        targets.append(f"no stall at the default schedule: longest exchange {1000 * stall:.1f} ms")
    lines += ["", "Targets: " + "; ".join(targets) + "."]
    lines += ["", "Shape sets: " + "; ".join(f"{s}: {DESCRIPTIONS[s]}" for s in args.shapes) + "."]
    return "\n".join(lines) + "\n"


def cost_markdown(results):
    lines = [
        f"`{results['command']}`",
        "",
        describe_machine(results["machine"]) + " One torch thread, the local transport (a world of one).",
        "",
        f"L-GreCo's first decision at its defaults over {COST_METHOD} (the step that makes it: error "
        "rows by the randomized range finder, then the DP), on seeded normal gradients, against the "
        "same decision with the exact SVD's rows (`torch.linalg.svdvals`), the two in turn in one "
        "process. Seconds of the decision thread (`Decision.seconds`) and its CPU seconds (what other "
        "processes' load changes least), with the 1-minute load average before each; ratio: the "
        "medians' ratio, target <= "
        f"{DECISION_COST_TARGET:g}x.",
        "",
        "| shapes | layers decided | L-GreCo s (CPU s, load) | exact s (CPU s, load) | ratio (CPU) | "
        "target | same choice every round | layers differing from exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shapes, r in results["points"].items():

        def cells(kind):
            return "; ".join(f"{x['seconds']:.2f} ({x['cpu_seconds']:.2f}, {x['load']:.1f})" for x in r[kind])

        def ratio(key):
            return statistics.median(x[key] for x in r["lgreco"]) / statistics.median(x[key] for x in r["exact"])

        met = "met" if max(ratio("seconds"), ratio("cpu_seconds")) <= DECISION_COST_TARGET else "MISSED"
        lines.append(
            f"| {shapes} | {r['layers_decided']} | {cells('lgreco')} | {cells('exact')} | "
            f"{ratio('seconds'):.3f}x ({ratio('cpu_seconds'):.3f}x) | {met} | "
            f"{'yes' if r['same_settings_every_round'] else 'no'} | {r['differing_layers_from_exact']} |"
        )
    lines += ["", "Shape sets: " + "; ".join(f"{s}: {DESCRIPTIONS[s]}" for s in results["points"]) + "."]
    return "\n".join(lines + notes_lines(results)) + "\n"


def run_decision_cost(args):
    results = {"command": command_line(args), "machine": machine(), "rounds": args.rounds, "points": {}}
    for shapes in args.shapes:
        results["points"][shapes] = measure_decision_cost(random_gradients(shape_set(shapes)), args.rounds)
    save_record(args.out / "benchmarks" / "decision_cost.json", results)
    render(args.out)


def run(args):
    results, save = resumed_section(args.out, "controller_overhead", SECTION, lambda record: markdown(record, args))
    results.setdefault("points", {})
    results.update(machine=machine(), command=command_line(args))
    for shapes in args.shapes:
        wanted = [f"{shapes}/{method}" for method in METHODS] + [f"{shapes}/GraVAC"]
        if all(key in results["points"] for key in wanted):
            continue
        listing = shape_set(shapes)
        grads = synthetic_gradients(listing)
        print(f"{shapes}: {parameter_count(listing):,} parameters", flush=True)
        for key in wanted:
            if key in results["points"]:
                continue
            method = key.split("/")[1]
            record = gravac_seconds(grads) if method == "GraVAC" else measure_lgreco(method, grads, args)
            results["points"][key] = record
            print(f"  {key}: {json.dumps(record)}", flush=True)
            save()
    # Also when every point was there: the section follows the current report.
    save()
    return results


def command_line(args):
    command = "python -m benchmarks controller_overhead"
    if args.decision_cost:
        command += f" --decision-cost --shapes {','.join(args.shapes)} --rounds {args.rounds}"
    return command + " --quick" if args.quick else command


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        help="comma-separated shape sets (benchmarks/shapes.py); default "
        "resnet50,bert-base,transformer-xl, with --decision-cost bert-base",
    )
    parser.add_argument("--step-ms", type=float, default=300.0, help="the emulated step time")
    parser.add_argument("--decide-every", type=int, default=1000, help="the default schedule's decision period")
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 20 ms steps: a smoke test")
    parser.add_argument(
        "--decision-cost", action="store_true", help="only the first decision's cost against the exact SVD's, in turn"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--decision-cost: rounds of the two in turn")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be positive, got {args.rounds}")
    default = "bert-base" if args.decision_cost else "resnet50,bert-base,transformer-xl"
    args.shapes = ["tiny"] if args.quick else (args.shapes or default).split(",")
    if args.quick and args.decision_cost:
        args.rounds = 1
    if args.quick:
        args.step_ms, args.decide_every = 20.0, 50
    for shapes in args.shapes:
        shape_set(shapes)  # a KeyError naming the known sets
    return args


def render(out: Path) -> None:
    """Rewrites each page that has stored JSON, the options from the command it records."""
    results = stored(out, "controller_overhead")
    if results is not None:
        write_section(out, SECTION, markdown(results, parse_args(shlex.split(results["command"])[4:])))
    cost = stored(out, "decision_cost")
    if cost is not None:
        write_section(out, COST_SECTION, cost_markdown(cost))


def main(argv=None):
    torch.set_num_threads(1)
    args = parse_args(argv)
    if args.decision_cost:
        logging.basicConfig(format="%(message)s")
        logger.setLevel(logging.INFO)  # this benchmark's lines, not each decision's per-layer listing
        run_decision_cost(args)
    else:
        run(args)

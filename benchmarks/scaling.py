"""Bytes per rank as ranks grow: every method's traffic counters at W = 2, 4, 8 and 32, the two
terms of its formula fitted to them, and the W past which it sends more than uncompressed.

One ``mpirun -np W`` job per W on this host: on every rank, the character LM of "Time to quality"
(``quality.LM``), each method of ``METHODS`` in turn trained ``--steps`` steps from the same
weights through ``hvd_compress.DistributedOptimizer``. Rank 0 records what its compressor's
``Traffic`` counted per step: the bytes this rank sends under the bandwidth-optimal (ring)
algorithms (all-reduce 2(W-1)/W of its payload, all-gather W-1 times it, all-to-all (W-1)/W).

The formula: a method's bytes per rank are ``a (W-1)/W + b (W-1)``: ``a`` what it sends through
all-reduces and all-to-alls (uncompressed: a = 8 bytes x the n parameters; FP16 and BF16 4n; a
two-hop b-bit all-reduce about 2n b/8 plus its scales), flat in W; ``b`` its all-gathered payload
(Top-K's values and indices, QSGD's codes and norms), which every other rank receives, so that
the bytes grow linearly in W. ``a`` and ``b`` are fitted by least squares to the measured W, the
fit's largest error is reported, and the fit is extended to W = 256. A method stops paying in
bytes at the smallest W where its formula exceeds uncompressed's, ``8n (W-1)/W``.

Writes ``<out>/benchmarks/scaling.json``, ``scaling.png`` and the page "Bytes per rank as
ranks grow" beside them; each W's job is saved as it ends and a rerun skips those
done. ``--quick``: W = 2 and 3, one step each, the registry's small methods.
"""

import argparse
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

import hvd_compress as hc
from benchmarks import quality
from benchmarks.convergence import QUICK_LM
from benchmarks.harness.jobs import add_job_options, command_line, mpirun_job, say
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import panels, resumed, save_figure, save_record, stored, write_section
from examples.workloads import charlm

RESULT_PREFIX = "SCALING_RESULT "
SECTION = "Bytes per rank as ranks grow"
WORLDS = [2, 4, 8, 32]
PROJECTED = [64, 128, 256]
UNCOMPRESSED = "uncompressed"
# The per-step methods of "Time to quality", BF16 and SignSGD, the two-hop quantized all-reduce
# and SparseLoCo's chunked top-k where the registry has them: (label, registry name or None for
# uncompressed, settings).
METHODS: List[Tuple[str, Optional[str], Dict[str, Any]]] = [
    (UNCOMPRESSED, None, {}),
    ("FP16", "fp16", {}),
    ("BF16", "bf16", {}),
    ("PowerSGD rank 8", "powersgd", {"rank": 8}),
    ("ACP-SGD rank 16", "acpsgd", {"rank": 16}),
    ("QSGD 8 bits", "qsgd", {"bits": 8}),
    ("QSGD 4 bits", "qsgd", {"bits": 4}),
    ("Top-K 10%", "topk", {"density": 0.1}),
    ("Top-K 1%", "topk", {"density": 0.01}),
    ("ScaleCom 10%", "scalecom", {"density": 0.1}),
    ("SignSGD", "signsgd", {}),
    ("Two-hop 8 bits", "qallreduce", {"bits": 8}),
    ("Two-hop 4 bits", "qallreduce", {"bits": 4}),
    ("Chunked Top-K 2%, 2 bits", "chunkedtopk", {"density": 0.02}),
]


def available_methods(quick: bool) -> List[Tuple[str, Optional[str], Dict[str, Any]]]:
    """``METHODS`` whose compressor this package has (all but uncompressed at their small
    settings with ``quick``)."""
    methods = [m for m in METHODS if m[1] is None or m[1] in hc.COMPRESSORS]
    if quick:
        methods = [
            (label, name, {} if name is None else dict(hc.COMPRESSORS[name].small)) for label, name, _ in methods[:4]
        ]
    return methods


# ----- one job: runs on every rank -------------------------------------------------------------
def measure(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Every method of ``spec`` trained ``spec["steps"]`` steps on this rank; rank 0's bytes."""
    import horovod.torch as hvd

    lm = spec["lm"]
    train_ids, _ = charlm.load_corpus(lm["max_chars"])
    record: Dict[str, Any] = {"world": hvd.size(), "methods": {}}
    for label, name, settings in spec["methods"]:
        torch.manual_seed(0)
        model = charlm.CharTransformer(**lm["model"])
        named = list(model.named_parameters())
        compression = hc.NoCompression() if name is None else hc.COMPRESSORS[name].build(named, **settings)
        optimizer = hc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), named, compression)
        generator = torch.Generator().manual_seed(hvd.rank())
        data = charlm.batches(train_ids, lm["batch_size"], model.context, generator)
        sent = []
        for _ in range(spec["steps"]):
            x, y = next(data)
            optimizer.zero_grad()
            charlm.cross_entropy(model, x, y).backward()
            optimizer.step()
            sent.append(compression.traffic.last_step[2])
        record["methods"][label] = {
            "bytes_per_step": sent,
            "parameters": sum(p.numel() for p in model.parameters()),
            "by_collective": compression.traffic.by_collective,
            "identical_ranks": identical_across_ranks(model, label),
        }
    return record


def identical_across_ranks(model: torch.nn.Module, label: str) -> bool:
    """True when every rank holds bit-identical parameters; raises ``RuntimeError`` naming the
    method and the first parameter that differs otherwise, on every rank."""
    import horovod.torch as hvd

    for name, parameter in model.named_parameters():
        rows = hvd.allgather(parameter.detach().reshape(1, -1), name=f"scaling.identity.{label}.{name}")
        if not all(torch.equal(rows[0], row) for row in rows):
            raise RuntimeError(f"{label}: parameter {name} differs between ranks at W = {hvd.size()}")
    return True


def worker(spec: Dict[str, Any]) -> None:
    import horovod.torch as hvd

    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()
    record = measure(spec)
    if hvd.rank() == 0:
        print(RESULT_PREFIX + json.dumps(record), flush=True)


# ----- the formula -----------------------------------------------------------------------------
def fit(points: Dict[int, float]) -> Tuple[float, float]:
    """(a, b) of ``a (W-1)/W + b (W-1)`` by least squares over ``points`` ({W: bytes}); b is
    clipped at 0 (no method's all-gathered payload is negative) and a refitted alone."""
    rows = [((w - 1) / w, w - 1.0, value) for w, value in points.items()]
    saa = sum(x * x for x, _, _ in rows)
    sbb = sum(y * y for _, y, _ in rows)
    sab = sum(x * y for x, y, _ in rows)
    sav = sum(x * v for x, _, v in rows)
    sbv = sum(y * v for _, y, v in rows)
    det = saa * sbb - sab * sab
    if det > 0:
        a, b = (sav * sbb - sbv * sab) / det, (saa * sbv - sab * sav) / det
        if b >= 0:
            return a, b
    return sav / saa, 0.0


def formula(a: float, b: float, world: int) -> float:
    return a * (world - 1) / world + b * (world - 1)


def crossing(a: float, b: float, dense: float) -> Optional[int]:
    """The smallest W >= 2 at which ``a (W-1)/W + b (W-1)`` exceeds uncompressed's ``dense
    (W-1)/W``; None if it never does (b = 0 and a <= dense)."""
    if b <= 1e-9 * max(a, dense):  # no all-gathered payload but float rounding in the fit
        return None if a <= dense else 2
    # (W-1)(a/W + b) > (W-1) dense/W  <=>  a + b W > dense  <=>  W > (dense - a) / b
    return max(2, math.floor((dense - a) / b) + 1)


def summary(results: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per method: bytes per step at each measured W (mean over its steps), the fit, its largest
    relative error, the projection and the crossing with uncompressed."""
    jobs = {int(w): job for w, job in results.get("jobs", {}).items()}
    labels = [label for label, _, _ in results.get("methods", [])]
    out: Dict[str, Dict[str, Any]] = {}
    for label in labels:
        measured = {
            w: sum(job["methods"][label]["bytes_per_step"]) / len(job["methods"][label]["bytes_per_step"])
            for w, job in sorted(jobs.items())
            if label in job["methods"]
        }
        if len(measured) < 2:
            continue
        a, b = fit(measured)
        error = max(abs(formula(a, b, w) - v) / v for w, v in measured.items() if v)
        out[label] = {"measured": measured, "a": a, "b": b, "fit_error": error}
    if UNCOMPRESSED in out:
        dense = out[UNCOMPRESSED]["a"]
        for entry in out.values():
            entry["crossing"] = crossing(entry["a"], entry["b"], dense)
    return out


# ----- the report ------------------------------------------------------------------------------
def megabytes(value: float) -> str:
    return f"{value / 1e6:.3g}"


def markdown(results: Dict[str, Any], figure: Optional[Path] = None) -> str:
    rows = summary(results)
    worlds = sorted({int(w) for w in results.get("jobs", {})})
    lines = [
        f"`{results['command']}`",
        "",
        f"Machine: {describe_machine(results['machine'])}",
        "",
        f"The character LM of \"Time to quality\" ({results.get('parameters', '?'):,} parameters), "
        f"each method {results['steps']} steps through `hvd_compress.DistributedOptimizer` on "
        f"`mpirun -np W` jobs of this host: megabytes one rank sends per step, as its traffic "
        f"counters count them (ring algorithms), at each measured W; then the formula "
        f"`a (W-1)/W + b (W-1)` fitted to them (its largest error over the measured W), "
        f"extended to larger W, and the W from which the method sends more than uncompressed.",
        "",
    ]
    head = (
        ["method"]
        + [f"W={w}" for w in worlds]
        + ["fit error"]
        + [f"W={w} (formula)" for w in PROJECTED]
        + ["x uncompressed at W=32", "more than uncompressed from"]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = rows.get(UNCOMPRESSED)
    for label, entry in rows.items():
        cells = [label] + [megabytes(entry["measured"][w]) if w in entry["measured"] else "-" for w in worlds]
        cells.append(f"{100 * entry['fit_error']:.1f}%")
        cells += [megabytes(formula(entry["a"], entry["b"], w)) for w in PROJECTED]
        if dense is not None:
            cells.append(f"{formula(entry['a'], entry['b'], 32) / formula(dense['a'], dense['b'], 32):.2f}x")
            where = entry.get("crossing")
            cells.append("-" if label == UNCOMPRESSED else ("never" if where is None else f"W = {where}"))
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if figure is not None:
        lines += ["", f"![Bytes per rank against W]({figure.name})"]
    checked = [w for w in worlds if all(m.get("identical_ranks") for m in results["jobs"][str(w)]["methods"].values())]
    if checked:
        lines += [
            "",
            "After its steps, every method's parameters were bit-identical on every rank "
            f"(all-gathered and compared) at W = {', '.join(map(str, checked))}.",
        ]
    lines += [line for note in results.get("notes", []) for line in ("", note)]
    return "\n".join(lines) + "\n"


def draw_figure(results: Dict[str, Any], path: Path) -> None:
    rows = summary(results)
    _, figure, (axis,) = panels(1, 7.5, 4.5)
    grid = sorted(set(range(2, 257, 2)) | set(WORLDS))
    for label, entry in rows.items():
        (line,) = axis.plot(
            grid,
            [formula(entry["a"], entry["b"], w) / 1e6 for w in grid],
            linestyle="--" if label == UNCOMPRESSED else "-",
            linewidth=1,
        )
        measured = entry["measured"]
        axis.plot(
            list(measured), [v / 1e6 for v in measured.values()], "o", color=line.get_color(), label=label, markersize=4
        )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("ranks W")
    axis.set_ylabel("MB one rank sends per step")
    axis.set_title("Measured (points) and the fitted formula (lines)")
    axis.legend(fontsize=7, ncol=2)
    save_figure(figure, path)


def render(out: Path) -> None:
    """Rewrites the page and figure from the stored JSON."""
    results = stored(out, "scaling")
    figure = out / "benchmarks" / "scaling.png"
    if summary(results):
        draw_figure(results, figure)
    write_section(out, SECTION, markdown(results, figure if figure.exists() else None))


def run(args: Any) -> Dict[str, Any]:
    methods = available_methods(args.quick)
    lm = QUICK_LM if args.quick else quality.LM
    path = args.out / "benchmarks" / "scaling.json"
    results = resumed(path)
    if results.get("methods") != [list(m) for m in methods] or results.get("steps") != args.steps:
        # Another method list or step count: the earlier jobs do not fit. The notes stay: the
        # counters are formulas of the payloads, so a method's bytes do not change between runs.
        results = {"notes": results["notes"]} if results.get("notes") else {}
    results.update(
        command=command_line("scaling", dropped=("--out", "--job-timeout")),
        machine=machine(),
        steps=args.steps,
        methods=[list(m) for m in methods],
    )
    results.setdefault("jobs", {})
    for world in args.np:
        if str(world) in results["jobs"]:
            continue
        say(f"scaling: W = {world}, {len(methods)} methods, {args.steps} steps each")
        spec = {"lm": lm, "steps": args.steps, "methods": methods}
        (record,) = mpirun_job(
            "scaling", spec, world, args.job_timeout, RESULT_PREFIX, f"scaling W={world}", expected=1
        )
        results["jobs"][str(world)] = record
        results["parameters"] = next(iter(record["methods"].values()))["parameters"]
        save_record(path, results)
        render(args.out)
    return results


def parse_args(argv: Optional[List[str]] = None) -> Any:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--np",
        type=lambda text: [int(w) for w in text.split(",")],
        default=WORLDS,
        help="the world sizes to measure, comma-separated",
    )
    parser.add_argument("--steps", type=int, default=4, help="steps per method (even: ACP-SGD alternates P and Q)")
    add_job_options(parser, 1800, "W = 2 and 3, one step, the first methods at their small settings")
    args = parser.parse_args(argv)
    if args.quick and args.np == WORLDS:
        args.np, args.steps = [2, 3], 1
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    run(args)

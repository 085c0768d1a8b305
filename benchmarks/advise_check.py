"""advise's projection model against the step times the end-to-end benchmark measured.

A check of the model only, not of advise's measurements: for every rate, model and plain
method of ``python -m benchmarks endtoend`` (S-SGD, FP16, PowerSGD, ACP-SGD, ScaleCom: the
stock ``hvd.DistributedOptimizer`` runs; the wrapper's and the controllers' runs are not what
advise projects), it feeds :func:`hvd_compress.advise.projection.project` what that run measured (compute,
codec, and the links fitted by :func:`hvd_compress.advise.projection.fit_link` to its probe jobs; the
broadcast, which the probes did not time, as an all-gather) and the messages that
:func:`hvd_compress.advise.measure.measure_codec` counts on the model's shapes, with backward taken as
two thirds of compute (as advise does when given ``--compute-ms``). It compares the projected
step with the measured median, and the fastest projected method with the fastest measured.

Writes the "advise against end to end" page, ``<out>/benchmarks/advise-against-end-to-end.md``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.endtoend import WORKLOADS
from benchmarks.harness.jobs import command_line, say
from benchmarks.harness.render import DOCS, stored, write_section
from hvd_compress import advise
from hvd_compress.advise.measure import measure_codec
from hvd_compress.advise.projection import fit_link, project

SECTION = "advise against end to end"
REGISTERED = {
    "S-SGD": ("none", {}),
    "FP16": ("fp16", {}),
    "PowerSGD": ("powersgd", {"rank": None}),
    "ACP-SGD": ("acpsgd", {"rank": None}),
    "ScaleCom": ("scalecom", {}),
}
WITHIN_STEP, WITHIN_CHOICE = 0.20, 0.10


def messages_of(model_name, rank, world):
    """{method: Candidate} with the messages advise counts (first rounds and following ones)."""
    torch.manual_seed(0)
    model = WORKLOADS[model_name](torch.Generator().manual_seed(0))[0]
    grads = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    named = list(model.named_parameters())
    counted = {}
    for method, (name, settings) in REGISTERED.items():
        settings = {key: rank if value is None else value for key, value in settings.items()}
        counted[method] = measure_codec(name, settings, grads, named, 0, world, steps=1)
    return counted


def check(measured):
    rows, choices = [], []
    messages = {model: messages_of(model, measured["rank"], measured["np"]) for model in measured["models"]}
    for rate, entry in measured["rates"].items():
        links = {
            collective: fit_link({int(n): s for n, s in by_size.items()})
            for collective, by_size in entry["probe"].items()
        }
        links.setdefault("broadcast", links["allgather"])
        for model, methods in entry["models"].items():
            projected = {}
            for method, run in methods.items():
                if method not in REGISTERED:
                    continue
                counted = messages[model][method]
                candidate = advise.Candidate(
                    method, "", 0.0, run["codec_ms"], counted.messages, serial_messages=counted.serial_messages
                )
                compute_s = run["compute_ms"] / 1e3
                project(candidate, links, compute_s, 2 * compute_s / 3)
                projected[method] = candidate.step_ms
                measured_ms = run["step_ms"]["median"]
                rows.append(
                    {
                        "rate": rate,
                        "model": model,
                        "method": method,
                        "measured_ms": measured_ms,
                        "projected_ms": candidate.step_ms,
                        "met": abs(candidate.step_ms / measured_ms - 1) <= WITHIN_STEP,
                    }
                )
            chosen = min(projected, key=projected.get)
            fastest = min(projected, key=lambda m: methods[m]["step_ms"]["median"])
            ratio = methods[chosen]["step_ms"]["median"] / methods[fastest]["step_ms"]["median"]
            choices.append(
                {
                    "rate": rate,
                    "model": model,
                    "chosen": chosen,
                    "fastest": fastest,
                    "ratio": ratio,
                    "met": ratio <= 1 + WITHIN_CHOICE,
                }
            )
    return rows, choices


def markdown(rows, choices, command, measured):
    lines = [
        f"Command: `{command}` (from the [end-to-end run](end-to-end.md): {measured['np']} ranks, "
        f"low-rank methods at rank {measured['rank']}). A check of advise's projection model fed with "
        "that run's measurements, not a run of advise on the testbed (that is "
        "[advise live on the emulated cluster](advise-live-on-the-emulated-cluster.md)); how, in "
        "`benchmarks/advise_check.py`.",
        "",
        f"Per rate: each method's projected step within {100 * WITHIN_STEP:.0f}% of the measured "
        f"median, and the method projected fastest within {100 * WITHIN_CHOICE:.0f}% of the "
        "fastest measured.",
        "",
        "| rate Gbit/s | model | steps within 20% | met | projected fastest | measured fastest | "
        "its step / fastest's | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for choice in choices:
        mine = [r for r in rows if r["rate"] == choice["rate"] and r["model"] == choice["model"]]
        lines.append(
            f"| {choice['rate']} | {choice['model']} | {sum(r['met'] for r in mine)} of {len(mine)} | "
            f"{'yes' if all(r['met'] for r in mine) else 'NO'} | {choice['chosen']} | "
            f"{choice['fastest']} | {choice['ratio']:.2f} | {'yes' if choice['met'] else 'NO'} |"
        )
    lines += [
        "",
        "| rate Gbit/s | model | method | measured ms | projected ms | projected / measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['model']} | {r['method']} | {r['measured_ms']:.1f} | "
            f"{r['projected_ms']:.1f} | {r['projected_ms'] / r['measured_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def render(out: Path) -> None:
    """Rewrites the page from the end-to-end run's stored JSON."""
    measured = stored(out, "endtoend")
    write_section(out, SECTION, markdown(*check(measured), "python -m benchmarks advise_check", measured))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks advise_check", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, default=DOCS / "benchmarks" / "endtoend.json")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    measured = json.loads(args.source.read_text())
    rows, choices = check(measured)
    command = command_line("advise_check", dropped=())
    write_section(args.out, SECTION, markdown(rows, choices, command, measured))
    for choice in choices:
        say(
            f"{choice['rate']} Gbit/s {choice['model']}: projected fastest {choice['chosen']}, measured "
            f"fastest {choice['fastest']} ({choice['ratio']:.2f}x)"
        )

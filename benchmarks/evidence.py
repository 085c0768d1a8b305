"""The evidence that ``hvd_compress.advise`` prints: the tables of the "Quality against bytes" page
(``docs/benchmarks/quality-against-bytes.md``), and the steps each method needs to reach the uncompressed run's quality
(``docs/benchmarks/time_to_quality.json``), read into the package's data file.

Rerun it after ``python -m benchmarks quality`` rewrites that page, or after
``python -m benchmarks time_to_quality`` adds points. Each row becomes a record under the
registry's name of its method (``powersgd``; a controller as ``lgreco/acpsgd``) and its setting
as advise names it (``rank=8``, ``density=0.01``, ``bits=4``; ``""`` for none). Rows whose
method is not a registered one as it is (a variant of a schedule) are left out.

Steps to target (``"steps_to_target"``, once the uncompressed seeds have set the target): per
method and setting, its median steps to target over its seeds divided by uncompressed's
(``factor``; null where the median run did not reach it), with the seeds that ran and reached
it. DiLoCo's points are left out: advise does not project outer steps.
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from benchmarks.harness.methods import REGISTERED
from hvd_compress.advise.local import LOCAL_KINDS
from hvd_compress.advise.projection import setting_label

ROOT = Path(__file__).resolve().parents[1]
CONTROLLERS = {"L-GreCo": "lgreco", "GraVAC": "gravac"}


def method_key(label):
    """The registry's name of a table's method label, or None for a variant."""
    if label in REGISTERED:
        return REGISTERED[label]
    match = re.fullmatch(r"(L-GreCo|GraVAC) \(([^)]+)\)", label)
    if match and match.group(2) in REGISTERED:
        return f"{CONTROLLERS[match.group(1)]}/{REGISTERED[match.group(2)]}"
    return None


def setting_key(setting):
    """ "rank 8" -> "rank=8", "-" -> "" (advise's names)."""
    return "" if setting.strip() in ("-", "") else "=".join(setting.split(None, 1))


def parse(page):
    """{"source", "workloads": {name: metric}, "methods": {method: {setting: [record]}}} from the
    text of the "Quality against bytes" page."""
    evidence = {
        "source": "docs/benchmarks.md, 'Quality against bytes' (python -m benchmarks quality; "
        "4 ranks, stock hvd.DistributedOptimizer)",
        "workloads": {},
        "methods": {},
    }
    workload = None
    for line in page.splitlines():
        heading = re.fullmatch(r"\*\*(.+)\*\*", line.strip())
        if heading:
            workload = heading.group(1)
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if workload is None or len(cells) != 8 or cells[0] == "method" or set(cells[0]) <= {"-"}:
            continue
        method = method_key(cells[0])
        if method is None:
            continue
        if cells[0] == "uncompressed":
            evidence["workloads"].setdefault(workload, {})
        evidence["methods"].setdefault(method, {}).setdefault(setting_key(cells[1]), []).append(
            {
                "workload": workload,
                "value": cells[2],
                "spread": cells[3],
                "delta": cells[4],
                "fewer_bytes": cells[6],
                "seeds": int(cells[7]),
            }
        )
    header = re.findall(r"\| method \| setting \| ([^|]+) \|", page)
    for name, metric in zip(evidence["workloads"], header):
        evidence["workloads"][name] = metric.strip()
    return evidence


def steps_to_target(results):
    """The ``"steps_to_target"`` part from the time-to-quality results, or None until their target
    is set."""
    from benchmarks import time_to_quality as ttq  # needs Horovod, as that benchmark does

    plan = results["plan"]
    goal = ttq.target_of(results, plan["base_seeds"], plan["knee_gain"])
    if goal is None:
        return None
    base = ttq.score(ttq.records_of(results, ttq.UNCOMPRESSED), goal["target"])["median"]
    methods = {}
    for label in ttq.labels_in_order(results):
        spec = next(entry["spec"] for entry in results["points"].values() if entry["spec"]["label"] == label)
        named = advise_name(spec)
        if named is None:
            continue
        method, setting = named
        outcome = ttq.score(ttq.records_of(results, label), goal["target"])
        methods.setdefault(method, {})[setting] = {
            "factor": None if outcome["median"] is None else round(outcome["median"] / base, 3),
            "seeds": outcome["seeds"],
            "reached": outcome["reached"],
        }
    return {
        "source": "docs/benchmarks.md, 'Time to quality' (python -m benchmarks time_to_quality)",
        "workload": f"Character LM, {results['np']} ranks, validation loss {goal['target']:.4f} "
        f"(uncompressed: {base:,.0f} steps)",
        "methods": methods,
    }


def advise_name(spec: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """A time-to-quality point as advise and the evidence name it, (method, setting): ("none", ""),
    ("topk", "density=0.1"), ("lgreco/topk", "density=0.1"); a local method's with its schedule
    first (``hvd_compress.advise.local``): ("diloco/qsgd", "H=50,bits=4"), with "outer=lr/momentum"
    where the point sets its outer step, ("streaming/qsgd", "H=50,F=2,delay=5,mixing=0.5,bits=4")."""
    controller = spec["controller"] or {}
    kind = controller.get("kind")
    method = spec["compressor"] or "none"
    if kind in LOCAL_KINDS:
        schedule = {"H": controller["inner_steps"]}
        if kind == "streaming":
            schedule.update(F=controller["fragments"], delay=controller["delay"], mixing=controller["mixing"])
        if "outer_lr" in controller:
            schedule["outer"] = f"{controller['outer_lr']}/{controller.get('outer_momentum', 0.9)}"
        return f"{kind}/{method}", setting_label({**schedule, **spec["settings"]})
    if kind in ("lgreco", "gravac"):
        method = f"{kind}/{method}"
    return method, setting_label(spec["settings"])


def gather(page: Path, steps: Path):
    """The whole data file: the quality tables of the ``page``, and the steps to target of the
    time-to-quality results at ``steps`` (where they exist and set a target)."""
    evidence = parse(page.read_text())
    measured = steps_to_target(json.loads(steps.read_text())) if steps.exists() else None
    if measured is not None:
        evidence["steps_to_target"] = measured
    return evidence


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks evidence", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--from", dest="source", type=Path, default=ROOT / "docs" / "benchmarks" / "quality-against-bytes.md"
    )
    parser.add_argument("--steps", type=Path, default=ROOT / "docs" / "benchmarks" / "time_to_quality.json")
    parser.add_argument("--to", type=Path, default=ROOT / "hvd_compress" / "data" / "quality_evidence.json")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    evidence = gather(args.source, args.steps)
    steps = evidence.get("steps_to_target")
    args.to.parent.mkdir(parents=True, exist_ok=True)
    args.to.write_text(json.dumps(evidence, indent=1, sort_keys=True) + "\n")
    count = sum(len(records) for settings in evidence["methods"].values() for records in settings.values())
    print(
        f"{count} records of {len(evidence['methods'])} methods on {len(evidence['workloads'])} "
        f"workloads, steps to target of {len((steps or {}).get('methods', {}))} methods, written to {args.to}"
    )

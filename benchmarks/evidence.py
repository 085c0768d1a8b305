"""The quality evidence that ``hvd_compress.advise`` prints: the "Quality against bytes" tables of
``docs/benchmarks.md``, read into the package's data file.

    python -m benchmarks evidence [--from docs/benchmarks.md] [--to hvd_compress/data/quality_evidence.json]

Rerun it after ``python -m benchmarks quality`` rewrites that section. Each row becomes a record
under the registry's name of its method (``powersgd``; a controller as ``lgreco/acpsgd``) and
its setting as advise names it (``rank=8``, ``density=0.01``, ``bits=4``; ``""`` for none).
Rows whose method is not a registered one as it is (a variant of a schedule) are left out.
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Quality against bytes"
METHODS = {"uncompressed": "none", "FP16": "fp16", "BF16": "bf16", "ACP-SGD": "acpsgd",
           "PowerSGD": "powersgd", "QSGD": "qsgd", "ScaleCom": "scalecom", "Top-K": "topk",
           "SignSGD": "signsgd"}
CONTROLLERS = {"L-GreCo": "lgreco", "GraVAC": "gravac"}


def method_key(label):
    """The registry's name of a table's method label, or None for a variant."""
    if label in METHODS:
        return METHODS[label]
    match = re.fullmatch(r"(L-GreCo|GraVAC) \(([^)]+)\)", label)
    if match and match.group(2) in METHODS:
        return f"{CONTROLLERS[match.group(1)]}/{METHODS[match.group(2)]}"
    return None


def setting_key(setting):
    """ "rank 8" -> "rank=8", "-" -> "" (advise's names)."""
    return "" if setting.strip() in ("-", "") else "=".join(setting.split(None, 1))


def parse(markdown):
    """{"source", "workloads": {name: metric}, "methods": {method: {setting: [record]}}}."""
    start = markdown.index(SECTION)
    end = markdown.find("\n## ", start + len(SECTION))
    section = markdown[start:end if end != -1 else None]
    evidence = {"source": "docs/benchmarks.md, 'Quality against bytes' (python -m benchmarks quality; "
                          "4 ranks, stock hvd.DistributedOptimizer)",
                "workloads": {}, "methods": {}}
    workload = None
    for line in section.splitlines():
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
        evidence["methods"].setdefault(method, {}).setdefault(setting_key(cells[1]), []).append({
            "workload": workload, "value": cells[2], "spread": cells[3], "delta": cells[4],
            "fewer_bytes": cells[6], "seeds": int(cells[7])})
    header = re.findall(r"\| method \| setting \| ([^|]+) \|", section)
    for name, metric in zip(evidence["workloads"], header):
        evidence["workloads"][name] = metric.strip()
    return evidence


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks evidence", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--to", type=Path, default=ROOT / "hvd_compress" / "data" / "quality_evidence.json")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    evidence = parse(args.source.read_text())
    args.to.parent.mkdir(parents=True, exist_ok=True)
    args.to.write_text(json.dumps(evidence, indent=1, sort_keys=True) + "\n")
    count = sum(len(records) for settings in evidence["methods"].values() for records in settings.values())
    print(f"{count} records of {len(evidence['methods'])} methods on {len(evidence['workloads'])} "
          f"workloads written to {args.to}")


if __name__ == "__main__":
    main()

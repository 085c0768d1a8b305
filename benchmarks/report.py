"""``python -m benchmarks report``: rewrites every benchmark's page in ``docs/benchmarks/``, its
figures, and the list of pages in ``docs/benchmarks.md`` from the JSON records stored beside them;
nothing is measured. A benchmark takes part by defining ``render(out)``."""

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from benchmarks.__main__ import BENCHMARKS
from benchmarks.harness.render import DOCS, write_index

logger = logging.getLogger(__name__)


def render_all(out: Path) -> List[str]:
    """Renders every benchmark that can be rendered into the docs folder ``out``, then the list of
    pages; returns the benchmarks rendered."""
    rendered = []
    for name in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        if hasattr(module, "render"):
            module.render(out)
            rendered.append(name)
    write_index(out)
    return rendered


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: ``--out`` names the docs folder (this checkout's by default)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS, help="the docs folder whose pages are rewritten")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rendered = render_all(args.out)
    logger.info("rendered %d benchmarks from their JSON into %s: %s", len(rendered), args.out, ", ".join(rendered))

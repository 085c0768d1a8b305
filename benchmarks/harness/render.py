"""The writing of a benchmark's page (``docs/benchmarks/<slug>.md``) and figures, from its JSON
record beside them, and of the list of pages in ``docs/benchmarks.md``."""

import collections
import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union


# Where results go unless --out says otherwise: this checkout's docs/, from any directory.
DOCS = Path(__file__).resolve().parents[2] / "docs"


# The summary page's text where none is yet; what is written outside the list of pages is kept.
BENCHMARKS_PREAMBLE = (
    "# Benchmarks\n\nOne page per benchmark, each written by the command it names "
    "(`python -m benchmarks <benchmark>`; the page gives the options it ran with); raw numbers and "
    "figures are beside the pages, in `benchmarks/`.\n"
)


PAGES_START = "<!-- The list of pages: python -m benchmarks rewrites it; write outside it. -->"


PAGES_END = "<!-- End of the list of pages. -->"


# A page's verdicts, as its tables and "Target:" lines state them.
VERDICTS = {"yes": True, "met": True, "no": False, "not met": False, "missed": False}


def resumed(path: Path) -> Dict[str, Any]:
    """The JSON record that earlier runs left at ``path`` (empty: none yet), its folder made for
    this run's saves: a benchmark rerun goes on where the last one stopped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return json.loads(path.read_text()) if path.exists() else {}


def save_record(path: Path, results: Dict[str, Any]) -> None:
    """Writes ``results`` to ``path`` (its folder made) as ``resumed`` reads it back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


def resumed_section(
    out: Path, name: str, section: str, markdown: Callable[[Dict[str, Any]], str]
) -> Tuple[Dict[str, Any], Callable[[], None]]:
    """A resumable benchmark's record, as earlier runs left it in ``out``/benchmarks/``name``.json,
    and the save to call after each job: it writes the record and rewrites the page of ``section``
    from it with ``markdown``, so that a stopped run loses one job at most."""
    path = out / "benchmarks" / f"{name}.json"
    results = resumed(path)

    def save() -> None:
        save_record(path, results)
        write_section(out, section, markdown(results))

    return results, save


def gpu_lines(machine_info: Dict[str, Any]) -> List[str]:
    """The GPU a run timed on (``gpu_description``, in its machine record) and how it was timed,
    as a paragraph; none where it ran on the CPU."""
    if "gpu" not in machine_info:
        return []
    return [f"GPU: **{machine_info['gpu']}**; every timing starts and ends with a device synchronisation.", ""]


def notes_lines(results: Dict[str, Any]) -> List[str]:
    """What the numbers mean, written after a run into the JSON record's ``notes`` (kept when it
    resumes): a paragraph each, for a section's end."""
    return [line for note in results.get("notes", []) for line in ("", note)]


def slug(heading: str) -> str:
    """The anchor MkDocs gives ``heading`` (Python-Markdown's ``toc`` slugify), which names its page."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def page(out: Path, heading: str) -> Path:
    """The page of the benchmark section ``heading`` under the docs folder ``out``; its figures and
    JSON lie beside it."""
    return out / "benchmarks" / f"{slug(heading)}.md"


def write_section(out: Path, heading: str, body: str) -> None:
    """Writes the page of ``heading`` (``page``) anew, ``heading`` its title and ``body`` the rest,
    and the list of pages in ``out``/benchmarks.md; other benchmarks' pages are left as they are.
    What a page says beyond its run (notes) comes from the benchmark's JSON record, so a rerun
    keeps it."""
    path = page(out, heading)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = body.rstrip("\n")
    path.write_text(f"# {heading}\n\n{body}\n")
    write_index(out)


def write_index(out: Path) -> None:
    """Rewrites the list of pages in ``out``/benchmarks.md (between ``PAGES_START`` and
    ``PAGES_END``; at the end where absent) from the pages in ``out``/benchmarks, a row each: its
    title, what its benchmark measures, the targets it states as met, the command that writes it.
    The rest of the file is left as it is."""
    from benchmarks.__main__ import BENCHMARKS

    rows = []
    for path in (out / "benchmarks").glob("*.md"):
        text = path.read_text()
        title = text.splitlines()[0].removeprefix("# ")
        named = re.search(r"`python -m benchmarks (\w+)", text)
        name = named.group(1) if named and named.group(1) in BENCHMARKS else None
        met = verdicts(text)
        rows.append(
            (
                title.casefold(),
                f"| [{title}](benchmarks/{path.name}) | {BENCHMARKS[name] if name else ''} "
                f"| {f'{met[True]} of {met[True] + met[False]}' if met else '—'} "
                f"| {f'`python -m benchmarks {name}`' if name else ''} |\n",
            )
        )
    summary = out / "benchmarks.md"
    text = summary.read_text() if summary.exists() else BENCHMARKS_PREAMBLE
    header = "| benchmark | what it measures | targets met | rerun |\n|---|---|---|---|\n"
    block = "".join([PAGES_START, "\n\n", header, *(row for _, row in sorted(rows)), "\n", PAGES_END, "\n"])
    if PAGES_START in text and PAGES_END in text:
        before, rest = text.split(PAGES_START, 1)
        text = before + block + rest.split(PAGES_END + "\n", 1)[-1]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    summary.write_text(text)


def verdicts(text: str) -> collections.Counter:
    """How many of a page's targets it states as met (``True``) and as not met (``False``): the
    cells of its tables' ``met`` columns (``target`` columns where it has none: those may repeat
    a ``met`` table's rows), and the phrases of its lines that begin with "Target"."""
    columns = {"met": collections.Counter(), "target": collections.Counter()}
    stated = collections.Counter()
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            if re.match(r"Targets?\b", line):
                stated.update(
                    VERDICTS[phrase.lower()] for phrase in re.findall(r"\bNOT met\b|\bmet\b|\bmissed\b", line)
                )
            continue
        cells = [cell.strip().strip("*").strip().lower() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        for name, cell in zip(header, cells):
            if name in columns and cell in VERDICTS:
                columns[name][VERDICTS[cell]] += 1
    return (columns["met"] or columns["target"]) + stated


def save_figure(figure: Any, path: Path, dpi: Union[float, str] = 80) -> None:
    """Lays ``figure`` out, writes it to ``path`` (``dpi="figure"``: the figure's own) and frees it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


def panels(columns, width, height, rows=1, dpi=80):
    """(pyplot, figure, the ``rows`` x ``columns`` axes row by row in one list), each panel
    ``width`` x ``height`` inches, for a PNG written without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), dpi=dpi, squeeze=False)
    return plt, figure, list(axes.flat)


def method_bars(axis, values, reference):
    """Horizontal bars, one per method from the top down (``values``: method -> value), the
    ``reference`` method's bar grey and its value marked across the panel."""
    bars = axis.barh(
        list(values),
        list(values.values()),
        color=["tab:gray" if label == reference else "tab:blue" for label in values],
    )
    if reference in values:
        axis.axvline(values[reference], color="tab:gray", linestyle="--", linewidth=0.8)
    axis.invert_yaxis()
    return bars


def stored(out: Path, name: str) -> Optional[Dict[str, Any]]:
    """The JSON record ``out``/benchmarks/``name``.json, None where there is none: what a page is
    rendered from."""
    path = out / "benchmarks" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None

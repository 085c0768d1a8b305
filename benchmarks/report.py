"""What every benchmark shares: a description of the machine, CPU accounting that tells
whether a measurement had the cores to itself, step-time statistics, and the writer of a
benchmark's page (``docs/benchmarks/<slug>.md``) and of the list of pages in
``docs/benchmarks.md``."""

import argparse
import collections
import datetime
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from hvd_compress.metrics import Exporter

# Where results go unless --out says otherwise: this checkout's docs/, from any directory.
DOCS = Path(__file__).resolve().parents[1] / "docs"

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


def machine():
    """CPU, cores, memory, kernel and the versions that set the numbers."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    memory_kib = int(
        next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    )
    described = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(),
    }
    try:
        import horovod

        described["horovod"] = horovod.__version__
        described["mpi"] = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()[0]
    except (ImportError, OSError, IndexError, subprocess.TimeoutExpired):
        pass
    return described


def describe_machine(m):
    """One line for a markdown section."""
    versions = f"Python {m['python']}, torch {m['torch']}"
    if "horovod" in m:
        versions += f", Horovod {m['horovod']}, {m.get('mpi', 'no mpirun')}"
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}; {versions}; {m['date']}."


def busy_cpu_seconds():
    """Busy CPU seconds of all cores since boot (/proc/stat), interrupts left out: most of
    them are the testbed's own network traffic, charged to no process."""
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process and its finished descendants (mpirun and, through it, the
    ranks). Busy time beyond it went to other processes, or was stolen by the hypervisor."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OthersShare:
    """The share of the machine's CPU capacity that other processes used between its
    creation and :meth:`share`."""

    def __init__(self):
        self.started, self.busy, self.own = time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()

    def seconds(self):
        return max(0.0, busy_cpu_seconds() - self.busy - (own_cpu_seconds() - self.own))

    def share(self):
        return self.seconds() / ((time.perf_counter() - self.started) * os.cpu_count())


def wait_until_idle(max_share, interval=2.0, patience=300):
    """Waits, at most ``patience`` seconds, until the cores were busy less than ``max_share``
    of an ``interval``: on a shared machine another user's work would otherwise share the
    cores with what is measured."""
    started = time.monotonic()
    while time.monotonic() - started < patience:
        busy = busy_cpu_seconds()
        time.sleep(interval)
        if (busy_cpu_seconds() - busy) / (interval * os.cpu_count()) <= max_share:
            break
    waited = time.monotonic() - started - interval
    if waited >= 1:
        say(f"  waited {waited:.0f} s for other processes to leave the cores")


def say(text, stream=None):
    """Prints ``text`` and its newline in one write. ``horovodrun`` sets PYTHONUNBUFFERED, so a
    plain ``print`` writes the text and the newline separately, and ``mpirun --tag-output``
    then tags the newline as a line of its own (``...accuracy 0.3788[1,0]<stdout>:``)."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


class Progress:
    """How far a long sweep is, with an ETA from the items it ran so far (resumed ones left
    out). On a terminal, one status line is rewritten in place under the result lines; in a log
    (CI, a file), each result line starts with ``[done/total, elapsed, ETA]`` and nothing is
    rewritten."""

    def __init__(self, total, label, stream=None):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.monotonic()

    def add(self, count):
        """More items than first counted (a stage that follows from the first's results)."""
        self.total += count

    def where(self):
        elapsed = time.monotonic() - self.started
        left = "?" if not self.done else _minutes(elapsed / self.done * (self.total - self.done))
        return f"{self.done}/{self.total}, {_minutes(elapsed)} elapsed, ETA {left}"

    def starting(self, item):
        """Shows what runs now (on a terminal only)."""
        if self.tty:
            self.stream.write(f"\r\033[K{self.label} [{self.where()}] running {item}")
            self.stream.flush()

    def line(self, text):
        """A result line, whole, above the status line (or prefixed with it in a log)."""
        say(f"\r\033[K{text}" if self.tty else f"[{self.where()}] {text}", self.stream)

    def finished(self, text=None):
        """One item done, with its result line if not shown already."""
        self.done += 1
        if text is not None:
            self.line(text)


def _minutes(seconds):
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


class CodecClock(Exporter):
    """Rank 0's host seconds in this project's codec (compress and decompress, every layer),
    per step: what of a step over compute is codec rather than waiting. It watches
    ``compression`` (a compressor or controller; None: nothing to time, ``seconds`` stays empty)
    from construction; a step's entry is written at its ``end_step``."""

    def __init__(self, compression=None):
        super().__init__(every=1)
        self.seconds = []
        if compression is not None:
            self.watch(compression)

    def write(self, step, numbers):
        self.seconds.append(numbers["codec_seconds"])

    def write_decision(self, step, record):
        """A controller's decisions are not codec time."""


def summarise(seconds):
    """Median, quartiles and extremes, in ms, of a list of seconds."""
    ms = sorted(1000 * s for s in seconds)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median": statistics.median(ms), "p25": quartiles[0], "p75": quartiles[2], "min": ms[0], "max": ms[-1]}


def resumed(path: Path) -> Dict[str, Any]:
    """The JSON record that earlier runs left at ``path`` (empty: none yet), its folder made for
    this run's saves: a benchmark rerun goes on where the last one stopped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return json.loads(path.read_text()) if path.exists() else {}


def save_record(path: Path, results: Dict[str, Any]) -> None:
    """Writes ``results`` to ``path`` as ``resumed`` reads it back."""
    path.write_text(json.dumps(results, indent=1) + "\n")


# Per-job figures a pooled timing entry gives as the median of its jobs' (each job's kept under
# ``<key>_each_job``), those it sums, and those it gives as the largest (the most disturbed job's).
JOB_MEDIANS = ("compute_ms", "codec_ms")
JOB_SUMS = ("wall_seconds", "disturbed_attempts")
JOB_MAXIMA = ("load_average", "other_cpu_share")


def jobs_of(entry: Optional[Dict[str, Any]]) -> int:
    """Timing jobs an entry holds (failed ones included); an entry from before ``--repeats`` is one."""
    return 0 if entry is None else entry.get("jobs", 1)


def pooled(entry: Optional[Dict[str, Any]], new: Dict[str, Any]) -> Dict[str, Any]:
    """``entry`` (None, or earlier timing jobs of one method: ``step_ms_each`` and its summary
    ``step_ms``) with one more job's: steps pooled, each job's median kept, ``JOB_MEDIANS`` as the
    median of the jobs', ``JOB_SUMS`` summed, ``JOB_MAXIMA`` the largest. A failed job counts, and
    keeps its failure."""
    if entry is None or "failed" in entry and "failed" in new:
        return dict(new, jobs=jobs_of(entry) + 1)
    if "failed" in new or "failed" in entry:
        kept, failed = (entry, new) if "failed" in new else (new, entry)
        return dict(kept, jobs=jobs_of(entry) + 1, failed_jobs=kept.get("failed_jobs", 0) + 1, failure=failed["failed"])
    each = entry["step_ms_each"] + new["step_ms_each"]
    merged = dict(
        entry,
        step_ms=summarise([ms / 1e3 for ms in each]),
        step_ms_each=each,
        job_medians_ms=entry.get("job_medians_ms", [entry["step_ms"]["median"]]) + [new["step_ms"]["median"]],
        jobs=jobs_of(entry) + 1,
    )
    for key in (k for k in JOB_MEDIANS if k in new):
        values = entry.get(f"{key}_each_job", [entry[key]] if key in entry else []) + [new[key]]
        merged.update({key: statistics.median(values), f"{key}_each_job": values})
    for key in (k for k in JOB_SUMS if k in new):
        merged[key] = entry.get(key, 0) + new[key]
    for key in (k for k in JOB_MAXIMA if new.get(k) is not None):
        merged[key] = max(new[key], entry.get(key) if entry.get(key) is not None else new[key])
    return merged


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


def gpu_description() -> str:
    """The first CUDA device, as the GPU benchmarks' machine lines name it."""
    import torch

    gpu = torch.cuda.get_device_properties(0)
    return f"{gpu.name}, {gpu.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"


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


def cluster_job(cluster, argv, env, timeout, result_prefix):
    """Runs ``argv`` on every rank of ``cluster`` and returns the JSON that rank 0 printed
    after ``result_prefix``, with the job's ``wall_seconds`` and the ``other_cpu_seconds``
    that went to other processes meanwhile; a failed job raises with its output's tail."""
    started, others = time.perf_counter(), OthersShare()
    returncode, stdout, stderr = cluster.run(argv, timeout=timeout, env=env)
    wall = time.perf_counter() - started
    result = printed_results(returncode, stdout, stderr, result_prefix, wall, "job")[-1]
    result.update(wall_seconds=wall, other_cpu_seconds=others.seconds())
    return result


def printed_results(returncode, stdout, stderr, result_prefix, wall, what, expected=None):
    """The JSON records a job printed after ``result_prefix``, in order; a job that failed,
    printed none, or printed other than ``expected`` records raises with its output's tail."""
    records = [json.loads(line[len(result_prefix) :]) for line in stdout.splitlines() if line.startswith(result_prefix)]
    if returncode != 0 or not records or (expected is not None and len(records) != expected):
        raise RuntimeError(f"{what} failed (exit {returncode}) after {wall:.0f} s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return records


def root_cause(error):
    """The line of a failed job's output that names what went wrong: a C++ exception's
    ``what():`` (the rank that failed first; the others only lost a peer), else the last Python
    exception line that is not a launcher's wrapper (torchrun's ``ChildFailedError``), else the
    first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    thrown = [line for line in lines if "what():" in line]
    raised = [
        line
        for line in lines
        if re.match(r"^[\w.]*(Error|Exception|Timeout)\b.*:", line) and "ChildFailedError" not in line
    ]
    return thrown[0] if thrown else raised[-1] if raised else lines[0] if lines else ""


def torchrun_job(argv, nproc, timeout, result_prefix, expected=1, master_port=None, env=None):
    """``argv`` (``[python, -m, module, ...]``) under ``torchrun`` with ``nproc`` ranks on this
    host: ``--standalone``, or on ``master_port`` when given (jobs running side by side each
    take their own). Rank 0's printed records, each with the job's wall seconds, or
    RuntimeError with the job's output."""
    where = ["--master_addr", "127.0.0.1", "--master_port", str(master_port)] if master_port else ["--standalone"]
    from benchmarks.testbed import run_bounded

    command = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node", str(nproc), *argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=checkout_pythonpath(), **(env or {}))
    started = time.perf_counter()
    returncode, stdout, stderr = run_bounded(command, timeout, env)
    wall = time.perf_counter() - started
    records = printed_results(returncode, stdout, stderr, result_prefix, wall, shlex.join(command), expected=expected)
    for record in records:
        record["wall_seconds"] = wall
    return records


# Every rank on this host: Open MPI's TCP transports stay on loopback. Left to choose, they also
# take any other interface up or down (Docker's docker0), and 4-rank launches then hung at exit.
LOOPBACK_ONLY = ("--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo")


def mpirun_job(module, spec, np, timeout, result_prefix, what, expected=None):
    """``python -m <module> --worker <spec as JSON>`` as one ``mpirun -np <np>`` job on this host,
    bounded by ``timeout`` seconds; rank 0's printed records, each with the job's wall seconds,
    or RuntimeError with the job's output."""
    from benchmarks.testbed import run_bounded

    argv = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(np),
        "--mca",
        "btl",
        "self,tcp",
        *LOOPBACK_ONLY,
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        "-x",
        "PATH",
        sys.executable,
        "-m",
        module,
        "--worker",
        json.dumps(spec),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=checkout_pythonpath())
    started = time.perf_counter()
    returncode, stdout, stderr = run_bounded(argv, timeout, env)
    wall = time.perf_counter() - started
    records = printed_results(
        returncode, stdout, stderr, result_prefix, wall, f"{what}: {shlex.join(argv)}", expected=expected
    )
    for record in records:
        record["job_seconds"] = wall
    return records


def undisturbed(job, max_other_cpu, describe, attempts=3, show=say):
    """``job()`` run until the ranks had the machine to themselves: a run during which more
    than ``max_other_cpu`` of the cores' time went elsewhere runs again, up to ``attempts``
    times in all; the last one is kept, its ``disturbed_attempts`` saying so. ``describe(result)``
    is the progress line, shown by ``show``."""
    for attempt in range(attempts):
        wait_until_idle(max_other_cpu)
        result = job()
        result["disturbed_attempts"] = attempt
        show(describe(result))
        share = result["other_cpu_seconds"] / (result["wall_seconds"] * os.cpu_count())
        if share <= max_other_cpu:
            return result
        show(f"  {100 * share:.0f}% of the CPU went to other processes during that job")
    result["disturbed_attempts"] = attempts
    return result


def checkout_pythonpath():
    """PYTHONPATH with this checkout first, so ranks import this hvd_compress and these
    benchmarks, whatever is installed."""
    return os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))


def timed_step(optimizer, forward_backward):
    """One step of a Horovod distributed optimizer, timed: seconds of the whole step, of
    ``forward_backward()`` (zero_grad, forward, backward: the hooks compress and submit
    gradients during it) and of ``synchronize`` (what is left of communication, then the
    decompression)."""
    started = time.perf_counter()
    forward_backward()
    backward_done = time.perf_counter()
    optimizer.synchronize()
    synchronized = time.perf_counter()
    with optimizer.skip_synchronize():
        optimizer.step()
    return {
        "step": time.perf_counter() - started,
        "backward": backward_done - started,
        "synchronize": synchronized - backward_done,
    }


def command_line(benchmark: str, dropped: Sequence[str] = ("--out",)) -> str:
    """``python -m benchmarks <benchmark>`` with this process's arguments, less the options in
    ``dropped`` and their values: those that do not change results (where to write, when to
    stop)."""
    kept, skip = [], False
    for argument in sys.argv[1:]:
        if skip:
            skip = False
        elif argument in dropped:
            skip = True
        elif not argument.startswith(tuple(f"{option}=" for option in dropped)):
            kept.append(shlex.quote(argument))
    return " ".join([f"python -m benchmarks {benchmark}"] + kept)


# The options of a sweep of jobs that say where to write and when to stop, not what to run.
RUN_LIMITS = ("--out", "--max-minutes", "--job-timeout")


def add_job_options(
    parser: Any,
    job_timeout: Union[int, float],
    quick: str,
    workers: Optional[Sequence[str]] = None,
    job_timeout_help: Optional[str] = "seconds per mpirun job",
) -> None:
    """The options of a benchmark that runs its work as jobs: ``--job-timeout`` (``job_timeout``
    by default, of its type), ``--out`` (the docs folder to write into), ``--quick`` (a smoke
    test; ``quick`` says what it runs) and the hidden ``--worker`` (what a job runs: one of
    ``workers``, or, without them, the JSON SPEC of a point)."""
    parser.add_argument("--job-timeout", type=type(job_timeout), default=job_timeout, help=job_timeout_help)
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--quick", action="store_true", help=quick)
    if workers is None:
        parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    else:
        parser.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)


def names_from(known: Sequence[str]) -> Callable[[str], List[str]]:
    """An argparse ``type``: a comma-separated list of some of ``known`` (methods, workloads),
    refusing the others by name."""

    def names(text: str) -> List[str]:
        listed = text.split(",")
        unknown = [name for name in listed if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        return listed

    return names


def add_cluster_worker_options(parser: Any) -> None:
    """The hidden options of a torch.distributed worker that a job on the emulated cluster starts
    (``worker_argv``): the model and method it runs, ``--master`` (rank 0's address on the
    shaped links; none under torchrun) and ``--interface-prefix`` (the namespaces' links')."""
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--interface-prefix", default="", help=argparse.SUPPRESS)


def init_cluster_worker(args: Any, port: int, ranks_per_node: int = 1) -> int:
    """Joins the worker's Gloo process group and returns its rank: started by mpirun in a
    namespace (``--master``), over its node's shaped link, rank 0 listening on ``port``;
    started by torchrun (``--quick``), torchrun's."""
    import torch.distributed as dist

    if args.master:
        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        os.environ["GLOO_SOCKET_IFNAME"] = f"{args.interface_prefix}{rank // ranks_per_node}e"
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{port}", rank=rank, world_size=size)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank()


def worker_argv(module: str, args: Any, kind: str, **flags: Any) -> List[str]:
    """The command of one of ``module``'s jobs running its ``kind`` worker: ``--rank`` from
    ``args`` (the low-rank methods' rank), and ``flags`` as options."""
    argv = [sys.executable, "-m", module, "--worker", kind, "--rank", str(args.rank)]
    return argv + [item for key, value in flags.items() for item in (f"--{key.replace('_', '-')}", str(value))]


def run_or_work(args: Any, run: Callable[[Any], Any], workers: Dict[str, Callable[[Any], Any]]) -> None:
    """The end of ``main()`` of a benchmark whose jobs run a worker named by ``--worker`` (ddp,
    fsdp): in a job, that worker; otherwise the benchmark."""
    if args.worker is not None:
        workers[args.worker](args)
    else:
        run(args)


def run_points(
    args: Any,
    train: Callable[[Dict[str, Any]], None],
    run: Callable[[Any], Dict[str, Any]],
    results: Path,
    write_report: Optional[Callable[[Dict[str, Any], Path], None]] = None,
) -> None:
    """The end of ``main()`` of a benchmark whose points run as jobs (claims, quality, outer,
    time_to_quality): in a job (``--worker SPEC``), ``train`` the point it names; with
    ``--report-only`` (where ``write_report`` is given), rewrite the section and figure from
    ``results``, the JSON; otherwise ``run`` what is missing, and say how long it took and where
    the points are."""
    if args.worker is not None:
        train(json.loads(args.worker))
        return
    if write_report is not None and args.report_only:
        write_report(json.loads(results.read_text()), args.out)
        return
    started = time.perf_counter()
    points = run(args)["points"]
    say(f"{(time.perf_counter() - started) / 60:.1f} min; {len(points)} points in {results}")


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


def train_one_point(train_point, spec, prefix):
    """One rank of a resumable benchmark's point (quality, claims, outer): trains ``spec`` on
    Horovod and rank 0 prints the record, after ``prefix``, for the driver to read."""
    import horovod.torch as hvd

    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()
    record = train_point(spec)
    if hvd.rank() == 0:
        print(prefix + json.dumps(record), flush=True)

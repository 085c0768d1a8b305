"""How a benchmark runs its work: jobs under mpirun or torchrun, bounded in time and rerun when
other processes took the cores; their printed JSON records read back; the options they share;
progress lines."""

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from benchmarks.harness.machine import OthersShare, busy_cpu_seconds
from benchmarks.harness.render import DOCS


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
# mpirun for ranks on this host alone, more of them than cores allowed, over TCP on loopback.
LOCAL_MPIRUN = ("mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,tcp", *LOOPBACK_ONLY)


def mpirun_job(benchmark, spec, np, timeout, result_prefix, what, expected=None):
    """``python -m benchmarks <benchmark> --worker <spec as JSON>`` as one ``mpirun -np <np>`` job on this host,
    bounded by ``timeout`` seconds; rank 0's printed records, each with the job's wall seconds,
    or RuntimeError with the job's output."""
    from benchmarks.testbed import run_bounded

    exports = ("-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PATH")
    argv = [*LOCAL_MPIRUN, "-np", str(np), *exports, *benchmark_argv(benchmark, "--worker", json.dumps(spec))]
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


def benchmark_argv(benchmark: str, *options: str) -> List[str]:
    """The command of a job's process that runs ``benchmark`` with ``options``, through the one
    entry point (``python -m benchmarks``)."""
    return [sys.executable, "-m", "benchmarks", benchmark, *options]


def checkout_pythonpath():
    """PYTHONPATH with this checkout first, so ranks import this hvd_compress and these
    benchmarks, whatever is installed."""
    return os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))


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
    np: Optional[int] = None,
    max_minutes: Optional[float] = None,
    max_minutes_help: str = "start no new point after this long; rerun to resume",
) -> None:
    """The options of a benchmark that runs its work as jobs: ``--job-timeout`` (``job_timeout``
    by default, of its type), ``--out`` (the docs folder to write into), ``--quick`` (a smoke
    test; ``quick`` says what it runs), the hidden ``--worker`` (what a job runs: one of
    ``workers``, or, without them, the JSON SPEC of a point), and where given, ``--np`` (ranks
    per job, ``np`` by default) and ``--max-minutes`` (a resumable sweep's, ``max_minutes``, with
    ``max_minutes_help``)."""
    if np is not None:
        parser.add_argument("--np", type=int, default=np, help="ranks per job")
    if max_minutes is not None:
        parser.add_argument("--max-minutes", type=float, default=max_minutes, help=max_minutes_help)
    parser.add_argument("--job-timeout", type=type(job_timeout), default=job_timeout, help=job_timeout_help)
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--quick", action="store_true", help=quick)
    if workers is None:
        parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    else:
        parser.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)


def add_timing_options(
    parser: Any,
    warmup: int,
    steps: int,
    max_other_cpu: float = 0.05,
    repeats: Optional[int] = None,
    steps_help: str = "timed steps per job",
) -> None:
    """The options of a benchmark that times training steps in jobs: ``--warmup`` untimed steps,
    then ``--steps`` timed ones (``warmup`` and ``steps`` by default), ``--max-other-cpu`` (the
    share of the cores other processes may take during a job before it runs again) and, where
    ``repeats`` is given, ``--repeats`` (timing jobs per method, pooled)."""
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps before the timed ones")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help="timing jobs per method, pooled")
    parser.add_argument(
        "--max-other-cpu",
        type=float,
        default=max_other_cpu,
        help="share of the cores other processes may take during a job before it runs again",
    )


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


def options_argv(**flags: Any) -> List[str]:
    """``flags`` as command-line options: ``kill_rank=1`` as ``--kill-rank 1``."""
    return [item for key, value in flags.items() for item in (f"--{key.replace('_', '-')}", str(value))]


def worker_argv(benchmark: str, args: Any, kind: str, **flags: Any) -> List[str]:
    """The command of one of ``benchmark``'s jobs running its ``kind`` worker: ``--rank`` from
    ``args`` (the low-rank methods' rank), and ``flags`` as options."""
    return benchmark_argv(benchmark, "--worker", kind, *options_argv(rank=args.rank, **flags))


def run_or_work(args: Any, run: Callable[[Any], Any], workers: Dict[str, Callable[[Any], Any]]) -> None:
    """The end of ``main()`` of a benchmark whose jobs run a worker named by ``--worker`` (ddp,
    fsdp): in a job, that worker; otherwise the benchmark."""
    if args.worker is not None:
        workers[args.worker](args)
    else:
        run(args)


def run_points(
    args: Any,
    train: Callable[[Dict[str, Any]], Any],
    run: Callable[[Any], Dict[str, Any]],
    results: Path,
    prefix: Optional[str] = None,
) -> None:
    """The end of ``main()`` of a benchmark whose points run as jobs (claims, quality, outer,
    time_to_quality): in a job (``--worker SPEC``), ``train`` the point it names (with ``prefix``,
    as ``train_one_point`` trains it); otherwise ``run`` what is missing, and say how long it took
    and where the points are (``results``)."""
    if args.worker is not None:
        spec = json.loads(args.worker)
        if prefix is None:
            train(spec)
        else:
            train_one_point(train, spec, prefix)
        return
    started = time.perf_counter()
    points = run(args)["points"]
    say(f"{(time.perf_counter() - started) / 60:.1f} min; {len(points)} points in {results}")


def train_one_point(train_point, spec, prefix):
    """One rank of a resumable benchmark's point (quality, claims, outer, time_to_quality): trains
    ``spec`` on Horovod, or where ``spec["backend"]`` is "ddp", on torch.distributed's Gloo under
    torchrun (its collectives take CUDA tensors too, so the ranks can share one GPU); rank 0
    prints the record, after ``prefix``, for the driver to read."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    ddp = spec.get("backend") == "ddp"
    if ddp:
        dist.init_process_group("gloo")
    else:
        import horovod.torch as hvd

        hvd.init()
    try:
        record = train_point(spec)
        if (dist.get_rank() if ddp else hvd.rank()) == 0:
            print(prefix + json.dumps(record), flush=True)
    finally:
        if ddp:
            dist.destroy_process_group()

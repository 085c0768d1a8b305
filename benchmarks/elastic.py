"""Elastic: training that loses a worker to SIGKILL, goes on with the others, and takes a new
one in; error feedback kept by the survivors against reset, on the character LM.

Each run is ``horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script`` on this machine
(Horovod's elastic mode, which runs under the Gloo controller), three "hosts" of one slot, all
names of this machine ("localhost", "127.0.0.1", its host name, its addresses). The discovery
script prints a file that the driver rewrites:

1. rank ``--kill-rank`` SIGKILLs itself at step ``--kill-step``; the driver takes its host out
   of the file (Horovod also blacklists a host whose worker failed);
2. after ``--rejoin-after`` steps with 2 workers, the driver adds a new host: a third worker
   joins, receives the state from rank 0 (``hvd.elastic.TorchState``) and training goes on.

Every rank draws the batch of (step, rank, world size), the learning rate follows the step, and
the state is committed every ``--commit-every`` steps, so the steps lost at the kill are the
ones since the last commit. At the end every rank's parameters are compared (bit-identical or
the run fails). The character LM (``examples.workloads.charlm``) trains with AdamW and
PowerSGD at the registry's small setting (rank 2) on the stock optimizer, once undisturbed and
once disturbed under each error-feedback policy (``feedback_on_world_change``: "keep",
"reset"), per seed. Results resume run by run from
``<out>/benchmarks/elastic.json``; writes the "Elastic training" page,
``<out>/benchmarks/elastic-training.md``. The fault-injection tests (``tests/test_elastic.py``) use the same
driver on the digits CNN.
"""

import argparse
import faulthandler
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.jobs import Progress, checkout_pythonpath, command_line, options_argv
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, resumed, save_record, stored, write_section

RESULT_FILE = "result.json"
PROGRESS_FILE = "progress.jsonl"
KILLED_FILE = "killed.json"
SECTION = "Elastic training"
WORKLOADS = ("digits", "charlm")
LOCAL_METHODS = ("diloco", "streaming")  # outer steps on QSGD 4 bits' pseudo-gradients, H = 10
METHODS = ("powersgd", "scalecom", "lgreco", "qallreduce", *LOCAL_METHODS)


# ----- the worker (every rank, under horovodrun's elastic driver) -------------------------------
def build(method, model, optimizer):
    """(compression, distributed optimizer): PowerSGD, ScaleCom and the two-hop quantized
    all-reduce on the stock optimizer, L-GreCo over ACP-SGD on the wrapper, with a short
    schedule (decisions at steps 25, 45, ...); DiLoCo and Streaming DiLoCo (two fragments, each
    applied 2 steps after it starts, so a commit can find one in flight) over ``optimizer``."""
    import horovod.torch as hvd
    import hvd_compress as hc

    if method in LOCAL_METHODS:
        codec = hc.QSGD(bits=4)
        if method == "diloco":
            return codec, hc.DiLoCo(optimizer, model.named_parameters(), codec, inner_steps=10)
        options = dict(inner_steps=10, fragments=2, delay=2, mixing=0.5)
        return codec, hc.StreamingDiLoCo(optimizer, model.named_parameters(), codec, **options)
    if method == "lgreco":
        compression = hc.LGreCo(hc.ACPSGD(rank=4, min_numel=0), warmup_steps=25, decide_every=20, timeout=120.0)
        return compression, hc.DistributedOptimizer(optimizer, model.named_parameters(), compression)
    compression = hc.COMPRESSORS[method].build(model.named_parameters(), small=True)
    return compression, hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )


class Workload:
    """The model, its batch for (step, rank, size), learning rate for a step, and final metric."""

    def __init__(self, name, steps, seed):
        self.name, self.steps, self.seed = name, steps, seed
        torch.manual_seed(seed)  # the same initial model everywhere; sync() broadcasts it anyway
        if name == "digits":
            from examples.workloads import digits

            self.x, self.y, self.test_x, self.test_y = digits.load_digits_split()
            self.model = digits.DigitsCNN()
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
            self.peak_lr = 0.05
        else:
            from examples.workloads import charlm

            self.charlm = charlm
            self.train_ids, self.val_ids = charlm.load_corpus()
            self.model = charlm.CharTransformer()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.01)
            self.peak_lr = 2e-3

    def batch(self, step, rank, size):
        g = torch.Generator().manual_seed(((self.seed * 100_003 + step) * 67 + size) * 31 + rank)
        if self.name == "digits":
            x, y = self.x[rank::size], self.y[rank::size]
            idx = torch.randint(len(y), (32,), generator=g)
            return x[idx], y[idx]
        return next(self.charlm.batches(self.train_ids, 32, self.model.context, g))

    def loss(self, x, y):
        if self.name == "digits":
            return torch.nn.functional.cross_entropy(self.model(x), y)
        return self.charlm.cross_entropy(self.model, x, y)

    def lr(self, step):
        """The charlm benchmark's schedule: 10% warmup, cosine decay to a tenth."""
        warmup = max(1, self.steps // 10)
        if step < warmup:
            return self.peak_lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        return self.peak_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    def final(self):
        """(metric name, value): test accuracy (digits) or validation perplexity (charlm)."""
        if self.name == "digits":
            from examples.workloads import digits

            return "accuracy", digits.accuracy(self.model, self.test_x, self.test_y)
        return "perplexity", self.charlm.evaluate(self.model, self.val_ids, self.model.context)


def initialise_state(optimizer):
    """Gives a distributed ``optimizer`` its state with one step of the wrapped optimizer (no
    exchange) on zero gradients and no weight decay, which leaves the parameters as they are.
    Horovod's TorchState.sync otherwise does it for a joining worker after the model was
    broadcast, with the weight decay: AdamW's then moves that worker's parameters away from
    everyone else's (seen here: ranks ended different)."""
    decays = [group.get("weight_decay", 0) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["weight_decay"] = 0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    super(type(optimizer), optimizer).step()  # as broadcast_optimizer_state does
    optimizer.zero_grad()
    for group, decay in zip(optimizer.param_groups, decays):
        group["weight_decay"] = decay


def worker(args):
    import horovod.torch as hvd

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a stuck worker is: kill -USR1
    hvd.init()
    workdir = Path(args.workdir)
    work = Workload(args.workload, args.steps, args.seed)
    compression, optimizer = build(args.method, work.model, work.optimizer)
    compression.feedback_on_world_change = args.feedback
    if args.method in LOCAL_METHODS:  # DiLoCo's handler holds its codec's state
        handlers = dict(optimizer=work.optimizer, outer=optimizer)
    else:
        initialise_state(optimizer)
        handlers = dict(optimizer=optimizer, compression=compression)
    state = hvd.elastic.TorchState(model=work.model, **handlers, step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append({"step": state.step, "size": hvd.size()})])

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = work.lr(state.step)
            x, y = work.batch(state.step, hvd.rank(), hvd.size())
            optimizer.zero_grad()
            loss = work.loss(x, y)
            loss.backward()
            optimizer.step()
            time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - started)))
            state.step += 1
            if hvd.rank() == 0:
                with open(workdir / PROGRESS_FILE, "a") as progress:
                    progress.write(json.dumps({"step": state.step, "size": hvd.size(), "loss": loss.item()}) + "\n")
            if hvd.rank() == args.kill_rank and state.step == args.kill_step and not (workdir / KILLED_FILE).exists():
                in_flight = getattr(compression, "decision_in_flight", None)
                (workdir / KILLED_FILE).write_text(
                    json.dumps(
                        {
                            "host": os.environ.get("HOROVOD_HOSTNAME"),
                            "rank": hvd.rank(),
                            "step": state.step,
                            "decision_in_flight": in_flight,
                        }
                    )
                )
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    # A local method's replicas agree on the anchors; its weights are local between outer steps.
    shared = optimizer.state_dict()["anchors"].values() if args.method in LOCAL_METHODS else work.model.parameters()
    flat = torch.cat([p.detach().reshape(-1) for p in shared])
    everyone = hvd.allgather(flat.unsqueeze(0), name="elastic.parameters")
    identical = all(torch.equal(everyone[0], row) for row in everyone)
    metric, value = work.final()
    if hvd.rank() == 0:
        decisions = [
            {"version": d.version, "decided_at": d.decided_at, "effective_step": d.effective_step}
            for d in getattr(compression, "decisions", [])
        ]
        (workdir / RESULT_FILE).write_text(
            json.dumps(
                {"identical": identical, "size": hvd.size(), metric: value, "resets": resets, "decisions": decisions}
            )
        )
    if not identical:
        raise RuntimeError("elastic run: ranks ended with different parameters")


# ----- the driver ------------------------------------------------------------------------------
def local_host_names():
    """Names of this machine, distinct to Horovod (each a "host") and all run locally."""
    import psutil

    names = ["localhost", "127.0.0.1", socket.gethostname()]
    for addresses in psutil.net_if_addrs().values():
        names += [a.address for a in addresses if a.family == socket.AF_INET and a.address != "127.0.0.1"]
    return list(dict.fromkeys(names))


def write_hosts(workdir, hosts):
    tmp = workdir / "hosts.tmp"
    tmp.write_text("".join(f"{host}:1\n" for host in hosts))
    tmp.replace(workdir / "hosts")  # atomic: the discovery script never reads half a file


def read_progress(workdir):
    path = workdir / PROGRESS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def run(
    workload,
    method,
    *,
    steps,
    seed=0,
    kill_rank=None,
    kill_step=None,
    rejoin_after=20,
    feedback="keep",
    commit_every=10,
    timeout=600,
    gloo_timeout=None,
    min_step_seconds=0.0,
):
    """One elastic run of 3 workers; with ``kill_rank``, the kill and the rejoin. Returns rank 0's
    result plus ``progress`` (rank 0's steps: step, size, loss), ``killed`` (who, when, and
    L-GreCo's decision in flight), ``steps_lost``, ``rejoined_at`` and ``wall_seconds``.
    ``gloo_timeout``: seconds a survivor waits in a collective with the killed worker before
    Gloo gives up (``HOROVOD_GLOO_TIMEOUT_SECONDS``; None: Horovod's 30). ``min_step_seconds``:
    each step padded to at least this long, so that a joining worker, which takes seconds to
    start, finds training still going when its steps take milliseconds (a local method's).
    Raises RuntimeError with the output's tail if the run fails or overruns ``timeout``."""
    names = local_host_names()
    if len(names) < 4:
        raise RuntimeError(f"elastic runs need 4 names for this machine, found {names}")
    with tempfile.TemporaryDirectory(prefix="hvd_compress-elastic-") as tmp:
        workdir = Path(tmp)
        write_hosts(workdir, names[:3])
        script = workdir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {workdir / 'hosts'}\n")
        script.chmod(0o755)
        recorded = dict(workload=workload, method=method, feedback=feedback, seed=seed)  # also in the result
        argv = [
            *("horovodrun", "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script)),
            *("--gloo", sys.executable, "-m", "benchmarks", "elastic", "--worker"),
            *options_argv(
                workdir=workdir,
                **recorded,
                steps=steps,
                commit_every=commit_every,
                min_step_seconds=min_step_seconds,
                kill_rank=-1 if kill_rank is None else kill_rank,
                kill_step=-1 if kill_step is None else kill_step,
            ),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=checkout_pythonpath(), PYTHONUNBUFFERED="1")
        if gloo_timeout is not None:
            env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(gloo_timeout)
        log = open(workdir / "output.log", "w+")
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed = rejoined_at = None
        try:
            while process.poll() is None:
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"overran {timeout} s")
                time.sleep(0.2)
                if killed is None and (workdir / KILLED_FILE).exists():
                    killed = json.loads((workdir / KILLED_FILE).read_text())
                    write_hosts(workdir, [h for h in names[:3] if h != killed["host"]])
                elif killed is not None and rejoined_at is None:
                    after = [p for p in read_progress(workdir) if p["size"] == 2]
                    if len(after) >= rejoin_after:
                        rejoined_at = after[-1]["step"]
                        write_hosts(workdir, [h for h in names[:3] if h != killed["host"]] + [names[3]])
            failure = (
                None if process.returncode == 0 and (workdir / RESULT_FILE).exists() else f"exit {process.returncode}"
            )
        except TimeoutError as error:
            failure = str(error)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.seek(0)
            output = log.read()
            log.close()
        wall = time.perf_counter() - started
        if failure is not None:
            raise RuntimeError(
                f"elastic run {workload}/{method} failed ({failure}) after {wall:.0f} s; "
                f"{' '.join(argv)}\n{output[-6000:]}"
            )
        result = json.loads((workdir / RESULT_FILE).read_text())
        progress = read_progress(workdir)
    steps_lost = None
    if killed is not None:
        resumed = next(p["step"] for p in progress if p["size"] == 2)
        steps_lost = killed["step"] - (resumed - 1)
    result.update(
        progress=progress,
        killed=killed,
        steps_lost=steps_lost,
        rejoined_at=rejoined_at,
        wall_seconds=wall,
        **recorded,
    )
    return result


# ----- the benchmark ---------------------------------------------------------------------------
def variants(args):
    """(key, run options) of every run: per seed, undisturbed, and disturbed under each policy."""
    kill = dict(kill_rank=args.kill_rank, kill_step=args.kill_step, rejoin_after=args.rejoin_after)
    for seed in args.seeds:
        yield f"undisturbed/{seed}", dict(seed=seed)
        for feedback in ("keep", "reset"):
            yield f"{feedback}/{seed}", dict(seed=seed, feedback=feedback, **kill)


def benchmark(args):
    path = args.out / "benchmarks" / "elastic.json"
    results = resumed(path)
    results.update(
        command=command_line("elastic", dropped=()),
        machine=machine(),
        steps=args.steps,
        kill_rank=args.kill_rank,
        kill_step=args.kill_step,
        rejoin_after=args.rejoin_after,
        commit_every=args.commit_every,
    )
    runs = results.setdefault("runs", {})
    wanted = [(key, options) for key, options in variants(args) if key not in runs]
    progress = Progress(len(wanted), "elastic")
    for key, options in wanted:
        progress.starting(key)
        result = run(
            "charlm", "powersgd", steps=args.steps, commit_every=args.commit_every, timeout=args.run_timeout, **options
        )
        del result["progress"]
        runs[key] = result
        progress.finished(
            f"{key}: perplexity {result['perplexity']:.3f}, steps lost "
            f"{result['steps_lost']}, {result['wall_seconds']:.0f} s"
        )
        save_record(path, results)
    write_section(args.out, SECTION, markdown(results, args.seeds))
    return results


def markdown(results, seeds):
    runs = results["runs"]
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"Machine: {describe_machine(results['machine'])}",
        "",
        f"Character LM, AdamW, PowerSGD rank 2 (the registry's small setting) on stock "
        f"`hvd.DistributedOptimizer`, {results['steps']} steps, 3 workers under `horovodrun` "
        f"elastic (Gloo). Disturbed runs: rank {results['kill_rank']} SIGKILLs itself at step "
        f"{results['kill_step']}, 2 workers go on from the last commit (every "
        f"{results['commit_every']} steps); after {results['rejoin_after']} steps with 2 "
        f"workers the driver adds a host and a third worker joins at the next commit. "
        f"Validation perplexity (lower is better):",
        "",
        "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
        "|---|" + "---:|" * (len(seeds) + 1),
    ]
    for label, prefix in [
        ("undisturbed", "undisturbed"),
        ("kill + rejoin, error feedback kept", "keep"),
        ("kill + rejoin, error feedback reset", "reset"),
    ]:
        values = [runs.get(f"{prefix}/{s}", {}).get("perplexity") for s in seeds]
        known = [v for v in values if v is not None]
        cells = [f"{v:.3f}" if v is not None else "-" for v in values]
        mean = f"{statistics.mean(known):.3f}" if known else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {mean} |")
    lost = [runs[k]["steps_lost"] for k in runs if runs[k].get("steps_lost") is not None]
    if lost:
        lines += ["", f"Steps lost at the kill (redone from the last commit): {sorted(set(lost))}."]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks elastic", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda text: [int(v) for v in text.split(",")], default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=105)
    parser.add_argument("--rejoin-after", type=int, default=50)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument(
        "--min-step-seconds",
        type=float,
        default=0.0,
        help="pad each step to this long: a local method's steps take milliseconds here, a GPU job's far more",
    )
    parser.add_argument("--run-timeout", type=int, default=900)
    parser.add_argument("--out", type=Path, default=DOCS)
    worker_options = parser.add_argument_group("worker (internal)")
    worker_options.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker_options.add_argument("--workdir", help=argparse.SUPPRESS)
    worker_options.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    worker_options.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    worker_options.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    worker_options.add_argument("--feedback", default="keep", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def render(out: Path) -> None:
    """Rewrites the page from the stored JSON, the seeds from the command it records."""
    results = stored(out, "elastic")
    write_section(out, SECTION, markdown(results, parse_args(shlex.split(results["command"])[4:]).seeds))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    benchmark(args)
    return 0

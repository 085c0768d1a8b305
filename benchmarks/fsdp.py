"""FSDP2 / HSDP on an emulated cluster: step time and final quality of plain HSDP against HSDP
whose replicate all-reduce goes through ``hvd_compress.fsdp.register`` (PowerSGD, ACP-SGD,
L-GreCo over ACP-SGD).

The cluster: two "nodes" of two ranks each (:mod:`benchmarks.testbed` with ``ranks_per_node=2``:
one network namespace per node, its link to the bridge shaped by ``tc tbf`` to ``--rate``
Gbit/s both ways; the two ranks of a node talk over its loopback, unshaped). mpirun starts the
4 ranks; each joins a Gloo process group over its node's link (``GLOO_SOCKET_IFNAME``) and
builds the 2 x 2 ``("replicate", "shard")`` device mesh, so each shard group is one node (its
reduce-scatter and all-gathers stay inside) and each replicate group spans both nodes (its
all-reduce crosses the shaped links: the one that is compressed).

Timing: the ``endtoend`` benchmark's models (character transformer, 19.1 M parameters, one
64-token sequence per rank and step; SmallVGG, 16 images), ``fully_shard`` on every block (or
layer) and the root, one torch thread per rank, SGD with momentum. Each job trains
``--warmup`` steps, then times ``--steps`` on rank 0 from ``zero_grad`` to the end of
``optimizer.step()``; the table gives the median. The load average of the machine when each
job started and the share of the CPU that went to other processes during it are recorded with
it. Methods: plain HSDP (FSDP's own float32 all-reduce over the replicate group); PowerSGD and
ACP-SGD at rank ``--rank``; L-GreCo over ACP-SGD at that rank (first decision at step 3, then
every 1000 steps, ``apply_delay="auto"``: its decision runs during the timed steps); and, timed
only, plain HSDP with its replicate all-reduce switched off (``set_requires_all_reduce(False)``),
the step that no exchange can beat: the ceiling of any compressor's speed-up here. Named in
``--methods`` only, timed only: pure FSDP over a 1-D mesh of the 4 ranks (its reduce-scatter and
all-gathers cross the shaped links), plain ("FSDP") and with its reduce-scatter quantized by
``QuantizedAllReduce`` ("FSDP int8", "FSDP int4"; 256-entry blocks), rated against plain FSDP.

Quality: the character LM of the quality benchmark (``examples.workloads.charlm.fit``: d_model
128, 2 layers, AdamW, warm-up and cosine decay, batch 32 per rank) under HSDP on a 2 x 2 mesh,
4 ranks under ``torchrun --standalone`` (no shaping: it does not change the arithmetic),
``--quality-steps`` steps per seed; the final validation perplexity of each method and seed.
L-GreCo decides first after a tenth of the steps, then every half of them.

Target: ACP-SGD at least 1.5x plain HSDP's step rate on the LM at 1 Gbit/s between
nodes, its mean final perplexity within the seeds' spread of plain HSDP's (the larger of the
two methods' max - min over seeds).

Results resume job by job from ``<out>/benchmarks/fsdp.json``; the "FSDP2 / HSDP on the emulated
cluster" page in ``<out>/benchmarks/`` is rewritten after each. ``--quick``: the CNN, 2 + 2
steps, 10 quality steps with one seed, no network shaping (plain ``torchrun``): a smoke test.
"""

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.jobs import (
    add_cluster_worker_options,
    add_job_options,
    checkout_pythonpath,
    cluster_job,
    command_line,
    init_cluster_worker,
    names_from,
    root_cause,
    run_or_work,
    torchrun_job,
    worker_argv,
)
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.methods import low_rank
from benchmarks.harness.render import notes_lines, resumed_section, stored, write_section
from benchmarks.harness.stats import CodecClock, jobs_of, pooled, summarise, timed_steps

RESULT_PREFIX = "FSDP_RESULT "
SECTION = "FSDP2 / HSDP on the emulated cluster"
PLAIN = "HSDP"
# Plain HSDP with the replicate all-reduce switched off (``set_requires_all_reduce(False)``): the
# replicas drift apart, so it is timed only, as the step no exchange could beat on this testbed.
FLOOR = "HSDP without replicate exchange"
METHODS = [PLAIN, "PowerSGD", "ACP-SGD", "L-GreCo", FLOOR]
# Pure FSDP (a 1-D mesh over all 4 ranks: its reduce-scatter crosses the links), plain and with
# the quantized reduce-scatter; compared with plain FSDP. Run only when named in --methods.
PLAIN_FSDP = "FSDP"
PURE_FSDP = [PLAIN_FSDP, "FSDP int8", "FSDP int4"]
TIMING_ONLY = {FLOOR, *PURE_FSDP}
NODES, RANKS_PER_NODE = 2, 2
PORT = 29541
TARGET = ("charlm", "ACP-SGD", 1.5)  # (model, method, least step-rate ratio to plain HSDP)
QUALITY_MODEL = {"d_model": 128, "layers": 2}


def make_compressor(method, rank, first_decision, decide_every):
    """The compressor or controller of ``method`` (None for plain HSDP)."""
    import hvd_compress as hc

    if method in (PLAIN, FLOOR, PLAIN_FSDP):
        return None
    quantized = {"FSDP int8": 8, "FSDP int4": 4}
    if method in quantized:
        return hc.QuantizedAllReduce(bits=quantized[method])
    return low_rank(method, rank, first_decision, decide_every)


def hsdp(model, method, rank, first_decision=3, decide_every=1000):
    """``model`` sharded in place over the 2 x 2 ("replicate", "shard") mesh (the 1-D mesh of all
    ranks for pure FSDP's methods), one ``fully_shard`` per block (transformer) or layer (CNN) and
    the root, ``method`` registered on it; returns the model and the method's compressor (None
    for plain HSDP or FSDP)."""
    import hvd_compress.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if method in PURE_FSDP:
        mesh = init_device_mesh("cpu", (NODES * RANKS_PER_NODE,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (NODES, RANKS_PER_NODE), mesh_dim_names=("replicate", "shard"))
    layers = list(model.blocks) if hasattr(model, "blocks") else [*model.convs, model.fc1, model.fc2, model.head]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if method == FLOOR:
        model.set_requires_all_reduce(False)  # every FSDP module below too
    compressor = make_compressor(method, rank, first_decision, decide_every)
    if compressor is not None:
        hvd_compress.fsdp.register(model, compressor)
    return model, compressor


# ----- one rank ---------------------------------------------------------------------------------
def timing_worker(args):
    from benchmarks.endtoend import WORKLOADS

    torch.set_num_threads(1)
    rank = init_cluster_worker(args, PORT, RANKS_PER_NODE)
    torch.manual_seed(0)
    model, data, loss_of = WORKLOADS[args.model](torch.Generator().manual_seed(rank))
    model, compressor = hsdp(model, args.method, args.rank)
    # The quantized reduce-scatter runs outside the compressor's timed rounds: no codec column.
    codec = CodecClock(None if args.method in PURE_FSDP else compressor)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seconds = timed_steps(model, optimizer, data, loss_of, args.warmup + args.steps)
    if rank == 0:
        print(
            RESULT_PREFIX
            + json.dumps({"seconds": seconds[args.warmup :], "codec_seconds": codec.seconds[args.warmup :]}),
            flush=True,
        )
    dist.destroy_process_group()


def quality_worker(args):
    from examples.workloads.charlm import CharTransformer, fit, load_corpus, warmup_steps

    torch.set_num_threads(1)
    init_cluster_worker(args, PORT, RANKS_PER_NODE)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    train_ids, val_ids = load_corpus()
    model, _ = hsdp(
        CharTransformer(**QUALITY_MODEL),
        args.method,
        args.rank,
        first_decision=warmup_steps(args.steps),
        decide_every=max(1, args.steps // 2),
    )
    _, perplexity = fit(
        lambda _model, optimizer: optimizer, model, train_ids, val_ids, rank, size, steps=args.steps, seed=args.seed
    )
    if rank == 0:
        print(RESULT_PREFIX + json.dumps({"perplexity": perplexity}), flush=True)
    dist.destroy_process_group()


# ----- the driver -------------------------------------------------------------------------------
def timing_job(args, cluster, model, method):
    flags = dict(model=model, method=method, warmup=args.warmup, steps=args.steps)
    load = os.getloadavg()[0]
    try:
        if cluster is None:  # --quick
            job = torchrun_job(
                worker_argv("fsdp", args, "timing", **flags),
                NODES * RANKS_PER_NODE,
                args.job_timeout,
                RESULT_PREFIX,
            )[0]
        else:
            argv = worker_argv(
                "fsdp", args, "timing", master=cluster.address(0), interface_prefix=cluster.prefix, **flags
            )
            env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_pythonpath()}
            job = cluster_job(cluster, argv, env, args.job_timeout, RESULT_PREFIX)
    except RuntimeError as error:
        failure = root_cause(error)
        print(f"{model} {method}: FAILED: {failure}", flush=True)
        return {"failed": failure[:240], "load_average": round(load, 1)}
    entry = {
        "step_ms": summarise(job["seconds"]),
        "step_ms_each": [round(1e3 * s, 1) for s in job["seconds"]],
        "wall_seconds": round(job["wall_seconds"], 1),
        "load_average": round(load, 1),
        "other_cpu_share": (
            round(job["other_cpu_seconds"] / (job["wall_seconds"] * os.cpu_count()), 2)
            if "other_cpu_seconds" in job
            else None
        ),
    }
    if job.get("codec_seconds"):
        entry["codec_ms"] = 1e3 * statistics.median(job["codec_seconds"])
    print(
        f"{model} {method}: median step {entry['step_ms']['median']:.0f} ms, load {load:.1f}, "
        f"other CPU share {entry['other_cpu_share']}, job {entry['wall_seconds']:.0f} s",
        flush=True,
    )
    return entry


def run(args):
    from benchmarks.testbed import emulated_cluster

    results, save = resumed_section(args.out, "fsdp", SECTION, markdown)
    results.setdefault("timing", {})
    results.setdefault("quality", {})
    # Runs at another rank than the first are kept beside it, their label naming the rank.
    results.setdefault("rank", args.rank)
    results.update(
        machine=machine(), rate_gbit=args.rate, warmup=args.warmup, steps=args.steps, quality_steps=args.quality_steps
    )
    if command_line("fsdp") not in results.setdefault("commands", [results.pop("command", command_line("fsdp"))]):
        results["commands"].append(command_line("fsdp"))

    def label(method):
        return method if method == PLAIN or args.rank == results["rank"] else f"{method}, rank {args.rank}"

    # Round by round: every method's first job, then every method's second, ...
    wanted = [
        (model, method)
        for repeat in range(args.repeats)
        for model in args.models
        for method in args.methods
        if jobs_of(results["timing"].get(model, {}).get(label(method))) <= repeat
    ]
    if wanted:
        shaped = (
            contextlib.nullcontext()
            if args.quick
            else emulated_cluster(NODES * RANKS_PER_NODE, args.rate, ranks_per_node=RANKS_PER_NODE)
        )
        with shaped as cluster:
            if cluster is not None:
                results["testbed"] = cluster.describe()
            for model, method in wanted:
                methods = results["timing"].setdefault(model, {})
                methods[label(method)] = pooled(methods.get(label(method)), timing_job(args, cluster, model, method))
                save()
    for seed in args.seeds:
        for method in (m for m in args.methods if m not in TIMING_ONLY):
            runs = results["quality"].setdefault(label(method), {})
            if str(seed) not in runs:
                argv = worker_argv("fsdp", args, "quality", method=method, steps=args.quality_steps, seed=seed)
                runs[str(seed)] = round(
                    torchrun_job(argv, NODES * RANKS_PER_NODE, args.job_timeout, RESULT_PREFIX)[0]["perplexity"], 3
                )
                print(f"charlm {label(method)} seed {seed}: perplexity {runs[str(seed)]:.3f}", flush=True)
                save()
    save()
    return results


# ----- the section ------------------------------------------------------------------------------
def markdown(results):
    shaped = "testbed" in results
    commands = results.get("commands", [results.get("command")])
    lines = [
        ", then ".join(f"`{command}`" for command in commands),
        "",
        describe_machine(results["machine"])
        + " 4 ranks (2 nodes x 2), one torch thread each, Gloo; "
        + (f"{results['testbed']}." if shaped else "no network shaping (--quick).")
        + f" HSDP over a 2 x 2 (\"replicate\", \"shard\") mesh: each shard group one node, each "
        f"replicate group across both. Low-rank methods at rank {results['rank']} unless the row says; "
        f"{results['warmup']} warm-up and {results['steps']} timed steps per job (a method of several "
        "jobs, run in rounds over the methods: its timed steps pooled, its codec the median of its jobs'); "
        "how each method runs: `benchmarks/fsdp.py`.",
        "",
    ]
    where = f"{results['rate_gbit']:g} Gbit/s between nodes" if shaped else "no network shaping"
    for model, methods in results["timing"].items():
        bases = {family: methods.get(family, {}).get("step_ms", {}).get("median") for family in (PLAIN, PLAIN_FSDP)}
        floor = (
            f" Plain HSDP's replicate all-reduce alone needs {wire_ms(model, results['rate_gbit']):.0f} ms "
            "a step on the wire (both ranks of a node send their float32 shard, half the model each, "
            "through the node's link)."
            if shaped
            else ""
        )
        lines += [
            f"**{model}, {where}** ({parameter_count(model) / 1e6:.1f} M parameters).{floor}",
            "",
            "| method | median step ms (p25-p75) | step rate vs plain HSDP (FSDP rows: plain FSDP) | "
            "load average at start | "
            "CPU to other processes | codec ms (rank 0) |",
            "|---|---|---|---|---|---|",
        ]
        # The methods in their usual order, then runs at another rank ("ACP-SGD, rank 16").
        known = METHODS + PURE_FSDP
        ordered = [m for m in known if m in methods] + [m for m in methods if m not in known]
        for method, entry in ((m, methods[m]) for m in ordered):
            base = bases[PLAIN_FSDP if method in PURE_FSDP else PLAIN]
            if "failed" in entry:
                lines.append(f"| {method} | failed: `{entry['failed']}` | - | {entry['load_average']} | - | - |")
                continue
            step = entry["step_ms"]
            lines.append(
                f"| {method} | **{step['median']:.0f}** ({step['p25']:.0f}-{step['p75']:.0f}) | "
                + (f"{base / step['median']:.2f}x" if base else "-")
                + f" | {entry['load_average']} | "
                + ("-" if entry["other_cpu_share"] is None else f"{100 * entry['other_cpu_share']:.0f}%")
                + (f" | {entry['codec_ms']:.0f} |" if "codec_ms" in entry else " | - |")
            )
        lines.append("")
    if results["quality"]:
        seeds = sorted({seed for runs in results["quality"].values() for seed in runs}, key=int)
        lines += [
            f"Character LM (d_model {QUALITY_MODEL['d_model']}, {QUALITY_MODEL['layers']} layers), "
            f"{results['quality_steps']} steps under HSDP, 4 ranks under torchrun: final validation "
            "perplexity.",
            "",
            "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | max - min |",
            "|---|" + "---|" * (len(seeds) + 2),
        ]
        for method, runs in results["quality"].items():
            values = list(runs.values())
            lines.append(
                f"| {method} | "
                + " | ".join(f"{runs[s]:.3f}" if s in runs else "-" for s in seeds)
                + f" | {statistics.mean(values):.3f} | {max(values) - min(values):.3f} |"
            )
        lines.append("")
    lines += ["Target: " + "; ".join(target_lines(results)) + "."]
    lines += notes_lines(results)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def parameter_count(model):
    from benchmarks.endtoend import WORKLOADS

    return sum(p.numel() for p in WORKLOADS[model](torch.Generator())[0].parameters())


def wire_ms(model, rate_gbit):
    """Milliseconds that plain HSDP's replicate all-reduce takes on a node's link at ``rate_gbit``:
    with 2 replicas each rank sends its whole float32 shard once (half of it in each of the
    reduce-scatter and all-gather halves of the ring), and a node's 2 ranks hold the whole model."""
    return 1e3 * parameter_count(model) * 4 * 8 / (rate_gbit * 1e9)


def target_lines(results):
    """The target's outcome for the method at each rank measured (its label with or without
    ", rank R")."""
    model, method, least = TARGET
    rows = []
    timing, quality = results["timing"].get(model, {}), results["quality"]
    labels = [m for m in dict.fromkeys([*timing, *quality]) if m == method or m.startswith(f"{method}, rank ")]
    for label in labels:
        if "step_ms" in timing.get(label, {}) and "step_ms" in timing.get(PLAIN, {}):
            ratio = timing[PLAIN]["step_ms"]["median"] / timing[label]["step_ms"]["median"]
            rows.append(
                f"{label} {ratio:.2f}x plain HSDP's step rate on {model} "
                f"(>= {least}: {'met' if ratio >= least else 'NOT met'})"
            )
        if quality.get(label) and quality.get(PLAIN):
            ours, plain = list(quality[label].values()), list(quality[PLAIN].values())
            spread = max(max(ours) - min(ours), max(plain) - min(plain))
            gap = statistics.mean(ours) - statistics.mean(plain)
            rows.append(
                f"{label}'s mean perplexity {gap:+.3f} from plain HSDP's, seeds' spread {spread:.3f} "
                f"({len(plain)} seeds; {'met' if abs(gap) <= spread else 'NOT met'})"
            )
    if "step_ms" in timing.get(FLOOR, {}) and "step_ms" in timing.get(PLAIN, {}):
        ceiling = timing[PLAIN]["step_ms"]["median"] / timing[FLOOR]["step_ms"]["median"]
        rows.append(
            f"with no replicate exchange at all ({FLOOR}) the step rate is {ceiling:.2f}x plain HSDP's "
            f"on {model}: the most any compressor can reach on this testbed"
        )
    return rows or ["not measured yet"]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks fsdp", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        type=lambda text: [m for m in text.split(",") if m],
        default=["charlm", "cnn"],
        help="models of the timing jobs; empty: none (quality runs only)",
    )
    parser.add_argument(
        "--methods",
        type=names_from(METHODS + PURE_FSDP),
        default=METHODS,
        help=f"also: {', '.join(PURE_FSDP)} (pure FSDP, 1-D mesh; timing only)",
    )
    parser.add_argument("--rate", type=float, default=1.0, help="link rate between nodes, Gbit/s")
    parser.add_argument("--rank", type=int, default=4, help="rank of the low-rank methods")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="timing jobs per method, in rounds over the methods")
    parser.add_argument("--quality-steps", type=int, default=200)
    parser.add_argument(
        "--seeds",
        type=lambda text: [int(s) for s in text.split(",") if s],
        default=[0, 1],
        help="seeds of the quality runs; empty: none",
    )
    add_job_options(parser, 400, "the CNN, few steps, one seed, no shaping", ["timing", "quality"], None)
    add_cluster_worker_options(parser)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.warmup, args.steps, args.quality_steps, args.seeds = ["cnn"], 2, 2, 10, [0]
    return args


def render(out: Path) -> None:
    """Rewrites the page from the stored JSON."""
    write_section(out, SECTION, markdown(stored(out, "fsdp")))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_or_work(args, run, {"timing": timing_worker, "quality": quality_worker})

"""Time to quality: how many steps each method needs to reach the uncompressed run's quality
(steps to target), the half of time to target that needs no network.

The workload is the character LM of "Quality against bytes" (``quality.LM``, AdamW, peak
learning rate 2e-3, 4 ranks of 16 sequences of 32 bytes a step), trained through the stock
``hvd.DistributedOptimizer`` with the compressors that benchmark builds (``quality.point``,
``quality.build_compression``), or through ``hvd_compress.DiLoCo`` (or SparseLoCo, Streaming
DiLoCo) over the local AdamW (as ``benchmarks.outer``). ``--family`` runs the points of the
families named alone (after the uncompressed seeds), in the usual order. One ``mpirun -np W`` job per (method, seed).
Last, ``OUTER_SWEEP``: DiLoCo's outer learning rate and momentum around the paper's, one seed each.

Schedule: warmup-stable-decay (Hägele et al. 2024). One run per seed holds the learning rate at
its peak after a fixed warm-up; at 80% of each length of ``LENGTHS`` a cool-down (1 - sqrt, 20%
of that length) branches from the running state (model, optimizer, compressor with its error
feedback, data stream) and its end is evaluated; the state is then restored and the stable run
goes on. So one job gives the validation loss of a run stopped at each length, and every method
gets the same schedule and the same evaluation points (in samples: length x ranks x batch).

The target (MLPerf Training / AlgoPerf time-to-train rules): uncompressed runs at
``BASE_SEEDS`` seeds up to ``UNCOMPRESSED_LONGEST`` steps; the knee is the shortest length of the
median curve after which doubling the run lowers the median validation loss by less than
``KNEE_GAIN``; the target is the highest of the seeds' losses at the knee, so every uncompressed
seed reaches it there. Every other run is capped at twice the knee and stops at the first length
that reaches the target; a run that never does is "not reached", with its best loss. Steps to
target: the first length at or under the target, interpolated in log(length) from the length
before it. A method's score is the median over its seeds (a miss counts as infinitely slow).

Resumes point by point: each job's record goes into ``<out>/benchmarks/time_to_quality.json``
(and its page, ``<out>/benchmarks/time-to-quality.md``, is rewritten) as soon as it ends; a rerun skips the
points already there. Within a point, each rank saves its state at every length it evaluates
(``<out>/benchmarks/time_to_quality.partial/``), so a job stopped by ``--max-minutes``, its
timeout or the machine resumes from its last length, not from step 0.
``--quick``: 2 ranks, the convergence benchmark's tiny LM, a few steps.
"""

import argparse
import copy
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import horovod.torch as hvd
import torch

import hvd_compress as hc
from hvd_compress.advise.local import LOCAL_KINDS  # an outer step every inner_steps steps
from hvd_compress.comm.rounds import Collective
from benchmarks import quality
from benchmarks.convergence import QUICK_LM
from benchmarks.harness.jobs import RUN_LIMITS, Progress, add_job_options, command_line, mpirun_job, run_points
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import DOCS, method_bars, panels, resumed, save_record, stored, write_section
from examples.workloads import charlm

RESULT_PREFIX = "TTQ_RESULT "
RUN_ONLY = ("progress", "deadline", "checkpoint")  # a job's fields that do not change what it trains
SECTION = "Time to quality"
UNCOMPRESSED = quality.UNCOMPRESSED
WORKLOAD = "charlm"
PEAK_LR = 2e-3  # the quality benchmark's
COOLDOWN_FRACTION = 0.2  # Hägele et al.: a 20% 1-sqrt cool-down matches a cosine schedule
# The evaluation schedule, in steps of every rank (ratios 1.33-1.5); the same for every method.
LENGTHS = [1000, 1500, 2000, 3000, 4000, 6000, 8000, 12000, 16000]
# Validation windows of 32 bytes, spread over the whole split (about 6,200 fit): 8x "Quality
# against bytes"' 256, since a target compares losses a few tenths of a percent apart.
EVAL_WINDOWS = 2048
WARMUP_STEPS = 300  # fixed, so every length shares the run up to its cool-down
UNCOMPRESSED_LONGEST = 8000
# Set after seed 0 (gains per doubling 8.9, 5.9, 4.3, 2.6, 2.0% from 1,000 to 4,000 steps): 3% puts
# the knee where the curve flattens (3,000 steps, cap 6,000); 5% would put it at 2,000 steps,
# where it still falls 4.3% per doubling.
KNEE_GAIN = 0.03
BASE_SEEDS, OTHER_SEEDS = 5, 3
# --quick: any gain makes a knee, so that the compressed points run too.
QUICK = {
    "lengths": [8, 12, 16, 24],
    "warmup": 2,
    "longest": 16,
    "base_seeds": 2,
    "other_seeds": 1,
    "knee_gain": 1.0,
    "eval_windows": 64,
}

# The points the time-to-target claims rest on: FP16 (the strong baseline), ACP-SGD rank 16 and
# PowerSGD rank 8 (the soonest and advise's pick at r = 3 in its first pass), L-GreCo over Top-K
# 10% (the soonest at r = 3 on one seed), and the two-hop quantized all-reduce at 8 and 4 bits
# (the method whose bytes stay flat as ranks grow). MLPerf/AlgoPerf: as many seeds as the
# target's own, and run first.
DECIDING = (
    "FP16",
    "ACP-SGD rank 16",
    "PowerSGD rank 8",
    "L-GreCo (Top-K) density 0.1",
    "QuantizedAllReduce bits 8",
    "QuantizedAllReduce bits 4",
)
QUICK_FAMILIES = ("FP16", "L-GreCo (PowerSGD)", "DiLoCo H=10 (QSGD)")  # each kind of state, branched
# Compressed points, in the order their seed 0 runs: the settings "Quality against bytes" found
# closest to uncompressed first (the low-rank anchor, rank 8, and ACP-SGD at twice it), then
# cheaper settings of each family, then the controllers.
METHODS = [
    ("FP16", "fp16", {}, None),
    ("PowerSGD", "powersgd", {"rank": 8}, None),
    ("ACP-SGD", "acpsgd", {"rank": 16}, None),
    ("QSGD", "qsgd", {"bits": 8}, None),
    ("Top-K", "topk", {"density": 0.1}, None),
    ("PowerSGD", "powersgd", {"rank": 4}, None),
    ("ACP-SGD", "acpsgd", {"rank": 8}, None),
    ("QSGD", "qsgd", {"bits": 4}, None),
    ("ScaleCom", "scalecom", {"density": 0.1}, {"warmup": True}),
    ("L-GreCo (PowerSGD)", "powersgd", {"rank": 8}, {"kind": "lgreco"}),
    ("L-GreCo (Top-K)", "topk", {"density": 0.1}, {"kind": "lgreco"}),
    ("GraVAC (Top-K)", "topk", {}, {"kind": "gravac", "epsilon": 0.7}),
    ("Top-K", "topk", {"density": 0.01}, None),
    # DiLoCo with the codec "DiLoCo: local steps" found best (QSGD 4 bits, as good as FP16
    # at half its bytes), at two periods.
    ("DiLoCo H=50 (QSGD)", "qsgd", {"bits": 4}, {"kind": "diloco", "inner_steps": 50}),
    ("DiLoCo H=10 (QSGD)", "qsgd", {"bits": 4}, {"kind": "diloco", "inner_steps": 10}),
    # SparseLoCo at the paper's settings (2% of each chunk of 4,096 in 2 bits, residual decay
    # 0.95, outer SGD at learning rate 1), at the same two periods.
    ("SparseLoCo H=50", "chunkedtopk", {"density": 0.02}, {"kind": "sparseloco", "inner_steps": 50}),
    ("SparseLoCo H=10", "chunkedtopk", {"density": 0.02}, {"kind": "sparseloco", "inner_steps": 10}),
    # Streaming DiLoCo at the paper's overlap and mixing (tau 5, alpha 0.5), two fragments.
    (
        "Streaming DiLoCo H=50 F=2 (QSGD)",
        "qsgd",
        {"bits": 4},
        {"kind": "streaming", "inner_steps": 50, "fragments": 2, "delay": 5, "mixing": 0.5},
    ),
    # The two-hop quantized all-reduce, added after the points above had run.
    ("QuantizedAllReduce", "qallreduce", {"bits": 8}, None),
    ("QuantizedAllReduce", "qallreduce", {"bits": 4}, None),
]
# DiLoCo's outer step around the paper's settings (Nesterov SGD at learning rate 0.7, momentum
# 0.9; DiLoCo, section 3), one seed each at both periods: the small sweep that chooses them.
OUTER_SWEEP = [
    (
        f"DiLoCo H={period} outer {lr}/{momentum} (QSGD)",
        "qsgd",
        {"bits": 4},
        {"kind": "diloco", "inner_steps": period, "outer_lr": lr, "outer_momentum": momentum},
    )
    for period in (10, 50)
    for lr, momentum in ((0.5, 0.9), (1.0, 0.9), (0.7, 0.8))
]


# ----- one job: runs on every rank ----------------------------------------------------------------
def lr_factor(step: int, length: int, warmup: int) -> float:
    """The learning rate of step ``step`` (0-based) of a ``length``-step warmup-stable-decay run,
    as a fraction of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    cooldown = cooldown_steps(length)
    start = length - cooldown
    return 1.0 if step < start else 1.0 - math.sqrt((step - start) / cooldown)


def cooldown_steps(length: int) -> int:
    return max(1, round(COOLDOWN_FRACTION * length))


@dataclass
class Training:
    """One rank's run of a point, built as every job of this benchmark (and of ``time_to_target``,
    which times its steps) builds it."""

    model: Any
    optimizer: Any  # hvd.DistributedOptimizer, or hc.DiLoCo over the local AdamW
    compression: Any  # None: uncompressed
    stateful: Dict[str, Any]  # what a branch saves and restores
    generator: torch.Generator  # the data stream's
    data: Iterator
    val_ids: torch.Tensor


def build_training(spec: Dict[str, Any], schedule_steps: int) -> Training:
    """The model, optimizer, compression and data of ``spec`` on this rank. Schedules inside a
    method (L-GreCo's decisions, ScaleCom's warm-up) follow ``schedule_steps``."""
    lm = spec["lm"]
    torch.manual_seed(spec["seed"])  # as charlm.train: the model's initialisation follows the seed
    train_ids, val_ids = charlm.load_corpus(lm["max_chars"])
    model = charlm.CharTransformer(**lm["model"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    tokens = lm["batch_size"] * lm["model"]["context"]
    inner = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)
    stateful = {"model": model}
    outer = spec["controller"] or {}
    if outer.get("kind") in LOCAL_KINDS:
        # Local AdamW steps, then an outer step on the codec's average of the pseudo-gradients:
        # Nesterov SGD (DiLoCo; "outer_lr" and "outer_momentum" where given, else 0.7 and 0.9),
        # or SparseLoCo's plain SGD on its chunked top-k ("outer_lr", "feedback_decay").
        if outer["kind"] == "sparseloco":
            options = {key: outer[key] for key in ("outer_lr", "feedback_decay") if key in outer}
            optimizer = hc.SparseLoCo(inner, named, inner_steps=outer["inner_steps"], **spec["settings"], **options)
        elif outer["kind"] == "streaming":
            codec = hc.COMPRESSORS[spec["compressor"]].build(**spec["settings"])
            options = {key: outer[key] for key in ("inner_steps", "fragments", "delay", "mixing")}
            optimizer = hc.StreamingDiLoCo(inner, named, codec, **options)
        else:
            codec = hc.COMPRESSORS[spec["compressor"]].build(**spec["settings"])
            lr, momentum = outer.get("outer_lr", 0.7), outer.get("outer_momentum", 0.9)
            optimizer = hc.DiLoCo(
                inner,
                named,
                codec,
                inner_steps=outer["inner_steps"],
                outer_optimizer=lambda anchors: torch.optim.SGD(anchors, lr=lr, momentum=momentum, nesterov=True),
            )
        compression = optimizer.compression
        stateful.update(optimizer=inner, outer=optimizer)  # DiLoCo's state holds its codec's
    else:
        compression = quality.build_compression(spec, model, named, schedule_steps, tokens)
        extra = {} if compression is None else {"compression": compression}
        # time_to_target prices hvd_compress's own optimizer too (its overlapped path).
        wrap = hc.DistributedOptimizer if spec.get("integration") == "wrapper" else hvd.DistributedOptimizer
        optimizer = wrap(inner, named_parameters=named, **extra)
        stateful.update(optimizer=optimizer, **extra)
    generator = torch.Generator().manual_seed(hvd.size() * spec["seed"] + hvd.rank())  # as charlm.fit
    data = charlm.batches(train_ids, lm["batch_size"], model.context, generator)
    return Training(model, optimizer, compression, stateful, generator, data, val_ids)


def take_step(run: Training, lr: float) -> None:
    """One optimizer step of ``run`` at learning rate ``lr``."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    x, y = next(run.data)
    run.optimizer.zero_grad()
    charlm.cross_entropy(run.model, x, y).backward()
    run.optimizer.step()


def validation_loss(run: Training, windows: int) -> float:
    """``run``'s mean validation cross-entropy (nats) over ``windows`` windows."""
    return math.log(charlm.evaluate(run.model, run.val_ids, run.model.context, windows))


def train_point(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Trains the stable run with a cool-down branched at each length of ``spec["lengths"]``,
    stopping after the first length at or under ``spec["target"]`` (when given); rank 0's record."""
    lengths, target = sorted(spec["lengths"]), spec.get("target")
    rank, size = hvd.rank(), hvd.size()
    run = build_training(spec, lengths[-1])

    def train(first: int, last: int, length: int) -> None:
        for step in range(first, last):
            take_step(run, PEAK_LR * lr_factor(step, length, spec["warmup"]))

    def state() -> Dict[str, Any]:
        return copy.deepcopy(
            {**{name: obj.state_dict() for name, obj in run.stateful.items()}, "data": run.generator.get_state()}
        )

    def restore(saved: Dict[str, Any]) -> None:
        for name, obj in run.stateful.items():
            obj.load_state_dict(saved[name])
        run.generator.set_state(saved["data"])

    checkpoint = Path(spec["checkpoint"]) / f"rank{rank}.pt" if spec.get("checkpoint") else None
    started, done, steps_taken, points, wire_before = time.perf_counter(), 0, 0, [], 0
    resumed_at = load_checkpoint(checkpoint, spec)
    if resumed_at is not None:
        restore(resumed_at["state"])
        done, steps_taken, points, wire_before = (
            resumed_at[key] for key in ("done", "steps_taken", "points", "wire_bytes")
        )
        started -= resumed_at["seconds"]
    for length in lengths:
        if points and length <= points[-1]["length"]:
            continue
        branch = length - cooldown_steps(length)
        train(done, branch, length)
        steps_taken += branch - done
        done, saved = branch, state()
        train(branch, length, length)
        steps_taken += length - branch
        # Rank 0's loss decides for all: every rank must stop at the same length. Named: the
        # default name is the object's type, None on the other ranks, and mismatched names hang.
        # Its clock decides too: past the deadline, every rank stops at this length's checkpoint.
        loss, stop = (
            (None, None)
            if rank
            else (validation_loss(run, spec["eval_windows"]), time.time() >= spec.get("deadline", math.inf))
        )
        loss, stop = hvd.broadcast_object((loss, stop), root_rank=0, name="time_to_quality.loss")
        points.append({"length": length, "samples": length * size * spec["lm"]["batch_size"], "loss": loss})
        if rank == 0 and spec.get("progress"):
            with open(spec["progress"], "a") as log:
                log.write(f"{spec['key']}: length {length}, loss {loss:.4f}, {time.perf_counter() - started:.0f} s\n")
        if target is not None and loss <= target:
            break
        restore(saved)
        if checkpoint is not None:
            wire = wire_before + (run.compression.traffic.wire_bytes if run.compression is not None else 0)
            progress = dict(done=done, steps_taken=steps_taken, points=points, wire_bytes=wire)
            save_checkpoint(checkpoint, spec, dict(progress, state=saved, seconds=time.perf_counter() - started))
        if stop and length != lengths[-1]:
            return {"key": spec["key"], "stopped_at": length}
    record = {
        "key": spec["key"],
        "points": points,
        "steps_taken": steps_taken,
        "world_size": size,
        "train_seconds": time.perf_counter() - started,
    }
    if resumed_at is not None:
        record["resumed_at"] = resumed_at["done"]  # the step it went on from; train_seconds spans the jobs
    if run.compression is not None:
        record["wire_bytes_per_step"] = (wire_before + run.compression.traffic.wire_bytes) / steps_taken
    return record


def checkpoint_identity(spec: Dict[str, Any]) -> str:
    """What a checkpoint must have been trained for to be resumed: the job's spec, less where
    its progress goes and when it stops."""
    return json.dumps({key: value for key, value in spec.items() if key not in RUN_ONLY}, sort_keys=True)


def save_checkpoint(path: Path, spec: Dict[str, Any], progress: Dict[str, Any]) -> None:
    """Writes this rank's ``progress`` (its stable run's state at the last branch, the lengths
    evaluated, the steps, seconds and wire bytes so far) to ``path``, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save(dict(progress, spec=checkpoint_identity(spec)), partial)
    os.replace(partial, path)


def load_checkpoint(path: Optional[Path], spec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """This rank's saved progress for ``spec`` where every rank has one at the same step, else
    None (a fresh start): ranks that resumed from different steps would train apart. Collective."""
    mine = torch.load(path, weights_only=False) if path is not None and path.exists() else None
    if mine is not None and mine["spec"] != checkpoint_identity(spec):
        mine = None
    steps = hvd.allgather_object(None if mine is None else mine["done"], name="time_to_quality.resume")
    return mine if None not in steps and len(set(steps)) == 1 else None


# ----- the target and the scores ----------------------------------------------------------------
def records_of(results: Dict[str, Any], label: str) -> List[Dict[str, Any]]:
    return [entry["record"] for entry in results["points"].values() if entry["spec"]["label"] == label]


def median_curve(records: List[Dict[str, Any]]) -> Dict[int, float]:
    """length -> median loss over the records, at the lengths every record reached."""
    common = set.intersection(*({p["length"] for p in r["points"]} for r in records))
    return {
        length: statistics.median(p["loss"] for r in records for p in r["points"] if p["length"] == length)
        for length in sorted(common)
    }


def target_of(results: Dict[str, Any], base_seeds: int, knee_gain: float) -> Optional[Dict[str, Any]]:
    """The knee and target from the uncompressed seeds, or None until all of them ran. Where no
    length gains less than ``knee_gain`` when doubled, the knee is the longest length whose double
    was measured ("knee_found" False)."""
    records = records_of(results, UNCOMPRESSED)
    if len(records) < base_seeds:
        return None
    curve = median_curve(records)
    doubled = [length for length in curve if 2 * length in curve]
    knee = next((length for length in doubled if curve[2 * length] > (1 - knee_gain) * curve[length]), None)
    outcome = {"curve": curve, "knee": knee or max(doubled), "knee_found": knee is not None, "seeds": len(records)}
    at_knee = [p["loss"] for r in records for p in r["points"] if p["length"] == outcome["knee"]]
    return dict(
        outcome,
        target=max(at_knee),
        median_at_knee=statistics.median(at_knee),
        spread_at_knee=max(at_knee) - min(at_knee),
        cap=2 * outcome["knee"],
    )


def steps_to_target(record: Dict[str, Any], target: float) -> Optional[float]:
    """Steps of the first length at or under ``target``, interpolated in log(length) from the
    length before it (linear in loss); None: not reached."""
    previous = None
    for point in record["points"]:
        if point["loss"] <= target:
            if previous is None:
                return float(point["length"])
            fraction = (previous["loss"] - target) / (previous["loss"] - point["loss"])
            return math.exp(
                math.log(previous["length"]) + fraction * (math.log(point["length"]) - math.log(previous["length"]))
            )
        previous = point
    return None


def score(records: List[Dict[str, Any]], target: float) -> Dict[str, Any]:
    """Median steps to target over the seeds (a miss counts as slowest: None when half or more
    missed), the mean without the fastest and slowest, the spread, and the best loss of misses."""
    steps = [steps_to_target(r, target) for r in records]
    ordered = sorted(math.inf if s is None else s for s in steps)
    median = statistics.median(ordered)
    trimmed = ordered[1:-1] if len(ordered) >= 3 else ordered
    reached = [s for s in ordered if s != math.inf]
    return {
        "seeds": len(records),
        "reached": len(reached),
        "steps": steps,
        "median": None if median == math.inf else median,
        "trimmed_mean": None if math.inf in trimmed else statistics.fmean(trimmed),
        "spread": max(reached) - min(reached) if len(reached) > 1 else None,
        "best_missed_loss": min(
            (min(p["loss"] for p in r["points"]) for r, s in zip(records, steps) if s is None), default=None
        ),
    }


# ----- the driver -----------------------------------------------------------------------------
def spec_for(
    family: str, compressor: Optional[str], settings: Dict[str, Any], controller: Optional[Dict[str, Any]], seed: int
) -> Dict[str, Any]:
    return quality.point(WORKLOAD, family, compressor, settings, seed, controller)


def base_points(plan: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [spec_for(UNCOMPRESSED, None, {}, None, seed) for seed in range(plan["base_seeds"])]


def method_points(plan: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every compressed point: the points of ``DECIDING`` first, with as many seeds as
    uncompressed; then every other method seed by seed (seed 0 of every method first); then the
    outer sweep at seed 0."""
    methods = [m for m in METHODS if m[0] in QUICK_FAMILIES] if plan["quick"] else METHODS
    deciding = [m for m in methods if spec_for(*m, 0)["label"] in DECIDING]
    sweep = [] if plan["quick"] else OUTER_SWEEP
    return (
        [spec_for(*method, seed) for seed in range(plan["base_seeds"]) for method in deciding]
        + [
            spec_for(*method, seed)
            for seed in range(plan["other_seeds"])
            for method in methods
            if method not in deciding
        ]
        + [spec_for(*method, 0) for method in sweep]
    )


def checkpoint_folder(out: Path, key: str) -> Path:
    """Where the ranks of point ``key`` keep their checkpoints until its record is saved."""
    return out / "benchmarks" / "time_to_quality.partial" / re.sub(r"[^\w.=-]+", "_", key)


def run_point(spec, lengths, target, args, results, path, progress, deadline) -> None:
    """Trains point ``spec`` as one job, from its checkpoint where an earlier job left one, and
    saves its record; past ``deadline`` (seconds since the epoch) the job stops at its next
    checkpoint and the point stays pending."""
    checkpoints = checkpoint_folder(args.out, spec["key"])
    job = dict(
        spec,
        lm=args.lm,
        lengths=lengths,
        target=target,
        warmup=args.plan["warmup"],
        eval_windows=args.plan["eval_windows"],
        progress=args.progress and str(args.progress),
        checkpoint=str(checkpoints),
        deadline=deadline,
    )
    [record] = mpirun_job("time_to_quality", job, args.np, args.job_timeout, RESULT_PREFIX, spec["key"], expected=1)
    if "stopped_at" in record:
        progress.finished(f"{spec['key']}: stopped at {record['stopped_at']} steps; a rerun resumes there")
        return
    results["points"][spec["key"]] = {"spec": dict(spec, lengths=lengths, target=target), "record": record}
    results["command"] = command_line("time_to_quality", RUN_LIMITS)
    save_record(path, results)
    shutil.rmtree(checkpoints, ignore_errors=True)
    write_report(results, args.out)
    last = record["points"][-1]
    progress.finished(
        f"{spec['key']}: loss {last['loss']:.4f} at {last['length']} steps, {record['job_seconds']:.0f} s"
    )


def run(args) -> Dict[str, Any]:
    """The uncompressed seeds, then (once they set the target) every compressed point not yet in
    the JSON; starts no new point after ``--max-minutes``."""
    path = args.out / "benchmarks" / "time_to_quality.json"
    results = resumed(path)
    results.setdefault("points", {})
    results.update(machine=machine(), np=args.np, plan=args.plan)
    deadline = time.time() + 60 * args.max_minutes
    plan = args.plan
    progress = Progress(0, "time_to_quality")

    def pending(specs):
        return [spec for spec in specs if spec["key"] not in results["points"]]

    base = pending(base_points(plan))
    progress.add(len(base))
    for spec in base:
        if time.time() < deadline:
            progress.starting(spec["key"])
            lengths = [n for n in plan["lengths"] if n <= plan["longest"]]
            run_point(spec, lengths, None, args, results, path, progress, deadline)
    goal = target_of(results, plan["base_seeds"], plan["knee_gain"])
    if goal is not None:
        others = [spec for spec in pending(method_points(plan)) if not args.family or spec["family"] in args.family]
        progress.add(len(others))
        for spec in others:
            if time.time() < deadline:
                progress.starting(spec["key"])
                run_point(
                    spec,
                    [n for n in plan["lengths"] if n <= goal["cap"]],
                    goal["target"],
                    args,
                    results,
                    path,
                    progress,
                    deadline,
                )
    write_report(results, args.out)
    return results


# ----- the report ---------------------------------------------------------------------------------
def labels_in_order(results: Dict[str, Any]) -> List[str]:
    labels = []
    for entry in results["points"].values():
        if entry["spec"]["label"] not in labels:
            labels.append(entry["spec"]["label"])
    return labels


def steps_text(value: Optional[float]) -> str:
    return "not reached" if value is None else f"{value:,.0f}"


def markdown(results: Dict[str, Any], figure: Path, out: Path = DOCS) -> str:
    """The page: ``figure`` relative to it (in ``out``/benchmarks), and ``out`` (docs/), where the GPU codec
    table is read too."""
    plan = results["plan"]
    goal = target_of(results, plan["base_seeds"], plan["knee_gain"])
    job_minutes = sum(e["record"].get("job_seconds", 0.0) for e in results["points"].values()) / 60
    lines = [
        f"Command: `{results.get('command', 'python -m benchmarks time_to_quality')}` (resumable; "
        f"{len(results['points'])} jobs, {job_minutes:.0f} min in jobs, in the background beside other "
        "work on the same cores: the job times are not step times)",
        "",
        f"Machine: {describe_machine(results['machine'])}",
        "",
        f"Workload: the character LM of \"Quality against bytes\", {results['np']} ranks under `mpirun` "
        "on loopback (no emulated network: this half counts steps, not seconds). Schedule: "
        f"warmup-stable-decay, {plan['warmup']} warm-up steps, peak learning rate {PEAK_LR}, and a "
        f"1 - sqrt cool-down over the last {COOLDOWN_FRACTION:.0%} of each length, branched from one "
        "stable run per seed (model, optimizer, compressor state and data stream restored after "
        f"each branch). Evaluation: validation loss (nats per byte, on {plan['eval_windows']} windows of 32 "
        f"bytes across the validation split) at the end of each length of "
        f"{', '.join(map(str, plan['lengths']))} steps (x {results['np']} ranks x 16 sequences of 32 bytes), "
        "the same for every method.",
        "",
    ]
    if goal is None:
        done = len(records_of(results, UNCOMPRESSED))
        lines += [f"Target: not measured yet ({done} of {plan['base_seeds']} uncompressed seeds have run).", ""]
        for entry in results["points"].values():
            if entry["spec"]["label"] == UNCOMPRESSED:
                lines += [
                    f"Uncompressed, {entry['spec']['key'].rsplit('/', 1)[-1]} (length: validation loss): "
                    + ", ".join(f"{p['length']}: {p['loss']:.4f}" for p in entry["record"]["points"])
                    + ".",
                    "",
                ]
    else:
        lines += [
            "Uncompressed, median validation loss over "
            f"{goal['seeds']} seeds (length: loss): "
            + ", ".join(f"{length}: {loss:.4f}" for length, loss in goal["curve"].items())
            + ".",
            "",
        ]
        rule = (
            f"the shortest length after which doubling the run lowers the median loss by less than "
            f"{plan['knee_gain']:.0%}"
            if goal["knee_found"]
            else f"no length up to {plan['longest'] // 2} gains less than {plan['knee_gain']:.0%} when doubled: "
            "the longest length whose double was measured, short of the knee"
        )
        lines += [
            f"Knee: {goal['knee']} steps ({rule}). Target: validation loss {goal['target']:.4f}, the "
            f"highest of the {goal['seeds']} seeds at the knee (median {goal['median_at_knee']:.4f}, "
            f"spread {goal['spread_at_knee']:.4f}). Cap: {goal['cap']} steps.",
            "",
        ]
        lines += steps_table(results, goal["target"])
    lines += link_settings(results["np"], out) + budget(plan, goal and goal["cap"])
    lines.append(f"![time to quality]({figure.as_posix()})")
    return "\n".join(lines) + "\n"


def job_steps(lengths: List[int]) -> int:
    """Steps one job trains: the stable run to the last cool-down's branch, and every cool-down."""
    return max(lengths) - cooldown_steps(max(lengths)) + sum(cooldown_steps(n) for n in lengths)


def budget(plan: Dict[str, Any], cap: Optional[int]) -> List[str]:
    """What the plan costs in steps, and what was left out to fit it."""
    base = job_steps([n for n in plan["lengths"] if n <= plan["longest"]])
    capped = job_steps([n for n in plan["lengths"] if n <= (cap or plan["longest"])])
    jobs = (
        plan["base_seeds"] * (1 + len(DECIDING))
        + (len(METHODS) - len(DECIDING)) * plan["other_seeds"]
        + len(OUTER_SWEEP)
    )
    # Every job to the cap, at 55 ms a step, or 110 ms with a CPU codec: the bound, before jobs
    # stop at the target.
    hours = [jobs * capped * step_s / 3600 for step_s in (0.055, 0.110)]
    whole = (
        (
            f"With every job run to the cap, the {jobs} jobs would take {hours[0]:.0f}-{hours[1]:.0f} h of idle "
            "cores; a job stops at the first length that reaches the target, so the plan fits the issue's 12 h "
            "only if most compressed jobs stop well before the cap."
        )
        if cap
        else ""
    )
    return [
        f"**Budget.** An uncompressed job trains {base:,} steps; a compressed one at most {capped:,} "
        f"({'at the cap of ' + format(cap, ',') + ' steps' if cap else 'the cap is not set yet'}), fewer "
        "when it reaches the target sooner. A step on idle cores is about 55 ms uncompressed (a "
        "hand-run: 3,000 steps in 164 s) and up to about twice that with a CPU codec; the first "
        f"uncompressed seed took 37 min (194 ms a step) beside two other people's work. {whole} "
        "Traded to fit: one or two "
        "settings per method (those \"Quality against bytes\" found closest to uncompressed, then one "
        f"cheaper), 3 seeds for every compressed point but those the targets rest on ({', '.join(DECIDING)}: "
        f"{plan['base_seeds']}, run first), DiLoCo with one codec, and lengths "
        "1.33-1.5x apart (steps to target interpolated between them).",
        "",
    ]


# GPU clusters placed on the same scale: (label, peak dense bf16 FLOPS, link Gbit/s per node,
# tokens per GPU and step); utilisation and fp32 gradients as GPU_UTILISATION, GPU_GRADIENT_BYTES.
GPU_CLUSTERS = [
    ("H100, 25 Gbit/s Ethernet", 989e12, 25, 56_000),
    ("A100, 25 Gbit/s Ethernet", 312e12, 25, 18_000),
    ("A100, 100 Gbit/s InfiniBand", 312e12, 100, 44_000),
    ("H100, 400 Gbit/s InfiniBand", 989e12, 400, 35_000),
]
GPU_UTILISATION, GPU_GRADIENT_BYTES = 0.4, 4


def gpu_ratio(
    peak_flops: float,
    link_gbit: float,
    tokens: int,
    utilisation: float = GPU_UTILISATION,
    gradient_bytes: int = GPU_GRADIENT_BYTES,
) -> float:
    """r of a GPU cluster: the ring bound of one all-reduce across nodes (2 x bytes x P / B, the
    nodes' GPUs reduced among themselves first) over a step's compute (6 x P x tokens / (peak x
    utilisation)). P cancels: r = bytes x peak x utilisation / (3 x tokens x B)."""
    return gradient_bytes * peak_flops * utilisation / (3 * tokens * link_gbit * 1e9 / 8)


def link_settings(world: int, out: Path) -> List[str]:
    """The two link settings, their arithmetic and the GPU clusters they stand for."""
    parameters = sum(p.numel() for p in charlm.CharTransformer(**quality.LM["model"]).parameters())
    ring = 2 * (world - 1) / world * 4 * parameters
    compute_s = 0.033  # "Quality against bytes": 3,000 steps in about 100 s on idle cores
    rows = [
        f"| {label} | {peak / 1e12:.0f} | {gbit} | {tokens:,} | {gpu_ratio(peak, gbit, tokens):.2f} |"
        for label, peak, gbit, tokens in GPU_CLUSTERS
    ]
    return [
        "**Link settings.** r is the ring bound of the uncompressed all-reduce, "
        f"2(W-1)/W x M / B, over the compute of a step. Here P = {parameters:,} parameters, M = "
        f"{4 * parameters:,} bytes of fp32 gradients, W = {world}: {ring / 1e6:.2f} MB / B, against about "
        f"{1e3 * compute_s:.0f} ms of compute a step (4 ranks on 2 cores). \"Ethernet\", r = 3, needs B = "
        f"{ring / (3 * compute_s) / 1e6:.1f} MB/s of all-reduce bandwidth; \"InfiniBand\", r = 0.3, "
        f"{ring / (0.3 * compute_s) / 1e6:.0f} MB/s. \"Time to target\" measures both on the testbed "
        "with a probe job (the nominal tbf rate is not the all-reduce's bandwidth) and sets the two "
        "rates from it.",
        "",
        "On a GPU cluster a step's compute is 6 P T / (F u) (T tokens per GPU and step, F peak FLOPS, u "
        "utilisation) and the all-reduce across nodes 2 b P / B (b bytes per gradient element, B one "
        "node's link): r = b F u / (3 T B), whatever the model's size. With u = "
        f"{GPU_UTILISATION} and fp32 gradients (b = {GPU_GRADIENT_BYTES}; bf16 halves r):",
        "",
        "| cluster | peak TFLOPS (bf16, dense) | link Gbit/s per node | tokens per GPU and step | r |",
        "|---|---|---|---|---|",
        *rows,
        "",
        *codec_share(out),
        "",
        "Time to target on the emulated cluster (steps to target here x step time measured there, "
        "checked against end-to-end runs): \"Time to target\".",
        "",
    ]


# The GPU codec share: "Codec cost on a GPU" (python -m benchmarks codec --device cuda) on this
# shape set, against its compute on the first GPU cluster above at its tokens per step.
SHARE_SHAPES, SHARE_CODECS = "bert-base", ("PowerSGD", "ACP-SGD", "TopK", "QSGD", "FP16")


def codec_share(out: Path) -> List[str]:
    """How a CPU codec biases time to target, against the GPU codec measured in the same docs."""
    cpu = (
        "A CPU codec is far costlier against compute than a GPU one should be: in a 440-step probe on "
        "loopback, beside other work, PowerSGD rank 8 took 190 ms a step against 108 ms uncompressed on "
        "this testbed, so every compressed method's step time here carries a codec share near compute's."
    )
    measured = out / "benchmarks" / "codec-cuda.json"
    if not measured.exists():
        return [cpu + " The GPU's share is not measured yet (`python -m benchmarks codec --device cuda`)."]
    gpu = json.loads(measured.read_text())
    codec = gpu["codec"].get(SHARE_SHAPES)
    if codec is None:
        return [cpu + f" The GPU's codec table has no {SHARE_SHAPES} row."]
    label, peak, _, tokens = GPU_CLUSTERS[0]
    compute_ms = 1e3 * 6 * codec["parameters"] * tokens / (peak * GPU_UTILISATION)
    methods = codec["methods"]
    cells = "; ".join(
        f"{name} {methods[name]['step_ms']:.1f} ms ({methods[name]['floor']['floor_ms']:.1f} at its floor)"
        for name in SHARE_CODECS
        if "floor" in methods.get(name, {})
    )
    settings = gpu["options"]
    return [
        cpu + f" On a GPU ({gpu['machine'].get('gpu', 'GPU')}, \"Codec cost on a GPU\"), a step of {SHARE_SHAPES}'s "
        f"codecs (rank {settings['rank']}, density {settings['density']}, {settings['bits']} bits), one layer at "
        f"a time, took: {cells}. Against its compute on the {label} cluster "
        f"({tokens:,} tokens per GPU and step: {compute_ms:.0f} ms), that is "
        + ", ".join(
            f"{name} {100 * methods[name]['step_ms'] / compute_ms:.0f}%" for name in SHARE_CODECS if name in methods
        )
        + " of compute as built today, bound by the host's dispatch of each layer's operators (hidden only "
        "where the host runs ahead of the backward pass's GPU work); a few percent at the floor. So the "
        "testbed is biased against compression, most for the costliest codecs (low rank, ScaleCom's "
        "selection), and a GPU cluster pays part of that bias too until same-shape layers are batched."
    ]


def dense_bytes_per_step(results: Dict[str, Any]) -> float:
    """What one rank sends per step uncompressed: a float32 ring all-reduce of the LM's
    gradients (``Traffic``'s ring model, as the records' ``wire_bytes_per_step``)."""
    lm = QUICK_LM if results["plan"]["quick"] else quality.LM
    numel = sum(p.numel() for p in charlm.CharTransformer(**lm["model"]).parameters())
    return Collective.ALLREDUCE.wire_bytes(4 * numel, results["np"])


def steps_table(results: Dict[str, Any], target: float) -> List[str]:
    """One row per method; *x uncompressed*: its median steps to target over uncompressed's, the
    factor a projected step time is multiplied by to give a time to target; *x fewer bytes*:
    uncompressed's bytes per step over the method's (a local method's per step-equivalent: its
    exchanges' over every step), median over its seeds."""
    base = score(records_of(results, UNCOMPRESSED), target)["median"]
    dense = dense_bytes_per_step(results)
    lines = [
        "| method | seeds | reached | median steps to target | x uncompressed | x fewer bytes | mean without "
        "fastest and slowest | spread | steps per seed | best loss of misses |",
        "|---" * 10 + "|",
    ]
    for label in labels_in_order(results):
        records = records_of(results, label)
        s = score(records, target)
        factor = "-" if s["median"] is None or not base else f"{s['median'] / base:.2f}"
        sent = [r["wire_bytes_per_step"] for r in records if r.get("wire_bytes_per_step")]
        fewer = f"{dense / statistics.median(sent):,.1f}" if sent else "1"
        per_seed = ", ".join(steps_text(v) for v in s["steps"])
        spread = "-" if s["spread"] is None else f"{s['spread']:,.0f}"
        missed = "-" if s["best_missed_loss"] is None else f"{s['best_missed_loss']:.4f}"
        lines.append(
            f"| {label} | {s['seeds']} | {s['reached']} | {steps_text(s['median'])} | {factor} | {fewer} | "
            f"{steps_text(s['trimmed_mean'])} | {spread} | {per_seed} | {missed} |"
        )
    return lines + [""]


def draw_figure(results: Dict[str, Any], path: Path) -> None:
    """Left: median validation loss against steps, one curve per method, the target dashed.
    Right: median steps to target, one bar per method (misses left out)."""
    plt, figure, (curves, bars) = panels(2, 6, 4.2)
    goal = target_of(results, results["plan"]["base_seeds"], results["plan"]["knee_gain"])
    medians = {}
    for label in labels_in_order(results):
        records = records_of(results, label)
        curve = median_curve(records)
        curves.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=f"{label} ({len(records)})")
        if goal is not None:
            medians[label] = score(records, goal["target"])["median"]
    if goal is not None:
        curves.axhline(goal["target"], color="black", linestyle="--", linewidth=0.8, label="target")
    curves.set_xscale("log")
    curves.set_xlabel("steps (log); wall-clock once step times are measured", fontsize=8)
    curves.set_ylabel("validation loss (median over seeds)", fontsize=8)
    curves.legend(fontsize=6)
    reached = {label: value for label, value in medians.items() if value is not None}
    if reached:
        method_bars(bars, reached, UNCOMPRESSED)
    else:
        bars.text(0.5, 0.5, "not measured yet", ha="center", transform=bars.transAxes)
    bars.set_xlabel("median steps to target", fontsize=8)
    for axis in (curves, bars):
        axis.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def write_report(results: Dict[str, Any], out: Path) -> None:
    figure = out / "benchmarks" / "time_to_quality.png"
    if results["points"]:
        draw_figure(results, figure)
    write_section(out, SECTION, markdown(results, figure.relative_to(figure.parent), out))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks time_to_quality", description=__doc__.splitlines()[0])
    add_job_options(
        parser,
        10800,
        "2 ranks, a tiny LM, a few steps: a smoke test",
        np=4,
        max_minutes=720.0,
        max_minutes_help="stop at the running job's next checkpoint after this long; rerun to resume",
    )
    parser.add_argument("--progress", type=Path, help="append a line per length of the running job here")
    parser.add_argument(
        "--family",
        action="append",
        choices=list(dict.fromkeys(method[0] for method in METHODS + OUTER_SWEEP)),
        help="run only this method family's points (repeatable; the uncompressed seeds run first regardless)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.np, args.lm = 2, QUICK_LM
        args.plan = dict(QUICK, quick=True)
    else:
        args.lm = quality.LM
        args.plan = {
            "lengths": LENGTHS,
            "warmup": WARMUP_STEPS,
            "longest": UNCOMPRESSED_LONGEST,
            "base_seeds": BASE_SEEDS,
            "other_seeds": OTHER_SEEDS,
            "knee_gain": KNEE_GAIN,
            "eval_windows": EVAL_WINDOWS,
            "quick": False,
        }
    return args


def render(out: Path) -> None:
    """Rewrites the page and figure from the stored JSON."""
    write_report(stored(out, "time_to_quality"), out)


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_points(args, train_point, run, args.out / "benchmarks" / "time_to_quality.json", RESULT_PREFIX)

"""The L-GreCo protocol: L-GreCo against the uniform settings it is anchored at, and ScaleCom in
its paper's regime, on the word-level GPT (``workloads/wordlm``), with paired seeds.

The protocol (every point one ``mpirun -np 2`` job through the stock ``hvd.DistributedOptimizer``,
seeds 0, 1 and 2):

* every compressed run sends gradients whole through the learning-rate warm-up (the first 10% of
  steps), then compresses;
* the anchor of a family (PowerSGD ranks, Top-K densities) is its most aggressive uniform setting
  whose 3-seed mean perplexity lies within 1% of uncompressed: settings are run from the least
  aggressive down, and the search stops at the first one outside;
* L-GreCo, anchored there, decides every 5% of the run, the first decision one period after the
  warm-up, on the mean of the last 10 steps' gradient plus residual (the class's defaults);
* bytes are reported per step after the first decision (what a layer-wise choice changes) and
  over the whole run, separately; quality is compared seed by seed: equal when the mean of the
  paired relative differences is at most max(1%, 2 standard errors);
* ScaleCom in its paper's regime: one epoch dense, 2,048 tokens per worker, beta = 1, the paper's
  per-layer rates from FLOPs per element; ablations: embeddings sent dense, and plain Top-K at the
  same per-layer densities;
* ablations of L-GreCo over PowerSGD: the table on raw gradients summed over the whole period
  (this repository's earlier behaviour), the whole period with residuals, raw gradients over the
  last 10 steps (the two factors apart), no uncompressed warm-up; and the workload: the
  character LM (``quality``'s) at the anchors ``quality`` found;
* the anchor-free verdict, on the character LM (decisions every 150 steps): each
  family's uniform curve (``CHAR_CURVE``, 3 seeds) and L-GreCo anchored at each of its settings;
  per L-GreCo setting, the uniform curve's bytes per step at L-GreCo's 3-seed mean perplexity
  (interpolated in log bytes between neighbouring settings, never extrapolated) over L-GreCo's.

``--scale gpu``: the same protocol at a larger scale on one CUDA GPU (``claims_gpu.json``, its own
section): a word LM of 6 blocks, d_model 256, context 128, 8,192 tokens, every point one
``torchrun`` job of 2 ranks sharing the GPU through PyTorch DDP and ``hvd_compress.ddp`` over
Gloo (NCCL takes one GPU per rank), ``--parallel`` jobs at a time; no character-LM rows.

Resumes point by point from ``<out>/benchmarks/claims.json`` (rewritten after every point, with
its page in ``<out>/benchmarks/``), so it can run in pieces; ``--max-minutes`` starts no new
point after that long.
``--stage curve`` runs only the character-LM curves and L-GreCo over them.
``--quick``: a tiny model and a few steps, every stage once with one seed: a smoke test.
"""

import argparse
import json
import math
import statistics
import sys
import time
import types
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hvd_compress as hc
import hvd_compress.ddp
from benchmarks.quality import LM as CHAR_LM
from benchmarks.harness.methods import paper_rates
from benchmarks.harness.jobs import (
    add_job_options,
    benchmark_argv,
    mpirun_job,
    root_cause,
    run_points,
    torchrun_job,
)
from benchmarks.harness.machine import describe_machine, machine
from benchmarks.harness.render import panels, resumed, save_figure, save_record, stored, write_section
from benchmarks.harness.training import StepCounter, train_workload
from examples.workloads import charlm, wordlm
from hvd_compress.comm.rounds import Collective

RESULT_PREFIX = "CLAIMS_RESULT "
SECTION = "L-GreCo protocol on the word LM"
NP = 2
SEEDS = [0, 1, 2]
UNCOMPRESSED = "uncompressed"
WORD_LM = {
    "model": {"d_model": 64, "layers": 4, "heads": 4, "context": 64},
    "batch_size": 32,
    "max_chars": 3_000_000,
    "vocab": wordlm.VOCAB,
}
WORD_STEPS = 600
# The larger scale, on a GPU: every 2-D shape grows 4x per side, the vocabulary doubles.
WORD_LM_GPU = {
    "model": {"d_model": 256, "layers": 6, "heads": 8, "context": 128},
    "batch_size": 32,
    "max_chars": 5_000_000,
    "vocab": 8192,
}
GPU_STEPS = 600
QUICK_LM = {
    "model": {"d_model": 32, "layers": 2, "heads": 2, "context": 32},
    "batch_size": 8,
    "max_chars": 300_000,
    "vocab": 512,
}
QUICK_STEPS = 40
# The character LM of ``quality`` and the anchors its sweep found (smallest within 2%).
CHAR_STEPS = 3000
CHAR_ANCHORS = {"PowerSGD": 8, "Top-K": 0.2}
# The uniform curves of the anchor-free verdict: the anchors and a setting either side, so that
# L-GreCo's quality lies between two of them. Run in this order: after the anchor, the side
# where L-GreCo at the anchor landed in the stored runs (worse than rank 8, better than density
# 0.2), so that the verdict on those runs needs three more jobs per family.
CHAR_CURVE = {"PowerSGD": [8, 4, 16], "Top-K": [0.2, 0.3, 0.1]}
# --quick: one family, two settings (the anchor and one more), enough to interpolate.
QUICK_CURVE = {"PowerSGD": [8, 4]}
# Where and how points run: backend (Horovod under mpirun, or DDP under torchrun), device, and
# the word LM; the character-LM rows are the CPU protocol's alone.
SCALES = {
    "cpu": {
        "backend": "horovod",
        "device": "cpu",
        "lm": WORD_LM,
        "steps": WORD_STEPS,
        "charlm": True,
        "name": "claims",
        "section": SECTION,
    },
    "gpu": {
        "backend": "ddp",
        "device": "cuda",
        "lm": WORD_LM_GPU,
        "steps": GPU_STEPS,
        "charlm": False,
        "name": "claims_gpu",
        "section": SECTION + " at larger scale (GPU)",
        # A lease of minutes: every candidate at once (the same anchor rule, applied
        # afterwards), three per family.
        "speculative": True,
        "values": {"PowerSGD": [16, 8, 4], "Top-K": [0.1, 0.03, 0.01]},
    },
}
# Uniform settings, least aggressive first, and how each family is built.
FAMILIES = {"PowerSGD": ("powersgd", "rank", [16, 8, 4, 2, 1]), "Top-K": ("topk", "density", [0.3, 0.1, 0.03, 0.01])}
WITHIN_ANCHOR = 0.01
EQUAL_QUALITY = 0.01
SCALECOM_WITHIN = 0.02
CLAIMED_RATIO = {"PowerSGD": 1.5, "Top-K": 2.5}
EMBEDDINGS = ("token_embedding.weight", "position_embedding.weight")
# L-GreCo ablations: label suffix -> LGreCo options (or the warm-up) replaced.
ABLATIONS = {
    "raw error, whole period": {"error_source": "raw", "accumulate_steps": None},
    "whole period": {"accumulate_steps": None},
    "raw error": {"error_source": "raw"},
    "no warm-up": {"start_step": 0},
}


def schedule(steps):
    """(learning-rate warm-up, L-GreCo's period, the step of its first decision)."""
    warmup = charlm.warmup_steps(steps)
    period = max(2, steps // 20)
    return warmup, period, warmup + period


def point(workload, family, seed, compressor=None, settings=None, extra=None, suffix=""):
    """One job's description (JSON); ``key`` names it in the results, ``label`` its seeds."""
    settings = settings or {}
    label = family + "".join(f" {k} {v}" for k, v in settings.items()) + (f", {suffix}" if suffix else "")
    return {
        "key": f"{workload}/{label}/seed {seed}",
        "workload": workload,
        "family": family,
        "label": label,
        "suffix": suffix,
        "seed": seed,
        "compressor": compressor,
        "settings": settings,
        "extra": extra or {},
    }


# ----- one job: runs on every rank ----------------------------------------------------------------
def epoch_steps(lm):
    """Steps of ``NP`` ranks in one pass over the word LM's training tokens."""
    train_ids, _, _ = wordlm.load_corpus(lm["max_chars"], lm["vocab"])
    return math.ceil(len(train_ids) / (NP * lm["batch_size"] * lm["model"]["context"]))


def build_compression(spec, model, named, steps, tokens_per_rank, world):
    """The ``compression=`` of ``hvd.DistributedOptimizer`` for the point; None: uncompressed."""
    if spec["compressor"] is None:
        return None
    extra = spec["extra"]
    warmup, period, _ = schedule(steps)
    settings = dict(spec["settings"])
    if extra.get("scalecom"):  # the paper's regime: one epoch dense, its per-layer rates
        epoch = extra["epoch_steps"]
        inner = hc.ScaleCom(named, beta=1.0, warmup_steps=epoch if spec["compressor"] == "scalecom" else 0)
        flops = paper_rates(inner, model, named, tokens_per_rank)
        if spec["compressor"] == "topk":  # the same k per layer, Top-K's all-gather
            ks = {name: inner.setting(name) for name in flops}
            inner = hc.TopK(named)
            for name, k in ks.items():
                inner.set_setting(name, k)
            return hc.DenseWarmup(inner, warmup_steps=epoch)
        return hc.DenseWarmup(inner, dense=EMBEDDINGS if extra.get("dense_embeddings") else ())
    inner = hc.COMPRESSORS[spec["compressor"]].build(named, **settings)
    if "lgreco" not in extra:
        return hc.DenseWarmup(inner, warmup_steps=warmup)
    options = dict(
        {"start_step": warmup, "warmup_steps": period, "decide_every": period, "apply_delay": min(5, period - 1)},
        **extra["lgreco"],
    )
    return hc.LGreCo(inner, **options)


def train_point(spec):
    """Trains the point on every rank (Horovod's, or torch.distributed's under DDP); rank 0's
    record."""
    counter, made, curve, bytes_before = StepCounter(), {}, [], []
    steps, lm = spec["steps"], spec["lm"]
    _, _, first_decision = schedule(steps)
    tokens = lm["batch_size"] * lm["model"]["context"]
    ddp = spec.get("backend") == "ddp"
    if not ddp:  # the GPU scale runs DDP where Horovod is not installed
        import horovod.torch as hvd
    rank, size = (dist.get_rank(), dist.get_world_size()) if ddp else (hvd.rank(), hvd.size())

    def prepare(model):
        model = model.to(spec.get("device", "cpu"))
        if not ddp:
            return model
        wrapped = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        wrapped.context = model.context
        return wrapped

    def make_optimizer(model, optimizer):
        module = getattr(model, "module", model)
        named = list(module.named_parameters())
        made["dense_bytes"] = 4 * sum(p.numel() for _, p in named)
        made["compression"] = build_compression(spec, module, named, steps, tokens, size)
        if ddp:
            if made["compression"] is not None:
                hvd_compress.ddp.register(model, made["compression"])
            wrapped = counter.wrap(optimizer)
        else:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            extra = {} if made["compression"] is None else {"compression": made["compression"]}
            wrapped = counter.wrap(hvd.DistributedOptimizer(optimizer, named_parameters=named, **extra))
        step = wrapped.step

        def step_and_count(_, *args, **kwargs):  # the bytes sent before the first decision
            result = step(*args, **kwargs)
            if counter.steps == first_decision:
                bytes_before.append(sent_bytes())
            return result

        wrapped.step = types.MethodType(step_and_count, wrapped)  # bound, as schedulers expect
        return wrapped

    def sent_bytes():
        compression = made["compression"]
        if compression is None:
            return counter.steps * Collective.ALLREDUCE.wire_bytes(made["dense_bytes"], size)
        return compression.traffic.wire_bytes

    started = time.perf_counter()
    metric = train_workload(spec["workload"], spec, make_optimizer, rank, size, spec["seed"], curve, prepare)
    total = sent_bytes()
    record = {
        "key": spec["key"],
        "metric": metric,
        "steps": counter.steps,
        "first_decision": first_decision,
        "train_seconds": time.perf_counter() - started,
        "world_size": size,
        "wire_bytes": total,
        "wire_bytes_per_step_after": (total - bytes_before[0]) / (counter.steps - first_decision),
        "dense_wire_bytes_per_step": Collective.ALLREDUCE.wire_bytes(made["dense_bytes"], size),
        "curve": curve,
    }
    compression = made["compression"]
    if isinstance(compression, hc.LGreCo):
        record["lgreco"] = [
            {
                "decided_at": d.decided_at,
                "effective_step": d.effective_step,
                "uniform_over_chosen": d.uniform_bytes / max(d.total_bytes, 1),
                **window_norms(d),
            }
            for d in compression.decisions
        ]
        record["last_settings"] = compression.decisions[-1].settings if compression.decisions else {}
    return record


def window_norms(decision):
    """The window's gradient and residual norms over the layers the solver decided (root of
    the sum of the per-layer squares), and the error it expected at its budget: what the
    flattening hypothesis needs."""
    layers = decision.layers.values()
    return {
        "gradient_norm": math.sqrt(sum(layer["gradient_norm"] ** 2 for layer in layers)),
        "residual_norm": math.sqrt(sum(layer["residual_norm"] ** 2 for layer in layers)),
        "budget": decision.budget,
    }


# ----- what to run next -------------------------------------------------------------------------
def seeds_of(results, label, workload="wordlm"):
    """The finished records of ``label``, by seed."""
    return {
        e["spec"]["seed"]: e["record"]
        for e in results["points"].values()
        if e["spec"]["workload"] == workload and e["spec"]["label"] == label
    }


def mean_metric(results, label, seeds, workload="wordlm"):
    done = seeds_of(results, label, workload)
    return statistics.fmean(done[s]["metric"] for s in seeds) if all(s in done for s in seeds) else None


def scale_of(results):
    return SCALES[results.get("scale", "cpu")]


def candidates(results, family):
    """``family``'s uniform settings at the results' scale, least aggressive first."""
    return scale_of(results).get("values", {}).get(family, FAMILIES[family][2])


def anchor_search(results, family, seeds, quick=False):
    """(points to run for the search so far, the anchor or None, why): settings from the least
    aggressive down, each at every seed, stopping at the first whose mean is over 1% above
    uncompressed (a speculative scale asks for every setting at once)."""
    scale = scale_of(results)
    name, keyword, _ = FAMILIES[family]
    values = candidates(results, family)
    if quick:  # a smoke test: one setting that compresses the tiny model, taken as the anchor
        value = values[1]
        return [point("wordlm", family, seed, name, {keyword: value}) for seed in seeds], value, ""
    base = mean_metric(results, UNCOMPRESSED, seeds)
    wanted, anchor = [], None
    if scale.get("speculative"):
        wanted = [point("wordlm", family, seed, name, {keyword: value}) for value in values for seed in seeds]
    for value in values:
        here = [point("wordlm", family, seed, name, {keyword: value}) for seed in seeds]
        wanted += [p for p in here if p not in wanted]
        mean = mean_metric(results, here[-1]["label"], seeds)
        if base is None or mean is None:
            return wanted, None, "search not finished"
        if mean > (1 + WITHIN_ANCHOR) * base:
            break
        anchor = value
    return wanted, anchor, "" if anchor is not None else "no uniform setting within 1% of uncompressed"


def lgreco_setting(results, family, anchor, why):
    """Where L-GreCo runs for ``family``, given its anchor search's (anchor, why): the anchor;
    where the search found none within 1%, its least aggressive setting, so that L-GreCo is
    still measured against the uniform run it adapts; None while the search goes on."""
    if anchor is not None or not why.startswith("no uniform"):
        return anchor
    return candidates(results, family)[0]


def curve_points(seeds: Sequence[int], quick: bool) -> List[Dict[str, Any]]:
    """The character LM's uniform curves, then L-GreCo anchored at each of their settings; a
    setting's seeds together, the families alternating: a run cut short leaves 3-seed curve
    points (the verdict of the L-GreCo runs already made needs only those) before L-GreCo rows."""
    curve = QUICK_CURVE if quick else CHAR_CURVE
    wanted = []
    for label, extra in [("{}", {}), ("L-GreCo ({})", {"lgreco": {}})]:
        wanted += [
            point(
                "charlm", label.format(family), seed, FAMILIES[family][0], {FAMILIES[family][1]: values[index]}, extra
            )
            for index in range(max(map(len, curve.values())))
            for family, values in curve.items()
            if index < len(values)
            for seed in seeds
        ]
    return wanted


def plan(results, quick, stage="all"):
    """Every point wanted, most important first, as far as the finished points determine it;
    ``stage`` "curve": the anchor-free verdict's points alone."""
    scale = scale_of(results)
    seeds = SEEDS[:1] if quick else SEEDS
    if stage == "curve":
        return curve_points(seeds, quick)
    wanted = [point("wordlm", UNCOMPRESSED, seed) for seed in seeds]
    anchors = {}
    # Each family's search, then L-GreCo there; over PowerSGD, its ablations next: they say
    # which factor decides the headline claim.
    for family, (name, keyword, _) in FAMILIES.items():
        search, anchor, why = anchor_search(results, family, seeds, quick)
        anchors[family] = lgreco_setting(results, family, anchor, why)
        wanted += search
        if anchors[family] is not None:
            wanted += [
                point("wordlm", f"L-GreCo ({family})", seed, name, {keyword: anchors[family]}, {"lgreco": {}})
                for seed in seeds
            ]
        if family == "PowerSGD" and anchors[family] is not None:
            wanted += [
                point(
                    "wordlm",
                    "L-GreCo (PowerSGD)",
                    seed,
                    "powersgd",
                    {"rank": anchors[family]},
                    {"lgreco": options},
                    suffix,
                )
                for suffix, options in ABLATIONS.items()
                for seed in seeds
            ]
    job = workload_spec("wordlm", quick, scale)
    epoch = epoch_steps(job["lm"])
    # --quick runs a fraction of an epoch: its ScaleCom stays dense through the LR warm-up only.
    scalecom = {"scalecom": True, "epoch_steps": schedule(job["steps"])[0] if quick else epoch}
    for seed in seeds:
        wanted += [
            point("wordlm", "ScaleCom (paper's regime)", seed, "scalecom", {}, scalecom),
            point(
                "wordlm",
                "ScaleCom (paper's regime)",
                seed,
                "scalecom",
                {},
                dict(scalecom, dense_embeddings=True),
                "embeddings dense",
            ),
            point("wordlm", "Top-K at ScaleCom's densities", seed, "topk", {}, scalecom),
        ]
    if not scale["charlm"]:
        return wanted
    wanted += [point("charlm", UNCOMPRESSED, seed) for seed in seeds]
    for family, value in CHAR_ANCHORS.items():
        name, keyword, _ = FAMILIES[family]
        wanted += [
            point("charlm", label, seed, name, {keyword: value}, extra)
            for label, extra in [(family, {}), (f"L-GreCo ({family})", {"lgreco": {}})]
            for seed in seeds
        ]
    keys = {p["key"] for p in wanted}  # the anchors are on the curves too: each point once
    return wanted + [p for p in curve_points(seeds, quick) if p["key"] not in keys]


def workload_spec(workload, quick, scale=SCALES["cpu"]):
    """Steps and LM of a point; where it runs (backend, device)."""
    where = {"backend": scale["backend"], "device": scale["device"]}
    if quick:
        return dict(
            where,
            steps=QUICK_STEPS,
            lm=QUICK_LM
            if workload == "wordlm"
            else dict(CHAR_LM, max_chars=200_000, model=dict(CHAR_LM["model"], d_model=32)),
        )
    return dict(
        where,
        **(
            {"steps": scale["steps"], "lm": scale["lm"]}
            if workload == "wordlm"
            else {"steps": CHAR_STEPS, "lm": CHAR_LM}
        ),
    )


def results_path(out, scale):
    return out / "benchmarks" / f"{SCALES[scale]['name']}.json"


def launch(job, scale, slot, timeout):
    """One point's job: ``mpirun -np 2`` (Horovod) or ``torchrun`` (DDP) on its own port."""
    if scale["backend"] == "ddp":
        argv = benchmark_argv("claims", "--worker", json.dumps(job))
        [record] = torchrun_job(argv, NP, timeout, RESULT_PREFIX, master_port=29611 + 10 * slot)
        record["job_seconds"] = record.pop("wall_seconds")
        return record
    return mpirun_job("claims", job, NP, timeout, RESULT_PREFIX, job["key"], expected=1)[0]


def run(args):
    path = results_path(args.out, args.scale)
    results = resumed(path)
    results.setdefault("points", {})
    results.update(machine=machine(), np=NP, quick=args.quick, scale=args.scale)
    scale = dict(SCALES[args.scale], device=args.device or SCALES[args.scale]["device"])
    failed, running = set(), {}
    deadline = time.monotonic() + 60 * args.max_minutes
    with ThreadPoolExecutor(args.parallel) as pool:
        while True:
            busy = {spec["key"] for spec, _ in running.values()}
            todo = [
                s
                for s in plan(results, args.quick, args.stage)
                if s["key"] not in results["points"] and s["key"] not in failed and s["key"] not in busy
            ]
            while todo and len(running) < args.parallel and time.monotonic() < deadline:
                spec = todo.pop(0)
                slot = min(set(range(args.parallel)) - {slot for _, slot in running.values()})
                job = dict(spec, **workload_spec(spec["workload"], args.quick, scale))
                running[pool.submit(launch, job, scale, slot, args.job_timeout)] = (spec, slot)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                spec, _ = running.pop(future)
                try:
                    record = future.result()
                except RuntimeError as error:  # recorded; retried by the next run of the command
                    failed.add(spec["key"])
                    results.setdefault("failures", {})[spec["key"]] = str(error)[-2000:]
                    print(f"{spec['key']}: FAILED ({root_cause(error)})", flush=True)
                    continue
                results.setdefault("failures", {}).pop(spec["key"], None)
                results["points"][spec["key"]] = {"spec": spec, "record": record}
                save_record(path, results)
                write_report(results, args.out)
                print(
                    f"{spec['key']}: perplexity {record['metric']:.3f}, "
                    f"{record['wire_bytes_per_step_after'] / 1e6:.3f} MB/step after the first decision, "
                    f"{record['wire_bytes'] / 1e6:,.1f} MB in all, {record['job_seconds']:.0f} s",
                    flush=True,
                )
    save_record(path, results)
    write_report(results, args.out)
    return results


# ----- the report ---------------------------------------------------------------------------------
def summary(records):
    """Mean and standard error of the metric, mean bytes, over ``records`` (one per seed)."""
    metrics = [r["metric"] for r in records]
    return {
        "metric": statistics.fmean(metrics),
        "se": statistics.stdev(metrics) / math.sqrt(len(metrics)) if len(metrics) > 1 else 0.0,
        "seeds": len(records),
        "per_step": statistics.fmean(r["wire_bytes_per_step_after"] for r in records),
        "whole": statistics.fmean(r["wire_bytes"] for r in records),
        "dense_per_step": records[0]["dense_wire_bytes_per_step"],
        "steps": records[0]["steps"],
        "seconds": sum(r["job_seconds"] for r in records),
    }


def paired(results, label, reference, workload="wordlm"):
    """Seed-paired comparison of ``label`` against ``reference``: (mean relative perplexity
    change, its standard error, seeds) over the seeds both have, or None."""
    mine, theirs = seeds_of(results, label, workload), seeds_of(results, reference, workload)
    common = sorted(set(mine) & set(theirs))
    if not common:
        return None
    changes = [mine[s]["metric"] / theirs[s]["metric"] - 1 for s in common]
    se = statistics.stdev(changes) / math.sqrt(len(changes)) if len(changes) > 1 else 0.0
    return statistics.fmean(changes), se, len(common)


def equal_quality_tolerance(se):
    """How much worse a paired mean may be and still count as equal quality: max(1%, 2 s.e.)."""
    return max(EQUAL_QUALITY, 2 * se)


def lgreco_claim(results, workload, family, value, seeds):
    """(claim text, met or None, numbers) of L-GreCo over ``family`` at ``value``."""
    name, keyword, _ = FAMILIES[family]
    uniform_label = f"{family} {keyword} {value}"
    adaptive_label = f"L-GreCo ({family}) {keyword} {value}"
    text = (
        f"{'Word' if workload == 'wordlm' else 'Char'} LM: L-GreCo over {family} {keyword} {value}: equal "
        f"quality at >= {CLAIMED_RATIO[family]}x fewer bytes per step"
    )
    uniform, adaptive = seeds_of(results, uniform_label, workload), seeds_of(results, adaptive_label, workload)
    if len(uniform) < len(seeds) or len(adaptive) < len(seeds):
        return text, None, f"not measured yet ({len(adaptive)} of {len(seeds)} L-GreCo seeds)"
    u, a = summary(list(uniform.values())), summary(list(adaptive.values()))
    change, se, count = paired(results, adaptive_label, uniform_label, workload)
    tolerance = equal_quality_tolerance(se)
    ratio, whole = u["per_step"] / a["per_step"], u["whole"] / a["whole"]
    met = change <= tolerance and ratio >= CLAIMED_RATIO[family]
    return (
        text,
        met,
        (
            f"perplexity {a['metric']:.2f} vs {u['metric']:.2f} (paired {100 * change:+.2f}% "
            f"± {100 * se:.2f}%, tolerance {100 * tolerance:.1f}%); {ratio:.2f}x fewer bytes per step "
            f"after the first decision, {whole:.2f}x over the whole run"
        ),
    )


def claims(results, quick):
    seeds = SEEDS[:1] if quick else SEEDS
    outcomes = []
    for family in FAMILIES:
        _, anchor, why = anchor_search(results, family, seeds, quick)
        if anchor is None:
            outcomes.append((f"Word LM: L-GreCo over {family}", None if why.startswith("search") else False, why))
            value = lgreco_setting(results, family, anchor, why)
            if value is not None:  # still measured against the uniform setting it adapts
                text, met, numbers = lgreco_claim(results, "wordlm", family, value, seeds)
                outcomes.append((text + " (that setting is outside 1% of uncompressed)", met, numbers))
        else:
            outcomes.append(lgreco_claim(results, "wordlm", family, anchor, seeds))
    text = "Word LM: ScaleCom in the paper's regime within 2% of uncompressed"
    change = paired(results, "ScaleCom (paper's regime)", UNCOMPRESSED)
    if change is None or change[2] < len(seeds):
        outcomes.append((text, None, "not measured yet"))
    else:
        s = summary(list(seeds_of(results, "ScaleCom (paper's regime)").values()))
        outcomes.append(
            (
                text,
                change[0] <= SCALECOM_WITHIN,
                f"perplexity paired {100 * change[0]:+.2f}% ± {100 * change[1]:.2f}% at "
                f"{s['dense_per_step'] / s['per_step']:.1f}x fewer bytes per step after the warm-up",
            )
        )
    for family, value in CHAR_ANCHORS.items() if scale_of(results)["charlm"] else ():
        outcomes.append(lgreco_claim(results, "charlm", family, value, seeds))
    return outcomes


def uniform_bytes_at(curve: Sequence[Tuple[float, float]], perplexity: float) -> Optional[float]:
    """Bytes per step of a uniform curve at ``perplexity``: ``curve`` holds (bytes per step,
    perplexity) per setting; linear in log bytes between the two settings, neighbours by bytes,
    whose perplexities bracket it; None outside the curve (never extrapolated). Where noise
    makes the curve non-monotone and several segments bracket it, the crossing with the fewest
    bytes: the reading least favourable to a method that claims to send fewer."""
    ordered = sorted(curve)
    for (low_bytes, low_metric), (high_bytes, high_metric) in zip(ordered, ordered[1:]):
        if min(low_metric, high_metric) <= perplexity <= max(low_metric, high_metric):
            if low_metric == high_metric:
                return low_bytes
            share = (perplexity - low_metric) / (high_metric - low_metric)
            return math.exp(math.log(low_bytes) + share * (math.log(high_bytes) - math.log(low_bytes)))
    return None


def curve_verdicts(results: Dict[str, Any], quick: bool) -> List[Tuple[str, Optional[bool], str]]:
    """The anchor-free verdict on the character LM, per L-GreCo setting: (claim text, met
    or None, numbers), met where the uniform curve's bytes per step at L-GreCo's 3-seed mean
    perplexity are at least the claimed multiple of L-GreCo's."""
    seeds = SEEDS[:1] if quick else SEEDS
    rows = []
    for family, values in (QUICK_CURVE if quick else CHAR_CURVE).items():
        keyword = FAMILIES[family][1]
        done = {value: list(seeds_of(results, f"{family} {keyword} {value}", "charlm").values()) for value in values}
        uniform = {value: summary(records) for value, records in done.items() if len(records) == len(seeds)}
        curve = [(s["per_step"], s["metric"]) for s in uniform.values()]
        for value in values:
            text = (
                f"Char LM: L-GreCo over {family} {keyword} {value}: the uniform curve needs >= "
                f"{CLAIMED_RATIO[family]}x its bytes per step at its quality"
            )
            adaptive = list(seeds_of(results, f"L-GreCo ({family}) {keyword} {value}", "charlm").values())
            if len(adaptive) < len(seeds) or len(uniform) < 2:
                rows.append(
                    (
                        text,
                        None,
                        f"not measured yet ({len(adaptive)} of {len(seeds)} L-GreCo seeds; "
                        f"{len(uniform)} of {len(values)} uniform settings at every seed)",
                    )
                )
                continue
            a = summary(adaptive)
            points = "; ".join(
                f"{keyword} {v}: {s['metric']:.3f} ± {s['se']:.3f} at {s['per_step'] / 1e6:.4f} MB"
                for v, s in sorted(uniform.items(), key=lambda item: item[1]["per_step"])
            )
            numbers = (
                f"L-GreCo {a['metric']:.3f} ± {a['se']:.3f} at {a['per_step'] / 1e6:.4f} MB/step after the "
                f"first decision; uniform curve (perplexity mean ± s.e., MB/step): {points}"
            )
            at_mean = uniform_bytes_at(curve, a["metric"])
            if at_mean is None:
                best = min(curve, key=lambda c: c[1])
                side = "better than" if a["metric"] < best[1] else "worse than"
                rows.append((text, None, f"outside the curve ({side} every uniform setting); " + numbers))
                continue
            ratio = at_mean / a["per_step"]
            # The seed spread: the same reading at L-GreCo's mean ± one standard error.
            spread = [uniform_bytes_at(curve, a["metric"] + sign * a["se"]) for sign in (-1, 1)]
            spread_text = ", ".join("outside the curve" if b is None else f"{b / a['per_step']:.2f}x" for b in spread)
            rows.append(
                (
                    text,
                    ratio >= CLAIMED_RATIO[family],
                    f"{ratio:.2f}x (uniform {at_mean / 1e6:.4f} MB/step at L-GreCo's mean; at mean "
                    f"- / + 1 s.e.: {spread_text}); " + numbers,
                )
            )
    return rows


def ablation_rows(results, quick):
    """Each L-GreCo run against the uniform run at its anchor: paired quality, bytes ratios."""
    seeds = SEEDS[:1] if quick else SEEDS
    anchors = {
        ("wordlm", family): lgreco_setting(results, family, *anchor_search(results, family, seeds, quick)[1:])
        for family in FAMILIES
    }
    if scale_of(results)["charlm"]:
        anchors.update({("charlm", family): value for family, value in CHAR_ANCHORS.items()})
    rows = []
    for (workload, family), value in anchors.items():
        if value is None:
            continue
        keyword = FAMILIES[family][1]
        uniform_label = f"{family} {keyword} {value}"
        uniform = seeds_of(results, uniform_label, workload)
        labels = sorted(
            {
                e["spec"]["label"]
                for e in results["points"].values()
                if e["spec"]["workload"] == workload
                and e["spec"]["label"].startswith(f"L-GreCo ({family}) {keyword} {value}")
            }
        )
        for label in labels if uniform else []:
            change = paired(results, label, uniform_label, workload)
            if change is None:
                continue
            records = list(seeds_of(results, label, workload).values())
            u, a = summary(list(uniform.values())), summary(records)
            equal = change[0] <= equal_quality_tolerance(change[1])
            rows.append(
                f"| {workload} | {label} | {change[2]} | {100 * change[0]:+.2f}% ± {100 * change[1]:.2f}% | "
                f"{'yes' if equal else 'no'} | {u['per_step'] / a['per_step']:.2f}x | "
                f"{u['whole'] / a['whole']:.2f}x | {solver_ratios(records)} |"
            )
    return rows


def solver_ratios(records):
    """The solver's own uniform-over-chosen bytes at the first and the last decision, mean over
    seeds: whether the redistribution grows or shrinks as training goes on."""
    decisions = [r["lgreco"] for r in records if r.get("lgreco")]
    if not decisions:
        return "-"
    first = statistics.fmean(d[0]["uniform_over_chosen"] for d in decisions)
    last = statistics.fmean(d[-1]["uniform_over_chosen"] for d in decisions)
    return f"{first:.2f}x → {last:.2f}x"


def table(results, workload):
    labels = {}
    for entry in results["points"].values():
        if entry["spec"]["workload"] == workload:
            labels.setdefault(entry["spec"]["label"], []).append(entry["record"])
    lines = [
        "| run | perplexity (mean ± s.e.) | paired Δ vs uncompressed | MB/step after first decision "
        "| fewer bytes/step | MB whole run | seeds | minutes |",
        "|---" * 8 + "|",
    ]
    ordered = sorted(labels.items(), key=lambda item: (item[0] != UNCOMPRESSED, item[0]))
    for label, records in ordered:
        s = summary(records)
        change = paired(results, label, UNCOMPRESSED, workload)
        delta = "-" if change is None or label == UNCOMPRESSED else f"{100 * change[0]:+.2f}% ± {100 * change[1]:.2f}%"
        lines.append(
            f"| {label} | {s['metric']:.2f} ± {s['se']:.2f} | {delta} | {s['per_step'] / 1e6:.3f} | "
            f"{s['dense_per_step'] / s['per_step']:.1f}x | {s['whole'] / 1e6:,.0f} | {s['seeds']} | "
            f"{s['seconds'] / 60:.0f} |"
        )
    return lines


def missing(results, quick):
    todo = [s for s in plan(results, quick) if s["key"] not in results["points"]]
    labels = sorted({f"{s['workload']}: {s['label']}" for s in todo})
    return labels


def markdown(results, figure):
    quick = results.get("quick", False)
    minutes = sum(e["record"]["job_seconds"] for e in results["points"].values()) / 60
    scale_name = results.get("scale", "cpu")
    scale = SCALES[scale_name]
    flags = (" --quick" if quick else "") + ("" if scale_name == "cpu" else f" --scale {scale_name}")
    model, steps = scale["lm"]["model"], scale["steps"]
    where = (
        "every point one `mpirun -np 2` job through Horovod's stock optimizer"
        if scale["backend"] == "horovod"
        else "every point one `torchrun` job of 2 ranks on the one GPU, DDP with `hvd_compress.ddp` over Gloo"
    )
    lines = [
        f"Command: `python -m benchmarks claims{flags}` (resumable; regenerate this "
        f"section from the JSON with `python -m benchmarks report`). Jobs finished: {len(results['points'])}, "
        f"{minutes:.0f} min of jobs in all, "
        + (
            "run niced beside other work on the same cores."
            if scale["backend"] == "horovod"
            else "run 6 to 8 side by side (`--parallel`), 16 ranks on the GPU's 16-core host."
        )
        + "",
        "",
        f"Machine: {describe_machine(results['machine'])}",
        "",
        f"Protocol: see `benchmarks/claims.py`; {where}. Word LM: {scale['lm']['vocab']}-token vocabulary "
        f"(Python standard library source), GPT of {model['layers']} blocks, d_model {model['d_model']}, "
        f"context {model['context']}, separate embedding and head; {steps} steps at np {NP}, "
        f"{scale['lm']['batch_size'] * model['context']:,} tokens per rank and step; dense through the "
        f"learning-rate warm-up ({schedule(steps)[0]} steps); L-GreCo decides every {schedule(steps)[1]} steps "
        f"from step {schedule(steps)[2]}. Bytes per rank on the ring model.",
        "",
    ]
    todo = missing(results, quick)
    if todo:
        lines += [
            "**Partial.** Not measured yet (all or some seeds): " + "; ".join(todo) + ". Further runs "
            "follow from these (the anchor search goes on while settings stay within 1%, L-GreCo and "
            "its ablations run at the anchor found).",
            "",
        ]
    lines += ["Claims:", "", "| claim | met | numbers |", "|---|---|---|"]
    for text, met, numbers in claims(results, quick):
        lines.append(f"| {text} | {'-' if met is None else 'yes' if met else 'NO'} | {numbers} |")
    if scale["charlm"]:
        warmup, period, first = schedule(CHAR_STEPS)
        lines += [
            "",
            "The same claims without the 1% anchor: each family's uniform curve on the "
            f"character LM ({CHAR_STEPS} steps, L-GreCo deciding every {period} steps from step {first}), "
            "3 seeds per setting, and L-GreCo anchored at each setting; the uniform curve's bytes per step "
            "at L-GreCo's mean perplexity (log bytes interpolated between the neighbouring settings, "
            "never extrapolated) over L-GreCo's. Above 1: L-GreCo sends fewer bytes for the same quality. "
            "The anchor rule's verdicts are the Char LM rows above.",
            "",
            "| claim (equal quality on the uniform curve) | met | numbers |",
            "|---|---|---|",
        ]
        for text, met, numbers in curve_verdicts(results, quick):
            lines.append(f"| {text} | {'-' if met is None else 'yes' if met else 'NO'} | {numbers} |")
    ablations = ablation_rows(results, quick)
    if ablations:
        lines += [
            "",
            "L-GreCo and its ablations against the uniform anchor, seed by seed (the factor that "
            "decides a claim is the row that moves it):",
            "",
            "| workload | L-GreCo run | seeds | paired Δ perplexity vs uniform | equal quality "
            "(<= max(1%, 2 s.e.)) | fewer bytes per step | fewer bytes, whole run | solver's ratio, first → "
            "last decision |",
            "|---" * 8 + "|",
        ] + ablations
    for workload, title in [("wordlm", "Word LM"), ("charlm", "Character LM (the small-model row)")]:
        rows = table(results, workload)
        if len(rows) > 2:
            lines += ["", f"**{title}**", ""] + rows
    lines += flattening_rows(results)
    curve = next(
        (
            e["record"].get("curve")
            for e in results["points"].values()
            if e["spec"]["workload"] == "wordlm" and e["spec"]["label"] == UNCOMPRESSED and e["spec"]["seed"] == 0
        ),
        None,
    )
    if curve:
        lines += [
            "",
            "Uncompressed word LM, seed 0, validation perplexity during the run (step: perplexity): "
            + ", ".join(f"{step}: {value:.2f}" for step, value in curve)
            + ".",
        ]
    if any(e["spec"]["workload"] == "wordlm" for e in results["points"].values()):
        lines += ["", f"![perplexity against bytes per step]({figure.as_posix()})"]
    return "\n".join(lines) + "\n"


def flattening_rows(results):
    """The flattening hypothesis, from the word-LM L-GreCo runs that recorded window norms:
    does the residual's share of what the solver sees grow over the run, and does the solver's
    ratio fall with it? Per run: that share and the ratio at the first and last decision, and
    their correlation over the decisions."""
    runs = [
        (e["spec"]["label"], e["spec"]["seed"], e["record"]["lgreco"])
        for e in results["points"].values()
        if e["spec"]["workload"] == "wordlm"
        and e["record"].get("lgreco")
        and "residual_norm" in e["record"]["lgreco"][0]
    ]
    if not runs:
        return []
    lines = [
        "",
        "Does the residual flatten the table? Per run, at its first and last decision: the norm of "
        "the residual over that of the gradient (each the mean per step of the window before the "
        "decision, over the layers decided), and the solver's ratio (uniform bytes over chosen). "
        "The table holds gradient plus residual, except under \"raw error\" (gradient alone). The "
        "flattening hypothesis predicts a growing residual share, a negative correlation where the "
        "table holds the residual, and none (or a positive one) under \"raw error\".",
        "",
        "| run | seed | decisions | residual / gradient, first → last | solver's ratio, first → last | "
        "correlation over decisions |",
        "|---|---|---|---|---|---|",
    ]
    for label, seed, decisions in sorted(runs):
        shares = [d["residual_norm"] / d["gradient_norm"] for d in decisions]
        ratios = [d["uniform_over_chosen"] for d in decisions]
        correlation = statistics.correlation(shares, ratios) if len(decisions) > 2 else float("nan")
        lines.append(
            f"| {label} | {seed} | {len(decisions)} | {shares[0]:.2f} → {shares[-1]:.2f} | "
            f"{ratios[0]:.2f}x → {ratios[-1]:.2f}x | {correlation:+.2f} |"
        )
    return lines


def draw_figure(results, path):
    """Word LM: mean perplexity (± s.e.) against MB per step after the first decision (left)
    and over the whole run (right), a line per family."""
    labels, families = {}, {}
    for entry in results["points"].values():
        spec = entry["spec"]
        if spec["workload"] == "wordlm":
            labels.setdefault(spec["label"], []).append(entry["record"])
            families[spec["label"]] = spec["family"] + (f", {spec['suffix']}" if spec.get("suffix") else "")
    _, figure, axes = panels(2, 6, 4.2)
    for axis, key, title in [
        (axes[0], "per_step", "MB per rank and step after the first decision (log)"),
        (axes[1], "whole", "MB per rank over the whole run (log)"),
    ]:
        lines = {}
        for label, records in labels.items():
            s = summary(records)
            lines.setdefault(families[label], []).append((s[key] / 1e6, s["metric"], s["se"]))
        for family, values in sorted(lines.items()):
            values.sort()
            x, y, se = zip(*values)
            style = (
                {"marker": "*", "markersize": 12, "linestyle": "none"}
                if family == UNCOMPRESSED
                else {"marker": "o", "markersize": 4, "linestyle": "--" if "L-GreCo" in family else "-"}
            )
            axis.errorbar(x, y, yerr=se, label=family, capsize=2, **style)
        axis.set_xscale("log")
        axis.set_xlabel(title, fontsize=8)
        axis.set_ylabel("validation perplexity (word LM), lower is better", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=6)
    save_figure(figure, path)


def write_report(results, out):
    scale = scale_of(results)
    figure = out / "benchmarks" / f"{scale['name']}.png"
    if any(e["spec"]["workload"] == "wordlm" for e in results["points"].values()):
        draw_figure(results, figure)
    write_section(out, scale["section"], markdown(results, figure.relative_to(figure.parent)))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks claims", description=__doc__.splitlines()[0])
    add_job_options(
        parser,
        7200,
        "a tiny model, a few steps, one seed",
        job_timeout_help="seconds per mpirun job (a point takes minutes on idle cores, an hour or more niced "
        "on busy ones)",
        max_minutes=360.0,
    )
    parser.add_argument(
        "--scale",
        choices=sorted(SCALES),
        default="cpu",
        help="cpu: the protocol on this machine's cores (Horovod, mpirun); gpu: a larger word LM "
        "on one CUDA GPU (DDP, torchrun)",
    )
    parser.add_argument(
        "--stage",
        choices=["all", "curve"],
        default="all",
        help="curve: only the character-LM uniform curves and L-GreCo at each of their settings",
    )
    parser.add_argument("--parallel", type=int, default=1, help="points run side by side")
    parser.add_argument("--device", help="torch device of the points (default: the scale's: cpu, or cuda)")
    return parser.parse_args(argv)


def render(out: Path) -> None:
    """Rewrites the page and picture of each scale from its stored JSON."""
    for scale in SCALES.values():
        results = stored(out, scale["name"])
        if results is not None:
            write_report(results, out)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.parallel < 1:
        raise SystemExit(f"--parallel must be at least 1, got {args.parallel}")
    run_points(args, train_point, run, results_path(args.out, args.scale), RESULT_PREFIX)

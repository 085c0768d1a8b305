"""``hvd_compress.advise``: the projection's parts, one process with a stand-in for the ranks,
and (slow) a 2-rank ``mpirun`` run that prints the table; the shipped quality evidence is the
one docs/benchmarks/ holds."""

import json
import os
import math
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import evidence as evidence_script
from benchmarks.harness.jobs import LOOPBACK_ONLY
from benchmarks.harness.render import page
from benchmarks.testbed import run_bounded
from hvd_compress import advise as adv
from hvd_compress.advise import advice as advice_module, evidence as quality, local, measure, projection
from hvd_compress.comm.rounds import Collective

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_evidence_is_what_docs_benchmarks_holds():
    """Rerun ``python -m benchmarks evidence`` after the quality or time-to-quality benchmark
    adds results."""
    parsed = evidence_script.gather(
        page(ROOT / "docs", "Quality against bytes"), ROOT / "docs" / "benchmarks" / "time_to_quality.json"
    )
    assert json.loads(quality.EVIDENCE.read_text()) == json.loads(json.dumps(parsed))
    assert parsed["workloads"] == {"Digits CNN": "test accuracy", "Character LM": "validation perplexity"}
    assert {"none", "powersgd", "topk", "qsgd", "lgreco/powersgd"} <= set(parsed["methods"])


def test_evidence_names_the_measurement_and_judges_it_against_the_limits():
    evidence = {
        "workloads": {"LM": "perplexity"},
        "methods": {
            "powersgd": {
                "rank=8": [{"workload": "LM", "value": "4.586", "delta": "+2.7%", "seeds": 3}],
                "rank=1": [{"workload": "LM", "value": "5.562", "delta": "+24.5%", "seeds": 1}],
            }
        },
    }
    text, ok = quality.evidence_for("powersgd", "rank=8", evidence)
    assert text == "LM: perplexity 4.586 (+2.7%, 3 seeds)" and ok is True
    assert quality.evidence_for("powersgd", "rank=1", evidence)[1] is False
    assert quality.evidence_for("powersgd", "rank=2", evidence) == ("none held", None)
    assert quality._loss_of("-0.84 points") == (0.84, "points")


def test_a_link_fit_recovers_a_straight_line():
    sizes = (4096, 65536, 1 << 20, 16 << 20)
    link = projection.fit_link({n: 1e-4 + n / 1e8 for n in sizes})
    assert link.bytes_per_s == pytest.approx(1e8, rel=1e-6)
    for nbytes in (*sizes, 300_000, 64 << 20):  # at, between and beyond the probes
        assert link.seconds(nbytes) == pytest.approx(1e-4 + nbytes / 1e8, rel=1e-6)
    assert projection.fit_link({4096: 2e-3}).seconds(1 << 30) == 2e-3  # one size: latency alone
    assert adv.Link(1e-3, 1e6).seconds(1e6) == pytest.approx(1.001)  # nothing measured: the line


def test_a_link_fit_holds_at_the_large_messages_past_a_burst():
    """advise's own all-reduce probes at 0.5 Gbit/s (docs/benchmarks/advise_live.json): the
    small ones pass in tbf's burst at memory speed; the large ones set the step."""
    measured = {4096: 0.00116, 86220: 0.00131, 1814956: 0.0688, 38204928: 1.684}
    link = projection.fit_link(measured)
    for nbytes, seconds in measured.items():
        assert link.seconds(nbytes) == pytest.approx(seconds)
    assert link.latency_s == 0.00116
    assert link.bytes_per_s == pytest.approx((38204928 - 1814956) / (1.684 - 0.0688))  # the large end's rate
    assert link.seconds(20e6) == pytest.approx(0.0688 + (20e6 - 1814956) * (1.684 - 0.0688) / (38204928 - 1814956))
    assert link.seconds(76e6) == pytest.approx(1.684 + (76e6 - 38204928) / link.bytes_per_s)
    assert link.seconds(100) == 0.00116
    assert projection.fit_link({4096: 2e-3, 8192: 1e-3}).bytes_per_s == float("inf")  # no rate visible


def test_stock_messages_fuse_first_rounds_and_run_following_ones_per_gradient():
    allreduce, broadcast = Collective.ALLREDUCE, Collective.BROADCAST
    powersgd_like = [(0, allreduce, 1000), (1, allreduce, 500)] * 3 + [(0, allreduce, 400)]
    first, following = projection.stock_messages(powersgd_like)
    assert first == {"allreduce": (1, 3400)} and following == {"allreduce": (3, 500)}
    scalecom_like = [(0, broadcast, 100), (1, allreduce, 300)] * 2 + [(0, allreduce, 400)]
    first, following = projection.stock_messages(scalecom_like)
    assert first == {"broadcast": (2, 100), "allreduce": (1, 400)} and following == {"allreduce": (2, 300)}
    dense = [(0, allreduce, 40 << 20)] * 4  # 160 MiB: three fusion buffers
    assert projection.stock_messages(dense) == ({"allreduce": (3, (160 << 20) / 3)}, {})


def test_a_step_counts_the_slowest_ranks_codec():
    """ScaleCom-like: the leader, a different rank at each timed step, selects for all."""
    ranks = [candidate("scalecom", "density=0.01", 0.0, {}) for _ in range(3)]
    for rank, steps in enumerate(([90.0, 10.0, 10.0], [10.0, 80.0, 10.0], [10.0, 10.0, 70.0])):
        ranks[rank].codec_step_ms = steps
    slowest = measure.slowest_codec(ranks)
    assert slowest is ranks[0] and slowest.codec_step_ms == [90.0, 80.0, 70.0] and slowest.codec_ms == 80.0


def test_following_rounds_are_exposed_whole():
    links = {"allreduce": adv.Link(1e-3, 1e9)}
    c = candidate("powersgd", "rank=4", 10.0, {"allreduce": (1, 1e6)})
    c.serial_messages = {"allreduce": (50, 1e4)}
    projection.project(c, links, compute_s=0.1, backward_s=0.06)
    assert c.communication_ms == pytest.approx(2 + 50 * 1.01)
    assert c.step_ms == pytest.approx(100 + 10 + 2 + 50 * 1.01)  # first round: its message alone


def test_measure_codec_counts_powersgd_rounds_as_the_stock_optimizer_issues_them():
    model, loss_of = small_model()
    grads = measure.gradients_of(model, loss_of)
    named = list(model.named_parameters())
    counted = measure.measure_codec("powersgd", {"rank": 4}, grads, named, 0, 4, steps=1)
    # Every first round fused into one all-reduce; each weight matrix's Q round on its own.
    assert counted.messages["allreduce"][0] == 1
    assert counted.serial_messages["allreduce"][0] == 2
    assert len(counted.codec_step_ms) == 1 and counted.codec_ms == counted.codec_step_ms[0]
    assert measure.measure_codec("fp16", {}, grads, named, 0, 4, steps=1).serial_messages == {}


def test_probe_sizes_span_4_kib_to_the_largest_message():
    sizes = measure.probe_sizes(64 << 20)
    assert sizes[0] == 4096 and sizes[-1] == 64 << 20 and len(sizes) == measure.PROBE_SIZES
    assert measure.probe_sizes(100) == [4096]


def candidate(method, setting, codec_ms, messages, quality_ok=True):
    c = adv.Candidate(method, setting, 0.0, codec_ms, messages)
    c.quality_ok = quality_ok
    return c


def projected(link_seconds_per_byte):
    links = {"allreduce": adv.Link(1e-4, 1 / link_seconds_per_byte)}
    dense = candidate("none", "", 0.0, {"allreduce": (1, 40e6)})
    compressed = candidate("powersgd", "rank=4", 20.0, {"allreduce": (2, 0.5e6)})
    risky = candidate("topk", "density=0.001", 1.0, {"allreduce": (1, 0.1e6)}, quality_ok=False)
    for c in (dense, compressed, risky):
        projection.project(c, links, compute_s=0.1, backward_s=0.06)
    for c in (dense, compressed, risky):
        c.speedup = dense.step_ms / c.step_ms
    return dense, compressed, risky


def test_projection_hides_communication_behind_backward_but_not_the_last_message():
    dense, compressed, _ = projected(1 / 1e8)  # 0.8 Gbit/s
    assert dense.communication_ms == pytest.approx(400.1)
    assert dense.step_ms == pytest.approx(100 + 400.1)  # one fused message: nothing to overlap
    assert compressed.step_ms == pytest.approx(100 + 20 + 5.1)  # hidden: max(10.2 - 60, 5.1)
    links = {"allreduce": adv.Link(0.0, 1e8)}
    split = candidate("none", "", 0.0, {"allreduce": (4, 10e6)})
    projection.project(split, links, compute_s=0.1, backward_s=0.06)
    assert split.step_ms == pytest.approx(100 + 400 - 60)  # backward hides all but the rest


def test_advice_is_the_fastest_safe_setting_or_not_to_compress():
    slow_link = projected(1 / 1e8)
    line = quality.recommend(slow_link)
    assert line.startswith("compress with powersgd rank=4") and "topk density=0.001" in line
    fast_link = projected(1 / 1e12)
    assert quality.recommend(fast_link).startswith("do not compress: the link is fast enough")


STEPS = {
    "steps_to_target": {
        "workload": "LM, loss 1.4",
        "methods": {
            "powersgd": {"rank=4": {"factor": 1.5, "seeds": 3, "reached": 3}},
            "topk": {"density=0.001": {"factor": None, "seeds": 3, "reached": 1}},
        },
    }
}


def test_steps_to_target_evidence_gives_the_factor_or_says_it_was_not_reached():
    assert quality.steps_for("powersgd", "rank=4", STEPS) == (
        "1.50x the steps (3 of 3 seeds reached it; LM, loss 1.4)",
        1.5,
    )
    assert quality.steps_for("topk", "density=0.001", STEPS)[1] == math.inf
    assert quality.steps_for("powersgd", "rank=8", STEPS) == ("", None)
    assert quality.steps_for("none", "", STEPS)[1] == 1.0
    assert quality.steps_for("none", "", {}) == ("", None)


def with_steps(candidates, factors, seeds=5):
    for c in candidates:
        c.steps_evidence, c.steps_factor = "measured", factors.get(c.method, 1.0 if c.method == "none" else None)
        c.steps_seeds = seeds
        if c.steps_factor is not None:
            c.to_target = c.steps_factor / c.speedup
    return candidates


def test_advice_picks_the_shortest_time_to_target_not_the_fastest_step():
    dense, compressed, risky = with_steps(projected(1 / 1e8), {"powersgd": 1.5, "topk": 1.2})
    risky.quality_ok = True  # the faster step: chosen by step time alone
    assert quality.recommend([dense, compressed, risky]).startswith("compress with topk")
    risky.steps_factor, risky.to_target = math.inf, math.inf  # but it never reaches the target
    line = quality.recommend([dense, compressed, risky])
    assert line.startswith("compress with powersgd rank=4: projected to reach uncompressed's quality in")
    assert f"{compressed.to_target:.2f}x its time" in line
    compressed.to_target = 1.0  # as slow to the target as uncompressed
    assert quality.recommend([dense, compressed, risky]).startswith("do not compress: no measured setting")


def test_advice_picks_only_by_steps_measured_on_enough_seeds_and_names_a_sooner_one_on_fewer():
    dense, compressed, risky = with_steps(projected(1 / 1e8), {"powersgd": 1.5, "topk": 1.2})
    risky.quality_ok, risky.steps_seeds, risky.steps_evidence = True, 1, "1.20x the steps (1 of 1 seeds reached it)"
    line = quality.recommend([dense, compressed, risky])
    assert line.startswith("compress with powersgd rank=4")
    assert (
        f"Projected sooner but on fewer than {quality.PICK_SEEDS} seeds, not picked: topk density=0.001, "
        f"{risky.to_target:.2f}x its time (1.20x the steps (1 of 1 seeds reached it))"
    ) in line
    compressed.steps_seeds = 2  # nothing measured on enough seeds: step time decides, and says why
    assert quality.recommend([dense, compressed, risky]).endswith(
        f"measured on fewer than {quality.PICK_SEEDS} seeds only, so this rests on step time alone"
    )


def test_the_timed_check_times_in_the_order_of_the_projection_until_a_timed_setting_beats_the_rest():
    from hvd_compress.advise.check import check_by_timing

    dense = candidate("none", "", 0.0, {})
    settings = {name: candidate(name, "", 0.0, {}) for name in ("a", "b", "c", "d")}
    projected = {"a": 0.5, "b": 0.6, "c": 1.0, "d": 0.55}  # time to target, relative to uncompressed
    for name, c in settings.items():
        c.steps_factor, c.steps_seeds, c.speedup = 1.2, 3, 1.2 / projected[name]
        c.to_target = projected[name]
    settings["d"].steps_seeds = 1  # cannot be picked: never timed
    timed_ms = {"none": 100.0, "a": 90.0, "b": 65.0, "c": 60.0, "d": 95.0}  # slower than projected
    order = []

    def time_one(c):
        order.append(c.method)
        return timed_ms[c.method]

    check_by_timing([dense, *settings.values()], time_one, pick_seeds=3)
    # a timed at 1.08x its time; then b, 0.78x, beats c's projection (1.0) by more than the margin: c is not timed.
    assert order == ["none", "a", "b"]
    assert settings["a"].to_target == pytest.approx(1.2 * 90 / 100) and settings["b"].timed_step_ms == 65.0
    assert settings["c"].timed_step_ms is None and settings["c"].to_target == 1.0
    assert quality.recommend([dense, *settings.values()]).startswith("compress with b")
    # Projected within the margin of b's timed 0.78x (0.9 < 0.78 x 1.2), c is timed, and wins (0.72x).
    order.clear()
    for name, c in settings.items():
        c.timed_step_ms, c.to_target = None, 0.9 if name == "c" else projected[name]
        c.speedup = 1.2 / c.to_target
    check_by_timing([dense, *settings.values()], time_one, pick_seeds=3)
    assert order == ["none", "a", "b", "c"]
    assert quality.recommend([dense, *settings.values()]).startswith("compress with c")
    order.clear()
    for name, c in settings.items():
        c.timed_step_ms, c.speedup, c.to_target = None, 1.2 / projected[name], projected[name]
    check_by_timing([dense, *settings.values()], time_one, pick_seeds=3, most=1)
    # One besides uncompressed to test the margin (a, 1.08x once timed); then b, which would be
    # picked on its projection (0.6x), is timed too, and leads timed (0.78x): c is not timed.
    assert order == ["none", "a", "b"] and settings["c"].timed_step_ms is None
    assert quality.recommend([dense, *settings.values()]).startswith("compress with b")
    # Past the budget, a setting projected too little sooner than uncompressed to be picked is not
    # timed (b, 1.05x, ahead of a's timed 1.08x): uncompressed would be picked over it.
    order.clear()
    for name, c in settings.items():
        c.timed_step_ms, c.to_target = None, {"a": 1.0, "b": 1.05, "c": 1.3, "d": 1.0}[name]
        c.speedup = 1.2 / c.to_target
    check_by_timing([dense, *settings.values()], time_one, pick_seeds=3, most=1)
    assert order == ["none", "a"]
    # Without steps to target, the order is the projected speed-up of settings of measured quality.
    for c in settings.values():
        c.timed_step_ms, c.steps_seeds, c.steps_factor, c.to_target = None, 0, None, None
    settings["a"].quality_ok = False
    order.clear()
    check_by_timing([dense, *settings.values()], time_one, pick_seeds=3)
    # d (projected 2.18x a step) timed at 1.05x, then b at 1.54x; c's projected 1.2x is more than the
    # margin behind it.
    assert order == ["none", "d", "b"]


def test_steps_seeds_are_the_records_and_the_targets_for_uncompressed():
    assert quality.steps_seeds("powersgd", "rank=4", STEPS) == 3
    assert quality.steps_seeds("powersgd", "rank=8", STEPS) == 0
    assert quality.steps_seeds("none", "", STEPS) == quality.PICK_SEEDS and quality.steps_seeds("none", "", {}) == 0


def test_advice_names_a_faster_setting_whose_steps_to_target_were_not_measured():
    dense, compressed, risky = with_steps(projected(1 / 1e8), {"powersgd": 1.5})
    risky.quality_ok = None  # no quality evidence either: not known to be worse
    line = quality.recommend([dense, compressed, risky])
    assert line.startswith("compress with powersgd rank=4")
    bound = risky.speedup * compressed.to_target
    assert line.endswith(
        f"Not measured to target but {risky.speedup:.2f}x faster a step: topk density=0.001, "
        f"which pays if it needs under {bound:.2f}x the steps"
    )


def test_advice_without_steps_evidence_says_it_rests_on_step_time():
    assert quality.recommend(projected(1 / 1e8)).endswith("rests on step time alone")


def test_steps_to_target_is_read_from_the_time_to_quality_results():
    def record(losses):
        return {"points": [{"length": n, "loss": loss} for n, loss in zip([1000, 2000, 4000], losses)]}

    def entry(label, compressor, settings, seed, losses, controller=None):
        spec = {"label": label, "compressor": compressor, "settings": settings, "controller": controller}
        return f"{label}/{seed}", {"spec": spec, "record": record(losses)}

    points = dict(
        [entry("uncompressed", None, {}, seed, [2.0, 1.6, 1.5]) for seed in range(5)]
        + [entry("PowerSGD rank 8", "powersgd", {"rank": 8}, seed, [2.1, 1.7, 1.65]) for seed in range(3)]
        + [
            entry("L-GreCo", "topk", {"density": 0.1}, 0, [2.0, 1.6, 1.5], {"kind": "lgreco"}),
            entry("DiLoCo", "qsgd", {"bits": 4}, 0, [2.0, 1.6, 1.5], {"kind": "diloco", "inner_steps": 50}),
            entry(
                "DiLoCo tuned",
                "qsgd",
                {"bits": 4},
                0,
                [2.0, 1.6, 1.5],
                {"kind": "diloco", "inner_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.8},
            ),
            entry(
                "Streaming",
                "qsgd",
                {"bits": 4},
                0,
                [2.0, 1.7, 1.7],
                {"kind": "streaming", "inner_steps": 50, "fragments": 2, "delay": 5, "mixing": 0.5},
            ),
        ]
    )
    results = {"points": points, "np": 4, "plan": {"base_seeds": 5, "knee_gain": 0.1}}  # knee 2,000: 1.6
    steps = evidence_script.steps_to_target(results)
    assert set(steps["methods"]) == {"none", "powersgd", "lgreco/topk", "diloco/qsgd", "streaming/qsgd"}
    assert set(steps["methods"]["diloco/qsgd"]) == {"H=50,bits=4", "H=10,outer=1.0/0.8,bits=4"}
    assert steps["methods"]["streaming/qsgd"]["H=50,F=2,delay=5,mixing=0.5,bits=4"]["factor"] is None
    assert steps["methods"]["none"][""]["factor"] == 1.0
    assert steps["methods"]["powersgd"]["rank=8"] == {"factor": None, "seeds": 3, "reached": 0}
    assert steps["methods"]["lgreco/topk"]["density=0.1"]["factor"] == 1.0


class OneRank:
    """A world of one in this process (the single-process tier's stand-in for the launcher)."""

    rank, size = 0, 1

    def run(self, collective, tensor, label):
        torch.cat([tensor.reshape(-1)] * 2)  # some work that grows with the size

    def barrier(self):
        pass

    def agree(self, obj):
        return obj


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def loss_of(model):
        return model(torch.randn(8, 64)).square().mean()

    return model, loss_of


def test_advise_in_one_process_measures_every_asked_method_at_its_settings():
    model, loss_of = small_model()
    advice = adv.advise(
        model, loss_of, methods=["powersgd", "topk", "fp16"], ranks=OneRank(), codec_steps=2, compute_steps=1, repeats=1
    )
    seen = {(c.method, c.setting) for c in advice.candidates}
    assert seen == {
        ("none", ""),
        ("fp16", ""),
        *(("powersgd", f"rank={r}") for r in (16, 8, 4)),
        *(("topk", f"density={d}") for d in (0.1, 0.01, 0.001)),
    }
    assert advice.parameters == sum(p.numel() for p in model.parameters())
    assert all(c.step_ms > 0 and c.codec_ms >= 0 for c in advice.candidates)
    assert set(advice.links) == {"allreduce", "allgather"}
    text = adv.format_advice(advice)
    assert "speed-up" in text and text.splitlines()[-1].startswith("advice: ")
    steps = json.loads(quality.EVIDENCE.read_text()).get("steps_to_target")
    if steps and "fp16" in steps["methods"]:  # the shipped evidence names its workload whole
        assert f"time to target (relative to uncompressed) measured on: {steps['workload']}" in text


def test_lgreco_is_projected_at_the_settings_the_evidence_measured_it_at():
    evidence = {
        "methods": {"lgreco/topk": {"density=0.01": []}, "gravac/topk": {"": []}},
        "steps_to_target": {"methods": {"lgreco/topk": {"density=0.1": {}}, "lgreco/qsgd": {"bits=3": {}}}},
    }
    assert advice_module.controlled(["topk", "qsgd", "fp16", "lgreco"], evidence) == [
        ("lgreco/topk", {"density": 0.1}),
        ("lgreco/topk", {"density": 0.01}),
    ]  # bits=3: not a setting tried
    assert advice_module.controlled(["topk", "qsgd"], evidence) == []  # L-GreCo not asked for


def test_lgreco_candidate_runs_the_settings_rank_0_decided_from_the_models_gradients():
    model, loss_of = small_model()
    grads = measure.gradients_of(model, loss_of)
    named = list(model.named_parameters())
    decided = measure.decided_settings("lgreco/topk", {"density": 0.1}, grads, named)
    assert set(decided) == set(grads) and decided != {name: 0.1 for name in grads}  # per layer, not uniform
    assert measure.build_compressor("lgreco/topk", {"density": 0.1}, named, decided).settings() == decided
    counted = measure.measure_codec("lgreco/topk", {"density": 0.1}, grads, named, 0, 4, 1, decided)
    uniform = measure.measure_codec("topk", {"density": 0.1}, grads, named, 0, 4, 1)
    assert (counted.method, counted.setting, counted.layer_settings) == ("lgreco/topk", "density=0.1", decided)
    assert counted.wire_bytes != uniform.wire_bytes
    advice = adv.advise(
        model, loss_of, methods=["topk", "lgreco"], ranks=OneRank(), codec_steps=1, compute_steps=1, repeats=1
    )
    projected = [c for c in advice.candidates if c.method == "lgreco/topk"]
    shipped = json.loads(quality.EVIDENCE.read_text())
    measured = {
        *shipped["methods"].get("lgreco/topk", {}),
        *shipped["steps_to_target"]["methods"].get("lgreco/topk", {}),
    }
    assert {c.setting for c in projected} == measured & {"density=0.1", "density=0.01", "density=0.001"}
    assert all(c.layer_settings and c.step_ms > 0 for c in projected)


LOCAL = {
    "steps_to_target": {
        "workload": "LM, loss 1.4",
        "methods": {
            "none": {"": {"factor": 1.0, "seeds": 5, "reached": 5}},
            "fp16": {"": {"factor": 1.0, "seeds": 5, "reached": 5}},
            "diloco/qsgd": {
                "H=50,bits=4": {"factor": 1.6, "seeds": 3, "reached": 3},
                "H=10,outer=1.0/0.8,bits=4": {"factor": None, "seeds": 1, "reached": 0},
            },
            "streaming/qsgd": {"H=50,F=2,delay=5,mixing=0.5,bits=4": {"factor": 1.7, "seeds": 3, "reached": 3}},
        },
    }
}


def test_local_methods_are_read_from_the_evidence_with_their_schedule():
    points = {p.setting: p for p in local.local_points(LOCAL)}
    assert set(points) == {"H=50,bits=4", "H=10,outer=1.0/0.8,bits=4", "H=50,F=2,delay=5,mixing=0.5,bits=4"}
    diloco = points["H=10,outer=1.0/0.8,bits=4"]
    assert (diloco.method, diloco.compressor, diloco.options, diloco.period) == ("diloco/qsgd", "qsgd", {"bits": 4}, 10)
    streaming = points["H=50,F=2,delay=5,mixing=0.5,bits=4"]
    assert (streaming.period, streaming.fragments, streaming.delay, streaming.options) == (50, 2, 5, {"bits": 4})
    assert [p.method for p in local.local_points(LOCAL, ["streaming"])] == ["streaming/qsgd"]


def test_a_local_exchange_is_spread_over_its_period_and_streaming_hides_it_behind_inner_steps():
    links = {"allreduce": adv.Link(1e-3, 1e8)}  # 1 ms + 10 ms a MB
    point = local.LocalPoint("diloco/qsgd", "H=50,bits=4", "qsgd", {"bits": 4}, period=50)
    c = candidate("diloco/qsgd", "H=50,bits=4", 50.0, {"allreduce": (2, 5e6)})
    c.wire_bytes = 10e6
    local.project_local(c, point, links, compute_s=0.1)
    # Exchange: 2 x (1 + 50) ms, all exposed, with 50 ms of codec, over 50 steps.
    assert c.period == 50 and c.wire_bytes == pytest.approx(0.2e6) and c.codec_ms == pytest.approx(1.0)
    assert c.communication_ms == pytest.approx(102 / 50) and c.step_ms == pytest.approx(100 + 102 / 50 + 1)
    streamed = local.LocalPoint("streaming/qsgd", "", "qsgd", {}, period=50, fragments=2, delay=1)
    s = candidate("streaming/qsgd", "", 0.0, {"allreduce": (2, 5e6)})
    local.project_local(s, streamed, links, compute_s=0.01)
    # A fragment's exchange: 2 x (1 + 25) ms, 10 ms of it behind an inner step; two a period.
    assert s.communication_ms == pytest.approx(2 * 52 / 50) and s.step_ms == pytest.approx(10 + 2 * 42 / 50)
    local.project_local(s := candidate("streaming/qsgd", "", 0.0, {"allreduce": (2, 5e6)}), streamed, links, 1.0)
    assert s.step_ms == pytest.approx(1000)  # a slow step hides the whole exchange


def test_local_advice_names_the_soonest_local_setting_or_the_per_step_method_that_beats_it():
    def made(method, setting, to_target, seeds=3, period=50):
        c = candidate(method, setting, 0.0, {})
        c.to_target, c.steps_seeds, c.period, c.wire_bytes, c.steps_evidence = to_target, seeds, period, 2e5, "seen"
        return c

    fp16 = made("fp16", "", 0.7, seeds=5, period=1)
    diloco = made("diloco/qsgd", "H=50,bits=4", 0.9)
    thin = made("diloco/qsgd", "H=10,bits=4", 0.1, seeds=1)
    line = local.local_advice([fp16, diloco, thin])
    assert line.startswith(
        "across sites: diloco/qsgd H=50,bits=4 is projected to reach uncompressed's quality in 0.90x"
    )
    assert line.endswith("the per-step fp16 is sooner here (0.70x): train with it")
    fp16.to_target = 1.2
    assert local.local_advice([fp16, diloco]).endswith("sooner than the per-step fp16 (1.20x), the soonest per-step")
    dense = made("none", "", 0.5, seeds=5, period=1)
    assert local.local_advice([dense, diloco]).endswith(
        "; uncompressed per-step training is sooner here (0.50x): train with it"
    )
    diloco.to_target = math.inf
    assert "no local setting measured here reached" in local.local_advice([fp16, diloco, thin])
    assert local.local_advice([fp16]) == ""


def test_advise_projects_the_local_methods_the_evidence_measured_apart_from_the_per_step_advice(monkeypatch):
    monkeypatch.setattr(advice_module, "shipped_evidence", lambda: LOCAL)
    model, loss_of = small_model()
    advice = adv.advise(
        model, loss_of, methods=["fp16", "diloco", "streaming"], ranks=OneRank(), codec_steps=1, compute_steps=1
    )
    by_name = {(c.method, c.setting): c for c in advice.candidates}
    diloco = by_name["diloco/qsgd", "H=50,bits=4"]
    assert diloco.period == 50 and diloco.steps_factor == 1.6 and diloco.step_ms > 0
    assert by_name["diloco/qsgd", "H=10,outer=1.0/0.8,bits=4"].period == 10
    assert by_name["streaming/qsgd", "H=50,F=2,delay=5,mixing=0.5,bits=4"].period == 50
    assert "diloco" not in advice.recommendation and advice.across_sites.startswith("across sites: ")
    text = adv.format_advice(advice)
    assert text.splitlines()[-1] == f"advice {advice.across_sites}" and "per step, their exchange's over H" in text
    without = adv.advise(model, loss_of, methods=["fp16"], ranks=OneRank(), codec_steps=1, compute_steps=1)
    assert all(c.period == 1 for c in without.candidates) and without.across_sites == ""


def test_advise_refuses_bad_input_naming_it():
    model, _ = small_model()
    with pytest.raises(ValueError, match="compute_ms"):
        adv.advise(model, ranks=OneRank())
    with pytest.raises(ValueError, match="methods"):
        adv.advise(model, compute_ms=10, methods=["zip"], ranks=OneRank())
    with pytest.raises(ValueError, match="timed_steps"):
        adv.advise(model, compute_ms=10, ranks=OneRank(), timed_steps=-1)
    with pytest.raises(ValueError, match="module:function"):
        measure.load_model("examples.models")


@pytest.mark.slow
@pytest.mark.serial  # two ranks of its own
def test_advise_on_two_ranks_prints_its_table(tmp_path):
    """``python -m hvd_compress.advise`` under ``mpirun -np 2`` on the small character LM, with
    per-step methods and a local one (Streaming DiLoCo, from the evidence), which gets its own
    rows and its own line of advice."""
    out = tmp_path / "advice.json"
    command = [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        "2",
        *LOOPBACK_ONLY,
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        "-m",
        "hvd_compress.advise",
        "--model",
        "examples.models:charlm_small",
        "--methods",
        "powersgd,topk,streaming",
        "--json",
        str(out),
    ]
    code, stdout, stderr = run_bounded(command, 300, dict(os.environ, OMP_NUM_THREADS="1"))
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    lines = stdout.splitlines()
    assert any(line.startswith("method") and "speed-up" in line and "quality evidence" in line for line in lines)
    assert sum(line.startswith(("none ", "powersgd ", "topk ")) for line in lines) == 7
    streaming = [line for line in lines if line.startswith("streaming/qsgd ")]
    assert len(streaming) == len(local.local_points(quality.shipped_evidence(), ["streaming"])) >= 1
    assert lines[-2].startswith("advice: ") and lines[-1].startswith("advice across sites: ")
    advice = json.loads(out.read_text())
    assert advice["world_size"] == 2 and len(advice["candidates"]) == 7 + len(streaming)
    # Real steps timed: uncompressed always, and at least the setting the advice would pick.
    timed = [c for c in advice["candidates"] if c["timed_step_ms"] is not None]
    assert any(c["method"] == "none" for c in timed) and len(timed) >= 2 and all(c["timed_step_ms"] > 0 for c in timed)


@pytest.mark.slow
@pytest.mark.serial  # two ranks of its own
def test_advise_check_compares_the_model_with_a_measured_run(tmp_path, monkeypatch):
    from benchmarks import __main__ as bench

    measured = json.loads((ROOT / "docs" / "benchmarks" / "endtoend.json").read_text())
    measured["rates"] = {"1": measured["rates"]["1"]}
    measured["rates"]["1"]["models"] = {"cnn": measured["rates"]["1"]["models"]["cnn"]}
    measured["models"] = {"cnn": measured["models"]["cnn"]}
    source = tmp_path / "endtoend.json"
    source.write_text(json.dumps(measured))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["advise_check", "--from", str(source), "--out", str(tmp_path)]) == 0
    text = page(tmp_path, "advise against end to end").read_text()
    assert text.startswith("# advise against end to end\n") and "| 1 | cnn | S-SGD |" in text


def test_the_table_marks_methods_that_send_more_than_uncompressed_at_these_ranks():
    """At 32 ranks Top-K 10% all-gathers 0.8 n (W-1) bytes against uncompressed's 8 n (W-1)/W:
    the table says so."""
    from hvd_compress.advise.projection import Candidate

    n, w = 1_000_000, 32
    candidates = [
        Candidate("none", "", 8 * n * (w - 1) / w, 0.0, {}),
        Candidate("topk", "density=0.1", 0.8 * n * (w - 1), 1.0, {}),
        Candidate("fp16", "", 4 * n * (w - 1) / w, 0.5, {}),
    ]
    advice = advice_module.Advice(
        world_size=w,
        parameters=n,
        compute_ms=10.0,
        backward_ms=6.0,
        links={},
        candidates=candidates,
        recommendation="do not compress",
    )
    text = adv.format_advice(advice)
    marked = [line for line in text.splitlines() if line.startswith(("topk", "fp16", "none"))]
    assert [line.split()[0] for line in marked if "*" in line.split()[2]] == ["topk"]
    assert "* sends more bytes per step than uncompressed at 32 ranks" in text


def test_a_link_is_scaled_to_more_ranks_as_the_ring_algorithms_scale():
    """From 8 to 32 ranks a ring all-reduce sends 62 messages in turn, not 14, and 2(W-1)/W of
    its bytes; an all-gather 31 messages, not 7, and (W-1) times its bytes. Latency is the
    intercept (the smallest probe less its bytes); a hop's, the all-reduce's over the
    all-gather's, over the W - 1 messages more it sends in turn."""
    from hvd_compress.advise.projection import Link, fit_link, hop_latency, scaled_link

    link = fit_link({4096: 1e-3 + 4096 / 1e8, 1 << 20: 1e-3 + (1 << 20) / 1e8, 1 << 22: 1e-3 + (1 << 22) / 1e8})
    assert link.intercept_s == pytest.approx(1e-3) and link.latency_s == pytest.approx(1e-3 + 4096 / 1e8)
    hop = 1e-5
    allreduce = scaled_link(link, "allreduce", 8, 32, hop)
    wire = (2 * 31 / 32) / (2 * 7 / 8)
    assert allreduce.intercept_s == pytest.approx(1e-3 + 48 * hop)
    assert allreduce.bytes_per_s == pytest.approx(1e8 / wire)
    assert allreduce.seconds(1 << 21) == pytest.approx(1e-3 + 48 * hop + (1 << 21) * wire / 1e8)
    allgather = scaled_link(link, "allgather", 8, 32, hop)
    assert allgather.intercept_s == pytest.approx(1e-3 + 24 * hop)
    assert allgather.seconds(1 << 20) == pytest.approx(1e-3 + 24 * hop + (1 << 20) * 31 / 7 / 1e8)
    assert scaled_link(link, "alltoall", 8, 8, hop).measured == pytest.approx(link.measured)
    for measured_world, world in ((8, 1), (1, 8)):
        with pytest.raises(ValueError, match="world"):
            scaled_link(link, "allreduce", measured_world, world)
    links = {"allreduce": Link(1e-3 + 14 * hop, math.inf), "allgather": Link(1e-3 + 7 * hop, math.inf)}
    assert hop_latency(links, 8) == pytest.approx(hop)
    assert hop_latency({"allreduce": links["allgather"], "allgather": links["allreduce"]}, 8) == 0.0
    assert hop_latency({"allreduce": links["allreduce"]}, 8) == 0.0
    assert hop_latency(links, 2) == 0.0  # one hop of difference: not told from noise


class TwoRanks(OneRank):
    size = 2


def test_advise_projects_to_more_ranks_than_launched_and_marks_the_all_gathers_that_stop_paying():
    """Launched on 2 ranks, projected to 32: each codec runs as one of 32 ranks, so Top-K 10%
    all-gathers 31 payloads and sends more than uncompressed, and the table says what was
    projected; no timed check runs."""
    model, loss_of = small_model()
    options = dict(methods=["topk", "fp16"], ranks=TwoRanks(), codec_steps=1, compute_steps=1, repeats=1)
    advice = adv.advise(model, loss_of, world=32, **options)
    assert (advice.world_size, advice.measured_world) == (32, 2)
    by_name = {(c.method, c.setting): c for c in advice.candidates}
    dense = by_name["none", ""].wire_bytes
    parameters = sum(p.numel() for p in model.parameters())
    assert dense == pytest.approx(2 * 31 / 32 * 4 * parameters, rel=1e-3)
    assert by_name["topk", "density=0.1"].wire_bytes > dense > by_name["fp16", ""].wire_bytes
    assert all(c.timed_step_ms is None for c in advice.candidates)
    text = adv.format_advice(advice)
    assert "projected to 32 ranks, not launched: links measured on 2" in text and "no timed check" in text
    assert "no hop latency added: not told from noise" in text  # 2 ranks: one hop of difference
    assert "links scaled to 32 ranks" in text
    assert "* sends more bytes per step than uncompressed at 32 ranks" in text
    launched = adv.advise(model, loss_of, **options)
    assert launched.world_size == 2 and by_name["topk", "density=0.1"].wire_bytes > 10 * next(
        c.wire_bytes for c in launched.candidates if (c.method, c.setting) == ("topk", "density=0.1")
    )
    for world in (1, 32.0, "32", True):
        with pytest.raises(ValueError, match="world"):
            adv.advise(model, loss_of, world=world, **options)
    with pytest.raises(ValueError, match="world: .* launch 2 or more"):
        adv.advise(model, loss_of, world=8, **dict(options, ranks=OneRank()))

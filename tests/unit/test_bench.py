"""Smoke test of the benchmark harness: it runs end to end on tiny shapes and writes its
outputs (no timing assertions: timings belong in docs/benchmarks/, not in tests)."""

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as bench
from benchmarks import batching, codec, controller_overhead, layouts
import hvd_compress as hc
from benchmarks.codec import HOOK, draws_ms, floor_ms, floor_model, measure_in_fresh_process
from benchmarks.harness.render import page, write_section
from benchmarks.shapes import parameter_count, shape_set

# Their jobs start ranks of their own: ci/test.sh runs them one at a time, after the parallel pass.
pytestmark = pytest.mark.serial


def test_shape_sets_match_the_published_parameter_counts():
    assert parameter_count(shape_set("resnet50")) == 25_557_032
    assert parameter_count(shape_set("bert-base")) == 109_482_240


def test_codec_quick_writes_json_figures_and_its_section(tmp_path, monkeypatch):
    write_section(tmp_path, "Other", "kept\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["codec", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "benchmarks" / "codec.json").read_text())
    methods = results["codec"]["tiny"]["methods"]
    assert {"torch powerSGD_hook", "PowerSGD", "ACP-SGD", "TopK", "QSGD"} <= set(methods)
    assert all(entry["step_ms"] > 0 for entry in methods.values())
    assert results["throughput"]["bandwidth_bytes_per_s"] > 0 and results["throughput"]["gemm_flops_per_s"] > 0
    assert all(methods[label]["floor"]["floor_ms"] > 0 for label in ["PowerSGD", "ACP-SGD", "TopK", "QSGD"])
    shares = methods["QSGD"]["operators"]
    assert len(shares["largest"]) == 3 and sum(s for _, s in shares["largest"]) + shares["rest"] == pytest.approx(1)
    for png in ["codec_cost.png", "topk_selection.png"]:
        assert (tmp_path / "benchmarks" / png).stat().st_size > 0
    text = page(tmp_path, "Codec cost").read_text()
    assert page(tmp_path, "Other").read_text() == "# Other\n\nkept\n"
    assert text.startswith("# Codec cost\n") and text.count("# Codec cost") == 1 and "](codec_cost.png)" in text
    assert "python -m benchmarks codec --quick" in text and "| x floor |" in text and "| largest operators |" in text
    # A second run rewrites the page instead of appending to it.
    assert bench.main(["codec", "--quick", "--out", str(tmp_path)]) == 0
    assert page(tmp_path, "Codec cost").read_text().count("# Codec cost") == 1
    # How the codecs ran is said only where the run recorded it: older runs (a fresh result per layer) did not.
    assert "run as the integrations run it" in page(tmp_path, "Codec cost").read_text()
    results["options"].pop("results_in_gradients")
    (tmp_path / "benchmarks" / "codec.json").write_text(json.dumps(results))
    codec.render(tmp_path)
    assert "run as the integrations run it" not in page(tmp_path, "Codec cost").read_text()


@pytest.mark.slow
def test_codec_quick_compiled_times_both_paths_in_one_process(tmp_path, monkeypatch):
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["codec", "--quick", "--compiled", "--out", str(tmp_path)]) == 0
    entry = json.loads((tmp_path / "benchmarks" / "codec.json").read_text())["codec"]["tiny"]
    assert entry["methods"]["QSGD compiled"]["step_ms"] > 0
    assert entry["methods"]["QSGD compiled"]["compile_seconds_each_round"][0] > 0
    assert set(entry["interleaved"]) == {"QSGD", "QSGD compiled", "TopK", "TopK compiled"}
    assert entry["interleaved"]["QSGD compiled"]["compile_seconds"] > 0
    assert "| shape set | method | eager | compiled | compiled / eager |" in page(tmp_path, "Codec cost").read_text()


def test_codec_floor_counts_each_methods_least_bytes_and_flops():
    """By hand: a 32 x 64 matrix (2,048 entries, compressed) and a 16-entry bias (sent whole:
    read and written once, 128 bytes). Error feedback reads and writes the residual too (16
    bytes an entry); the payload is written once and read once (none of these four needs a
    marker of its input: each payload carries the input's non-finite entries)."""
    shapes = [("w", (32, 64)), ("b", (16,))]

    def model(name, label, **settings):
        return floor_model(label, hc.COMPRESSORS[name].build(**settings), shapes)

    # Rank 2: P 32 x 2 and Q 64 x 2 are 768 bytes; P = M Q, Q = M^T P, the residual M - P Q^T
    # (this rank's factors) and the decompression (the mean's): 4 x 2 x 32 x 64 x 2.
    # Its operators pass over the matrix 8 times (4 bytes an entry each), beside the floor.
    assert model("powersgd", "PowerSGD", rank=2) == {
        "bytes": 16 * 2048 + 2 * 768 + 128,
        "flops": 32_768,
        "random_words": 0,
        "operator_bytes": 32 * 2048 + 2 * 768 + 128,
    }
    # Without error feedback, no residual: neither its bytes nor its product (nor the operators' bound).
    assert model("powersgd", "PowerSGD", rank=2, error_feedback=False) == {
        "bytes": 8 * 2048 + 2 * 768 + 128,
        "flops": 24_576,
        "random_words": 0,
    }
    # ACP-SGD sends P or Q (half of both on average): one projection, the residual, the decompression.
    assert model("acpsgd", "ACP-SGD", rank=2) == {
        "bytes": 16 * 2048 + 2 * 384 + 128,
        "flops": 24_576,
        "random_words": 0,
        "operator_bytes": 28 * 2048 + 2 * 384 + 128,
    }
    # k = 512 float32 values and int32 indices.
    assert model("topk", "TopK", density=0.25) == {"bytes": 16 * 2048 + 2 * 4096 + 128, "flops": 0, "random_words": 0}
    # No error feedback; 4-bit codes (1,024 bytes) and 4 bucket norms (16 bytes); a random 64-bit
    # word for every four entries it compresses (beside the floor, not in it).
    assert model("qsgd", "QSGD", bits=4) == {"bytes": 8 * 2048 + 2 * 1040 + 128, "flops": 0, "random_words": 512}
    # The larger of moving the bytes and doing the flops.
    speed = {"bandwidth_bytes_per_s": 1e9, "gemm_flops_per_s": 1e6}
    assert floor_ms({"bytes": 2e6, "flops": 1e3}, speed) == pytest.approx(2.0)
    assert floor_ms({"bytes": 2e6, "flops": 1e4}, speed) == pytest.approx(10.0)
    assert draws_ms({"random_words": 3e6}, {"random_words_per_s": 1e9}) == pytest.approx(3.0)


def test_codec_operators_counts_every_compressor_alone(tmp_path, monkeypatch):
    """``--operators`` runs only the operator counts (no timings) and writes its own page."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["codec", "--operators", "--quick", "--out", str(tmp_path)]) == 0
    entry = json.loads((tmp_path / "benchmarks" / "codec-operators.json").read_text())["operators"]["tiny"]
    assert {"PowerSGD", "ACP-SGD", "TopK", "QSGD"} <= set(entry["per_step"])
    assert all(counts["all"] >= counts["not_views"] > 0 for counts in entry["per_step"].values())
    assert entry["error_rows"]["PowerSGD"]["layers"] > 0
    assert not (tmp_path / "benchmarks" / "codec.json").exists()
    assert page(tmp_path, "Codec operators per step").read_text().startswith("# Codec operators per step\n")


def test_the_gpu_section_sets_each_step_against_its_operators(tmp_path, monkeypatch):
    """``codec.render`` rewrites the GPU's section from its JSON (here a CPU run
    relabelled, since CI has no GPU), with the time per operator that ``--operators`` counted."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["codec", "--operators", "--quick", "--out", str(tmp_path)]) == 0
    assert bench.main(["codec", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "benchmarks" / "codec.json").read_text())
    results["options"]["device"], results["machine"]["gpu"] = "cuda", "a GPU"
    (tmp_path / "benchmarks" / "codec-cuda.json").write_text(json.dumps(results))
    codec.render(tmp_path)
    section = page(tmp_path, "Codec cost on a GPU").read_text()
    assert section.startswith("# Codec cost on a GPU\n")
    assert "Time per operator" in section and "| tiny | QSGD |" in section
    assert "--out" not in section and (tmp_path / "benchmarks" / "codec_cost-cuda.png").exists()


def test_batching_quick_writes_its_section_and_counts_operators_per_shape(tmp_path):
    assert bench.main(["batching", "--quick", "--out", str(tmp_path)]) == 0
    assert page(tmp_path, "Same-shape batching").read_text().startswith("# Same-shape batching\n")
    row = json.loads((tmp_path / "benchmarks" / "batching.json").read_text())["sets"]["tiny"]
    # QR, P = M Q and the residual: per layer one at a time, per shape batched; the decompression
    # per layer either way (each result goes to its own gradient).
    assert row["per_layer_operators"] == 4 * row["layers"]
    assert row["batched_operators"] == 3 * row["shapes"] + row["layers"]
    # No two tiny matrices share a shape: no bucket group to time; the whole step is timed both ways.
    results = json.loads((tmp_path / "benchmarks" / "batching.json").read_text())
    assert results["command"] == "python -m benchmarks batching --quick"
    assert results["bucket_groups"] == {"tiny": []}
    assert results["whole_steps"]["tiny"]["off_ms"] > 0 and results["whole_steps"]["tiny"]["on_ms"] > 0
    path = tmp_path / "benchmarks" / "batching.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), notes=["A note kept in the JSON."])))
    batching.render(tmp_path)
    assert "A note kept in the JSON." in page(tmp_path, "Same-shape batching").read_text()


def test_layouts_quick_times_every_form_at_every_rank_and_rewrites_its_section(tmp_path):
    assert bench.main(["layouts", "--quick", "--ranks", "1,2,4", "--out", str(tmp_path)]) == 0
    assert page(tmp_path, "Low-rank products by layout").read_text().startswith("# Low-rank products by layout\n")
    path = tmp_path / "benchmarks" / "layouts.json"
    assert json.loads(path.read_text())["command"] == "python -m benchmarks layouts --quick --ranks 1,2,4"
    shape = json.loads(path.read_text())["shapes"]["small"]
    assert [row["rank"] for row in shape["projection"]] == [1, 2, 4]
    assert all(
        row["row_major_ms"] > 0 and row["column_major_ms"] > 0 and row["transposed_ms"] > 0
        for row in shape["projection"]
    )
    # On a CPU the codecs' product takes M Q at rank 1 and the transposed form at ranks 2-4.
    assert [row["codecs_form"] for row in shape["projection"]] == ["direct", "transposed", "transposed"]
    assert shape["decompression"]["mm_out_ms"] > 0
    results = json.loads(path.read_text())
    path.write_text(json.dumps(dict(results, notes=["A note kept in the JSON."])))
    layouts.render(tmp_path)
    assert "A note kept in the JSON." in page(tmp_path, "Low-rank products by layout").read_text()


def test_controller_overhead_quick_measures_every_controller_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["controller_overhead", "--quick", "--out", str(tmp_path)]) == 0
    path = tmp_path / "benchmarks" / "controller_overhead.json"
    points = json.loads(path.read_text())["points"]
    assert set(points) == {
        f"tiny/{m}" for m in ["PowerSGD rank 4", "ACP-SGD rank 4", "Top-K 1%", "QSGD 4 bits", "GraVAC"]
    }
    assert points["tiny/PowerSGD rank 4"]["same_settings_as_exact"] is True
    assert set(points["tiny/Top-K 1%"]["stall_seconds"]) == {
        "default, apply_delay 10",
        "default, auto",
        "short, apply_delay 1",
        "short, auto",
    }
    assert page(tmp_path, "Controller overhead").read_text().startswith("# Controller overhead\n")
    before = path.read_text()
    assert json.loads(before)["command"] == "python -m benchmarks controller_overhead --quick"
    assert bench.main(["controller_overhead", "--quick", "--out", str(tmp_path)]) == 0
    assert json.loads(path.read_text())["points"] == json.loads(before)["points"]  # nothing re-ran


@pytest.mark.slow
def test_decision_cost_quick_times_both_decisions_in_turn_and_rewrites_its_section(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["controller_overhead", "--decision-cost", "--quick", "--out", str(tmp_path)]) == 0
    path = tmp_path / "benchmarks" / "decision_cost.json"
    point = json.loads(path.read_text())["points"]["tiny"]
    for kind in ("lgreco", "exact"):
        assert len(point[kind]) == 1 and point[kind][0]["seconds"] > 0 and point[kind][0]["cpu_seconds"] > 0
    assert point["same_settings_every_round"] is True and point["layers_decided"] > 0
    text = page(tmp_path, "L-GreCo decision cost").read_text()
    assert text.startswith("# L-GreCo decision cost\n") and "controller_overhead --decision-cost" in text
    results = json.loads(path.read_text())
    path.write_text(json.dumps(dict(results, notes=["A note kept in the JSON."])))
    controller_overhead.render(tmp_path)
    assert "A note kept in the JSON." in page(tmp_path, "L-GreCo decision cost").read_text()


def test_unknown_benchmark_prints_usage(capsys):
    assert bench.main(["nope"]) == 2
    assert "codec" in capsys.readouterr().err


def test_a_rerun_rewrites_only_its_page_keeps_its_notes_and_the_summary_lists_every_page(tmp_path):
    from benchmarks.harness.render import notes_lines, resumed_section

    def markdown(results):
        lines = ["Command: `python -m benchmarks codec`", "", f"Runs: {results['runs']}."]
        return "\n".join(lines + notes_lines(results)) + "\n"

    summary = tmp_path / "benchmarks.md"
    summary.write_text("# Benchmarks\n\nWritten by hand, above the list.\n")
    results, save = resumed_section(tmp_path, "codec", "Codec cost", markdown)
    results["runs"] = 1
    save()
    write_section(
        tmp_path, "Projection", "`python -m benchmarks projection`\n\n| target | met |\n|---|---|\n| a | yes |\n"
    )
    write_section(tmp_path, "Other", "Target: b: NOT met; c: met.\n")
    summary.write_text(summary.read_text() + "\nWritten by hand, below the list.\n")
    others = {heading: page(tmp_path, heading).read_text() for heading in ("Projection", "Other")}
    # A note is written into the JSON record, where a rerun finds it.
    record = tmp_path / "benchmarks" / "codec.json"
    record.write_text(json.dumps(dict(json.loads(record.read_text()), notes=["Note: written by hand."])))
    results, save = resumed_section(tmp_path, "codec", "Codec cost", markdown)
    results["runs"] = 2
    save()
    text = page(tmp_path, "Codec cost").read_text()
    assert text == "# Codec cost\n\nCommand: `python -m benchmarks codec`\n\nRuns: 2.\n\nNote: written by hand.\n"
    assert {heading: page(tmp_path, heading).read_text() for heading in others} == others
    assert sorted(path.name for path in (tmp_path / "benchmarks").glob("*.md")) == [
        "codec-cost.md",
        "other.md",
        "projection.md",
    ]
    text = summary.read_text()
    assert text.startswith("# Benchmarks\n\nWritten by hand, above the list.\n\n<!--")
    assert text.endswith("-->\n\nWritten by hand, below the list.\n")
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert rows == [
        f"| [Codec cost](benchmarks/codec-cost.md) | {bench.BENCHMARKS['codec']} | — | `python -m benchmarks codec` |",
        "| [Other](benchmarks/other.md) |  | 1 of 2 |  |",
        f"| [Projection](benchmarks/projection.md) | {bench.BENCHMARKS['projection']} | 1 of 1 "
        "| `python -m benchmarks projection` |",
    ]


def test_the_summary_lists_every_page_of_the_docs_as_the_pages_state_them(tmp_path):
    """docs/benchmarks.md as ``write_index`` writes it from the pages: a page renamed, added or
    rewritten by hand shows here until the list is rewritten."""
    from benchmarks.harness.render import DOCS, write_index

    (tmp_path / "benchmarks").mkdir()
    for path in (DOCS / "benchmarks").glob("*.md"):
        (tmp_path / "benchmarks" / path.name).write_text(path.read_text())
    (tmp_path / "benchmarks.md").write_text((DOCS / "benchmarks.md").read_text())
    write_index(tmp_path)
    text = (DOCS / "benchmarks.md").read_text()
    assert (tmp_path / "benchmarks.md").read_text() == text
    for path in (DOCS / "benchmarks").glob("*.md"):
        title = path.read_text().splitlines()[0].removeprefix("# ")
        assert text.count(f"| [{title}](benchmarks/{path.name}) |") == 1, path


@pytest.mark.slow
def test_report_renders_every_page_of_the_docs_from_its_json_as_stored(tmp_path, monkeypatch):
    """``python -m benchmarks report`` into a copy of docs/: every page and figure of
    docs/benchmarks/ is rewritten from the JSON beside it, and the pages and the summary come out as
    stored (a figure's bytes depend on matplotlib's build, so of those only the rewriting counts)."""
    import os
    import shutil

    from benchmarks.harness.render import DOCS

    shutil.copytree(DOCS / "benchmarks", tmp_path / "benchmarks")
    shutil.copy(DOCS / "benchmarks.md", tmp_path / "benchmarks.md")
    written = sorted([*(tmp_path / "benchmarks").glob("*.md"), *(tmp_path / "benchmarks").glob("*.png")])
    for path in written:
        os.utime(path, (0, 0))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["report", "--out", str(tmp_path)]) == 0
    assert [path.name for path in written if path.stat().st_mtime == 0] == []
    for path in [tmp_path / "benchmarks.md", *(p for p in written if p.suffix == ".md")]:
        assert path.read_text() == (DOCS / path.relative_to(tmp_path)).read_text(), path.name


def test_verdicts_count_met_columns_before_target_columns_and_target_lines():
    from benchmarks.harness.render import verdicts

    page_text = "\n".join(
        [
            "| shape | x floor | target |",
            "|---|---|---|",
            "| a | 3.0x | missed |",
            "",
            "| target | value | met |",
            "|---|---|---|",
            "| a / floor | 3.0 | no |",
            "| a / hook | 0.4 | yes |",
            "| b | 0.4 | **NO** |",
            "| c | - | - |",
            "",
            "Targets: d 1.1 s met, e 1.2 s NOT met; f: missed (1.6x).",
            "Said in passing: g met.",
        ]
    )
    assert verdicts(page_text) == {True: 2, False: 4}
    assert verdicts("| shape | target |\n|---|---|\n| a | met |\n| b | missed |\n") == {True: 1, False: 1}
    assert not verdicts("No target here.\n")


def test_benchmarks_are_outside_the_installed_package():
    import hvd_compress

    assert not hasattr(hvd_compress, "bench") and not hasattr(hvd_compress, "workloads")
    package = Path(hvd_compress.__file__).parent
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert "from benchmarks" not in text and "import benchmarks" not in text, path


def test_full_runs_measure_each_method_in_a_fresh_process():
    options = argparse.Namespace(rank=2, density=0.01, bits=4, repeats=1, device="cpu")
    timed = measure_in_fresh_process("tiny", HOOK, options)
    assert len(timed["cycles"]) == 1 and timed["cycles"][0] > 0


@pytest.mark.slow
def test_convergence_quick_trains_every_method_under_mpirun_and_writes_its_section(tmp_path, monkeypatch):
    from benchmarks.convergence import METHODS

    write_section(tmp_path, "Convergence", "stale\n")
    write_section(tmp_path, "Other", "kept\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    # A hang fails in two minutes, not the default five per job.
    assert bench.main(["convergence", "--quick", "--job-timeout", "120", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "benchmarks" / "convergence.json").read_text())
    assert set(results["workloads"]) == {"digits", "charlm"}
    for workload in results["workloads"].values():
        methods = workload["methods"]
        assert list(methods) == METHODS
        assert all(record["steps"] > 0 and record["world_size"] == 2 for record in methods.values())
        # Counted bytes: every compressor sent fewer than a float32 all-reduce would have.
        assert all(record["compression_ratio"] > 1 for name, record in methods.items() if name != "uncompressed")
    assert 0 <= results["workloads"]["digits"]["methods"]["uncompressed"]["metric"] <= 1
    assert results["workloads"]["charlm"]["methods"]["uncompressed"]["metric"] > 1  # a perplexity
    assert (tmp_path / "benchmarks" / "convergence.png").stat().st_size > 0
    text = page(tmp_path, "Convergence").read_text()
    assert text.startswith("# Convergence\n") and text.count("# Convergence") == 1 and "stale" not in text
    assert page(tmp_path, "Other").read_text() == "# Other\n\nkept\n"
    assert "python -m benchmarks convergence --quick" in results["command"]
    assert "](convergence.png)" in text


@pytest.mark.slow
def test_quality_quick_runs_a_point_per_method_resumes_and_writes_its_section(tmp_path, benchmark_runs):
    from benchmarks.quality import sweep_points

    options = ["quality", "--quick", "--workloads", "charlm", "--job-timeout", "120", "--out", str(tmp_path)]
    benchmark_runs.run(options)
    path = tmp_path / "benchmarks" / "quality.json"
    points = json.loads(path.read_text())["points"]
    expected = {spec["key"] for spec in sweep_points("charlm", quick=True)}
    assert set(points) == expected
    families = {entry["spec"]["family"] for entry in points.values()}
    assert {"uncompressed", "FP16", "PowerSGD", "L-GreCo (Top-K)", "GraVAC (Top-K)", "ScaleCom"} <= families
    assert all(0 < entry["record"]["wire_bytes"] <= entry["record"]["dense_wire_bytes"] for entry in points.values())
    text = page(tmp_path, "Quality against bytes").read_text()
    assert (
        text.startswith("# Quality against bytes\n")
        and text.count("# Quality against bytes") == 1
        and "| claim | met | numbers |" in text
    )
    assert (tmp_path / "benchmarks" / "quality.png").stat().st_size > 0
    benchmark_runs.resumes(options, path)


@pytest.mark.slow
def test_endtoend_on_the_testbed_then_its_projection(tmp_path, monkeypatch):
    from benchmarks.testbed import NetworkNamespacesUnavailable

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    endtoend = [
        "endtoend",
        "--np",
        "2",
        "--rates",
        "1,2.5",
        "--models",
        "cnn",
        "--methods",
        "S-SGD,ACP-SGD+fusion",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--max-other-cpu",
        "1",
        "--job-timeout",
        "120",
        "--out",
        str(tmp_path),
    ]
    try:
        assert bench.main(endtoend) == 0
    except NetworkNamespacesUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")
    results = json.loads((tmp_path / "benchmarks" / "endtoend.json").read_text())
    methods = results["rates"]["2.5"]["models"]["cnn"]
    dense = 4 * results["models"]["cnn"]["parameters"]
    # Counted by the kernel: S-SGD's ring all-reduce sends about the gradient's size at np 2,
    # ACP-SGD a small fraction of it.
    assert 0.95 * dense < methods["S-SGD"]["sent_bytes_per_step"] < 1.2 * dense
    assert methods["ACP-SGD+fusion"]["sent_bytes_per_step"] < 0.1 * dense
    assert methods["ACP-SGD+fusion"]["traffic"]["by_collective"]["allreduce"]["calls"] > 0
    # Cut off before the last job: the same command resumes with that job alone.
    progress = tmp_path / "benchmarks" / "endtoend.progress.json"
    assert not progress.exists()
    del methods["ACP-SGD+fusion"]
    progress.write_text(json.dumps(results))
    assert bench.main(endtoend) == 0
    resumed = json.loads((tmp_path / "benchmarks" / "endtoend.json").read_text())
    assert resumed["rates"]["1"] == results["rates"]["1"]
    assert resumed["rates"]["2.5"]["models"]["cnn"]["S-SGD"] == methods["S-SGD"]
    assert "ACP-SGD+fusion" in resumed["rates"]["2.5"]["models"]["cnn"] and not progress.exists()
    assert (
        bench.main(["projection", "--from", str(tmp_path / "benchmarks" / "endtoend.json"), "--out", str(tmp_path)])
        == 0
    )
    projection = json.loads((tmp_path / "benchmarks" / "projection.json").read_text())
    assert projection["alpha_us"] >= 0 and 0 < projection["efficiency"] <= 1.5
    text = page(tmp_path, "End to end").read_text()
    assert text.startswith("# End to end\n") and text.count("# End to end") == 1 and "](endtoend.png)" in text
    text = page(tmp_path, "Projection").read_text()
    assert text.startswith("# Projection\n") and text.count("# Projection") == 1 and "](projection.png)" in text
    for png in ["endtoend.png", "projection.png"]:
        assert (tmp_path / "benchmarks" / png).stat().st_size > 0


@pytest.mark.slow
def test_ddp_quick_times_and_trains_its_methods_under_torchrun(tmp_path, monkeypatch):
    # Plain DDP, torch's hook and ACP-SGD, what the section's target compares: each method is a
    # torchrun job or two, and every method's DDP exchange is tested in tests/ddp.
    from benchmarks.ddp import HOOK, HOOK_ONE_BUCKET

    methods = ["DDP", HOOK, "ACP-SGD"]
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    argv = ["ddp", "--quick", "--methods", ",".join(methods), "--job-timeout", "120", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "benchmarks" / "ddp.json").read_text())
    assert list(results["timing"]["cnn"]) == methods == list(results["digits"])
    # torch's own powerSGD_hook may fail over Gloo (benchmarks/ddp.py says why); it is then
    # recorded with its error. This project's methods must run.
    timing = results["timing"]["cnn"]
    failed = {method: entry["failed"] for method, entry in timing.items() if "failed" in entry}
    assert set(failed) <= {HOOK, HOOK_ONE_BUCKET}, f"timing jobs failed: {failed}"
    assert all(entry["step_ms"]["median"] > 0 for method, entry in timing.items() if method not in failed)
    assert all(0 <= accuracy <= 1 for accuracy in results["digits"].values())
    text = page(tmp_path, "PyTorch DDP").read_text()
    assert text.startswith("# PyTorch DDP\n") and "python -m benchmarks ddp --quick" in text and "Targets:" in text


def test_repeated_timing_jobs_pool_their_steps_and_keep_a_failure_apart():
    from benchmarks.harness.stats import jobs_of, pooled

    def job(ms, codec=None):
        entry = {
            "step_ms": {"median": ms},
            "step_ms_each": [ms] * 3,
            "compute_ms": ms / 2,
            "wall_seconds": 1.0,
            "disturbed_attempts": 0,
        }
        return dict(entry, codec_ms=codec) if codec is not None else entry

    first = pooled(None, job(200.0, codec=30.0))
    both = pooled(first, job(220.0, codec=40.0))
    assert jobs_of(None) == 0 and jobs_of(job(1.0)) == 1 and both["jobs"] == 2
    assert both["job_medians_ms"] == [200.0, 220.0] and both["step_ms"]["median"] == 210.0
    assert (
        both["compute_ms"] == 105.0 and both["codec_ms"] == 35.0 and both["step_ms_each"] == [200.0] * 3 + [220.0] * 3
    )
    # A failed job counts as a job; the successful ones stay the entry's numbers.
    failed = pooled(both, {"failed": "Connection reset by peer"})
    assert failed["jobs"] == 3 and failed["failed_jobs"] == 1 and failed["step_ms"] == both["step_ms"]
    assert "failed" not in pooled({"failed": "x"}, job(210.0)) and pooled({"failed": "x"}, {"failed": "y"})["jobs"] == 2
    # An FSDP job: no compute time, a load average (the largest kept) and a CPU share that may be unknown.
    fsdp = [
        {
            "step_ms": {"median": ms},
            "step_ms_each": [ms],
            "wall_seconds": 2.0,
            "load_average": load,
            "other_cpu_share": share,
        }
        for ms, load, share in ((1400.0, 4.4, None), (1500.0, 6.8, 0.01))
    ]
    pooled_fsdp = pooled(pooled(None, fsdp[0]), fsdp[1])
    assert "compute_ms" not in pooled_fsdp and pooled_fsdp["load_average"] == 6.8
    assert pooled_fsdp["other_cpu_share"] == 0.01 and pooled_fsdp["wall_seconds"] == 4.0


# A stand-in for Horovod's test/ folder: the harness's plumbing, without Horovod's file (which
# the sdist lacks and which is fetched from GitHub). One test passes with any compressor, one
# asserts an exact value that a lossy compressor changes.
STAND_IN = '''
import unittest
import torch
import horovod.torch as hvd


class TorchTests(unittest.TestCase):
    def test_optimizer_runs(self):
        hvd.init()
        model = torch.nn.Linear(64, 64)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(torch.ones(2, 64)).sum().backward()
        opt.step()

    def test_optimizer_exact_gradient(self):
        hvd.init()
        model = torch.nn.Linear(64, 64, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        loss = (model(torch.randn(2, 64, generator=torch.Generator().manual_seed(hvd.rank()))) ** 2).sum()
        # Not model.weight.grad after backward(): Horovod reduces it in place, asynchronously,
        # so a clone there races the reduction. autograd.grad runs no accumulation hook.
        raw, = torch.autograd.grad(loss, model.weight, retain_graph=True)
        loss.backward()
        opt.synchronize()
        assert torch.allclose(model.weight.grad, hvd.allreduce(raw, name="raw"), atol=1e-6)

    def test_not_an_optimizer_test(self):
        pass
'''


@pytest.mark.slow
def test_horovod_suite_injects_each_compressor_on_both_paths_and_resumes(tmp_path):
    tests = tmp_path / "test"
    (tests / "parallel").mkdir(parents=True)
    (tests / "parallel" / "test_torch.py").write_text(STAND_IN)
    args = [
        "horovod_suite",
        "--tests",
        str(tests),
        "--methods",
        "horovod,powersgd",
        "--out",
        str(tmp_path),
        "--timeout",
        "300",
    ]
    assert bench.main(args) == 0
    results = json.loads((tmp_path / "benchmarks" / "horovod_suite.json").read_text())
    assert sorted(results) == ["horovod", "powersgd stock", "powersgd wrapper"]
    assert results["horovod"]["outcomes"] == {
        "test_optimizer_exact_gradient": "passed",
        "test_optimizer_runs": "passed",
    }
    for job in ("powersgd stock", "powersgd wrapper"):  # injected: rank 2 of 64 x 64 is not exact
        assert results[job]["outcomes"] == {
            "test_optimizer_exact_gradient": "failed",
            "test_optimizer_runs": "passed",
        }, results[job]
    text = page(tmp_path, "Horovod's own optimizer tests").read_text()
    assert "| `test_optimizer_runs` | passed | passed | passed |" in text
    assert bench.main(args) == 0  # resumed: nothing to run again


@pytest.mark.slow
def test_fsdp_quick_times_and_trains_hsdp_with_and_without_a_controller_and_resumes(tmp_path, monkeypatch):
    # Two of the four methods: plain HSDP and L-GreCo (a controller over ACP-SGD through
    # hvd_compress.fsdp); each job is a 4-rank torchrun launch, and CI time matters.
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    argv = ["fsdp", "--quick", "--methods", "HSDP,L-GreCo", "--job-timeout", "120", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    path = tmp_path / "benchmarks" / "fsdp.json"
    results = json.loads(path.read_text())
    assert list(results["timing"]["cnn"]) == ["HSDP", "L-GreCo"] == list(results["quality"])
    failed = {method: entry["failed"] for method, entry in results["timing"]["cnn"].items() if "failed" in entry}
    assert not failed, f"timing jobs failed: {failed}"
    assert all(entry["step_ms"]["median"] > 0 for entry in results["timing"]["cnn"].values())
    assert all(perplexity["0"] > 1 for perplexity in results["quality"].values())
    text = page(tmp_path, "FSDP2 / HSDP on the emulated cluster").read_text()
    assert text.startswith("# FSDP2 / HSDP on the emulated cluster\n") and "python -m benchmarks fsdp --quick" in text
    before = path.read_text()
    assert bench.main(argv) == 0  # resumes: nothing left to run
    assert json.loads(path.read_text())["timing"] == json.loads(before)["timing"]


def test_claims_protocol_searches_anchors_then_plans_lgreco_and_resumes(tmp_path, monkeypatch):
    """The protocol's driver with jobs faked: the anchor search runs each setting at 3 seeds from
    the least aggressive and stops at the first over 1% above uncompressed; L-GreCo and its
    ablations follow at the anchor; the report names the claims; a rerun runs nothing."""
    from benchmarks import claims

    metric = {
        "uncompressed": 100.0,
        "PowerSGD": lambda rank: 100 + 4 / rank,
        "Top-K": lambda density: 100 + 0.1 / density,
    }
    ran = []

    def fake_job(module, job, np, timeout, prefix, what, expected=None):
        ran.append(job["key"])
        family, settings = job["family"], job["settings"]
        value = metric[family](*settings.values()) if family in ("PowerSGD", "Top-K") else 99.5
        value = metric["uncompressed"] if family == "uncompressed" else value
        if job["workload"] == "charlm" and family.startswith("L-GreCo"):  # on its uniform curve, half the bytes
            value = metric[family[len("L-GreCo (") : -1]](*settings.values())
        value += 0.1 * (job["seed"] - 1)
        sent = 1e6 / (2 if "L-GreCo" in family else 1)
        return [
            {
                "key": job["key"],
                "metric": value,
                "steps": job["steps"],
                "wire_bytes": 100 * sent,
                "wire_bytes_per_step_after": sent,
                "dense_wire_bytes_per_step": 4e6,
                "job_seconds": 1.0,
            }
        ]

    monkeypatch.setattr(claims, "mpirun_job", fake_job)
    monkeypatch.setattr(sys, "argv", ["python -m benchmarks claims"])
    monkeypatch.setattr(claims, "CHAR_ANCHORS", {"PowerSGD": 8})
    monkeypatch.setattr(claims, "epoch_steps", lambda lm: 100)
    draw = claims.draw_figure
    monkeypatch.setattr(claims, "draw_figure", lambda *_: None)  # once at the end, below
    claims.main(["--out", str(tmp_path)])
    labels = {key.split("/")[1] for key in ran}
    assert {"PowerSGD rank 16", "PowerSGD rank 4", "PowerSGD rank 2", "Top-K density 0.03"} <= labels
    assert "PowerSGD rank 1" not in labels and "Top-K density 0.01" not in labels  # the search stopped
    assert {
        "L-GreCo (PowerSGD) rank 4",
        "L-GreCo (Top-K) density 0.1",
        "L-GreCo (PowerSGD) rank 4, raw error, whole period",
        "ScaleCom (paper's regime)",
    } <= labels
    assert ran.index("wordlm/L-GreCo (PowerSGD) rank 4/seed 2") < ran.index("wordlm/Top-K density 0.3/seed 0")
    assert ran.index("wordlm/L-GreCo (Top-K) density 0.1/seed 2") < ran.index("wordlm/ScaleCom (paper's regime)/seed 0")
    assert set(collections.Counter(key.split("/seed")[0] for key in ran).values()) == {3}  # every point, 3 seeds
    text = page(tmp_path, "L-GreCo protocol on the word LM").read_text()
    assert text.startswith("# L-GreCo protocol on the word LM\n") and "Partial" not in text
    assert "| Word LM: L-GreCo over PowerSGD rank 4: equal quality at >= 1.5x fewer bytes per step | yes |" in text
    # The anchor-free verdict: at equal quality the uniform curve sends twice L-GreCo's bytes.
    verdict = (
        "| Char LM: L-GreCo over {}: the uniform curve needs >= {}x its bytes per step at its quality | {} | 2.00x"
    )
    assert (
        verdict.format("PowerSGD rank 4", 1.5, "yes") in text and verdict.format("Top-K density 0.1", 2.5, "NO") in text
    )
    monkeypatch.setattr(claims, "draw_figure", draw)
    claims.render(tmp_path)
    assert (tmp_path / "benchmarks" / "claims.png").stat().st_size > 0
    monkeypatch.setattr(claims, "draw_figure", lambda *_: None)
    ran.clear()
    claims.main(["--out", str(tmp_path)])
    assert ran == []


def test_uniform_bytes_at_interpolates_in_log_bytes_and_never_extrapolates():
    """The anchor-free verdict's reading of a uniform curve: log bytes linear in perplexity
    between the neighbouring settings; None beyond either end; the fewest-bytes crossing where
    noise makes the curve non-monotone."""
    from benchmarks.claims import uniform_bytes_at

    curve = [(2e5, 4.85), (4e4, 5.0), (1e5, 4.9)]  # any order
    assert uniform_bytes_at(curve, 4.95) == pytest.approx(math.sqrt(4e4 * 1e5))
    assert uniform_bytes_at(curve, 5.0) == pytest.approx(4e4)
    assert uniform_bytes_at(curve, 4.85) == pytest.approx(2e5)
    assert uniform_bytes_at(curve, 5.01) is None and uniform_bytes_at(curve, 4.84) is None
    assert uniform_bytes_at([(1.0, 5.0), (2.0, 4.8), (4.0, 4.9)], 4.85) == pytest.approx(2**0.75)
    assert uniform_bytes_at([(1.0, 5.0), (2.0, 5.0)], 5.0) == 1.0


def test_claims_at_gpu_scale_asks_every_candidate_at_once_and_runs_lgreco_where_no_anchor_holds(tmp_path, monkeypatch):
    """The GPU scale's driver with torchrun jobs faked, 4 side by side: every candidate setting
    is asked for before any finishes; where none lies within 1% of uncompressed, L-GreCo still
    runs at the least aggressive one and the claim table says both; no character-LM rows."""
    from benchmarks import claims

    ran, slots = [], set()

    def fake_torchrun(argv, nproc, timeout, prefix, master_port=None, **_):
        job = json.loads(argv[argv.index("--worker") + 1])
        ran.append(job["key"])
        slots.add(master_port)
        assert job["backend"] == "ddp" and job["device"] == "cuda" and nproc == 2
        value = 100.0 if job["family"] == "uncompressed" else 105.0  # every setting 5% off
        return [
            {
                "key": job["key"],
                "metric": value + 0.1 * job["seed"],
                "steps": job["steps"],
                "wire_bytes": 1e8,
                "wire_bytes_per_step_after": 1e6,
                "dense_wire_bytes_per_step": 4e6,
                "wall_seconds": 1.0,
            }
        ]

    monkeypatch.setattr(claims, "torchrun_job", fake_torchrun)
    monkeypatch.setattr(claims, "epoch_steps", lambda lm: 100)
    monkeypatch.setattr(claims, "draw_figure", lambda *_: None)
    claims.main(["--scale", "gpu", "--parallel", "4", "--out", str(tmp_path)])
    labels = {key.split("/")[1] for key in ran}
    assert {
        "PowerSGD rank 4",
        "Top-K density 0.01",
        "L-GreCo (PowerSGD) rank 16",
        "L-GreCo (Top-K) density 0.1",
    } <= labels
    assert not any(key.startswith("charlm") for key in ran) and len(slots) == 4
    text = page(tmp_path, "L-GreCo protocol on the word LM at larger scale (GPU)").read_text()
    assert text.startswith("# L-GreCo protocol on the word LM at larger scale (GPU)\n")
    assert "| Word LM: L-GreCo over PowerSGD | NO | no uniform setting within 1% of uncompressed |" in text
    assert "L-GreCo over PowerSGD rank 16: equal quality at >= 1.5x fewer bytes per step (that setting" in text
    assert json.loads((tmp_path / "benchmarks" / "claims_gpu.json").read_text())["scale"] == "gpu"


def test_advise_live_compares_each_point_with_endtoend_writes_its_section_and_resumes(tmp_path, monkeypatch):
    """advise_live's driver with the testbed and the advise job faked: each method's projection
    against the measured step, the recommendation's method against the fastest measured, each
    end-to-end file on its own (a rate one did not measure left without verdict), and a rerun
    runs nothing."""
    import contextlib

    from benchmarks import advise_live

    measured = {"S-SGD": 700.0, "FP16": 500.0, "PowerSGD": 300.0, "ACP-SGD": 250.0, "ScaleCom": 265.0}

    def endtoend(name, rates, scale):
        path = tmp_path / name
        runs = {
            method: {
                "step_ms": {"median": scale * ms},
                "compute_ms": 150.0,
                "codec_ms": 20.0,
                "exposed_comm_ms": scale * ms - 170.0,
            }
            for method, ms in measured.items()
        }
        path.write_text(
            json.dumps(
                {
                    "np": 4,
                    "rank": 4,
                    "command": f"python -m benchmarks endtoend {name}",
                    "load_average_before": [0.5, 0.5, 0.5],
                    "rates": {rate: {"models": {"cnn": runs}} for rate in rates},
                }
            )
        )
        return str(path)

    stored, again = endtoend("stored.json", ["1"], 1.0), endtoend("again.json", ["1", "10"], 2.0)
    # Projections: PowerSGD 25% over the stored step, the rest within 20%.
    projected = {
        ("none", ""): 720.0,
        ("fp16", ""): 520.0,
        ("powersgd", "rank=4"): 375.0,
        ("acpsgd", "rank=4"): 240.0,
        ("acpsgd", "rank=16"): 230.0,
        ("scalecom", "density=0.01"): 280.0,
    }
    ran = []

    def fake_point(cluster, model, timeout):
        ran.append((cluster.rate_gbit, model))
        candidates = [{"method": m, "setting": s, "step_ms": ms, "codec_ms": 20.0} for (m, s), ms in projected.items()]
        link = {"latency_s": 0.001, "bytes_per_s": 1e8, "measured": {"4096": 0.001, "1000000": 0.02}}
        advice = {
            "candidates": candidates,
            "recommendation": "compress with acpsgd rank=16: 720.0 -> 230.0 ms",
            "compute_ms": 150.0,
            "links": {"allreduce": link},
        }
        return {
            "command": "mpirun -np 4 python -m hvd_compress.advise",
            "testbed": "faked",
            "table": "THE TABLE",
            "advice": advice,
            "load_average_before": [0.5, 0.5, 0.5],
            "wall_seconds": 30.0,
            "other_cpu_seconds": 0.1,
        }

    @contextlib.contextmanager
    def fake_cluster(ranks, rate):
        yield argparse.Namespace(rate_gbit=rate, ranks=ranks)

    monkeypatch.setattr(advise_live, "advise_point", fake_point)
    monkeypatch.setattr(advise_live, "emulated_cluster", fake_cluster)
    monkeypatch.setattr(sys, "argv", ["python -m benchmarks advise_live"])
    options = ["--rates", "1,10", "--models", "cnn", "--from", f"{stored},{again}", "--out", str(tmp_path)]
    advise_live.main(options)
    assert ran == [(1.0, "cnn"), (10.0, "cnn")]
    points = json.loads((tmp_path / "benchmarks" / "advise_live.json").read_text())["points"]
    one = points["1/cnn"]["comparisons"][stored]
    assert [m["met"] for m in one["methods"]] == [True, True, False, True, True]
    assert (one["recommended_as"], one["setting_measured"], one["fastest"], one["met"]) == (
        "ACP-SGD",
        False,
        "ACP-SGD",
        True,
    )
    assert "met" not in points["10/cnn"]["comparisons"][stored]
    assert [m["met"] for m in points["10/cnn"]["comparisons"][again]["methods"]] == [False] * 5
    text = page(tmp_path, "advise live on the emulated cluster").read_text()
    assert text.startswith("# advise live on the emulated cluster\n") and "THE TABLE" in text
    assert "| 1 | cnn | 4 of 5 | **NO** | acpsgd rank=16 | no | ACP-SGD | 1.00 | yes |" in text
    assert "1 Gbit/s: steps within 20% NOT met, recommendation within 10% met; 10 Gbit/s: not measured" in text
    assert "| 1 | cnn | PowerSGD | rank=4 | 375.0 | 300.0 | 1.25 | 600.0 | 0.62 |" in text
    assert "| 1 | cnn | PowerSGD | 150 / 150 | 20 / 20 | 205 / 430 |" in text  # the parts against [2]
    assert "| 1 | cnn | 20 / 20 at 1.0 MB | - | - | - |" in text  # the link at its largest probe: as measured
    repeat = tmp_path / "repeat.json"
    repeat.write_text((tmp_path / "benchmarks" / "advise_live.json").read_text())
    advise_live.main(options + ["--repeat", str(repeat)])
    assert len(ran) == 2
    text = page(tmp_path, "advise live on the emulated cluster").read_text()
    assert (
        "| 1 | cnn | acpsgd rank=16 / acpsgd rank=16 | 720 / 720, 520 / 520, 375 / 375, 240 / 240, 280 / 280 |" in text
    )
    assert advise_live.recommended("do not compress: the link is fast enough") == ("none", "")


def test_time_to_quality_schedule_target_and_scores():
    from benchmarks import time_to_quality as ttq

    # Warmup-stable-decay: the peak until 80% of the length, then 1 - sqrt down.
    assert ttq.lr_factor(0, 1000, 300) == pytest.approx(1 / 300)
    assert ttq.lr_factor(799, 1000, 300) == 1.0
    assert ttq.lr_factor(800, 1000, 300) == 1.0 and ttq.lr_factor(900, 1000, 300) == pytest.approx(1 - 0.5**0.5)

    def run(label, seed, losses):
        return {
            "spec": {"label": label},
            "record": {
                "points": [{"length": length, "loss": loss} for length, loss in zip([1000, 2000, 4000], losses)]
            },
            "seed": seed,
        }

    base = [run("uncompressed", s, [2.0 + d, 1.8 + d, 1.75 + d]) for s, d in enumerate([0.0, 0.01, 0.02, 0.03, 0.04])]
    results = {"points": {f"u{i}": point for i, point in enumerate(base)}}
    goal = ttq.target_of(results, 5, 0.05)
    # 1000 -> 2000 gains 10%, 2000 -> 4000 under 5%: the knee is 2000; the target the worst seed there.
    assert goal["knee"] == 2000 and goal["knee_found"] and goal["cap"] == 4000
    assert goal["target"] == pytest.approx(1.84) and goal["median_at_knee"] == pytest.approx(1.82)
    assert ttq.target_of(results, 6, 0.05) is None  # a seed missing
    # Steps to target: interpolated in log(length) between the lengths around the target.
    record = {"points": [{"length": 1000, "loss": 2.0}, {"length": 4000, "loss": 1.8}]}
    assert ttq.steps_to_target(record, 1.9) == pytest.approx(2000)
    assert ttq.steps_to_target(record, 2.1) == 1000 and ttq.steps_to_target(record, 1.7) is None
    missed = {"points": [{"length": 1000, "loss": 2.2}, {"length": 4000, "loss": 1.95}]}
    scored = ttq.score([record, record, missed], 1.9)
    assert scored["median"] == pytest.approx(2000) and scored["reached"] == 2
    assert scored["trimmed_mean"] == pytest.approx(2000) and scored["best_missed_loss"] == 1.95
    assert ttq.score([record, missed, missed], 1.9)["median"] is None  # most seeds missed: not reached
    # 5 seeds for each point a target rests on, first; then 3 a compressed point, seed 0 of every
    # method first; then the outer sweep, one seed each.
    points = ttq.method_points(ttq.parse_args([]).plan)
    deciding, others = 5 * len(ttq.DECIDING), len(ttq.METHODS) - len(ttq.DECIDING)
    assert len(points) == deciding + 3 * others + len(ttq.OUTER_SWEEP)
    sweep = points[-len(ttq.OUTER_SWEEP) :]
    assert all(p["seed"] == 0 and p["controller"]["kind"] == "diloco" for p in sweep)
    assert {(p["controller"]["inner_steps"], p["controller"]["outer_lr"]) for p in sweep} >= {(10, 1.0), (50, 0.5)}
    assert {p["label"] for p in points[:deciding]} == set(ttq.DECIDING)
    assert [p["key"] for p in points[deciding - 6 : deciding]] == [
        "charlm/FP16/seed 4",
        "charlm/PowerSGD rank 8/seed 4",
        "charlm/ACP-SGD rank 16/seed 4",
        "charlm/L-GreCo (Top-K) density 0.1/seed 4",
        "charlm/QuantizedAllReduce bits 8/seed 4",
        "charlm/QuantizedAllReduce bits 4/seed 4",
    ]
    assert all(p["seed"] == 0 for p in points[deciding : deciding + others]) and points[deciding + others]["seed"] == 1


def test_time_to_target_fits_the_rate_for_a_ratio_and_waits_out_late_schedules():
    from benchmarks import time_to_target as ttt

    # T(R) = 2 ms + 10 ms Gbit/s / R, compute 10 ms: r = 3 wants 30 ms, so R = 10 / 28 Gbit/s.
    probes = [{"rate_gbit": rate, "allreduce_s": 0.002 + 0.010 / rate, "compute_s": 0.010} for rate in (0.05, 1.0)]
    rate, alpha, c = ttt.fitted_rate(probes, 3.0)
    assert rate == pytest.approx(10 / 28) and alpha == pytest.approx(0.002) and c == pytest.approx(0.010)
    assert ttt.fitted_rate(probes, 0.1)[0] is None  # 1 ms wanted, under the 2 ms latency floor
    # A CI run's probes: the fit's rate measured r = 3.3 (that job's compute was the lowest), the
    # next fit landed 0.1% away, and a secant through those two read a 5.9 ms latency floor: r = 3
    # "out of reach". The secant takes the nearest probe at a distinct rate instead.
    seen = [
        {"rate_gbit": rate, "allreduce_s": allreduce, "compute_s": compute}
        for rate, allreduce, compute in (
            (0.05, 0.019367, 0.002353),
            (1.0, 0.001171, 0.002467),
            (0.136489, 0.006395, 0.001915),
            (0.136357, 0.006396, 0.001966),
        )
    ]
    pair = ttt.secant_pair(seen, 3.0)
    assert [p["rate_gbit"] for p in pair] == [0.136357, 0.05]
    assert ttt.fitted_rate(pair, 3.0)[0] is not None
    # A CI run under load: the all-reduce at 1 Gbit/s took longer than at 0.05, so the fit's
    # bandwidth term came out negative. That is noise, not a latency floor: probe a slower rate.
    loaded = [
        {"rate_gbit": rate, "allreduce_s": allreduce, "compute_s": 0.01}
        for rate, allreduce in ((0.05, 0.02), (1.0, 0.025))
    ]
    entry = {"probes": loaded}
    assert ttt.next_probe(entry, 3.0) == pytest.approx(0.005) and "rate_gbit" not in entry and entry["c_s_gbit"] < 0
    # Out of reach only once the probes have run out.
    entry = {"probes": loaded + [dict(loaded[0], rate_gbit=0.001 * (k + 1)) for k in range(ttt.MAX_PROBES - 2)]}
    assert ttt.next_probe(entry, 3.0) is None and entry["rate_gbit"] is None
    # Within the tolerance: the nearest probe is priced.
    entry = {"probes": probes + [{"rate_gbit": 10 / 28, "allreduce_s": 0.030, "compute_s": 0.010}]}
    assert ttt.next_probe(entry, 3.0) is None and entry["rate_gbit"] == pytest.approx(10 / 28)
    assert entry["at_rate"] is entry["probes"][-1]
    plain = {"controller": None}
    assert ttt.untimed_steps(plain, 8000, 20) == 20
    assert ttt.untimed_steps({"controller": {"kind": "lgreco"}}, 8000, 20) == 810
    assert ttt.untimed_steps({"controller": {"warmup": True}}, 8000, 20) == 810
    assert ttt.untimed_steps({"controller": {"kind": "diloco", "inner_steps": 10}}, 8000, 20) == 20
    # Jobs pooled by the median of their means; an entry of one job without "jobs" counts as one.
    one = {"mean_step_ms": 70.0, "median_step_ms": 69.0}
    two = ttt.pooled(one, {"mean_step_ms": 50.0, "median_step_ms": 49.0})
    three = ttt.pooled(two, {"mean_step_ms": 55.0, "median_step_ms": 54.0})
    assert ttt.jobs_of(None) == 0 and ttt.jobs_of(one) == 1 and ttt.jobs_of(three) == 3
    assert (
        three["mean_step_ms"] == 55.0 and three["median_step_ms"] == 54.0 and ttt.job_means(three) == [70.0, 50.0, 55.0]
    )


@pytest.mark.slow
def test_time_to_target_quick_prices_steps_on_the_testbed_and_resumes(tmp_path, benchmark_runs, monkeypatch):
    from benchmarks import time_to_quality as ttq
    from benchmarks import time_to_target as ttt
    from benchmarks.testbed import NetworkNamespacesUnavailable

    plan = dict(ttq.QUICK, quick=True)
    lengths = [8, 12, 16]

    def point(family, compressor, seed, losses):
        spec = dict(ttq.spec_for(family, compressor, {}, None, seed), lengths=lengths, target=None)
        return spec["key"], {
            "spec": spec,
            "record": {"points": [{"length": n, "loss": loss} for n, loss in zip(lengths, losses)]},
        }

    steps = {
        "plan": plan,
        "np": 2,
        "points": dict(
            [
                point(ttq.UNCOMPRESSED, None, 0, [3.0, 2.5, 2.4]),
                point(ttq.UNCOMPRESSED, None, 1, [3.0, 2.6, 2.5]),
                point("FP16", "fp16", 0, [2.9, 2.4, 2.3]),
            ]
        ),
    }
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "time_to_quality.json").write_text(json.dumps(steps))
    options = [
        "time_to_target",
        "--quick",
        "--direct",
        "--max-other-cpu",
        "1",
        "--job-timeout",
        "300",
        "--out",
        str(tmp_path),
    ]
    try:
        benchmark_runs.run(options)
    except NetworkNamespacesUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")
    results = json.loads((tmp_path / "benchmarks" / "time_to_target.json").read_text())
    setting = results["settings"]["3"]
    # Probed until one lands within 10% of r = 3 (or the probes run out), and priced there.
    measured = ttt.ratio_of(setting["at_rate"])
    assert abs(measured / 3 - 1) <= ttt.RATIO_TOLERANCE or len(setting["probes"]) == ttt.MAX_PROBES
    assert setting["at_rate"] in setting["probes"] and setting["rate_gbit"] == setting["at_rate"]["rate_gbit"]
    # Every method, and the drop-in wrapper's path of one (FP16 in a quick run), on its steps.
    assert set(setting["methods"]) == {"uncompressed", "FP16", "FP16" + ttt.WRAPPER}
    # advise ran on the same cluster, as a user runs it, and its pick is judged (or said not to be).
    assert setting["advise"]["recommendation"] and {c["method"] for c in setting["advise"]["candidates"]} == {
        "none",
        "fp16",
    }
    assert ttt.pick_of("compress with powersgd rank=8: projected ...") == ("powersgd", "rank=8")
    assert (
        ttt.pick_of("compress with fp16: 1.2 -> 1.0 ms") == ("fp16", "")
        and ttt.pick_of("do not compress: x")[0] == "none"
    )
    assert all([j["steps"] for j in m["jobs"]] == [10] and m["mean_step_ms"] > 0 for m in setting["methods"].values())
    # End to end: each method for the first length its seed 0 reached the target at (8 steps here).
    assert {label: run["length"] for label, run in setting["direct"].items()} == {"uncompressed": 8, "FP16": 8}
    runs = [run for entry in setting["direct"].values() for run in ttt.recorded(entry, "runs")]
    assert len(runs) == 2 and all(run["train_s"] > 0 and math.isfinite(run["loss"]) for run in runs)
    # An entry written before --direct took a number of runs is its one run.
    assert ttt.recorded({"length": 8, "train_s": 1.0, "loss": 2.0}, "runs") == [
        {"length": 8, "train_s": 1.0, "loss": 2.0}
    ]
    text = page(tmp_path, "Time to target").read_text()
    assert text.startswith("# Time to target\n") and "| FP16 |" in text and "measured there r =" in text
    assert f"| FP16{ttt.WRAPPER} | 8 (1) |" in text
    assert "End to end on the same cluster" in text and "the decomposition agrees with the end-to-end runs" in text
    assert (tmp_path / "benchmarks" / "time_to_target.png").stat().st_size > 0
    # Resumed: nothing left to run, so no testbed is built.
    monkeypatch.setattr("benchmarks.testbed.emulated_cluster", lambda *_: pytest.fail("a finished job ran again"))
    benchmark_runs.run(options)
    assert json.loads((tmp_path / "benchmarks" / "time_to_target.json").read_text())["settings"] == results["settings"]


@pytest.mark.slow
def test_time_to_quality_quick_branches_exactly_resumes_and_writes_its_section(tmp_path, benchmark_runs):
    from benchmarks import time_to_quality as ttq
    from benchmarks.harness.jobs import mpirun_job

    options = ["time_to_quality", "--quick", "--job-timeout", "600", "--out", str(tmp_path)]
    benchmark_runs.run(options)
    path = tmp_path / "benchmarks" / "time_to_quality.json"
    results = json.loads(path.read_text())
    plan = results["plan"]
    labels = {entry["spec"]["label"] for entry in results["points"].values()}
    assert labels == {"uncompressed", "FP16", "L-GreCo (PowerSGD) rank 8", "DiLoCo H=10 (QSGD) bits 4"}
    base = results["points"]["charlm/uncompressed/seed 0"]
    assert [p["length"] for p in base["record"]["points"]] == [n for n in plan["lengths"] if n <= plan["longest"]]
    assert not (tmp_path / "benchmarks" / "time_to_quality.partial").exists() or not any(
        (tmp_path / "benchmarks" / "time_to_quality.partial").iterdir()
    ), "a finished point's checkpoints are left behind"
    # A cool-down branched and the stable run restored: the longest length's loss is that of a
    # run that never branched (DiLoCo: its anchors, outer momentum and period restored too). A
    # job stopped at its deadline after the first length, and a second one resumed from its
    # checkpoint, end where the job that ran through did, with the same steps and bytes.
    diloco = results["points"]["charlm/DiLoCo H=10 (QSGD) bits 4/seed 0"]["spec"]
    for spec in (base["spec"], diloco):
        records = []
        halves = [plan["longest"] // 2, plan["longest"]]
        for lengths, extra in (
            (halves, {}),
            ([plan["longest"]], {}),
            (halves, {"checkpoint": str(tmp_path / "resume" / spec["key"]), "deadline": 0}),
            (halves, {"checkpoint": str(tmp_path / "resume" / spec["key"])}),
        ):
            job = dict(
                spec,
                lm=ttq.QUICK_LM,
                lengths=lengths,
                target=None,
                warmup=plan["warmup"],
                eval_windows=plan["eval_windows"],
                **extra,
            )
            [record] = mpirun_job("time_to_quality", job, 2, 600, ttq.RESULT_PREFIX, "branch", expected=1)
            records.append(record)
        through, unbranched, stopped, resumed = records
        assert through["points"][-1]["loss"] == unbranched["points"][-1]["loss"], spec["label"]
        assert stopped == {"key": spec["key"], "stopped_at": halves[0], "job_seconds": stopped["job_seconds"]}
        assert resumed["resumed_at"] == halves[0] - ttq.cooldown_steps(halves[0]) and "resumed_at" not in through
        assert resumed["points"] == through["points"], spec["label"]
        assert resumed["steps_taken"] == through["steps_taken"]
        assert resumed.get("wire_bytes_per_step") == through.get("wire_bytes_per_step")
    text = page(tmp_path, "Time to quality").read_text()
    assert (
        text.startswith("# Time to quality\n")
        and text.count("# Time to quality") == 1
        and "| method | seeds | reached |" in text
    )
    assert (tmp_path / "benchmarks" / "time_to_quality.png").stat().st_size > 0
    benchmark_runs.resumes(options, path)


def test_the_codec_clock_times_steps_and_skips_controllers_decisions():
    """An L-GreCo decision reaches exporters too; the clock keeps one entry per step."""
    import torch

    import hvd_compress as hc
    from benchmarks.harness.stats import CodecClock
    from hvd_compress.comm.simulated import SimulatedWorld

    lgreco = hc.LGreCo(hc.PowerSGD(rank=2), warmup_steps=1, decide_every=2, apply_delay=1, transport="local")
    clock = CodecClock(lgreco)
    world = SimulatedWorld([lgreco])
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        world.step([{"fc.weight": torch.randn(64, 48, generator=g), "fc.bias": torch.randn(64, generator=g)}])
    assert lgreco.decisions and len(clock.seconds) == 6


def test_time_to_quality_sets_the_gpu_codec_against_a_gpu_clusters_compute(tmp_path):
    """The codec share from "Codec cost on a GPU" where its JSON is, else says it is not measured."""
    from benchmarks.time_to_quality import GPU_CLUSTERS, codec_share

    assert "not measured yet" in codec_share(tmp_path)[0]
    _, peak, _, tokens = GPU_CLUSTERS[0]
    parameters = 1e8
    compute_ms = 1e3 * 6 * parameters * tokens / (peak * 0.4)
    methods = {
        name: {"step_ms": compute_ms / 2, "floor": {"floor_ms": 1.0}}
        for name in ["PowerSGD", "ACP-SGD", "TopK", "QSGD", "FP16"]
    }
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "codec-cuda.json").write_text(
        json.dumps(
            {
                "machine": {"gpu": "a GPU"},
                "options": {"rank": 4, "density": 0.01, "bits": 4},
                "codec": {"bert-base": {"parameters": parameters, "methods": methods}},
            }
        )
    )
    [text] = codec_share(tmp_path)
    assert "On a GPU (a GPU" in text and "PowerSGD 50%" in text and "FP16 50%" in text


def test_time_to_target_finds_advise_run_on_older_evidence(tmp_path, monkeypatch):
    """A pick made with steps factors the shipped evidence has since changed is stale: the
    report says so and a rerun runs advise again."""
    from benchmarks import time_to_target as ttt

    evidence = {
        "steps_to_target": {
            "workload": "w",
            "methods": {
                "powersgd": {"rank=8": {"factor": 1.3, "reached": 2, "seeds": 2}},
                "fp16": {"": {"factor": 1.05, "reached": 2, "seeds": 2}},
            },
        }
    }
    shipped = tmp_path / "evidence.json"
    shipped.write_text(json.dumps(evidence))
    monkeypatch.setattr("hvd_compress.advise.evidence.EVIDENCE", shipped)
    advice = {
        "candidates": [
            {"method": "powersgd", "setting": "rank=8", "steps_factor": 1.09},
            {"method": "fp16", "setting": "", "steps_factor": 1.05},
            {"method": "none", "setting": "", "steps_factor": 1.0},
        ]
    }
    assert ttt.stale_factors(advice) == {("powersgd", "rank=8"): (1.09, 1.3)}
    advice["candidates"][0]["steps_factor"] = 1.3
    assert ttt.stale_factors(advice) == {}


def test_scaling_formula_fits_both_terms_and_finds_where_a_method_stops_paying():
    from benchmarks.scaling import crossing, fit, formula

    n = 1000
    all_gather = {w: formula(0.0, 0.8 * n, w) for w in (2, 4, 8, 32)}  # Top-K 10%: 8 bytes per kept entry
    a, b = fit(all_gather)
    assert abs(a) < 1e-6 and b == pytest.approx(0.8 * n)
    assert crossing(a, b, 8 * n) == 11  # sends more than a float32 ring all-reduce from W = 11
    two_hop = {w: formula(2.1 * n, 0.0, w) for w in (2, 4, 8, 32)}
    assert fit(two_hop) == pytest.approx((2.1 * n, 0.0)) and crossing(*fit(two_hop), 8 * n) is None
    assert crossing(9.0 * n, 0.0, 8 * n) == 2


@pytest.mark.slow
def test_scaling_quick_counts_bytes_at_two_worlds_and_writes_its_section(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["scaling", "--quick", "--job-timeout", "300", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "benchmarks" / "scaling.json").read_text())
    assert set(results["jobs"]) == {"2", "3"}
    for job in results["jobs"].values():
        dense = job["methods"]["uncompressed"]["bytes_per_step"][0]
        assert dense > 0 and all(
            0 < m["bytes_per_step"][0] < dense for label, m in job["methods"].items() if label != "uncompressed"
        )
    text = page(tmp_path, "Bytes per rank as ranks grow").read_text()
    assert text.startswith("# Bytes per rank as ranks grow\n") and "python -m benchmarks scaling --quick" in text
    assert (tmp_path / "benchmarks" / "scaling.png").stat().st_size > 0


def test_time_to_quality_runs_only_the_families_asked_for_by_name(tmp_path, monkeypatch):
    from benchmarks import time_to_quality as ttq

    with pytest.raises(SystemExit):
        ttq.parse_args(["--family", "no such family"])
    args = ttq.parse_args(["--family", "SparseLoCo H=10", "--out", str(tmp_path)])
    ran = []
    monkeypatch.setattr(ttq, "target_of", lambda *_: {"target": 1.0, "cap": 8000})
    monkeypatch.setattr(ttq, "write_report", lambda *_: None)
    monkeypatch.setattr(ttq, "run_point", lambda spec, *rest: ran.append(spec["key"]))
    ttq.run(args)
    base = [spec["key"] for spec in ttq.base_points(args.plan)]
    assert ran == base + [f"charlm/SparseLoCo H=10 density 0.02/seed {seed}" for seed in range(ttq.OTHER_SEEDS)]

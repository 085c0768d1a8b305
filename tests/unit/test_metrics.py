"""Per-step metrics (``compression.metrics()``, ``hvd_compress.metrics``) and the examples'
whole output lines; the TensorBoard run of a 2-rank ``mpirun`` is read back with
tensorboard's own event reader."""

import io
import json
import math
import os
import pickle
import sys

import pytest
import torch

import hvd_compress as hc
from benchmarks.harness.jobs import LOOPBACK_ONLY, Progress, say
from benchmarks.testbed import run_bounded
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.metrics import JsonLines, TensorBoard, read_json_lines
from test_device_audit import audited_steps, methods

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gradients(step):
    g = torch.Generator().manual_seed(step)
    return {"fc.weight": torch.randn(64, 48, generator=g), "fc.bias": torch.randn(64, generator=g)}


def lgreco():
    return hc.LGreCo(hc.PowerSGD(rank=2), warmup_steps=1, decide_every=2, apply_delay=1, transport="local")


@pytest.mark.parametrize("name", sorted(hc.COMPRESSORS))
def test_metrics_are_one_flat_dict_of_numbers_for_the_last_step(name):
    world = SimulatedWorld([hc.COMPRESSORS[name].build(small=True) for _ in range(2)])
    world.step([gradients(0), gradients(1)])
    numbers = world.compressors[0].metrics()
    assert all(isinstance(v, (int, float)) for v in numbers.values()), numbers
    traffic = world.compressors[0].traffic.summary()
    assert numbers["bytes_sent"] == traffic["wire_bytes_per_step"] > 0
    assert numbers["float32_allreduce_bytes"] == traffic["float32_allreduce_wire_bytes_per_step"]
    assert numbers["ratio"] == pytest.approx(numbers["float32_allreduce_bytes"] / numbers["bytes_sent"])
    assert numbers["steps"] == 1 and numbers["skipped_steps"] == 0
    assert "codec_seconds" not in numbers  # nothing is timed unless an exporter watches


def test_controllers_add_their_state():
    controller = lgreco()
    world = SimulatedWorld([controller])
    for step in range(4):
        world.step([gradients(step)])
    numbers = controller.metrics()
    assert numbers["lgreco_version"] == controller.version >= 1
    assert numbers["setting/fc.weight"] == controller.setting("fc.weight")
    assert "setting/fc.bias" not in numbers  # 1-D: never compressed
    gravac = hc.GraVAC(hc.TopK(density=0.1), theta_min=2, theta_max=16, window=2)
    SimulatedWorld([gravac]).step([gradients(0)])
    assert gravac.metrics()["gravac_factor"] == gravac.cf


def test_json_lines_every_n_steps_with_codec_time_and_sampled_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    exporter = JsonLines(path, every=2, error_every=4)
    controller = exporter.watch(lgreco())
    world = SimulatedWorld([controller])
    for step in range(8):
        world.step([gradients(step)])
    records = [r for r in read_json_lines(path) if "decision" not in r]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert all(r["codec_seconds"] > 0 for r in records)
    assert [("relative_error" in r) for r in records] == [False, True, False, True]
    assert all(0 < r["relative_error"] < 1 for r in records if "relative_error" in r)
    assert records[-1]["lgreco_version"] == controller.version
    exporter.close()
    assert "begin" not in vars(controller) and "codec_seconds" not in controller.metrics()
    written = len(read_json_lines(path))
    world.step([gradients(9)])  # unwatched again: nothing more is written
    assert len(read_json_lines(path)) == written


def test_each_decision_is_written_with_what_the_solver_saw(tmp_path):
    """Per layer the chosen setting, the error and size rows, and the window's
    gradient and residual norms, once per decision, at the step it took effect."""
    path = tmp_path / "metrics.jsonl"
    exporter = JsonLines(path, every=100)
    controller = exporter.watch(lgreco())
    world = SimulatedWorld([controller])
    for step in range(8):
        world.step([gradients(step)])
    decisions = [r["decision"] for r in read_json_lines(path)]
    assert [d["version"] for d in decisions] == [d.version for d in controller.decisions]
    assert len(decisions) >= 2
    layers = decisions[-1]["layers"]
    assert set(layers) == {"fc.weight"}  # the bias is never compressed: not in the problem
    layer = layers["fc.weight"]
    assert len(layer["options"]) == len(layer["errors"]) == len(layer["bytes"]) > 1
    assert layer["options"][layer["chosen"]] == decisions[-1]["settings"]["fc.weight"]
    assert layer["gradient_norm"] > 0 and layer["residual_norm"] > 0  # PowerSGD keeps a residual
    assert layer["errors"][layer["default"]] == pytest.approx(decisions[-1]["budget"])

    writer = ScalarWriter()
    tensorboard = TensorBoard(writer, every=100)
    world = SimulatedWorld([tensorboard.watch(lgreco())])
    for step in range(4):
        world.step([gradients(step)])
    tags = {tag for tag, _, _ in writer.scalars}
    assert {
        "hvd_compress/decision/fc.weight/gradient_norm",
        "hvd_compress/decision/fc.weight/setting",
        "hvd_compress/decision/fc.weight/residual_norm",
    } <= tags
    assert any(tag.startswith("hvd_compress/decision/fc.weight/error@") for tag in tags)


def test_only_rank_0_writes_unless_all_ranks(tmp_path):
    exporters = [JsonLines(tmp_path / f"rank{rank}.jsonl") for rank in range(2)]
    both = [JsonLines(tmp_path / f"all{rank}.jsonl", all_ranks=True) for rank in range(2)]
    for group in (exporters, both):
        world = SimulatedWorld([e.watch(hc.TopK(density=0.1)) for e in group])
        world.step([gradients(0), gradients(1)])
        for e in group:
            e.close()
    assert (tmp_path / "rank0.jsonl").exists() and not (tmp_path / "rank1.jsonl").exists()
    assert (tmp_path / "all1.jsonl").exists()


class ScalarWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass


def test_tensorboard_writes_scalars_to_a_writer():
    writer = ScalarWriter()
    exporter = TensorBoard(writer, every=1)
    SimulatedWorld([exporter.watch(hc.PowerSGD(rank=2))]).step([gradients(0)])
    assert ("hvd_compress/steps", 1, 1) in writer.scalars
    assert {tag for tag, _, _ in writer.scalars} >= {"hvd_compress/bytes_sent", "hvd_compress/codec_seconds"}


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="every"):
        JsonLines("x.jsonl", every=0)
    with pytest.raises(ValueError, match="error_every"):
        JsonLines("x.jsonl", error_every=-1)
    with pytest.raises(ValueError, match="writer"):
        TensorBoard(3)
    exporter = JsonLines("x.jsonl")
    with pytest.raises(ValueError, match="compression"):
        exporter.watch(object())
    exporter.watch(hc.FP16())
    with pytest.raises(ValueError, match="already watching"):
        exporter.watch(hc.FP16())


def test_a_watched_compression_pickles_unwatched(tmp_path):
    exporter = JsonLines(tmp_path / "m.jsonl")
    compressor = exporter.watch(hc.PowerSGD(rank=2))
    restored = pickle.loads(pickle.dumps(compressor))
    SimulatedWorld([restored]).step([gradients(0)])
    assert not (tmp_path / "m.jsonl").exists()


def watched(make):
    def made():
        return JsonLines(os.devnull, every=1).watch(make())

    return made


@pytest.mark.parametrize("make", methods())
def test_watching_adds_no_wait_for_the_device(make):
    """The device audit with an exporter on: codec timing and metrics read no tensor."""
    plain, watched_audit = audited_steps(make, layers=2), audited_steps(watched(make), layers=2)
    assert watched_audit.waits == plain.waits
    assert not watched_audit.placed_on_cpu


def test_say_writes_a_line_in_one_write():
    writes = []

    class Stream(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    say("epoch 1  loss 0.5", Stream())
    assert writes == ["epoch 1  loss 0.5\n"]


def test_progress_prefixes_plain_lines_with_count_and_eta():
    stream = io.StringIO()
    progress = Progress(2, "test", stream)
    progress.starting("a")  # a log shows no status line
    progress.finished("a: done")
    progress.add(1)
    lines = stream.getvalue().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("[1/2, ") and "ETA" in lines[0]
    assert lines[0].endswith("] a: done")
    assert "/3" in progress.where()


def test_progress_on_a_terminal_rewrites_one_status_line_under_whole_result_lines():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress(2, "quality", stream)
    progress.starting("a")
    progress.finished("a: 4.5")
    progress.starting("b")
    status_a, result, status_b = stream.getvalue().split("\r\033[K")[1:]
    assert status_a.startswith("quality [0/2, ") and status_a.endswith("ETA ?] running a")
    assert result == "a: 4.5\n"  # whole, over the status line
    assert status_b.startswith("quality [1/2, ") and status_b.endswith("] running b") and "\n" not in status_b


@pytest.mark.slow
@pytest.mark.serial  # two ranks of its own
def test_tensorboard_event_file_of_a_two_rank_run_holds_the_scalars(tmp_path):
    """examples/train_digits.py at np 2 under mpirun: rank 0 alone writes an event file, and
    tensorboard's event reader finds the metrics in it; the output lines are whole."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
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
        "--tag-output",
        sys.executable,
        os.path.join(ROOT, "examples", "train_digits.py"),
        "--epochs",
        "1",
        "--adapt",
        "lgreco",
        "--tensorboard",
        str(logdir),
        "--metrics-every",
        "2",
    ]
    code, stdout, stderr = run_bounded(command, 240, dict(os.environ, OMP_NUM_THREADS="1"))
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    rank0 = [line for line in stdout.splitlines() if line.startswith("[1,0]<stdout>:")]
    assert any(line.endswith("compression ratio " + line.rsplit(" ", 1)[-1]) for line in rank0)
    assert all("<stdout>:" not in line.split("<stdout>:", 1)[1] for line in rank0), rank0
    events = list(logdir.iterdir())
    assert len(events) == 1 and events[0].name.startswith("events.out.tfevents"), events
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    expected = {
        "hvd_compress/" + key
        for key in (
            "bytes_sent",
            "ratio",
            "codec_seconds",
            "skipped_steps",
            "lgreco_version",
            "float32_allreduce_bytes",
        )
    }
    assert expected <= tags, sorted(tags)
    assert any(tag.startswith("hvd_compress/setting/") for tag in tags)
    sent = accumulator.Scalars("hvd_compress/bytes_sent")
    assert [e.step for e in sent] == list(range(2, 2 * len(sent) + 1, 2)) and len(sent) >= 5
    assert all(e.value > 0 for e in sent)
    assert all(e.value > 1 for e in accumulator.Scalars("hvd_compress/ratio"))
    assert all(math.isfinite(e.value) for e in accumulator.Scalars("hvd_compress/codec_seconds"))


def test_metrics_overhead_benchmark_writes_its_page(tmp_path, monkeypatch):
    from benchmarks import __main__ as bench
    from benchmarks.harness.render import page

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["metrics_overhead", "--layers", "3", "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "benchmarks" / "metrics_overhead.json").read_text())
    assert set(result["ms"]) == {"unwatched", "JsonLines every 10", "JsonLines every step"}
    assert page(tmp_path, "Metrics overhead").read_text().startswith("# Metrics overhead\n")

"""L-GreCo in one process: the schedule, the decisions, the objectives, checkpoints."""

import logging
import threading

import numpy as np
import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.control.decision import fit_bucket_seconds_per_byte

SHAPES = {"a": (96, 96), "b": (64, 256), "c": (128, 32), "bias": (32,)}


def layered_gradients(step, decay):
    """Layers whose spectra decay at different speeds, so one rank does not fit all."""
    g = torch.Generator().manual_seed(step)
    grads = {}
    for name, shape in SHAPES.items():
        if len(shape) == 1:
            grads[name] = torch.randn(shape, generator=g)
            continue
        n, m = shape
        r = min(n, m)
        u, v = torch.randn(n, r, generator=g), torch.randn(m, r, generator=g)
        grads[name] = (u * torch.logspace(0, -decay[name], r)) @ v.t() / r
    return grads


DECAY = {"a": 3.0, "b": 0.3, "c": 1.5}


def run(lgreco, steps):
    sim = SimulatedWorld([lgreco])
    shapes_seen = []
    for step in range(steps):
        sim.step([layered_gradients(step, DECAY)])
        shapes_seen.append(dict(lgreco.settings()))
    return shapes_seen


def make(inner, **kwargs):
    options = dict(warmup_steps=3, decide_every=5, apply_delay=2, transport="local")
    options.update(kwargs)
    return hc.LGreCo(inner, **options)


def test_decisions_take_effect_at_the_announced_step():
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0))
    sim = SimulatedWorld([lgreco])
    payload_rank = []
    for step in range(13):
        g = layered_gradients(step, DECAY)
        p_and_marker = lgreco.inner.begin("probe", torch.randn(64, 64)).payload.numel()
        payload_rank.append((p_and_marker - 1) // 64)
        sim.step([g])
    assert [(d.version, d.decided_at, d.effective_step) for d in lgreco.decisions] == [(1, 3, 5), (2, 8, 10)]
    before = {n: 4 for n in ["a", "b", "c"]}
    assert all(lgreco.setting(n) == lgreco.decisions[-1].settings[n] for n in before)
    assert lgreco.decisions[0].settings != before  # the spectra differ, so do the ranks


@pytest.mark.parametrize(
    "inner",
    [
        lambda: hc.PowerSGD(rank=4, min_numel=0),
        lambda: hc.ACPSGD(rank=4, min_numel=0),
        lambda: hc.TopK(density=0.05, min_numel=0),
        lambda: hc.QSGD(bits=4, bucket_size=64, min_numel=0),
    ],
)
def test_decision_meets_budget_with_fewer_bytes(inner):
    lgreco = make(inner())
    run(lgreco, 6)
    decision = lgreco.decisions[0]
    assert decision.total_error <= decision.budget * (1 + 1e-9)
    assert decision.total_bytes <= decision.uniform_bytes
    assert set(decision.settings) == {"a", "b", "c"}  # the 1-D bias is never tuned


def test_lowrank_decision_spends_rank_where_error_falls_fastest_per_byte():
    """Layer c (128 x 32) is cheap per rank and its error falls fast with rank; b's flat
    spectrum gains little per rank. The optimum moves rank from b to c."""
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0))
    run(lgreco, 6)
    decision = lgreco.decisions[0]
    assert decision.settings["c"] > 4 > decision.settings["b"]
    assert decision.total_bytes < decision.uniform_bytes


def test_accordion_picks_the_critical_default_first():
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0), objective="accordion", accordion=hc.Accordion(critical=8, normal=2))
    run(lgreco, 6)
    decision = lgreco.decisions[0]
    # Everything is critical at the first decision: the budget is that of rank 8 everywhere.
    uniform8 = sum(lgreco.inner.tuning.payload_bytes(SHAPES[n], 8) for n in "abc")
    assert decision.uniform_bytes == uniform8


def test_time_model_fit_recovers_per_bucket_coefficients():
    rng = np.random.default_rng(0)
    truth = np.array([1e-9, 5e-9, 2e-9])
    samples = [(list(b), 0.01 + float(truth @ b)) for b in rng.integers(1, 10**6, size=(20, 3))]
    assert np.allclose(fit_bucket_seconds_per_byte(samples, 3), truth, rtol=1e-6)
    assert fit_bucket_seconds_per_byte(samples[:3], 3) is None  # too few samples


def test_time_objective_falls_back_to_size_without_measurements():
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0), objective="time")
    run(lgreco, 6)
    assert "not identifiable" in lgreco.decisions[0].notes[0]


def test_state_dict_resumes_with_the_same_decisions():
    a = make(hc.ACPSGD(rank=4, min_numel=0))
    run(a, 7)
    b = make(hc.ACPSGD(rank=4, min_numel=0))
    b.load_state_dict(a.state_dict())
    assert b.settings() == a.settings() == {}  # names are unbound in the simulated world
    assert all(b.setting(n) == a.setting(n) for n in "abc")
    assert b.step == a.step and b.decisions == a.decisions
    out_a = SimulatedWorld([a]).step([layered_gradients(99, DECAY)])[0]
    out_b = SimulatedWorld([b]).step([layered_gradients(99, DECAY)])[0]
    assert all(torch.equal(out_a[n], out_b[n]) for n in SHAPES)


def test_accumulate_steps_averages_only_the_last_steps_before_a_decision():
    """decide_every 5 from step 3: decisions at 3 and 8. With accumulate_steps=2 (raw gradients)
    the second one sees steps 6 and 7 only, and so decides as a run given just those two steps
    would; accumulate_steps=None averages the whole period."""

    def decided(lgreco, steps):
        sim = SimulatedWorld([lgreco])
        for step in steps:
            sim.step([layered_gradients(step, DECAY)])
        return lgreco.decisions[-1]

    raw = dict(error_source="raw", apply_delay=1)
    windowed = decided(make(hc.TopK(density=0.05, min_numel=0), accumulate_steps=2, **raw), range(9))
    everything = decided(make(hc.TopK(density=0.05, min_numel=0), accumulate_steps=None, **raw), range(9))
    assert windowed.decided_at == everything.decided_at == 8
    alone = make(hc.TopK(density=0.05, min_numel=0), warmup_steps=2, accumulate_steps=2, **raw)
    alone_decision = decided(alone, [6, 7, 8])
    assert windowed.budget == pytest.approx(alone_decision.budget, rel=1e-12)
    assert windowed.settings == alone_decision.settings
    assert windowed.budget != pytest.approx(everything.budget, rel=1e-3)


def decision_budget(inner, tables):
    """The uniform default's total error on ``tables`` (name -> the tensor the table is built on)."""
    return sum(
        inner.tuning.errors(x, [inner.tuning.resolve(tuple(x.shape), inner.config.default)])[0] for x in tables.values()
    )


@pytest.mark.parametrize("error_source", ["sent", "raw"])
def test_error_table_is_built_on_gradient_plus_residual_or_on_the_gradient(error_source):
    """Decision at step 3 over the last step only: the table is built on step 2's gradient plus
    the residual compression left before it ("sent", the reference's), or on the gradient alone."""
    lgreco = make(hc.TopK(density=0.05, min_numel=0), accumulate_steps=1, apply_delay=1, error_source=error_source)
    sim = SimulatedWorld([lgreco])
    for step in range(2):
        sim.step([layered_gradients(step, DECAY)])
    grads = layered_gradients(2, DECAY)
    residuals = {n: lgreco.inner.residual(n).clone() for n in "abc"}
    assert all(r.norm() > 0 for r in residuals.values())
    tables = {n: grads[n] + residuals[n].view(grads[n].shape) if error_source == "sent" else grads[n] for n in "abc"}
    for step in range(2, 5):
        sim.step([grads if step == 2 else layered_gradients(step, DECAY)])
    [decision] = lgreco.decisions
    assert decision.decided_at == 3
    assert decision.budget == pytest.approx(decision_budget(lgreco.inner, tables), rel=1e-6)


def test_sent_errors_see_the_residual_of_a_layer_cut_too_far():
    """After a decision that cut layer b, b's residual grows; the next decision, built on what
    b actually sends, gives it more bytes than one built on its raw gradient."""

    def second_decision(error_source):
        lgreco = make(hc.PowerSGD(rank=4, min_numel=0), accumulate_steps=2, error_source=error_source)
        run(lgreco, 11)
        return lgreco.decisions[-1]

    sent, raw = second_decision("sent"), second_decision("raw")
    assert sent.version == raw.version == 2
    assert sent.budget > raw.budget  # the residuals add to what is compressed
    assert sent.settings != raw.settings


def test_start_step_sends_everything_whole_and_accumulates_nothing():
    """start_step 4: steps 0-3 dense (no residual, nothing accumulated for the error table),
    compression from step 4, the first decision warmup_steps (3) later, at step 7."""
    lgreco = make(hc.TopK(density=0.05, min_numel=0), start_step=4, accumulate_steps=None, apply_delay=1)
    sim = SimulatedWorld([lgreco])
    dense = 4 * sum(torch.Size(shape).numel() for shape in SHAPES.values())
    for step in range(4):
        assert lgreco.next_payload_bytes("a", SHAPES["a"]) == 4 * 96 * 96
        sim.step([layered_gradients(step, DECAY)])
        assert lgreco.traffic.payload_bytes == dense * (step + 1)
        assert not lgreco._sums.committed and lgreco.inner.residual("a") is None
    assert lgreco.next_payload_bytes("a", SHAPES["a"]) < 4 * 96 * 96
    for step in range(4, 10):
        sim.step([layered_gradients(step, DECAY)])
    assert lgreco.traffic.payload_bytes < dense * 10
    assert [d.decided_at for d in lgreco.decisions] == [7]


def held_decisions(lgreco):
    """Makes each decision of ``lgreco`` wait, in its background thread, for an event of its
    own before it computes; returns the list of those events, one per decision submitted so far
    (the test sets them)."""
    gates, submit = [], lgreco.service.submit

    def held(compute):
        gate = threading.Event()
        gates.append(gate)
        submit(lambda: compute() if gate.wait(60) else pytest.fail("the test never released the decision"))

    lgreco.service.submit = held
    return gates


def test_auto_delay_postpones_instead_of_waiting_for_a_slow_decision():
    """The first decision is held until 10 steps after its submission, by the step count (an
    event the training loop sets), not by a sleep: on a loaded machine 10 steps can outlast any
    sleep. Rank 0 names a later step and training goes on; had it waited for the decision, the
    loop could not have set the event, and the decision would have given up waiting for it.
    The next delay follows from the measured time."""
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0), apply_delay="auto", decide_every=80)
    released, held_until_released = threading.Event(), []
    errors = lgreco.inner.tuning.errors_of_layers  # the decision's one call for its error rows

    def held(*args):
        held_until_released.append(released.wait(20))
        return errors(*args)

    lgreco.inner.tuning.errors_of_layers = held
    sim, submitted = SimulatedWorld([lgreco]), None
    for step in range(5000):
        sim.step([layered_gradients(step, DECAY)])
        if submitted is None and lgreco.decision_in_flight is not None:
            submitted = lgreco.step
        if submitted is not None and lgreco.step >= submitted + 10:
            released.set()
        if lgreco.decisions:
            break
    assert held_until_released and all(held_until_released), "training waited for the decision"
    [decision] = lgreco.decisions
    assert decision.decided_at == submitted and decision.effective_step > decision.decided_at + 10
    assert decision.seconds > 0 and decision.step_seconds > 0
    from hvd_compress.control.lgreco import next_delay

    assert lgreco._delay == next_delay(decision)


def test_a_decision_due_while_one_is_pending_is_skipped():
    """Decisions are due every 2 steps; each is held until the loop has run 3 steps past its
    submission (events, not timing), so the next one due finds it pending and is skipped: the
    next decision is the first one due after it took effect."""
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0), apply_delay="auto", decide_every=2, warmup_steps=2)
    gates, submitted = held_decisions(lgreco), []
    sim = SimulatedWorld([lgreco])
    for step in range(5000):
        sim.step([layered_gradients(step, DECAY)])
        if len(submitted) < len(gates):
            submitted.append(lgreco.step)
        if submitted and lgreco.step >= submitted[-1] + 3:
            gates[-1].set()
        if len(lgreco.decisions) == 3:
            break
    decisions = list(lgreco.decisions)
    assert [d.version for d in decisions] == [1, 2, 3]
    assert [d.decided_at for d in decisions] == submitted[:3]
    for earlier, later in zip(decisions, decisions[1:]):
        assert later.decided_at > earlier.decided_at + 2  # at least the one due in between skipped
        # The first due (an even step, from warmup_steps=2 on) after the earlier took effect.
        assert later.decided_at == earlier.effective_step + 2 - earlier.effective_step % 2


def test_auto_delay_keeps_the_deadline_for_a_decision_that_never_ends():
    """A decision never released: training goes on (postponed exchanges) until it has run
    longer than the timeout, then every exchange fails."""
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0), apply_delay="auto", decide_every=100, timeout=0.3)
    gates, sim = held_decisions(lgreco), SimulatedWorld([lgreco])
    try:
        with pytest.raises(RuntimeError, match="over the timeout"):
            for step in range(10**6):
                sim.step([layered_gradients(step, DECAY)])
        assert len(gates) == 1
    finally:
        for gate in gates:  # the abandoned thread ends (it computes a decision nobody reads)
            gate.set()


def test_decision_log_names_every_layer(caplog):
    lgreco = make(hc.TopK(density=0.05, min_numel=0))
    with caplog.at_level(logging.INFO, logger="hvd_compress.control.lgreco"):
        run(lgreco, 6)
    lines = [record.getMessage() for record in caplog.records]
    assert "bytes/step vs" in lines[0] and "of budget" in lines[0]
    assert all(f"  {n}: k " in lines[0] for n in "abc")


def test_bad_configuration_is_named():
    with pytest.raises(ValueError, match="compressor must be one of ACPSGD, PowerSGD, QSGD, QuantizedAllReduce, TopK"):
        hc.LGreCo(hc.FP16())
    with pytest.raises(ValueError, match="apply_delay"):
        hc.LGreCo(hc.PowerSGD(), decide_every=5, apply_delay=5)
    with pytest.raises(ValueError, match="every candidate must be a density"):
        hc.LGreCo(hc.TopK(), candidates=[0.5, 2])
    with pytest.raises(ValueError, match="objective"):
        hc.LGreCo(hc.PowerSGD(), objective="speed")
    with pytest.raises(ValueError, match="steps_per_epoch"):
        hc.LGreCo(hc.PowerSGD(), decide_every="epoch")
    with pytest.raises(ValueError, match="transport"):
        hc.LGreCo(hc.PowerSGD(), transport="tcp")
    with pytest.raises(ValueError, match="error_source"):
        hc.LGreCo(hc.PowerSGD(), error_source="residual")


def test_topk_decisions_from_the_histogram_match_the_exact_selection(monkeypatch):
    """Large layers' Top-K rows come from a histogram; the decisions must match the exact
    selection's (layers of 128 x 1024 are above the histogram's threshold)."""
    from hvd_compress.maths import error_tables as error_maths

    shapes = {"a": (128, 1024), "b": (256, 512), "c": (1024, 96)}
    decisions = {}
    for exact in [False, True]:
        if exact:
            histogram = error_maths.topk_errors
            monkeypatch.setattr(error_maths, "topk_errors", lambda flat, ks: histogram(flat, ks, exact=True))
        lgreco = make(hc.TopK(density=0.01, min_numel=0))
        sim = SimulatedWorld([lgreco])
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            sim.step(
                [
                    {
                        name: torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** (3 * i)
                        for i, (name, shape) in enumerate(shapes.items())
                    }
                ]
            )
        decisions[exact] = lgreco.decisions[0]
    assert decisions[False].settings == decisions[True].settings
    assert decisions[False].total_bytes < decisions[False].uniform_bytes


def test_decisions_from_randomized_errors_match_the_exact_svd(monkeypatch):
    """The error table's low-rank rows come from a randomized range finder; the decisions it
    leads to must match those of the exact SVD."""
    from hvd_compress.maths import error_tables as error_maths

    decisions = {}
    for exact in [False, True]:
        if exact:
            randomized = error_maths.lowrank_errors
            monkeypatch.setattr(
                error_maths, "lowrank_errors", lambda matrix, ranks: randomized(matrix, ranks, exact=True)
            )
        lgreco = make(hc.PowerSGD(rank=8, min_numel=0))
        run(lgreco, 6)
        decisions[exact] = lgreco.decisions[0]
    approximate, exact = decisions[False], decisions[True]
    assert approximate.settings == exact.settings
    assert approximate.total_error == pytest.approx(exact.total_error, rel=5e-3)


def test_a_run_ending_while_a_decision_computes_exits_cleanly(tmp_path):
    """The interpreter exiting while the decision thread is inside torch operations used to
    abort the process (SIGABRT); the thread is joined at exit instead. The thread runs torch
    operations from the moment it signals that it started until the interpreter is exiting
    (an exit handler registered after the package's, so run before its join, stops it)."""
    import subprocess
    import sys

    script = tmp_path / "ends_mid_decision.py"
    script.write_text(
        "import atexit, threading, torch\n"
        "import hvd_compress as hc\n"
        "from hvd_compress.comm.simulated import SimulatedWorld\n"
        "lgreco = hc.LGreCo(hc.PowerSGD(rank=4, min_numel=0), warmup_steps=1, decide_every=100,\n"
        "                   transport='local')\n"
        "errors = lgreco.inner.tuning.errors_of_layers\n"
        "started, exiting = threading.Event(), threading.Event()\n"
        "def busy(*args):\n"
        "    started.set()\n"
        "    x = torch.randn(256, 256)\n"
        "    while not exiting.is_set():\n"
        "        x = torch.tanh(x @ x)\n"
        "    return errors(*args)\n"
        "lgreco.inner.tuning.errors_of_layers = busy\n"
        "SimulatedWorld([lgreco]).step([{'w': torch.randn(64, 64)}])\n"
        "assert started.wait(60)\n"
        "assert lgreco.service.running()\n"
        "atexit.register(exiting.set)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def gradients_with_a_small_layer(step):
    """SHAPES' layers plus "small" (24 x 24), which rank 4 compresses and rank 8 does not
    (PowerSGD asks 2x), and "tiny" (12 x 12), which rank 4 already sends whole."""
    grads = layered_gradients(step, DECAY)
    g = torch.Generator().manual_seed(1000 + step)
    grads.update(small=torch.randn(24, 24, generator=g), tiny=torch.randn(12, 12, generator=g))
    return grads


@pytest.mark.parametrize("dense_candidates", [False, True])
def test_candidates_are_compressed_settings_unless_dense_ones_are_asked_for(dense_candidates):
    """The reference's problem: every candidate compresses its layer, and a layer the default
    does not compress is left out (it keeps its setting). dense_candidates=True is the ablation
    that also offers sending a layer whole, at error 0."""
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0), dense_candidates=dense_candidates)
    sim = SimulatedWorld([lgreco])
    for step in range(6):
        sim.step([gradients_with_a_small_layer(step)])
    decision = lgreco.decisions[0]
    shapes = dict(SHAPES, small=(24, 24), tiny=(12, 12))
    if dense_candidates:
        assert {"small", "tiny"} <= set(decision.settings)
    else:
        assert "tiny" not in decision.settings and "small" in decision.settings
        assert all(lgreco.inner.tuning.compresses(shapes[name], setting) for name, setting in decision.settings.items())
    assert decision.total_error <= decision.budget * (1 + 1e-9)


def test_a_decision_with_nothing_to_decide_keeps_every_setting():
    lgreco = make(hc.PowerSGD(rank=4, min_numel=0))
    sim = SimulatedWorld([lgreco])
    for step in range(6):
        sim.step([{"tiny": torch.randn(12, 12, generator=torch.Generator().manual_seed(step))}])
    assert lgreco.decisions[0].settings == {} and lgreco.setting("tiny") == 4

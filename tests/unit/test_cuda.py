"""The CUDA tier: every compressor and controller on a GPU in the simulated world. Skipped, with
its reason, where torch sees no CUDA device (CI's machines). On a GPU machine:
``python -m pytest tests/unit/test_cuda.py``.

* Aggregates equal the CPU's within float tolerance (QSGD draws its rounding noise from the
  device's generator, so its CPU and GPU draws differ: its aggregate is checked on the device
  only; L-GreCo's randomized error estimates draw on the device too, so its decisions may).
* State stays on the device; float16 gradients come back float16 on the device.
* A step waits for the device as often with 6 layers as with 2, and so does an L-GreCo decision
  (torch's own sync debug mode counts the waits; a failure names each one's line and thread).
* A checkpoint written on the GPU, loaded with ``map_location="cpu"``, resumes on the GPU.
* An Inf on one rank drops the step on every rank: the finiteness check on the device, through
  the results' bounds (``StepGuard.bound_by``) as through their extremes."""

import io
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from test_device_audit import gradients, methods

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here (torch.cuda.is_available() is False); this tier runs on a GPU machine",
)
PACKAGE = Path(hc.__file__).parent


def stochastic(method_id: str) -> bool:
    """QSGD draws its rounding noise, and L-GreCo its error estimates, from the device's
    generator: their GPU and CPU runs differ."""
    return "qsgd" in method_id or method_id.startswith("lgreco")


def run(make, device, steps=6, layers=2, dtype=torch.float32):
    """Two ranks (one for L-GreCo, whose "local" decisions are a world of one); each step's
    aggregates per rank, on ``device``."""
    ranks = 1 if isinstance(make(), hc.LGreCo) else 2
    world = SimulatedWorld([make() for _ in range(ranks)])
    outputs = []
    for step in range(steps):
        per_rank = [
            {name: (grad * (r + 1)).to(device, dtype) for name, grad in gradients(step, layers).items()}
            for r in range(ranks)
        ]
        outputs.append(world.step(per_rank))
    return world, outputs


def tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


@pytest.mark.parametrize("make", methods())
def test_aggregates_match_the_cpu_and_state_stays_on_the_device(make, request):
    world, on_gpu = run(make, "cuda")
    for step in on_gpu:
        for aggregates in step:
            assert all(t.is_cuda and t.dtype == torch.float32 for t in aggregates.values())
            assert all(torch.isfinite(t).all() for t in aggregates.values())
    for compressor in world.compressors:
        assert all(t.is_cuda for t in tensors_in(compressor.state_dict()) if t.is_floating_point() and t.numel() > 1), (
            "state left the device"
        )
    if stochastic(request.node.callspec.id):
        return
    _, on_cpu = run(make, "cpu")
    for gpu_step, cpu_step in zip(on_gpu, on_cpu):
        for gpu, cpu in zip(gpu_step, cpu_step):
            for name in cpu:
                scale = cpu[name].abs().max().item() + 1e-6
                assert torch.allclose(gpu[name].cpu(), cpu[name], rtol=0, atol=1e-3 * scale), name


@pytest.mark.parametrize("make", methods())
def test_half_precision_stays_half_and_on_the_device(make):
    _, outputs = run(make, "cuda", dtype=torch.float16)
    for aggregates in outputs[-1]:
        assert all(t.is_cuda and t.dtype == torch.float16 for t in aggregates.values())


class Waits:
    """Torch's sync debug mode warns at every wait for the device; as ``warnings.showwarning``,
    this counts each by thread and the innermost line of hvd_compress on the stack at the time:
    a failure says where to look."""

    def __init__(self):
        self.by_thread = {}

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            where = self.by_thread.setdefault(threading.current_thread().name, Counter())
            where[line_in_package()] += 1


def line_in_package():
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            return f"{path.relative_to(PACKAGE)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside hvd_compress"


def count_waits(make, layers):
    """Where three steps wait: a Counter by line, for the training thread and for L-GreCo's
    decision thread (its decisions wait for the device in the background). After each step the
    decision thread is waited for, so that every decision submitted in the three is counted."""
    world, _ = run(make, "cuda", steps=3, layers=layers)
    # Copied to the GPU before counting: a copy from pageable host memory waits too.
    steps = [
        [{n: g.cuda() for n, g in gradients(step, layers).items()} for _ in world.compressors] for step in range(3, 6)
    ]
    controllers = [c for c in world.compressors if isinstance(c, hc.LGreCo)]
    settle_decisions(controllers)
    torch.cuda.synchronize()
    waits = Waits()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = waits
            for per_rank in steps:
                world.step(per_rank)
                settle_decisions(controllers)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    main = threading.main_thread().name
    return waits.by_thread.pop(main, Counter()), sum(waits.by_thread.values(), Counter())


def settle_decisions(controllers, timeout=60.0):
    """Waits until no decision computes, failing after ``timeout`` seconds rather than hanging."""
    deadline = time.monotonic() + timeout
    while any(controller.service.running() for controller in controllers):
        assert time.monotonic() < deadline, f"an L-GreCo decision still computes after {timeout} s"
        time.sleep(0.001)


# Found on an H200: ScaleCom's residual (a Python 0 assigned through the leader's indices) and
# L-GreCo's Top-K error rows (a Python list of k as an index) each waited once per layer; the
# CPU audit (tests/unit/test_device_audit.py, waits_on_a_gpu) now catches both.
@pytest.mark.parametrize("make", methods())
def test_a_step_waits_for_the_gpu_as_often_whatever_the_number_of_layers(make):
    (few, few_decisions), (many, many_decisions) = count_waits(make, 2), count_waits(make, 6)
    assert sum(many.values()) == sum(few.values()), (
        f"a step's waits grow with the layers: {sorted((many - few).items())}; with 2 layers: {sorted(few.items())}"
    )
    assert sum(many_decisions.values()) == sum(few_decisions.values()), (
        f"a decision's waits grow with the layers: {sorted((many_decisions - few_decisions).items())}; "
        f"with 2 layers: {sorted(few_decisions.items())}"
    )


@pytest.mark.parametrize("make", methods())
def test_a_gpu_checkpoint_loaded_on_the_cpu_resumes_on_the_gpu(make):
    world, _ = run(make, "cuda", steps=4)
    buffer = io.BytesIO()
    torch.save([c.state_dict() for c in world.compressors], buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu", weights_only=True)
    resumed = SimulatedWorld([make() for _ in world.compressors])
    for compressor, state in zip(resumed.compressors, saved):
        compressor.load_state_dict(state)
    per_rank = [{n: g.cuda() for n, g in gradients(4, 2).items()} for _ in world.compressors]
    for aggregates in resumed.step(per_rank):
        assert all(t.is_cuda and torch.isfinite(t).all() for t in aggregates.values())


def dropped_everywhere(make, device):
    """Whether an Inf in one rank's first gradient, after three clean steps on ``device``, drops
    that step on every rank."""
    world, _ = run(make, device, steps=3)
    per_rank = [{n: g.to(device) for n, g in gradients(3, 2).items()} for _ in world.compressors]
    per_rank[-1]["layer0.weight"][0, 0] = float("inf")
    world.step(per_rank)
    return all((c.wrapped or c).skipped_steps == 1 for c in world.compressors)


# The check on the device, through the results' bounds (PowerSGD, ACP-SGD, Top-K and QSGD: the
# largest magnitude of the mean factor or the gathered values) as through other results' extremes.
@pytest.mark.parametrize("make", methods())
def test_an_infinity_on_one_rank_drops_the_step_on_every_rank_on_the_gpu(make):
    assert dropped_everywhere(make, "cuda")


if __name__ == "__main__":
    # python tests/unit/test_cuda.py ID...: where each method (test_device_audit.methods' ids)
    # waits with 2 and 6 layers, passing or not.
    makers = {p.id: p.values[0] for p in methods()}
    for method_id in sys.argv[1:]:
        for layers in (2, 6):
            step, decision = count_waits(makers[method_id], layers)
            print(f"{method_id}, {layers} layers: step {sorted(step.items())}; decisions {sorted(decision.items())}")


@pytest.mark.parametrize("bits", range(2, 9))
def test_qsgd_codes_pack_to_the_same_bytes_on_the_gpu_as_on_the_cpu(bits):
    """Widths that do not divide 8 pack a field at a time on the CPU and all fields at once on
    other devices: the bytes on the wire must not depend on where a rank packed them."""
    from hvd_compress.maths import quantize

    s = quantize.levels_for_bits(bits)
    codes = torch.randint(-s, s + 1, (10_007,), dtype=torch.int8)
    packed = quantize.pack_codes(codes, bits)
    on_gpu = quantize.pack_codes(codes.cuda(), bits)
    assert torch.equal(on_gpu.cpu(), packed)
    assert torch.equal(quantize.unpack_codes(packed.cuda(), bits, codes.numel()).cpu(), codes)

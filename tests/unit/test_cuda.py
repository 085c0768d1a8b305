"""The CUDA tier: every compressor and controller on a GPU in the simulated world. Skipped, with
its reason, where torch sees no CUDA device (CI's machines). On a GPU machine:
``python -m pytest tests/unit/test_cuda.py``.

* Aggregates equal the CPU's within float tolerance (QSGD draws its rounding noise from the
  device's generator, so its CPU and GPU draws differ: its aggregate is checked on the device
  only; L-GreCo's randomized error estimates draw on the device too, so its decisions may).
* State stays on the device; float16 gradients come back float16 on the device.
* A step waits for the device as often with 6 layers as with 2 (torch's own sync debug mode
  counts the waits).
* A checkpoint written on the GPU, loaded with ``map_location="cpu"``, resumes on the GPU."""
import io
import warnings

import pytest
import torch

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from test_device_audit import gradients, methods

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here (torch.cuda.is_available() is False); "
                                       "this tier runs on a GPU machine")
STOCHASTIC = {"qsgd", "lgreco-powersgd", "lgreco-topk", "gravac-qsgd"}


def run(make, device, steps=6, layers=2, dtype=torch.float32):
    """Two ranks (one for L-GreCo, whose "local" decisions are a world of one); each step's
    aggregates per rank, on ``device``."""
    ranks = 1 if isinstance(make(), hc.LGreCo) else 2
    world = SimulatedWorld([make() for _ in range(ranks)])
    outputs = []
    for step in range(steps):
        per_rank = [{name: (grad * (r + 1)).to(device, dtype) for name, grad in gradients(step, layers).items()}
                    for r in range(ranks)]
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
        assert all(t.is_cuda for t in tensors_in(compressor.state_dict())
                   if t.is_floating_point() and t.numel() > 1), "state left the device"
    if request.node.callspec.id in STOCHASTIC:
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


def count_waits(make, layers):
    world, _ = run(make, "cuda", steps=3, layers=layers)
    # Copied to the GPU before counting: a copy from pageable host memory waits too.
    steps = [[{n: g.cuda() for n, g in gradients(step, layers).items()} for _ in world.compressors]
             for step in range(3, 6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for per_rank in steps:
                world.step(per_rank)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# Seen on an H200 (2026-11-26, torch 2.11): waits with 6 layers against 2. Strict, so a fix shows.
PER_LAYER_WAITS = {
    "scalecom": "42 vs 18: the leader's threshold selection reads the device per layer "
                "(maths/sparsify.py: .item() of the threshold, nonzero)",
    # Since then the decision reads its table back once (control/lgreco.py read_rows) and takes
    # svdvals once per distinct shape (errors_of_layers); the CPU audit,
    # tests/unit/test_device_audit.py, shows both. Not rerun on a GPU: lgreco-topk and
    # lgreco-acpsgd (whose only known cause was that svdvals) are expected to pass, and
    # lgreco-powersgd too; it stays strict until a GPU run confirms it.
    "lgreco-powersgd": "50 vs 19: the decision's error tables came back per layer (.tolist()) and "
                       "maths/errors.py took svdvals per layer; both fixed since, not rerun on a GPU"}


@pytest.mark.parametrize("make", [pytest.param(*p.values, id=p.id, marks=[pytest.mark.xfail(
    reason=PER_LAYER_WAITS[p.id], strict=True)] if p.id in PER_LAYER_WAITS else []) for p in methods()])
def test_a_step_waits_for_the_gpu_as_often_whatever_the_number_of_layers(make):
    assert count_waits(make, 6) == count_waits(make, 2)


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

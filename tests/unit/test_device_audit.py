"""The device audit, shown without a GPU (the CUDA tier, tests/unit/test_cuda.py, repeats it on
one). A torch function mode watches every step of every compressor and controller:

* waits for the device: reads of a tensor's values on the host (``item``, ``tolist``, ``bool``,
  ...), operations whose output size depends on the data (``nonzero``, ...), and indexing with
  a Python list or assigning a Python number through a tensor index (``waits_on_a_gpu``). On
  a GPU each one stalls the host until the device catches up. A step may wait a fixed number of times
  (its finiteness check, GraVAC's statistics), never once per layer;
* tensors made from nothing (``torch.zeros`` and kin) without ``device=``: on a GPU they land
  on the CPU. Only functions that draw on the CPU by design (identical values on every rank
  and device, then moved) may, and the decision service's pickled bytes."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_compress as hc
from hvd_compress.comm.simulated import SimulatedWorld
from hvd_compress.registry import controllable

PACKAGE = Path(hc.__file__).parent
WAITS = {
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
    "masked_select",
    "unique",
    "bincount",
    "linalg_svd",
    "svdvals",
    "linalg_svdvals",
    "linalg_eigh",
    "linalg_eigvalsh",
}
FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "randn",
    "rand",
    "randint",
    "randperm",
    "eye",
    "linspace",
    "scalar_tensor",
}
CPU_BY_DESIGN = {"seeded_normal", "_sample_positions", "on_device"}
# Pickled bytes between ranks (decisions, the configuration check), not gradients: on the host.
HOST_BYTES = {"control/service.py", "comm/transports.py"}


class Audit(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.waits = Counter()
        self.placed_on_cpu = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        where = caller_in_package()
        if where is not None:
            if name in WAITS or waits_on_a_gpu(name, args):
                self.waits[(name, where)] += 1
            if (
                name in FACTORIES
                and "device" not in kwargs
                and where[1] not in CPU_BY_DESIGN
                and where[0] not in HOST_BYTES
            ):
                self.placed_on_cpu.add((name, where))
        return func(*args, **kwargs)


def waits_on_a_gpu(name, args):
    """Calls whose name alone does not say they wait, but which do on a GPU (found there by the
    CUDA tier): indexing with a Python list (copied from pageable memory) and assigning a
    Python number through a tensor index."""
    if name == "__getitem__":
        return holds(args[1], list)
    if name == "__setitem__":
        return holds(args[1], torch.Tensor) and isinstance(args[2], (bool, int, float))
    return False


def holds(index, kind):
    return isinstance(index, kind) or (isinstance(index, tuple) and any(isinstance(i, kind) for i in index))


def caller_in_package():
    """(file, function) of the innermost frame in hvd_compress outside comm/simulated.py (the
    test's stand-in for the network), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents and path.name != "simulated.py":
            return (str(path.relative_to(PACKAGE)), frame.f_code.co_name)
        frame = frame.f_back
    return None


def methods():
    """Every registered compressor, and every registered controller over every compressor it can
    wrap, at their small settings (L-GreCo submits and applies a decision in the audited steps)."""
    for name, method in hc.COMPRESSORS.items():
        yield pytest.param(lambda method=method: method.build(small=True), id=name)
    for controller in sorted(hc.CONTROLLERS):
        for name in controllable():
            yield pytest.param(
                lambda c=controller, n=name: hc.CONTROLLERS[c].build(hc.COMPRESSORS[n].build(small=True), small=True),
                id=f"{controller}-{name}",
            )


def gradients(step, layers):
    g = torch.Generator().manual_seed(step)
    grads = {}
    for i in range(layers):
        grads[f"layer{i}.weight"] = torch.randn(32, 48, generator=g)
        grads[f"layer{i}.bias"] = torch.randn(32, generator=g)
    return grads


def audited_steps(make, layers, audit=None, steps=6, audited=3):
    """``audit`` (an ``Audit`` unless given: waits and CPU placements) over the last ``audited``
    of ``steps`` steps (after warm-ups and first decisions) of one rank (L-GreCo's "local"
    decisions are a world of one)."""
    world = SimulatedWorld([make()])
    for step in range(steps - audited):
        world.step([gradients(step, layers)])
    audit = audit or Audit()
    with audit:
        for step in range(steps - audited, steps):
            world.step([gradients(step, layers)])
    return audit


@pytest.mark.parametrize("make", methods())
def test_a_step_waits_for_the_device_as_often_whatever_the_number_of_layers(make):
    few, many = audited_steps(make, layers=2), audited_steps(make, layers=6)
    assert many.waits == few.waits, f"waits that grow with the layers: {sorted((many.waits - few.waits).items())}"
    assert sum(few.waits.values()) <= 3 * 2, sorted(few.waits.items())  # at most twice a step


def audited_decisions(make, layers, steps=6):
    """The waits of every decision L-GreCo computes in ``steps`` steps, on its decision thread."""
    controller = make()
    audit, decide = Audit(), controller._decide

    def audited(*args):
        with audit:  # modes are per thread: entered on the decision's own
            return decide(*args)

    controller._decide = audited
    world = SimulatedWorld([controller])
    for step in range(steps):
        world.step([gradients(step, layers)])
    assert controller.decisions
    return audit


# The audit counts svdvals as a wait (WAITS): the low-rank rows take one per distinct shape
# (errors_of_layers). Whether it waits on a GPU is for the CUDA tier (tests/unit/test_cuda.py).
@pytest.mark.parametrize("make", [p for p in methods() if p.id.startswith("lgreco")])
def test_a_decision_reads_the_device_as_often_whatever_the_number_of_layers(make):
    """The error table and the window's norms come back once per decision."""
    few, many = audited_decisions(make, layers=2), audited_decisions(make, layers=6)
    assert many.waits == few.waits, f"waits that grow with the layers: {sorted((many.waits - few.waits).items())}"


class HostWaits(TorchDispatchMode):
    """Counts, below the torch functions, the aten calls that make the host wait for the
    device: ``_local_scalar_dense`` (``item`` and every scalar read) and copies to the CPU
    from another device (none on the CPU, counted so that the CUDA tier could reuse it)."""

    def __init__(self):
        super().__init__()
        self.waits = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default or (
            func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
            and _to_cpu_from_a_device(func, args, kwargs)
        ):
            self.waits[func.__name__] += 1
        return func(*args, **kwargs)


def _to_cpu_from_a_device(func, args, kwargs):
    if func is torch.ops.aten.copy_.default:
        destination, source = args[0], args[1]
        return destination.device.type == "cpu" and source.device.type != "cpu"
    target = kwargs.get("device")
    return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


@pytest.mark.parametrize("make", methods())
def test_a_step_s_host_waits_at_the_aten_level_do_not_grow_with_the_layers(make):
    """What the function-level audit above might miss (a scalar read inside a torch
    function), counted where every scalar read ends: N same-shape layers against 2N."""
    few, many = (audited_steps(make, layers, HostWaits()).waits for layers in (3, 6))
    assert many == few, f"host waits that grow with the layers: {sorted((many - few).items())}"
    assert sum(few.values()) <= 3 * 2, sorted(few.items())  # at most twice a step


@pytest.mark.parametrize("make", methods())
def test_every_tensor_a_step_makes_is_made_on_the_gradients_device(make):
    audit = audited_steps(make, layers=2)
    assert not audit.placed_on_cpu, sorted(audit.placed_on_cpu)


@pytest.mark.parametrize("name", ["powersgd", "topk"])  # the driver's rounds and a placeholder
def test_the_stock_bridge_makes_its_tensors_on_the_gradients_device(name):
    """Through Horovod's Compression API in one process (Horovod's all-reduce of one rank
    returns its input), as stock ``hvd.DistributedOptimizer`` calls it."""
    import horovod.torch as hvd

    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Linear(32, 32))
    compression = hc.COMPRESSORS[name].build(model.named_parameters(), small=True)
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        audit = Audit()
        with audit:
            sent = [compression.compress(p.grad) for p in model.parameters()]
            for payload, ctx in sent:
                compression.decompress(payload, ctx)
        assert not audit.placed_on_cpu, sorted(audit.placed_on_cpu)

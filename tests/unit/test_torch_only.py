"""torch alone is enough for everything except the Horovod paths. Each check without Horovod runs
in a subprocess whose imports of ``horovod`` fail (``sys.modules["horovod"] = None``), so Horovod
stays installed for the rest of the suite; ``ci/torch_only.sh`` runs the torchrun tier in a
virtual environment that has no Horovod at all."""

import pickle
import subprocess
import sys
import textwrap

import pytest

import hvd_compress as hc
from hvd_compress.registry import controllable


def _has_horovod() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return False
    return True


# The torch-only tier runs these files in a venv without Horovod.
NEEDS_HOROVOD = pytest.mark.skipif(not _has_horovod(), reason="needs horovod.torch")
# Makes every import of horovod or horovod.* raise ImportError in the subprocess.
BLOCK_HOROVOD = "import sys\nsys.modules['horovod'] = None\n"


def run_without_horovod(code, stdin=None):
    """Runs ``code`` in a fresh interpreter without Horovod; its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_HOROVOD + textwrap.dedent(code)], input=stdin, capture_output=True, timeout=300
    )
    assert result.returncode == 0, result.stderr.decode()[-6000:]
    return result.stdout.decode()


def test_every_registered_method_builds_and_exchanges_without_horovod():
    """The package imports, no Horovod module is loaded, and every compressor runs three steps in
    a simulated world of 2, and every controller around every compressor it can wrap in a world
    of 1 (its ``small`` settings decide locally there)."""
    out = run_without_horovod("""
        import torch
        import hvd_compress as hc
        from hvd_compress.comm.simulated import SimulatedWorld
        from hvd_compress.registry import controllable

        assert not [name for name, module in sys.modules.items() if name.startswith("horovod") and module]
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        named = list(model.named_parameters())

        def run(make, ranks):
            world = SimulatedWorld([make() for _ in range(ranks)])
            for step in range(3):
                grads = [{name: torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + rank))
                          for name, p in named} for rank in range(ranks)]
                results = world.step(grads)
                assert all(torch.isfinite(grad).all() for result in results for grad in result.values())

        built = []
        for name, method in hc.COMPRESSORS.items():
            assert type(method.build(named, small=True)) is getattr(hc, method.core.__name__)
            run(lambda: method.build(named, small=True), 2)
            built.append(name)
        for name, controller in hc.CONTROLLERS.items():
            for inner in controllable():
                run(lambda: controller.build(hc.COMPRESSORS[inner].build(named, small=True), small=True), 1)
                built.append(f"{name}({inner})")
        print(" ".join(built))
    """)
    built = out.split()
    assert set(hc.COMPRESSORS) <= set(built)
    assert {f"{c}({inner})" for c in hc.CONTROLLERS for inner in controllable()} <= set(built)


def test_horovod_only_entry_point_says_how_to_install_horovod():
    out = run_without_horovod("""
        import hvd_compress as hc
        for attempt in [lambda: hc.DistributedOptimizer, lambda: __import__("hvd_compress").DistributedOptimizer]:
            try:
                attempt()
            except ImportError as error:
                print(error)
            else:
                raise AssertionError("no ImportError")
        assert "DistributedOptimizer" not in hc.__all__
        assert not hasattr(hc, "no_such_name")
    """)
    assert out.count("hvd_compress.DistributedOptimizer needs Horovod") == 2
    assert "ci/setup.sh" in out and "torchrun" in out


def test_each_integration_has_one_public_module_and_the_horovod_one_needs_horovod():
    out = run_without_horovod("""
        import hvd_compress.ddp, hvd_compress.fsdp, hvd_compress.diloco
        import hvd_compress as hc
        assert hvd_compress.diloco.DiLoCo is hc.DiLoCo
        try:
            import hvd_compress.horovod
        except ImportError as error:
            print(error)
    """)
    assert "hvd_compress.horovod needs Horovod" in out and "ci/setup.sh" in out


@pytest.mark.parametrize(
    "former, now",
    [
        pytest.param("stock", "horovod.compression", marks=NEEDS_HOROVOD),
        pytest.param("optimizer", "horovod.optimizer", marks=NEEDS_HOROVOD),
        pytest.param("elastic", "horovod.elastic", marks=NEEDS_HOROVOD),
        ("ddp", "torch.ddp"),
        ("fsdp", "torch.fsdp"),
        ("outer", "torch.diloco"),
    ],
)
def test_an_integration_module_imports_under_its_former_name_with_a_deprecation_warning(former, now):
    import importlib

    module = importlib.import_module(f"hvd_compress.integration.{now}")
    sys.modules.pop(f"hvd_compress.integration.{former}", None)
    with pytest.warns(DeprecationWarning, match=f"integration.{former} is now hvd_compress.integration.{now}"):
        assert importlib.import_module(f"hvd_compress.integration.{former}") is module
    assert module.__spec__.name == module.__name__ == f"hvd_compress.integration.{now}"


def test_diloco_without_any_backend_says_what_to_initialise():
    out = run_without_horovod("""
        import torch
        import hvd_compress as hc
        model = torch.nn.Linear(4, 2)
        outer = hc.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), inner_steps=2)
        model(torch.ones(1, 4)).sum().backward()
        try:
            outer.step()
        except RuntimeError as error:
            print(error)
    """)
    assert "torch.distributed.init_process_group()" in out


def test_a_compressor_pickled_with_horovod_loads_without_it():
    """The public classes are named hvd_compress.<ClassName> either way."""
    pytest.importorskip("horovod.torch")
    pickled = pickle.dumps(hc.PowerSGD(rank=3))
    out = run_without_horovod(
        """
        import pickle
        compressor = pickle.loads(sys.stdin.buffer.read())
        print(type(compressor).__module__, type(compressor).__name__, compressor.config.default)
    """,
        stdin=pickled,
    )
    assert out.split() == ["hvd_compress", "PowerSGD", "3"]


def test_with_horovod_the_public_classes_are_horovod_compressors():
    """What stock hvd.DistributedOptimizer(compression=...) takes, and the wrapper is there."""
    pytest.importorskip("horovod.torch")
    from horovod.torch.compression import Compressor

    for cls in hc.PUBLIC.values():
        assert issubclass(cls, Compressor) and cls.__module__ == "hvd_compress"
    assert "DistributedOptimizer" in hc.__all__ and callable(hc.DistributedOptimizer)

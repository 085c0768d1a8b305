"""A stand-in for Horovod's import on the GPU lease machine (``ci/gpu/run.sh``), where Horovod is
not installed and cannot be built: ``import hvd_compress`` needs Horovod's names at import time, and the CUDA tier, the DDP hook and
the simulated world use none of them at run time. Any attribute is a distinct placeholder class
(subclassable, usable as a dict key); the handler registry is a list. Never on CI's path."""
import sys
import types


def stub_module(name):
    module = types.ModuleType(name)
    made = {}

    def __getattr__(attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return made.setdefault(attribute, type(attribute, (), {"__module__": name}))
    module.__getattr__ = __getattr__
    module.__path__ = []
    return module


def install():
    for name in ["horovod", "horovod.common", "horovod.runner", "horovod.torch", "horovod.torch.compression",
                 "horovod.torch.optimizer", "horovod.torch.mpi_ops", "horovod.torch.elastic",
                 "horovod.torch.elastic.state", "horovod.common.util", "horovod.common.exceptions"]:
        sys.modules[name] = stub_module(name)
    sys.modules["horovod"].__version__ = "none (an import stand-in)"
    registry = []
    state = sys.modules["horovod.torch.elastic.state"]
    state.get_handler_registry = lambda: list(registry)
    state.set_handler_registry = lambda new: registry.__init__(new)
    for parent, child in [("horovod", "torch"), ("horovod", "common"), ("horovod", "runner"),
                          ("horovod.torch", "elastic"), ("horovod.torch", "compression"),
                          ("horovod.torch", "optimizer"), ("horovod.torch", "mpi_ops"),
                          ("horovod.torch.elastic", "state")]:
        setattr(sys.modules[parent], child, sys.modules[f"{parent}.{child}"])

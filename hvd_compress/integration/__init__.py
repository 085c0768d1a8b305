"""Integrations, by engine: ``horovod/`` (the stock optimizer's Compression API, our
``DistributedOptimizer``, the elastic state handlers; imported only where Horovod is) and
``torch/`` (DDP's comm hook, FSDP2/HSDP's replicate exchange, DiLoCo). At this level, what both
use: the binding to a world (``binding.py``), the cross-rank configuration check
(``agreement.py``), mixed precision's overflow rule (``amp.py``) and gradient names (``names.py``).

The modules' former names (``integration.stock``, ``.optimizer``, ``.elastic``, ``.ddp``,
``.fsdp``, ``.outer``) still import, with a ``DeprecationWarning``, for one release.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

MOVED = {
    "stock": "horovod.compression",
    "optimizer": "horovod.optimizer",
    "elastic": "horovod.elastic",
    "ddp": "torch.ddp",
    "fsdp": "torch.fsdp",
    "outer": "torch.diloco",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a former module name and answers it with the module it moved to (one object under
    both names, so state set through either is the same), after a ``DeprecationWarning``."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, leaf = fullname.rpartition(".")
        if package != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        moved_to = f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(
            f"{spec.name} is now {moved_to}; the former name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(moved_to)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import machinery set the former name's spec on it


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

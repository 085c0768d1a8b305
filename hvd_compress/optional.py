"""Horovod is optional: torch alone serves ``hvd_compress.ddp``, ``hvd_compress.fsdp`` and
``hvd_compress.DiLoCo`` under ``torchrun``. The package asks here whether Horovod imports before
it loads its Horovod modules, and a Horovod-only entry point reached without Horovod raises
here, naming itself and how to install Horovod. A leaf, like ``arguments.py``: every layer may
use it."""

from functools import lru_cache
from types import ModuleType

INSTALL_HOROVOD = (
    "install Horovod with PyTorch support (Horovod 0.28.1 needs a C++17 patch to build against "
    "torch >= 2.1: from an hvd_compress checkout, `bash ci/setup.sh` builds and installs it; "
    "DEVELOPERS.md says how)"
)


@lru_cache(maxsize=None)  # asked once per exported class; a failed import is not cached by Python
def horovod_available() -> bool:
    """Whether ``horovod.torch`` imports here (a Horovod built without PyTorch does not)."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return False
    return True


def import_horovod(entry_point: str) -> ModuleType:
    """``horovod.torch``, or an ImportError that names ``entry_point`` and how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as error:
        raise ImportError(
            f"{entry_point} needs Horovod, which does not import here ({error}): "
            f"{INSTALL_HOROVOD}. Without Horovod, hvd_compress.ddp, hvd_compress.fsdp and "
            f"hvd_compress.DiLoCo run under torchrun with torch alone."
        ) from error
    return hvd

"""hvd_compress: gradient compression for Horovod + PyTorch.

Layers, from the bottom up (each imports only the ones below it):
  maths/         pure tensor functions (low-rank, quantisation, top-k); no communication
  comm/          the communication plan: rounds, collectives, the driver, backends, a simulated
                 world, and the transports that carry decisions and configurations between ranks
  compressors/   per-parameter state and settings; each builds rounds from a gradient; one frozen
                 configuration object per method (``compressors/config.py``)
  control/       adaptive controllers (L-GreCo, GraVAC) and the rank-0 decision service; they use
                 compressors only through the controller protocol of ``compressors/tuning.py``
  integration/   by engine: horovod/ (the stock optimizer's Compression API, our
                 DistributedOptimizer, the elastic state handlers) and torch/ (DDP's comm hook,
                 HSDP's replicate exchange, DiLoCo's outer loop: local steps, compressed
                 pseudo-gradients); one public module each: ``hvd_compress.horovod``,
                 ``hvd_compress.ddp``, ``hvd_compress.fsdp``, ``hvd_compress.diloco``
``metrics.py`` exports per-step metrics (TensorBoard, JSON lines); ``advise/`` projects every
method's step time on the user's own model and ranks (``python -m hvd_compress.advise``).
``registry.py`` names every method once; the classes exported here come from it. ``arguments.py``
and ``optional.py`` are leaves every layer may use.

Horovod is optional. torch alone serves ``hvd_compress.ddp``, ``hvd_compress.fsdp`` and
``DiLoCo`` under ``torchrun``, with every compressor and controller. Where Horovod is installed,
the exported compressors also have its Compression API, ``DistributedOptimizer`` is there, and
importing the package makes every compressor (and ``DiLoCo``) part of ``hvd.elastic.TorchState``
(``integration/horovod/elastic.py``); without it, ``hvd_compress.DistributedOptimizer`` raises an
ImportError that says how to install Horovod.

Use with stock Horovod::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_compress.PowerSGD(model.named_parameters(), rank=4))

or with the wrapper, which overlaps multi-round compressors with backward::

    opt = hvd_compress.DistributedOptimizer(opt, model.named_parameters(), hvd_compress.PowerSGD(rank=4))
"""

from hvd_compress.comm.fusion import ScaledFusion
from hvd_compress.compressors.base import Compressor
from hvd_compress.control.gravac import GraVACConfig, GraVACPolicy
from hvd_compress.control.lgreco_config import Accordion
from hvd_compress.comm.transports import DecisionTimeout
from hvd_compress.integration.torch.diloco import DiLoCo, SparseLoCo, StreamingDiLoCo
from hvd_compress.optional import horovod_available, import_horovod
from hvd_compress.registry import COMPRESSORS, CONTROLLERS, PUBLIC
from hvd_compress import metrics

globals().update(PUBLIC)

HOROVOD_ONLY = ["DistributedOptimizer"]
if horovod_available():
    from hvd_compress.integration.horovod import elastic  # noqa: F401  (registers the elastic state handlers)
    from hvd_compress.integration.horovod.optimizer import DistributedOptimizer
else:

    def __getattr__(name: str) -> object:
        """A Horovod-only name without Horovod: an ImportError that says how to install it."""
        if name in HOROVOD_ONLY:
            import_horovod(f"hvd_compress.{name}")
        raise AttributeError(f"module 'hvd_compress' has no attribute {name!r}")


__all__ = sorted(
    [
        "Accordion",
        "COMPRESSORS",
        "CONTROLLERS",
        "Compressor",
        "DecisionTimeout",
        "DiLoCo",
        "GraVACConfig",
        "GraVACPolicy",
        "ScaledFusion",
        "SparseLoCo",
        "StreamingDiLoCo",
        "metrics",
        *PUBLIC,
        *(HOROVOD_ONLY if horovod_available() else []),
    ]
)

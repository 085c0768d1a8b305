"""hvd_compress: gradient compression for Horovod + PyTorch.

Layers, from the bottom up (each imports only the ones below it):
  maths/         pure tensor functions (low-rank, quantisation, top-k); no communication
  comm/          the communication plan: rounds, collectives, the driver, backends, a simulated
                 world, and the transports that carry decisions and configurations between ranks
  compressors/   per-parameter state and settings; each builds rounds from a gradient; one frozen
                 configuration object per method (``compressors/config.py``)
  control/       adaptive controllers (L-GreCo, GraVAC) and the rank-0 decision service; they use
                 compressors only through the controller protocol of ``compressors/base.py``
  integration/   Horovod (the stock optimizer's Compression API, our DistributedOptimizer, the
                 elastic state handler), PyTorch DDP's comm hook (``hvd_compress.ddp``) and HSDP's
                 replicate exchange (``hvd_compress.fsdp``)
``metrics.py`` exports per-step metrics (TensorBoard, JSON lines); ``advise.py`` projects every
method's step time on the user's own model and ranks (``python -m hvd_compress.advise``).
``registry.py`` names every method once; the classes exported here come from it. ``arguments.py``
is a leaf every layer may use. Importing the
package makes every compressor part of ``hvd.elastic.TorchState`` (``integration/elastic.py``).

Use with stock Horovod::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_compress.PowerSGD(model.named_parameters(), rank=4))

or with the wrapper, which overlaps multi-round compressors with backward::

    opt = hvd_compress.DistributedOptimizer(opt, model.named_parameters(), hvd_compress.PowerSGD(rank=4))
"""
from hvd_compress.comm.fusion import ScaledFusion
from hvd_compress.compressors.base import Compressor
from hvd_compress.control.gravac import GraVACPolicy
from hvd_compress.control.lgreco import Accordion
from hvd_compress.comm.transports import DecisionTimeout
from hvd_compress.integration.optimizer import DistributedOptimizer
from hvd_compress.registry import COMPRESSORS, CONTROLLERS, PUBLIC
from hvd_compress import metrics

globals().update(PUBLIC)

__all__ = sorted(["Accordion", "COMPRESSORS", "CONTROLLERS", "Compressor", "DecisionTimeout", "DistributedOptimizer",
                  "GraVACPolicy", "ScaledFusion", "metrics", *PUBLIC])

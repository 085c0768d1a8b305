"""hvd_compress: gradient compression for Horovod + PyTorch.

Layers, from the bottom up (each imports only the ones below it):
  maths/         pure tensor functions (low-rank, quantisation, top-k); no communication
  comm/          the communication plan: rounds, collectives, the driver, backends, a simulated world
  compressors/   per-parameter state and settings; each builds rounds from a gradient
  control/       adaptive controllers (L-GreCo, GraVAC) and the rank-0 decision service; they use
                 compressors only through the controller protocol of ``compressors/base.py``
  integration/   Horovod: the stock optimizer's Compression API, and our DistributedOptimizer;
                 DiLoCo's outer loop (local steps, compressed pseudo-gradients)
``registry.py`` names every method once; the classes exported here come from it. Importing the
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
from hvd_compress.control.service import DecisionTimeout
from hvd_compress.integration.optimizer import DistributedOptimizer
from hvd_compress.integration.outer import DiLoCo
from hvd_compress.registry import COMPRESSORS, CONTROLLERS, PUBLIC

globals().update(PUBLIC)

__all__ = sorted(["Accordion", "COMPRESSORS", "CONTROLLERS", "Compressor", "DecisionTimeout", "DiLoCo", "DistributedOptimizer",
                  "GraVACPolicy", "ScaledFusion", *PUBLIC])

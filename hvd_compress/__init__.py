"""hvd_compress: gradient compression for Horovod + PyTorch.

Layers, from the bottom up:
  maths/         pure tensor functions (low-rank, quantisation, top-k); no communication
  comm/          the communication plan: rounds, collectives, the driver, a simulated world
  compressors/   per-parameter state and settings; each builds rounds from a gradient
  control/       adaptive controllers (L-GreCo, GraVAC) and the rank-0 decision service
  integration/   Horovod: the stock optimizer's Compression API, and our DistributedOptimizer

Use with stock Horovod::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_compress.PowerSGD(model.named_parameters(), rank=4))

or with the wrapper, which overlaps multi-round compressors with backward::

    opt = hvd_compress.DistributedOptimizer(opt, model.named_parameters(), hvd_compress.PowerSGD(rank=4))
"""
from hvd_compress.comm.fusion import ScaledFusion
from hvd_compress.compressors import (ACPSGD, BF16, FP16, QSGD, Compressor, NoCompression,
                                      PowerSGD, ScaleCom, TopK)
from hvd_compress.control.gravac import GraVAC, GraVACPolicy
from hvd_compress.control.lgreco import Accordion, LGreCo
from hvd_compress.integration.optimizer import DistributedOptimizer

__all__ = ["ACPSGD", "Accordion", "BF16", "Compressor", "DistributedOptimizer", "FP16", "GraVAC",
           "GraVACPolicy", "LGreCo", "NoCompression", "PowerSGD", "QSGD", "ScaleCom", "ScaledFusion",
           "TopK"]

"""Horovod: our ``DistributedOptimizer`` (``hvd_compress.horovod.DistributedOptimizer(opt,
model.named_parameters(), compressor)``), the Compression API every exported compressor has for
stock ``hvd.DistributedOptimizer(compression=...)``, and the elastic state handlers that make
compressors and ``DiLoCo`` part of ``hvd.elastic.TorchState``. Importing it without Horovod raises
an ImportError that says how to install Horovod."""

from hvd_compress.optional import import_horovod

import_horovod("hvd_compress.horovod")

from hvd_compress.integration.horovod.compression import StockCompression  # noqa: E402
from hvd_compress.integration.horovod.elastic import CompressionStateHandler, DiLoCoStateHandler  # noqa: E402
from hvd_compress.integration.horovod.optimizer import DistributedOptimizer  # noqa: E402

__all__ = ["CompressionStateHandler", "DiLoCoStateHandler", "DistributedOptimizer", "StockCompression"]

"""FSDP2: ``hvd_compress.fsdp.register(model, compressor)`` compresses HSDP's replicate
(inter-node) all-reduce with any compressor, or quantizes a 1-D mesh's reduce-scatter with
``QuantizedAllReduce``; the returned state saves with ``torch.distributed.checkpoint``."""

from hvd_compress.integration.torch.fsdp import State, register

__all__ = ["State", "register"]

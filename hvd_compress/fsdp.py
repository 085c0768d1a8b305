"""FSDP2 / HSDP: ``hvd_compress.fsdp.register(hsdp_model, compressor)`` compresses the replicate
(inter-node) all-reduce; the returned state saves with ``torch.distributed.checkpoint``."""

from hvd_compress.integration.torch.fsdp import State, register

__all__ = ["State", "register"]

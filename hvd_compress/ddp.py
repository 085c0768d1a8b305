"""PyTorch DDP communication hooks: ``hvd_compress.ddp.register(ddp_model, compressor)``, or
torch's pair ``ddp_model.register_comm_hook(hvd_compress.ddp.State(...), hvd_compress.ddp.hook)``."""

from hvd_compress.integration.torch.ddp import State, hook, register, scaled_bucket_cap_mb

__all__ = ["State", "hook", "register", "scaled_bucket_cap_mb"]

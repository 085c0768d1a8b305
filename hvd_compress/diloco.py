"""DiLoCo: H local steps, then compressed pseudo-gradients averaged across ranks and applied by an
outer optimizer: ``hvd_compress.diloco.DiLoCo(inner_optimizer, model.named_parameters(),
compressor, inner_steps=H)``, under ``torchrun`` or Horovod. ``SparseLoCo``: the same with sparse,
2-bit pseudo-gradients and error feedback in place of the outer momentum. ``StreamingDiLoCo``: the
model in fragments that exchange at staggered steps, each overlapped with the next inner steps."""

from hvd_compress.integration.torch.diloco import DiLoCo, DiLoCoConfig, SparseLoCo, StreamingDiLoCo, nesterov_outer

__all__ = ["DiLoCo", "DiLoCoConfig", "SparseLoCo", "StreamingDiLoCo", "nesterov_outer"]

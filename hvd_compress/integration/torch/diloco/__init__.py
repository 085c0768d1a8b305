"""DiLoCo and the methods built on it, one module each: ``diloco.py`` (:class:`DiLoCo`: local
steps, then an outer step on the averaged, compressed pseudo-gradients), ``sparseloco.py``
(:class:`SparseLoCo`: error feedback over sparse pseudo-gradients in place of the outer momentum)
and ``streaming.py`` (:class:`StreamingDiLoCo`: fragments that take their outer steps in turn)."""

from hvd_compress.integration.torch.diloco.diloco import DiLoCo, DiLoCoConfig, nesterov_outer
from hvd_compress.integration.torch.diloco.sparseloco import SparseLoCo
from hvd_compress.integration.torch.diloco.streaming import StreamingDiLoCo

__all__ = ["DiLoCo", "DiLoCoConfig", "SparseLoCo", "StreamingDiLoCo", "nesterov_outer"]

"""SparseLoCo's outer rule: sparse, 2-bit pseudo-gradients with error feedback, applied by plain SGD."""

import dataclasses
from typing import Any, Iterable, Tuple

import torch

from hvd_compress import arguments
from hvd_compress.compressors.chunked_topk import ChunkedTopK
from hvd_compress.integration.torch.diloco.diloco import DiLoCo


class SparseLoCo(DiLoCo):
    """DiLoCo whose outer momentum is error feedback over sparse pseudo-gradients: SparseLoCo
    (Sarfi et al. 2025, arXiv 2508.15706, section 3).

    Every ``inner_steps`` steps each rank adds its pseudo-gradient to its decayed residual,
    e = beta * e + delta, sends the top ``density`` of each chunk of e in ``bits`` bits
    (:class:`ChunkedTopK`), keeps what it did not send in e, and every rank applies the mean of
    what was sent with plain SGD at ``outer_lr``: theta = theta - outer_lr * mean. The decayed
    residual stands in for DiLoCo's Nesterov momentum, which is dropped; so the outer step adds
    no state beyond the residual.

    ::

        outer = hvd_compress.SparseLoCo(inner, model.named_parameters(), inner_steps=30)

    * ``density`` (default 0.02), ``chunk`` (4096 entries, 64 x 64 in the paper) and ``bits``
      (2): the paper's 1-3% of each chunk in 2 bits, about 85x fewer bytes than float32 per
      outer step at 2% (``ChunkedTopK``), on top of DiLoCo's ``inner_steps``-fold fewer steps.
    * ``feedback_decay`` (beta, default 0.95) and ``outer_lr`` (default 1.0): the paper's
      settings, as we read them; docs/benchmarks/diloco-local-steps-and-compressed-pseudo-gradients.md says what they
      give on this project's workloads.
    * ``min_numel`` (default 1024): smaller pseudo-gradients, and every 1-D one, are averaged
      dense.

    Everything else (checkpoints, the non-finite rule, elastic Horovod, ``process_set``) is
    DiLoCo's; the residual is the compression's state, in ``state_dict()["compression"]``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
        *,
        inner_steps: int,
        density: float = 0.02,
        chunk: int = 4096,
        bits: int = 2,
        feedback_decay: float = 0.95,
        outer_lr: float = 1.0,
        min_numel: int = 1024,
        process_set: Any = None,
    ):
        outer_lr = arguments.real("SparseLoCo", "outer_lr", outer_lr, low=0, low_open=True)
        compression = ChunkedTopK(
            density=density, chunk=chunk, bits=bits, feedback_decay=feedback_decay, min_numel=min_numel
        )
        super().__init__(
            optimizer,
            named_parameters,
            compression,
            inner_steps=inner_steps,
            outer_optimizer=lambda anchors: torch.optim.SGD(anchors, lr=outer_lr),
            process_set=process_set,
        )
        # Checked across ranks and against checkpoints with the rest: a rank with another
        # outer learning rate would move its copy of the shared weights apart.
        self.config = dataclasses.replace(self.config, outer_optimizer=f"SGD(lr={outer_lr})")

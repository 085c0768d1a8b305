"""Pure FSDP: FSDP2's reduce-scatter replaced by a quantized one (``QuantizedReduceScatter``,
its state ``ShardedState``).

Over a mesh with a shard dimension only, the one gradient collective is the reduce-scatter;
:func:`register` replaces it, through FSDP2's public ``set_custom_reduce_scatter``, by the first
hop of ``QuantizedAllReduce`` alone (ZeRO++'s qgZ, Wang et al. 2023, arXiv 2306.10209, section
4.3, with error feedback on each rank's own input): each rank adds its residuals to the group's
flat gradient buffer (W rows of m entries, row j rank j's rows of every parameter), quantizes
each row per block (the compressor's default bits, int8 unless set, and ``block_size``; one
float32 scale a block), sends row j to rank j (``all_to_all_single`` on uint8 bytes) and keeps
what quantisation left out as its residuals. The receiver decodes the W rows, divides each by W
first (``comm.rounds.divides_first``) where FSDP asks for the average, sums them in float32 and
writes FSDP's reduce-scatter output, which FSDP then divides (its float16 factors), casts and
stores as gradients as it would its own. Bytes a rank sends per group: (W-1)/W (m bits / 8 +
4 m / block_size), against (W-1)/W 4 m for a float32 reduce-scatter.

* Only ``QuantizedAllReduce`` is accepted (``ValueError`` naming ``compressor`` otherwise): the
  other compressors' payloads do not decode row by row into a sum. Per-parameter settings
  (``set_setting``, controllers) do not apply: a group's rows are quantized as one buffer.
* Residuals: one per parameter, float32, the full parameter's shape (each rank quantized the
  whole gradient, every rank's rows), in the compressor's error feedback under the parameter's
  name (``compressor.residual(name)``); the second hop's residual is unused. They are staged
  and kept at the end of backward, and saved by :class:`ShardedState` as by :class:`State`.
* Non-finite steps: an Inf on one rank reaches only the rows decoded from its blocks, so at the
  end of backward every rank learns (a MIN over the shard group) whether any output was
  non-finite; if one was, every gradient is made NaN on every rank and the step's residuals
  are dropped (``reject_step``).
* Meshes: a 1-D mesh (or a 1-D slice of a larger one), parameters ``Shard(0)``; other
  placements and a custom ``set_gradient_divide_factor`` are refused. Unused parameters reduce
  as zeros (``set_reduce_scatter_unused_params``), so every group's layout is fixed.
* Gradient accumulation: ``set_requires_gradient_sync(False)`` micro-batches do not reduce;
  the synchronised backward quantizes their sum once.
"""

from typing import Any, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from hvd_compress.compressors.base import GradientCompression
from hvd_compress.compressors.qallreduce import QuantizedAllReduce
from hvd_compress.integration.binding import Binding, TorchGroup
from hvd_compress.integration.torch.fsdp.base import Checkpointed, finite_everywhere
from hvd_compress.maths.finite import all_finite


class ShardedState(Checkpointed):
    """The quantized reduce-scatter of one pure FSDP model; :func:`register` makes it.

    ``compressor``: the ``QuantizedAllReduce`` whose ``bits`` (its default) and ``block_size``
    it uses and whose error feedback holds each parameter's residual (``residual(name)``: float32,
    the full parameter's shape); ``iter``: steps reduced so far; ``group``: the shard group. A
    ``torch.distributed.checkpoint`` ``Stateful``."""

    def __init__(self, compressor: GradientCompression, model: FSDPModule, groups):
        if not isinstance(compressor, QuantizedAllReduce):
            raise ValueError(
                f"hvd_compress.fsdp.register: compressor: pure FSDP (a mesh without a "
                f"replicate dimension) accepts QuantizedAllReduce only, got "
                f"{type(compressor).__name__}"
            )
        compressor.serve(self, "a pure FSDP model (hvd_compress.fsdp.register)", argument="compressor")
        self.compressor = compressor
        self.iter = 0
        self.group = groups[0][1].mesh_info.shard_process_group
        group = self.group
        # Binds the compressor to the shard group; its cross-rank configuration check names
        # global ranks. FSDP stores the reduced shards itself: no results into gradients.
        self._binding = Binding(
            compressor,
            TorchGroup(group),
            replaces_gradients=False,
            rank_name=lambda rank: dist.get_global_rank(group, rank),
        )
        self._world_shape = [self.group.size()]
        # Residuals are gradient-shaped: their shapes do not depend on the world.
        self._local_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self._params = [p for _, _, params in groups for p in params]
        self._verdicts: List[torch.Tensor] = []  # whether each reduce-scatter output was finite

    def _after_reduce_scatter(self, output: torch.Tensor) -> None:
        """Called by each group's reduce-scatter: this rank's verdict on its output, and the
        step's end queued after FSDP has stored every group's shards (one callback per group,
        not per backward, as :class:`State`'s: the first does the work, the others find none)."""
        self._verdicts.append(all_finite(output))
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        """An Inf on one rank reaches only the shards decoded from its blocks: every rank learns
        (a MIN over the shard group) whether any output was non-finite, and if one was, makes
        every gradient NaN (the user's or ``GradScaler``'s check skips the step everywhere) and
        drops the step's residuals (``reject_step``)."""
        if not self._verdicts:
            return
        verdicts, self._verdicts = self._verdicts, []
        if not finite_everywhere(verdicts, (self.group,), verdicts[0].device):
            for param in self._params:
                if param.grad is not None:
                    param.grad.to_local().fill_(float("nan"))
            self.compressor.reject_step()
        self.iter += 1
        self.compressor.end_step()


class QuantizedReduceScatter(ReduceScatter):
    """One parameter group's reduce-scatter, quantized: the first hop of ``QuantizedAllReduce``
    (ZeRO++'s qgZ, Wang et al. 2023, arXiv 2306.10209, section 4.3) with error feedback on this
    rank's input (Karimireddy et al. 2019), through FSDP2's ``set_custom_reduce_scatter``.

    FSDP hands a flat input of W rows (W: the shard group's size) of m entries each, row j the
    concatenation of every parameter's rows on rank j (each zero-padded to ceil(dim0 / W) rows),
    and a flat output of m entries, this rank's row of the reduction. Each row, plus this rank's
    residuals laid out the same way, is quantized per block (``maths.absmax``, rows zero-padded
    to a multiple of 32 entries); the residuals become what quantisation left out. Row j's
    bytes go to rank j (``all_to_all_single`` on uint8); the receiver decodes the W rows, divides
    each by W first where FSDP asked for the average (``ReduceOp.AVG``; ``comm.rounds.divides_first``)
    and sums them in float32 into the output. Raises ``ValueError`` for another reduce op (a
    custom divide factor), an input that is not the group's parameters, or ranks configured
    differently (at the first call, on every rank)."""

    def __init__(self, state: ShardedState, layout: List[Tuple[str, Tuple[int, ...]]]):
        self._state = state
        self._layout = layout  # (name, full shape) of the group's parameters, in FSDP's order

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"hvd_compress.fsdp: the quantized reduce-scatter sums or averages, FSDP asked for {op}")
        # Every rank reaches its first reduce-scatter together: ranks configured differently
        # (bits, block size) raise here, naming the difference, not in a mismatched all-to-all.
        self._state._binding.check_configuration()
        compressor = self._state.compressor
        size, m = group.size(), output_tensor.numel()
        rows = compressor.quantize_reduce_scatter(input_tensor.view(size, m), self._layout)
        received = torch.empty_like(rows)
        dist.all_to_all_single(received, rows, group=group)
        values = compressor.decode_reduce_scatter(received, m)
        if op == dist.ReduceOp.AVG:
            values.div_(size)
        output_tensor.copy_(values.sum(dim=0)[:m])
        self._state._after_reduce_scatter(output_tensor)


def replace_reduce_scatter(model: FSDPModule, compressor: GradientCompression, groups) -> ShardedState:
    """The :class:`ShardedState` of ``model``'s quantized reduce-scatter, installed: each of
    ``groups`` (``(FSDP module, its parameter group, its parameters)``, over a 1-D mesh) reduces
    through its own :class:`QuantizedReduceScatter`. Raises ``ValueError`` where ``compressor``
    is not a ``QuantizedAllReduce``."""
    sharded = ShardedState(compressor, model, groups)
    names = {id(p): name for name, p in model.named_parameters()}
    for module, _, params in groups:
        module.set_custom_reduce_scatter(
            QuantizedReduceScatter(sharded, [(names[id(p)], tuple(p.shape)) for p in params])
        )
    return sharded

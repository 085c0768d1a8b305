"""What HSDP's ``State`` and pure FSDP's ``ShardedState`` share: their checkpoint
(``Checkpointed``) and the step's finiteness verdict over the mesh (``finite_everywhere``).

Checkpoints: :class:`State` (and :class:`ShardedState`) is a ``torch.distributed.checkpoint``
``Stateful``; save it beside the model and optimizer (``{"model": ..., "optim": ..., "compression":
state}``). Its state dict
holds every rank's compressor state (gathered at save: each rank's error feedback is its own),
so a resume at the same world shape is bit-identical. At another world shape it restores
everything but error feedback where the shards keep their shapes (another number of replicas);
where the shard group's size changed, warm starts of reshaped shards are dropped too, and a
controller restarts its schedule with its compressor's settings restored.
"""

import io
import logging
from typing import Any, Dict, List

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Checkpointed:
    """The ``torch.distributed.checkpoint`` ``Stateful`` of :class:`State` and
    :class:`ShardedState`: ``compressor``, ``iter``, ``_world_shape`` (the mesh's sizes) and
    ``_local_shapes`` (name -> the shape the compressor's state of it has)."""

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's compressor state (a collective over the world: DCP calls it on every
        rank), the world shape it was taken at and the local shard shapes."""
        buffer = io.BytesIO()
        torch.save({"compressor": self.compressor.state_dict(), "iter": self.iter}, buffer)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, buffer.getvalue())
        return {
            "world_shape": list(self._world_shape),
            "ranks": everyone,
            "shapes": {name: list(shape) for name, shape in sorted(self._local_shapes.items())},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """This rank's own state at the same world shape. Otherwise rank 0's, without error
        feedback, and without the warm starts of shards whose shape changed (another shard
        group size); there a controller restarts its schedule (its statistics are per shard)
        and only its compressor's state, the per-layer settings included, comes back."""
        same_world = (
            list(state_dict["world_shape"]) == list(self._world_shape)
            and len(state_dict["ranks"]) == dist.get_world_size()
        )
        source = dist.get_rank() if same_world else 0
        saved = torch.load(io.BytesIO(state_dict["ranks"][source]), weights_only=True)
        compressor_state = saved["compressor"]
        self.iter = saved["iter"]
        if same_world:
            self.compressor.load_state_dict(compressor_state)
            return
        compressor_state = self.compressor.world_change_state(compressor_state)
        changed = {name for name, shape in state_dict["shapes"].items() if tuple(shape) != self._local_shapes.get(name)}
        if not changed:
            self.compressor.load_state_dict(compressor_state)
            return
        if self.compressor.wrapped is not None:
            logger.warning(
                "hvd_compress.fsdp: the checkpoint's shards have other shapes (%d "
                "parameters); %s restarts its schedule, its compressor's settings "
                "come back",
                len(changed),
                type(self.compressor).__name__,
            )
        self.compressor.restart_from(compressor_state, forget=changed)


def finite_everywhere(verdicts: List[torch.Tensor], groups, device: torch.device) -> bool:
    """Whether every rank's reduced outputs were finite: each rank's ``verdicts`` (0-d bools;
    none: finite) as one value, its MIN over each of ``groups`` in turn. Collective over them."""
    verdict = torch.ones(1, dtype=torch.float32, device=device)
    if verdicts:
        verdict.mul_(torch.stack(verdicts).all())
    for group in groups:
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    return bool(verdict.item() == 1)

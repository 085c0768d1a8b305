"""Elastic Horovod: an hvd_compress compressor (or controller) as part of the elastic state.

    state = hvd.elastic.TorchState(model, optimizer, compression=compression, step=0)

Importing ``hvd_compress`` adds :class:`CompressionStateHandler` to Horovod's registry of state
handlers (``horovod.torch.elastic.state.set_handler_registry``, Horovod's extension point), so
``TorchState`` handles any ``GradientCompression`` keyword as it handles the model:

* ``state.commit()`` saves ``elastic_state_dict()`` (copies; L-GreCo leaves a decision in
  flight out rather than wait for it);
* after a worker fails, ``restore()`` puts back the committed state, this process's error
  feedback included;
* after every reset (and when training starts), ``sync()`` sends rank 0's state to every rank,
  error feedback excepted: it follows ``compression.feedback_on_world_change`` ("keep": each
  process keeps its own residuals and a joining one starts from zero; "reset": all start from
  zero). The compression is bound to the new rank and size (``binding.reform_world``), which
  makes every ``integration.binding.Binding`` stale: the integration (the stock bridge,
  ``hvd_compress.DistributedOptimizer``, ``DiLoCo``) binds anew at its next step. A reset that
  only removed workers skips ``sync()`` in Horovod; the binding sees the new size at the next
  step and the integration rebinds then.

``hvd_compress.DiLoCo`` goes through the same handler (:class:`DiLoCoStateHandler` names where its
compression's state sits).

Elastic Horovod runs with the Gloo controller (``horovodrun --gloo`` is implied by
``--host-discovery-script``); the exchange runs among all ranks (``hvd.global_process_set``).
Imported by ``hvd_compress`` only where Horovod is.
"""

import logging
from typing import Any, Dict

import horovod.torch as hvd
from horovod.torch.elastic import state as elastic_state

from hvd_compress.compressors.base import GradientCompression
from hvd_compress.integration.binding import reform_world
from hvd_compress.integration.torch.diloco import DiLoCo

logger = logging.getLogger(__name__)

FEEDBACK_POLICIES = ("keep", "reset")


class CompressionStateHandler(elastic_state.StateHandler):
    """The one elastic handler: commit, restore and sync of a value whose ``elastic_state_dict``
    holds a compression's state. For a ``GradientCompression`` that state is the whole of it;
    :class:`DiLoCoStateHandler` names where it sits within DiLoCo's."""

    sync_name = "hvd_compress.elastic.sync"

    def __init__(self, value: Any):
        super().__init__(value)
        self._saved = value.elastic_state_dict()

    def compression(self) -> GradientCompression:
        return self.value

    def part(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The compression's state within the value's ``state``."""
        return state

    def with_part(self, state: Dict[str, Any], part: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` with ``part`` as the compression's state."""
        return part

    def save(self) -> None:
        self._saved = self.value.elastic_state_dict()

    def restore(self) -> None:
        compression, own = self.compression(), self.part(self._saved)
        self.value.load_state_dict(
            self.with_part(
                self._saved, compression.world_change_state(own, own=own, rank=compression.rank, size=compression.size)
            )
        )

    def sync(self) -> None:
        compression = self.compression()
        policy = compression.feedback_on_world_change
        if policy not in FEEDBACK_POLICIES:
            raise ValueError(
                f"{type(compression).__name__}.feedback_on_world_change must be one of "
                f"{', '.join(FEEDBACK_POLICIES)}, got {policy!r}"
            )
        mine = self.value.elastic_state_dict() if policy == "keep" or hvd.rank() == 0 else None
        shared = None
        if hvd.rank() == 0:  # the receivers take their rank, size and feedback from themselves
            shared = self.with_part(mine, compression.world_change_state(self.part(mine), rank=0, size=1))
        shared = hvd.broadcast_object(shared, root_rank=0, name=self.sync_name)
        rank, size = hvd.rank(), hvd.size()
        # Bound at once (the state loaded next is checked against it); every integration's
        # binding is stale from here and is made anew at its next step.
        reform_world(compression, rank, size)
        own = self.part(mine) if policy == "keep" else None
        self.value.load_state_dict(
            self.with_part(shared, compression.world_change_state(self.part(shared), own=own, rank=rank, size=size))
        )
        if rank == 0:
            logger.info(
                "hvd_compress: %s synchronised in a world of %d ranks (error feedback: %s)",
                type(self.value).__name__,
                size,
                policy,
            )


class DiLoCoStateHandler(CompressionStateHandler):
    """``hvd.elastic.TorchState(model, inner, outer=diloco, ...)``: a commit saves DiLoCo's state,
    a failed worker's survivors restore it, and after every reset rank 0's state (anchors, outer
    optimizer, step within the period, codec settings) goes to every rank; error feedback follows
    ``compression.feedback_on_world_change`` as anywhere else. The model handler then sends rank
    0's weights, so every rank continues the period from rank 0's local weights. The wrapper
    binds to the new world at its next step. Ahead of Horovod's optimizer handler, which would
    take DiLoCo for a torch optimizer."""

    sync_name = "hvd_compress.diloco.sync"

    def compression(self) -> GradientCompression:
        return self.value.compression

    def part(self, state: Dict[str, Any]) -> Dict[str, Any]:
        return state["compression"]

    def with_part(self, state: Dict[str, Any], part: Dict[str, Any]) -> Dict[str, Any]:
        return dict(state, compression=part)


# DiLoCo ahead of Horovod's optimizer handler, which would take it for a torch optimizer.
elastic_state.set_handler_registry(
    [
        (DiLoCo, DiLoCoStateHandler),
        *elastic_state.get_handler_registry(),
        (GradientCompression, CompressionStateHandler),
    ]
)

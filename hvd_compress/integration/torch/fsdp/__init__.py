"""Compression of FSDP2's gradient exchange (``torch.distributed.fsdp.fully_shard``):
``hvd_compress.fsdp.register(model, compressor)``. Over a 2-D ``("replicate", "shard")`` mesh
(HSDP) it compresses the replicate all-reduce with any compressor (``hsdp.py``); over a 1-D mesh
(pure FSDP) it quantizes the reduce-scatter with ``QuantizedAllReduce``
(``quantized_reduce_scatter.py``). Both states save with ``torch.distributed.checkpoint``
(``base.py``).
"""

from typing import Union

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
from torch.distributed.tensor import DTensor, Replicate, Shard

from hvd_compress.comm.fusion import ScaledFusion
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.integration.torch.fsdp.hsdp import State, replace_replicate_all_reduce
from hvd_compress.integration.torch.fsdp.quantized_reduce_scatter import (
    QuantizedReduceScatter,
    ShardedState,
    replace_reduce_scatter,
)

__all__ = ["QuantizedReduceScatter", "ShardedState", "State", "register"]


def _param_groups(model):
    """(whether the model is HSDP, [(FSDP module, its parameter group, its parameters)]) for
    every FSDP module of ``model``: HSDP (a replicate and a shard dimension) or pure FSDP (a
    shard dimension only), over one mesh; ValueError naming what is neither."""
    if not isinstance(model, FSDPModule):
        raise ValueError(
            f"hvd_compress.fsdp.register: model must be an FSDP2 module (after "
            f"torch.distributed.fsdp.fully_shard), got {type(model).__name__}"
        )
    found = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if not isinstance(group.mesh_info, FSDPMeshInfo):
                raise ValueError(
                    "hvd_compress.fsdp.register: replicate-only meshes (fully_shard without a "
                    "shard dimension) are not supported: use the DDP comm hook "
                    "(hvd_compress.ddp.register)"
                )
            found.append((module, group, [p.sharded_param for p in group.fsdp_params]))
    if not found:
        raise ValueError("hvd_compress.fsdp.register: the model has no parameters managed by FSDP")
    first = found[0][1].mesh_info
    hsdp = isinstance(first, DDPMeshInfo)
    placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
    for _, group, params in found:
        if group.mesh_info.mesh != first.mesh or isinstance(group.mesh_info, DDPMeshInfo) != hsdp:
            raise ValueError("hvd_compress.fsdp.register: every fully_shard of the model must use the same mesh")
        for param in params:
            if not (isinstance(param, DTensor) and tuple(param.placements) == placements):
                raise ValueError(
                    f"hvd_compress.fsdp.register: parameters must be sharded on dim 0 "
                    f"({'HSDP' if hsdp else 'FSDP'}'s {placements}); one has "
                    f"placements {getattr(param, 'placements', None)}"
                )
        if group.gradient_divide_factor is not None:
            raise ValueError(
                "hvd_compress.fsdp.register: set_gradient_divide_factor is not "
                "supported: the compressed exchange averages over its group"
            )
    return hsdp, found


def register(
    model: FSDPModule, compressor: GradientCompression, *, fusion: ScaledFusion = ScaledFusion()
) -> Union[State, ShardedState]:
    """Compresses ``model``'s gradient exchange with ``compressor``; returns the
    :class:`State` or :class:`ShardedState` (save it with ``torch.distributed.checkpoint``).
    Call once, after ``fully_shard`` and before the first backward; the one line a script adds.

    HSDP (a ("replicate", "shard") mesh): the replicate all-reduce, by ``compressor`` (a
    compressor or controller from the registry, built with or without the model's
    ``named_parameters``: it compresses each rank's local shards under the parameters' names
    either way); it replaces any ``set_all_reduce_hook`` of the model's modules::

        state = hvd_compress.fsdp.register(model, hvd_compress.PowerSGD(rank=4))

    Pure FSDP (a mesh with a shard dimension only): the reduce-scatter, quantized with
    ``compressor``'s bits and block size; ``compressor`` must be a ``QuantizedAllReduce``
    (ValueError naming ``compressor`` otherwise); it replaces any ``set_custom_reduce_scatter``::

        state = hvd_compress.fsdp.register(model, hvd_compress.QuantizedAllReduce(bits=8))

    ``fusion``: how HSDP's payloads fuse, as in ``hvd_compress.DistributedOptimizer`` (default:
    25 MiB scaled by the compression rate; ``ScaledFusion(0)``: one collective per shard);
    pure FSDP sends one all-to-all per parameter group, as FSDP's own reduce-scatter."""
    if getattr(model, "_hvd_compress_fsdp", None) is not None:
        raise ValueError(
            "hvd_compress.fsdp.register: this model's gradient exchange is already compressed (register once)"
        )
    if not isinstance(fusion, ScaledFusion):
        raise ValueError(f"hvd_compress.fsdp.register: fusion must be a ScaledFusion, got {type(fusion).__name__}")
    is_hsdp, groups = _param_groups(model)
    state = (
        replace_replicate_all_reduce(model, compressor, groups, fusion)
        if is_hsdp
        else replace_reduce_scatter(model, compressor, groups)
    )
    # Every parameter is reduced, as zeros where unused: each group's layout is fixed (pure
    # FSDP's rows) and every rank runs the same exchanges (HSDP).
    model.set_reduce_scatter_unused_params(True)
    model._hvd_compress_fsdp = state
    return state

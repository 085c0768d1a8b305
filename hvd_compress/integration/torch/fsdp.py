"""Compression of FSDP2's gradient exchange (``torch.distributed.fsdp.fully_shard``):
``hvd_compress.fsdp.register(model, compressor)``. Over a 2-D ``("replicate", "shard")`` mesh
(HSDP) it compresses the replicate all-reduce with any compressor; over a 1-D mesh (pure FSDP)
it quantizes the reduce-scatter with ``QuantizedAllReduce`` (section "Pure FSDP").

What changes, and what does not
-------------------------------
HSDP reduces each gradient in two steps: a reduce-scatter over the shard group (inside a node:
fast links) leaves each rank the average of its shard group's gradients for its rows, then an
all-reduce over the replicate group (between nodes: the slow links) averages those shards across
replicas. :func:`register` replaces the second step by the compressor's exchange over the
replicate group; the reduce-scatter stays FSDP's own, exact. Each parameter's local shard (its
rows, in the parameter's shape) is one gradient to the compressor, named by the parameter's
fully qualified name, so error feedback and warm starts are kept per shard and per-layer
settings, L-GreCo and GraVAC see the same names as under DDP or Horovod.

How: FSDP2 has no public way to swap its replicate all-reduce. :func:`register` gives each of
the model's parameter groups a shard-only mesh description (torch's ``FSDPMeshInfo`` over the
same mesh and shard dimension, so FSDP reduce-scatters, averages over the shard group and skips
its own all-reduce), and installs a hook through the public ``set_all_reduce_hook``, which FSDP
calls after each group's reduce-scatter, before it stores the group's shards as gradients. The
exchange overlaps the rest of backward: each group's shards go through the compressor
(``RoundDriver.start`` on a ``TorchBackend`` over the replicate group) as soon as FSDP has stored
them, at the next group's hook, and their first rounds travel in fusion buckets across groups,
sized as the Horovod wrapper's (ACP-SGD's scaled fusion, ``comm.fusion.FusionScheduler``). When
backward ends (an autograd final callback, queued after FSDP's own), the groups left start, the
driver finishes, and each aggregate is written into its shard's gradient.
This reads torch 2.13's private parameter groups (their mesh descriptions and
``all_reduce_grads`` flag): a later torch may need this module updated.

Behaviour, as under DDP:

* ``backward()`` returns with the aggregated gradients in place; ``optimizer.step()`` follows.
* Collectives start in the same order on every rank whatever order FSDP reduced groups in (a
  layer unused on one rank is reduced at the end there): groups start in one fixed order, the
  reverse of the model's modules (the order backward usually reduces them in), each once every
  group before it has started, names sorted within a group. A group reduced out of that order
  waits for the ones before it, as a DDP bucket ready early waits for its predecessors.
* Unused parameters: :func:`register` turns on FSDP's ``set_reduce_scatter_unused_params``, so a
  parameter that got no gradient on some rank is reduced as zeros and exchanged like any other
  (error feedback included), and every rank runs the same exchanges.
* Gradient accumulation: ``set_requires_gradient_sync(False)`` (no communication until the last
  micro-batch) works unchanged. ``set_requires_all_reduce(False)`` (reduce-scatter only) keeps
  the shard-averaged partial sums in the gradients, and the first backward with the all-reduce
  on exchanges their sum once. Several synchronised backwards add their aggregates to the
  gradients, as FSDP does.
* Non-finite steps: the compressor's own check sees only its replicate group's shards. So after
  the exchange every rank learns, over both mesh dimensions (one scalar), whether any rank's
  reduced shard was non-finite; if one was, every aggregate is made NaN on every rank (the
  user's or ``GradScaler``'s check skips the step everywhere) and the compressor is told to drop
  the step (``reject_step``), which leaves no trace of it in its state.
* ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: FSDP reduce-scatters in bf16 and casts
  the shards back to the parameters' dtype; the compressor receives that (bf16-exact) shard and
  chooses the replicate exchange's wire format itself (``bf16`` sends it in 2 bytes an entry).
* A custom ``set_gradient_divide_factor`` is refused: the divide factor of HSDP's sum over both
  groups has no counterpart once the replicate exchange averages.

Pure FSDP: the quantized reduce-scatter
---------------------------------------
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
import math
from typing import Any, Dict, List, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
from torch.distributed.tensor import DTensor, Replicate, Shard

from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.compressors.qallreduce import QuantizedAllReduce
from hvd_compress.integration.binding import Binding, TorchGroup
from hvd_compress.maths.finite import all_finite

logger = logging.getLogger(__name__)


class _Checkpointed:
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


class State(_Checkpointed):
    """The compression of one HSDP model's replicate all-reduce; :func:`register` makes it.

    ``compressor``: the compressor or controller; ``iter``: steps exchanged so far. A
    ``torch.distributed.checkpoint`` ``Stateful`` (``state_dict``/``load_state_dict``)."""

    def __init__(self, compressor: GradientCompression, model: FSDPModule, groups, fusion: ScaledFusion):
        if not isinstance(compressor, GradientCompression):
            raise ValueError(
                f"hvd_compress.fsdp.register: compressor must be an hvd_compress "
                f"compressor or controller, got {type(compressor).__name__}"
            )
        compressor.serve(self, "an HSDP model (hvd_compress.fsdp.register)", argument="compressor")
        if compressor.parameters:  # built with named_parameters: the same names, each rank's shards
            compressor.use_shards({name: p.to_local() for name, p in model.named_parameters()})
        self.compressor = compressor
        self.iter = 0
        mesh_info = groups[0][1].mesh_info
        self.replicate_group = mesh_info.replicate_process_group
        self.shard_group = mesh_info.shard_process_group
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._world_shape = [mesh_info.replicate_mesh_size, mesh_info.shard_mesh_size]
        self._local_shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
        self._device = next(iter(model.parameters())).device
        # The exchange runs over the replicate group; its configuration errors name global ranks.
        group = self.replicate_group
        self._binding = Binding(compressor, TorchGroup(group), rank_name=lambda rank: dist.get_global_rank(group, rank))
        # The fixed order groups start their exchange in: the reverse of the model's modules;
        # each group's non-empty shards by name (an empty shard is empty on the whole replicate group).
        ordered = list(reversed(groups))
        self._position = {id(param_group): index for index, (_, param_group, _) in enumerate(ordered)}
        self._members = [
            sorted(name for name in (self._names[id(p)] for p in params) if math.prod(self._local_shapes[name]))
            for _, _, params in ordered
        ]
        # Payloads fuse across groups, in that order, into ACP-SGD's scaled buckets (as the
        # Horovod wrapper's): one collective per group would pay a collective's fixed cost per layer.
        self._fusion = FusionScheduler(
            compressor,
            {name: self._local_shapes[name] for names in self._members for name in names},
            fusion,
            rank=dist.get_rank(),
        )
        # position -> the group's parameters this backward reduced for the exchange ([] without
        # all-reduce: an accumulating micro-batch)
        self._fired: Dict[int, List[torch.nn.Parameter]] = {}
        self._next = 0  # position of the next group to start
        self._shards: Dict[str, torch.Tensor] = {}  # started this backward: name -> local shard
        self._verdicts: List[torch.Tensor] = []  # whether each started shard was finite
        self._partial = set()  # ids of parameters holding reduce-scattered but unexchanged sums
        self._prior: Dict[int, torch.Tensor] = {}  # id -> gradient accumulated before this exchange

    # ----- called by FSDP ------------------------------------------------------------------
    def _after_reduce_scatter(self, group, params, _reduce_output):
        """FSDP's all-reduce hook of one parameter group, run before FSDP stores the group's
        reduced shards as gradients: starts the groups whose shards FSDP has stored."""
        if group.gradient_divide_factor is not None:
            raise ValueError(
                "hvd_compress.fsdp: set_gradient_divide_factor is not supported: "
                "the replicate exchange averages over the replicate group"
            )
        exchanged = []
        for param in params:
            key = id(param)
            if key not in self._partial and param.grad is not None:
                # FSDP would add the new shard to it; set aside, added back after the exchange.
                self._prior[key] = param.grad
                param.grad = None
            if group.all_reduce_grads:
                self._partial.discard(key)
                exchanged.append(param)
            else:
                self._partial.add(key)
        if self._binding.active:
            self._start_ready(before=self._position[id(group)])
        self._fired[self._position[id(group)]] = exchanged
        # One callback per group, not per backward: the first to run does the step's work and
        # the others find nothing left, so a backward that raised leaves no stale flag behind.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _start_ready(self, before=None):
        """Starts, in the fixed order, every group that fired and has every group ahead of it
        started; ``before``: a group that fired just now (its shards are not stored yet) stops
        the walk. None (backward has ended): every group left goes, a group that did not fire
        (or fired without all-reduce) leaving its members out of their fusion buckets."""
        driver = self._binding.driver
        if self._next == 0:
            driver.use_plan(self._fusion.plan())
        last = len(self._position)
        while self._next < last and self._next != before and (before is None or self._next in self._fired):
            shards = {}
            for param in self._fired.get(self._next, ()):
                if param.grad is not None:  # else FSDP stored nothing (no gradient anywhere)
                    shards[self._names[id(param)]] = param.grad.to_local()
            for name in self._members[self._next]:
                if name in shards:
                    self._binding.check_configuration()
                    self._verdicts.append(all_finite(shards[name]))
                    self._binding.start(name, shards[name])
                    self._shards[name] = shards[name]
                else:
                    driver.leave_out(name)
            self._next += 1
        # No driver.poll(): torch.distributed matches collectives by issue order, and which round
        # lands first differs between ranks; finish() advances the rest in name order.

    def _end_of_backward(self):
        if not self._fired:
            return
        reduced = [param for params in self._fired.values() for param in params]
        try:
            if self._binding.active:
                self._start_ready()
                self._finish_exchange(bool(reduced))
        finally:
            self._fired, self._next, self._shards, self._verdicts = {}, 0, {}, []
            self._restore_priors(reduced)

    def _finish_exchange(self, exchanged):
        """Finishes the step's exchange where any group was reduced for it (``exchanged``, alike on
        every rank: FSDP reduces a group on all of them), even with no shard here to send: the
        finiteness agreement spans the shard group, whose other ranks may have shards."""
        if not exchanged:  # every group fired without all-reduce (accumulating micro-batches)
            self._binding.driver.use_plan(None)
            return
        results, comm_seconds = self._binding.finish(self._device)
        # The compressor's own check sees only its replicate group's aggregates.
        finite = _finite_everywhere(self._verdicts, (self.replicate_group, self.shard_group), self._device)
        for name, shard in self._shards.items():
            if finite:
                shard.copy_(results[name].view_as(shard))
            else:
                shard.fill_(float("nan"))
        if not finite:
            self.compressor.reject_step()
        self.iter += 1
        self.compressor.end_step(comm_seconds=comm_seconds)

    def _restore_priors(self, reduced):
        """Adds each gradient set aside before this exchange back (as FSDP would have)."""
        for param in reduced:
            prior = self._prior.pop(id(param), None)
            if prior is not None:
                if param.grad is not None:
                    prior.to_local().add_(param.grad.to_local())
                param.grad = prior


def _finite_everywhere(verdicts: List[torch.Tensor], groups, device: torch.device) -> bool:
    """Whether every rank's reduced outputs were finite: each rank's ``verdicts`` (0-d bools;
    none: finite) as one value, its MIN over each of ``groups`` in turn. Collective over them."""
    verdict = torch.ones(1, dtype=torch.float32, device=device)
    if verdicts:
        verdict.mul_(torch.stack(verdicts).all())
    for group in groups:
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    return bool(verdict.item() == 1)


class ShardedState(_Checkpointed):
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
        if not _finite_everywhere(verdicts, (self.group,), verdicts[0].device):
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


def _shard_only(mesh_info):
    """``mesh_info`` without its replicate dimension: FSDP then reduce-scatters (averaging over
    the shard group) and skips the all-reduce. Its separate reduce-scatter group, if set, stays."""
    shard_only = FSDPMeshInfo(
        mesh=mesh_info.mesh,
        shard_mesh_dim=mesh_info.shard_mesh_dim,
        dp_mesh_dims=mesh_info.dp_mesh_dims,
        spmd_mesh=mesh_info.spmd_mesh,
    )
    shard_only.reduce_scatter_process_group = mesh_info.reduce_scatter_process_group
    return shard_only


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
    hsdp, groups = _param_groups(model)
    if not hsdp:
        sharded = ShardedState(compressor, model, groups)
        names = {id(p): name for name, p in model.named_parameters()}
        for module, _, params in groups:
            module.set_custom_reduce_scatter(
                QuantizedReduceScatter(sharded, [(names[id(p)], tuple(p.shape)) for p in params])
            )
        # A fixed layout of each group's rows: every parameter is reduced, as zeros where unused.
        model.set_reduce_scatter_unused_params(True)
        model._hvd_compress_fsdp = sharded
        return sharded
    state = State(compressor, model, groups, fusion)
    for module, group, params in groups:
        old = group.mesh_info
        group.mesh_info = _shard_only(old)
        if group.post_forward_mesh_info is old:  # reshard_after_forward=True: the same mesh
            group.post_forward_mesh_info = group.mesh_info
        module.set_all_reduce_hook(
            lambda output, group=group, params=params: state._after_reduce_scatter(group, params, output)
        )
    model.set_reduce_scatter_unused_params(True)
    model._hvd_compress_fsdp = state
    return state

"""HSDP: FSDP2's replicate all-reduce replaced by any compressor's exchange (``State``).

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
"""

import math
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

from hvd_compress.comm.fusion import FusionScheduler, ScaledFusion
from hvd_compress.compressors.base import GradientCompression
from hvd_compress.integration.binding import Binding, TorchGroup
from hvd_compress.integration.torch.fsdp.base import Checkpointed, finite_everywhere
from hvd_compress.maths.finite import all_finite


class State(Checkpointed):
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
        finite = finite_everywhere(self._verdicts, (self.replicate_group, self.shard_group), self._device)
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


def replace_replicate_all_reduce(
    model: FSDPModule, compressor: GradientCompression, groups, fusion: ScaledFusion
) -> State:
    """The :class:`State` of ``model``'s compressed replicate exchange, installed: each of
    ``groups`` (``(FSDP module, its parameter group, its parameters)``, over a 2-D mesh) gets a
    shard-only mesh description (FSDP then skips its own all-reduce) and an all-reduce hook
    that starts the group's exchange. Raises ``ValueError`` where ``compressor`` is no
    compressor or controller."""
    state = State(compressor, model, groups, fusion)
    for module, group, params in groups:
        old = group.mesh_info
        group.mesh_info = _shard_only(old)
        if group.post_forward_mesh_info is old:  # reshard_after_forward=True: the same mesh
            group.post_forward_mesh_info = group.mesh_info
        module.set_all_reduce_hook(
            lambda output, group=group, params=params: state._after_reduce_scatter(group, params, output)
        )
    return state

"""One way to bind a compression to a world, shared by every integration.

A :class:`Binding` is a compression bound to one group's world as it stood when the binding was
made: the compression's rank and size (``bind_world``) and process set (``use_process_set``),
the ``RoundDriver`` on the group's backend, and the cross-rank configuration check, run once,
when the integration calls it (a collective). It never rebinds itself: an integration that may
outlive an elastic reset asks :meth:`Binding.stale` at its step and makes a new binding, so
everything that depends on the world is made in one place, one binding per world (Bagua's one
implementation per process group). The integrations keep only what is theirs: where gradients
come from, when the step's rounds start and finish, and where the results go.

Groups, one class per kind of process group:

* :class:`HorovodGroup`: a Horovod process set, Horovod's collectives and transport. An elastic
  reset can re-form its world, seen in :func:`current_world`.
* :class:`TorchGroup`: a ``torch.distributed`` process group; nothing re-forms it under a
  binding.

:func:`group_of` picks one for a ``process_set`` that may be either (``DiLoCo``).
:func:`reform_world` is how the elastic handlers (``integration/horovod/elastic.py``) rebind: the
compression takes its new rank and size at once, and every binding is stale from then on.

Nothing here imports Horovod at module level: ``DiLoCo``, DDP and HSDP run on torch alone.
"""

import sys
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

# Imported after init_process_group (every optimizer's constructor imports it), torch._dynamo
# keeps references to the default process group (torch 2.13), so destroy_process_group cannot
# stop Gloo's worker threads; one that then drops a finished collective's tensors during
# interpreter shutdown takes the GIL and aborts the process (DEVELOPERS.md). Imported with the
# package, before the user's init_process_group, it keeps none. Costs nothing an optimizer would not.
import torch._dynamo  # noqa: F401

from hvd_compress.comm.driver import RoundDriver
from hvd_compress.comm.fusion import FusionPlan
from hvd_compress.comm.horovod_backend import HorovodBackend
from hvd_compress.comm.timing import finished_at
from hvd_compress.comm.torch_backend import TorchBackend
from hvd_compress.comm.transports import DEFAULT_TORCH_GROUP, HorovodTransport, TorchTransport, uses_torch_distributed
from hvd_compress.integration.agreement import verify_same_configuration

World = Optional[Tuple[int, Optional[int], Optional[int]]]

# Bumped by every elastic sync (reform_world): a binding made before it is stale, even when the
# rank and size came out the same (the state was replaced by rank 0's).
_generation = 0


def world_generation() -> int:
    return _generation


def reform_world(compression: Any, rank: int, size: int) -> None:
    """After an elastic reset re-formed the world: ``compression`` takes ``rank`` and ``size``
    now (the state loaded next is checked against them), and every binding made before is stale,
    so each integration binds anew at its next step."""
    global _generation
    compression.bind_world(rank, size)
    _generation += 1


def current_world(process_set: Any) -> World:
    """What an elastic reset changes: (reset count, rank, size) within a Horovod process set;
    a process outside ``process_set`` has no rank in it."""
    if not process_set.included():
        return world_generation(), None, None
    return world_generation(), process_set.rank(), process_set.size()


class HorovodGroup:
    """The ranks of a Horovod ``ProcessSet``: Horovod's collectives for the rounds, its
    transport for the configuration check. Horovod is imported when a backend is made."""

    def __init__(self, process_set: Any):
        self.process_set = process_set  # what compression.use_process_set receives

    @property
    def included(self) -> bool:
        return self.process_set.included()

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    @property
    def size(self) -> int:
        return self.process_set.size()

    def backend(self) -> HorovodBackend:
        return HorovodBackend(self.process_set)

    def transport(self) -> HorovodTransport:
        return HorovodTransport(self.process_set)

    def world(self) -> World:
        return current_world(self.process_set)


class TorchGroup:
    """The ranks of a ``torch.distributed`` process group (None: the default group)."""

    included = True  # a process outside a torch.distributed group never reaches an integration

    def __init__(self, group: Any = None):
        self.group = group
        # For whatever talks to other ranks outside the rounds (L-GreCo's decisions): a
        # torch.distributed group makes its "auto" transport torch.distributed's. The default
        # group by name, not dist.group.WORLD: held, it would outlive destroy_process_group.
        self.process_set = group if group is not None else DEFAULT_TORCH_GROUP

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def backend(self) -> TorchBackend:
        return TorchBackend(self.group)

    def transport(self) -> TorchTransport:
        return TorchTransport(self.group)

    def world(self) -> World:
        return None  # no elastic reset re-forms a torch.distributed group under a binding


def group_of(process_set: Any, owner: str) -> Any:
    """The group ``process_set`` names: a ``torch.distributed`` group, or None under torchrun
    (``comm.transports.uses_torch_distributed`` decides, as for transports); else a Horovod
    process set (None: Horovod's global one). Horovod is read only where it was imported
    and initialised; ``owner`` names the caller in the error where neither is."""
    if uses_torch_distributed(process_set):
        return TorchGroup(process_set)
    hvd = sys.modules.get("horovod.torch")  # hvd.init() imported it
    if hvd is None or not hvd.is_initialized():
        raise RuntimeError(
            f"{owner}: neither Horovod nor torch.distributed is initialised; "
            f"call hvd.init() or torch.distributed.init_process_group() first"
        )
    return HorovodGroup(hvd.global_process_set if process_set is None else process_set)


class Binding:
    """``compression`` bound to ``group``'s world as it is now.

    * ``active``: whether there is anything to exchange. As in Horovod, a world of one compresses
      nothing, so the compression is not bound and there is no driver; ``bind_alone`` binds it
      there too (the stock path: Horovod calls ``compress`` in a world of one under elastic).
    * ``driver``: the ``RoundDriver`` on the group's backend (None when not active).
    * :meth:`check_configuration`: the cross-rank check of ``described`` (default: the
      compression; ``DiLoCo`` describes itself), once per binding. A collective, so each
      integration calls it where all its ranks arrive together, never at construction: an
      elastic worker that joins builds its optimizer while the others synchronise.
    * :meth:`stale`: whether an elastic reset re-formed the world since.
    * :meth:`start`, :meth:`finish`, :meth:`exchange`: a step's rounds on the driver.

    ``rank_name`` maps a rank within the group to the rank a configuration error names
    (default: the rank within the group; HSDP names global ranks). ``replaces_gradients``: the
    integration replaces each gradient with its result, so results may be made in the
    gradients' memory (``write_results_into_gradients``); every integration does but stock
    Horovod's compression called from outside its optimizer (``hvd.allreduce``)."""

    def __init__(
        self,
        compression: Any,
        group: Any,
        *,
        described: Any = None,
        rank_name: Optional[Callable[[int], int]] = None,
        bind_alone: bool = False,
        replaces_gradients: bool = True,
    ):
        self.compression = compression
        self.group = group
        self.world = group.world()
        self.active = group.included and (group.size > 1 or bind_alone)
        self.driver: Optional[RoundDriver] = None
        self._described = compression if described is None else described
        self._rank_name = rank_name
        self._checked = False
        if self.active:
            compression.bind_world(group.rank, group.size)
            compression.use_process_set(group.process_set)
            if replaces_gradients:
                compression.write_results_into_gradients()
            self.driver = RoundDriver(group.backend(), compression.traffic)

    def stale(self, mid_step: bool = False) -> bool:
        """Whether an elastic reset re-formed the world since this binding was made. Mid-step
        only a sync counts (the reset count); a reset that only removed workers skips sync in
        Horovod, and its new rank and size are read between steps."""
        if self.world is None:
            return False
        if mid_step:
            return self.world[0] != world_generation()
        return self.world != self.group.world()

    def check_configuration(self, shapes: Optional[Dict[str, Tuple[int, ...]]] = None) -> None:
        """That every rank runs the same configuration (ValueError naming the difference), once
        per binding. Collective over the group: every rank must call it at the same point, and
        every integration calls it before its first round. So the compression compiles its
        kernels here first, on the gradients' ``shapes`` ({name: shape}; None: its parameters',
        ``prepare_compiled``; the check waits for the slowest rank, up to
        ``agreement.AGREEMENT_TIMEOUT``), and runs them compiled only where every rank could."""
        if self.active and not self._checked:
            ready = self.compression.prepare_compiled(shapes)
            everyone = verify_same_configuration(
                self._described, self.group.transport(), self._rank_name, compiled_ready=ready
            )
            self.compression.use_compiled(everyone)
            self._checked = True

    def start(self, name: str, grad: torch.Tensor) -> None:
        """Begins ``grad``'s exchange (the gradient of ``name``) and starts its first round, or
        holds it for its fusion bucket; a compression that batches layers begins a bucket's
        gradients together, when the last one is ready."""
        if self.compression.batches_layers:
            self.driver.hold(name, grad, self.compression.begin_many)
        else:
            self.driver.start(name, grad, self.compression.begin(name, grad))

    def finish(self, device: Optional[torch.device] = None) -> Tuple[Dict[str, torch.Tensor], float]:
        """Every round started since the last finish, to the end, in name order: ({name:
        aggregate}, seconds waited). On a GPU the clock is read after ``device``'s work (None:
        the results') where the compression times communication. The fusion plan ends here."""
        waited = time.perf_counter()
        try:
            results = self.driver.finish()
        finally:
            self.driver.use_plan(None)
        if device is None:
            device = next((grad.device for grad in results.values()), None)
        return results, finished_at(device, self.compression.times_communication) - waited

    def exchange(
        self, gradients: Dict[str, torch.Tensor], plan: Optional[FusionPlan], device: Optional[torch.device]
    ) -> Tuple[Dict[str, torch.Tensor], float]:
        """Every round of ``gradients`` ({name: gradient}, started in that order, first rounds
        fused by ``plan``), to the end: ({name: aggregate}, seconds from the first start).
        ``device`` as in :meth:`finish`, but None reads the clock without waiting for a GPU."""
        started = time.perf_counter()
        try:
            self.driver.use_plan(plan)
            for name, grad in gradients.items():
                self.start(name, grad)
            results = self.driver.finish()
        finally:
            self.driver.use_plan(None)
        return results, finished_at(device, self.compression.times_communication) - started

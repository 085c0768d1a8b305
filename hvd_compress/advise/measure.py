"""What advise measures on the launched ranks: a step's compute, each method's codec on this
model's gradients (its rounds answered locally, ``comm.simulated.run_alone``) and the links
(each collective timed over the ranks). Clocks read after a GPU's work (``comm.timing``)."""

import importlib
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hvd_compress.advise.projection import Candidate, Link, fit_link, setting_label, stock_messages
from hvd_compress.comm.simulated import run_alone
from hvd_compress.comm.timing import finished_at
from hvd_compress.registry import COMPRESSORS, CONTROLLERS

SMALLEST_PROBE = 4 << 10
PROBE_SIZES = 4


def load_model(spec: str) -> Tuple[torch.nn.Module, Optional[Callable]]:
    """``module:function`` -> (model, loss_of or None)."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"--model must be module:function (e.g. examples.models:charlm), got {spec!r}")
    sys.path.insert(0, ".")
    made = getattr(importlib.import_module(module_name), function_name)()
    model, loss_of = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--model: {spec}() must return a torch.nn.Module or (module, loss_of), got {type(model).__name__}"
        )
    return model, loss_of


def measure_compute(model, loss_of, steps: int = 3) -> Tuple[float, float]:
    """Median (forward, backward) seconds of one step of ``loss_of`` on this rank."""
    device = next(model.parameters()).device
    forward, backward = [], []
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        started = finished_at(device, settle=True)
        loss = loss_of(model)
        middle = finished_at(device, settle=True)
        loss.backward()
        ended = finished_at(device, settle=True)
        if step:  # the first: allocations, lazy initialisation
            forward.append(middle - started)
            backward.append(ended - middle)
    return statistics.median(forward), statistics.median(backward)


def gradients_of(model, loss_of) -> Dict[str, torch.Tensor]:
    """This model's gradients: one backward of ``loss_of``, else random ones of its shapes."""
    if loss_of is not None:
        model.zero_grad(set_to_none=True)
        loss_of(model).backward()
    generator = torch.Generator().manual_seed(0)
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
        else:
            grads[name] = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
    return grads


def build_compressor(
    method: str, options: Dict[str, Any], named, layer_settings: Optional[Dict[str, Any]] = None
) -> Any:
    """A candidate's compressor: the registry's ``method`` at ``options``; for a controller's
    candidate ("lgreco/topk"), the compressor it wraps, each layer at the setting the controller
    decided (``layer_settings``, from :func:`decided_settings`)."""
    compressor = COMPRESSORS[method.split("/")[-1]].build(named, **options)
    for name, value in (layer_settings or {}).items():
        compressor.set_setting(name, value)
    return compressor


def decided_settings(
    method: str, options: Dict[str, Any], grads: Dict[str, torch.Tensor], named, most_steps: int = 20
) -> Dict[str, Any]:
    """Each layer's setting as controller ``method`` ("lgreco/topk") decides it over its compressor
    at ``options`` from these gradients: the controller at its registry preset that decides within a
    few steps in a world of one, fed these gradients (each step a fresh copy) until its first
    decision takes effect. From gradients of one batch at the model's first weights, where training
    decides from gradients and residuals of later steps: a projection, as the rest of advise."""
    controller_name, compressor_name = method.split("/")
    controller = CONTROLLERS[controller_name].build(COMPRESSORS[compressor_name].build(named, **options), small=True)
    controller.bind_world(0, 1)
    for _ in range(most_steps):
        for name, grad in grads.items():
            run_alone(controller.begin(name, grad.clone()))
        controller.end_step()
        if controller.decisions:
            return controller.inner.settings()
    raise RuntimeError(f"advise: {method} made no decision in {most_steps} steps of its registry preset")


def measure_codec(
    method: str,
    setting: Dict[str, Any],
    grads: Dict[str, torch.Tensor],
    named,
    rank: int,
    world: int,
    steps: int = 2,
    layer_settings: Optional[Dict[str, Any]] = None,
) -> Candidate:
    """One method at one setting (a controller's candidate: at the settings it decided per layer,
    ``layer_settings``) on these gradients: codec seconds per step (median of ``steps`` after one
    untimed), bytes per step and the messages of each collective, counted by
    :func:`stock_messages` on the last step's rounds."""
    compressor = build_compressor(method, setting, named, layer_settings)
    compressor.bind_world(rank, world)
    compressor.write_results_into_gradients()  # as in training: each step is given fresh copies
    traffic = compressor.traffic
    device = next(iter(grads.values())).device
    work = {name: grad.clone() for name, grad in grads.items()}
    seconds = []
    for step in range(steps + 1):
        for name, grad in grads.items():
            work[name].copy_(grad)
        started = finished_at(device, settle=True)
        rounds = []  # (gradient's round index, collective, bytes) of this step
        for name, grad in work.items():
            traffic.add_gradient(grad)
            sent = []  # this gradient's rounds, each answered as if every rank had sent it
            run_alone(compressor.begin(name, grad), world, sent.append)
            for index, round_ in enumerate(sent):
                traffic.add_payload(round_.payload, round_.collective)
                rounds.append((index, round_.collective, round_.payload.numel() * round_.payload.element_size()))
        compressor.end_step()
        if step:
            seconds.append(finished_at(device, settle=True) - started)
    messages, serial = stock_messages(rounds)
    return Candidate(
        method,
        setting_label(setting),
        traffic.wire_bytes / max(1, traffic.steps),
        1e3 * statistics.median(seconds),
        messages,
        serial_messages=serial,
        codec_step_ms=[1e3 * s for s in seconds],
        options=dict(setting),
        layer_settings=dict(layer_settings or {}),
    )


def slowest_codec(every_rank: Sequence[Candidate]) -> Candidate:
    """The first rank's candidate with its codec time the median over the timed steps of the
    slowest rank's time at each (every rank timed the same steps)."""
    first = every_rank[0]
    per_step = [max(steps) for steps in zip(*(c.codec_step_ms for c in every_rank))]
    if per_step:
        first.codec_ms, first.codec_step_ms = statistics.median(per_step), per_step
    return first


def probe_sizes(largest: float) -> List[int]:
    """``PROBE_SIZES`` sizes from 4 KiB to ``largest`` bytes, geometrically, multiples of 4."""
    largest = max(SMALLEST_PROBE, int(largest))
    if largest == SMALLEST_PROBE:
        return [SMALLEST_PROBE]
    ratio = (largest / SMALLEST_PROBE) ** (1 / (PROBE_SIZES - 1))
    return sorted({4 * max(1, round(SMALLEST_PROBE * ratio**i / 4)) for i in range(PROBE_SIZES)})


def measure_links(ranks, largest: Dict[str, float], device: torch.device, repeats: int = 3) -> Dict[str, Link]:
    """Each collective timed over the ranks at ``probe_sizes(largest[collective])``: the median
    of ``repeats`` after one untimed, each started together (a barrier before it)."""
    links = {}
    for collective in sorted(largest):
        measured = {}
        for nbytes in probe_sizes(largest[collective]):
            numel = nbytes // 4
            tensor = torch.ones(
                (ranks.size, max(1, numel // ranks.size)) if collective == "alltoall" else (numel,), device=device
            )
            seconds = []
            for repeat in range(repeats + 1):
                ranks.barrier()
                started = finished_at(device, settle=True)
                ranks.run(collective, tensor, f"hvd_compress.advise.{collective}.{nbytes}")
                if repeat:
                    seconds.append(finished_at(device, settle=True) - started)
            measured[nbytes] = statistics.median(seconds)
        links[collective] = fit_link(ranks.agree(measured))
    return links

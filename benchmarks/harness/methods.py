"""The benchmarks' method table, built from ``hvd_compress.registry``: each registered compressor
by the label the benchmarks' tables give it, and ScaleCom's per-layer rates as its paper sets
them."""

from typing import Any, Dict, List, Tuple

import torch

import hvd_compress as hc

# The registry's name of each method label of the benchmarks' tables (and of the quality tables
# that ``evidence`` reads).
REGISTERED = {
    "uncompressed": "none",
    "FP16": "fp16",
    "BF16": "bf16",
    "ACP-SGD": "acpsgd",
    "PowerSGD": "powersgd",
    "QSGD": "qsgd",
    "ScaleCom": "scalecom",
    "Top-K": "topk",
    "SignSGD": "signsgd",
}


def build(label: str, named: Any = None, **settings: Any) -> Any:
    """The compressor of the method labelled ``label`` at its documented defaults, ``settings``
    on top."""
    return hc.COMPRESSORS[REGISTERED[label]].build(named, **settings)


def low_rank(label: str, rank: int, first_decision: int = 3, decide_every: int = 1000) -> Any:
    """PowerSGD, ACP-SGD or L-GreCo over ACP-SGD (``label``) at ``rank``, as the torch.distributed
    benchmarks (ddp, fsdp) register them: L-GreCo decides first at step ``first_decision``, then
    every ``decide_every`` steps."""
    if label == "L-GreCo":
        return hc.LGreCo(hc.ACPSGD(rank=rank), warmup_steps=first_decision, decide_every=decide_every)
    return build(label, rank=rank)


def scalecom_flops(model: torch.nn.Module, tokens_per_rank: int) -> Dict[str, float]:
    """Forward FLOPs per step of each 2-D weight, for the paper's per-layer rule: 2 per token and
    weight entry for a linear layer (a matrix product), none for an embedding (a lookup)."""
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    return {
        name: 0.0 if name in embeddings else 2.0 * tokens_per_rank * p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2
    }


def paper_rates(
    scalecom: Any, model: torch.nn.Module, named: List[Tuple[str, torch.nn.Parameter]], tokens_per_rank: int
) -> Dict[str, float]:
    """Sets ``scalecom``'s per-layer rates by its paper's rule from each 2-D weight's FLOPs
    (``scalecom_flops``), which the paper states at a per-worker batch of 4.5k tokens for
    language; returns those FLOPs."""
    flops = scalecom_flops(model, tokens_per_rank)
    scalecom.set_rates_from_flops(
        flops,
        {name: p.numel() for name, p in named if name in flops},
        per_worker_batch=tokens_per_rank,
        reference_batch=4500,
    )
    return flops

"""How the benchmarks that train a workload on every rank train it (convergence, quality, claims,
outer): one run of the digits CNN or a language model, Horovod's stock optimizer around a
compressor, and the optimizer steps counted."""

import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from examples.workloads import charlm, digits, wordlm

MakeOptimizer = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]


class StepCounter:
    """Counts an optimizer's steps. Not with torch's step hooks: Horovod's optimizer subclasses
    the wrapped optimizer's class, and the hooks run at both levels of ``step``."""

    def __init__(self) -> None:
        self.steps = 0

    def wrap(self, optimizer: Any) -> Any:
        """``optimizer``, its ``step`` counted."""
        step = optimizer.step

        def counted(_, *args, **kwargs):
            self.steps += 1
            return step(*args, **kwargs)

        # A bound method, which torch's learning-rate schedulers expect to find there.
        optimizer.step = types.MethodType(counted, optimizer)
        return optimizer


def horovod_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, build: Callable[[List[Tuple[str, Any]]], Any]
) -> Tuple[Any, Any, int]:
    """``optimizer`` in Horovod's stock ``DistributedOptimizer``, after rank 0's parameters are
    broadcast: ``build(named parameters)`` makes its ``compression`` (None: Horovod's float32
    all-reduce). Returns the optimizer, the compression and the bytes of the float32 gradient."""
    import horovod.torch as hvd  # in the job's ranks only: importing this module needs no Horovod

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    compression = build(named)
    extra = {} if compression is None else {"compression": compression}
    wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=named, **extra)
    return wrapped, compression, 4 * sum(p.numel() for _, p in named)


def train_workload(
    workload: str,
    spec: Dict[str, Any],
    make_optimizer: MakeOptimizer,
    rank: int,
    size: int,
    seed: int,
    curve: Optional[List[List[float]]] = None,
    prepare: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
) -> float:
    """The final metric of one run of ``workload`` on this rank: the digits CNN's test accuracy
    after ``spec["epochs"]`` epochs (SGD, lr 0.1), or a language model's validation perplexity
    after ``spec["steps"]`` steps of ``spec["lm"]`` ("charlm", or "wordlm" at the LM's ``vocab``,
    ``prepare`` turning its new model into the one trained). ``curve``: where an LM's validation
    perplexity goes, as ``[step, perplexity]``, every tenth of the run."""
    if workload == "digits":
        return digits.train(make_optimizer, rank, size, epochs=spec["epochs"], lr=0.1, seed=seed)[1]
    lm, steps, options = spec["lm"], spec["steps"], {}
    if curve is not None:
        options.update(log_every=max(1, steps // 10), log=lambda step, _, perplexity: curve.append([step, perplexity]))
    if workload == "wordlm":
        options.update(vocab=lm["vocab"], prepare=prepare)
    module = wordlm if workload == "wordlm" else charlm
    return module.train(
        make_optimizer,
        rank,
        size,
        steps=steps,
        batch_size=lm["batch_size"],
        seed=seed,
        model_kwargs=lm["model"],
        max_chars=lm["max_chars"],
        **options,
    )[1]

"""An in-process world of W ranks for the single-process unit tier and codec benchmarks.

Each rank has its own compressor instance; rounds run in lockstep and collectives are
computed exactly as their definitions say (mean, stack, transpose; a float16 or bfloat16 mean
divided before its sum, as every backend's: ``rounds.divides_first``)."""

from typing import Callable, Optional

import torch

from hvd_compress.comm.rounds import Collective, Round, divides_first


def aggregate(rounds):
    """What each rank receives when rank r contributes ``rounds[r]``."""
    payloads, collective = [r.payload for r in rounds], rounds[0].collective
    w = len(payloads)
    if collective is Collective.ALLREDUCE:
        if divides_first(payloads[0].dtype):
            mean = torch.stack([payload / w for payload in payloads]).sum(dim=0)
        else:
            mean = torch.stack(payloads).sum(dim=0) / w
        return [mean.clone() for _ in range(w)]
    if collective is Collective.ALLGATHER:
        stacked = torch.stack(payloads)
        return [stacked.clone() for _ in range(w)]
    if collective is Collective.BROADCAST:
        return [payloads[rounds[0].root].clone() for _ in range(w)]
    return [torch.stack([payloads[src][dst] for src in range(w)]) for dst in range(w)]


class SimulatedWorld:
    """``one_at_a_time``: each gradient begun alone (``begin``), as stock Horovod's optimizer
    does; by default a step's gradients are begun together (``begin_many``), as the integrations
    begin a fusion bucket's, here one bucket holding them all."""

    def __init__(self, compressors, one_at_a_time=False):
        self.compressors = list(compressors)
        self.one_at_a_time = one_at_a_time
        for rank, compressor in enumerate(self.compressors):
            compressor.bind_world(rank, len(self.compressors))
        # As a binding's configuration check does: compiled kernels ready before the first
        # round, and compiled on every rank or on none.
        ready = [compressor.prepare_compiled() for compressor in self.compressors]
        for compressor in self.compressors:
            compressor.use_compiled(ready)

    @property
    def size(self):
        return len(self.compressors)

    def step(self, grads_per_rank):
        """``grads_per_rank[r]`` maps names to rank r's gradients; returns the same shape of
        aggregated gradients, one dict per rank."""
        pending = []
        for compressor, grads in zip(self.compressors, grads_per_rank):
            for grad in grads.values():
                compressor.traffic.add_gradient(grad)
            if self.one_at_a_time:
                pending.append({name: compressor.begin(name, grad) for name, grad in grads.items()})
            else:
                pending.append(dict(zip(grads, compressor.begin_many(list(grads.items())))))
        results = [{} for _ in self.compressors]
        while pending[0]:
            for name in sorted(pending[0]):
                rounds = [exchanges[name] for exchanges in pending]
                for compressor, round_ in zip(self.compressors, rounds):
                    compressor.traffic.add_payload(round_.payload, round_.collective)
                received = aggregate(rounds)
                for rank, (round_, result) in enumerate(zip(rounds, received)):
                    following = round_.then(result)
                    if isinstance(following, Round):
                        pending[rank][name] = following
                    else:
                        results[rank][name] = following
                        del pending[rank][name]
        for compressor in self.compressors:
            compressor.end_step()
        return results


def exchange_alone(compressor, name, grad):
    """Runs every round of one gradient's exchange in a world of one: each collective returns
    the rank's own payload (an all-gather stacks it as the only row). What the codec costs
    without communication."""
    return run_alone(compressor.begin(name, grad))


def echoed(round_: Round, size: int = 1) -> torch.Tensor:
    """What ``round_``'s collective returns where each of ``size`` ranks sent this payload: the
    payload itself, or for an all-gather ``size`` rows of it."""
    if round_.collective is not Collective.ALLGATHER:
        return round_.payload
    return round_.payload.unsqueeze(0).expand(size, *round_.payload.shape).contiguous()


def run_alone(round_: Round, size: int = 1, sent: Optional[Callable[[Round], None]] = None):
    """``exchange_alone`` of an exchange already begun: its rounds without communication, each
    answered as if all ``size`` ranks had sent this rank's payload (``echoed``); ``sent`` sees
    every round before its answer (advise counts them). Returns the exchange's result."""
    while isinstance(round_, Round):
        if sent is not None:
            sent(round_)
        round_ = round_.then(echoed(round_, size))
    return round_

"""A compressor's exchange for one gradient is a chain of rounds.

Each round hands a payload to one collective; its ``then`` receives the collective's result
and returns either the next round or the final aggregated gradient. Compressors only build
rounds; drivers (Horovod, or the simulated world in tests) decide when and how they run.
"""

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch


class Collective(enum.Enum):
    # result: element-wise mean over ranks (float16/32/64 payloads; ``divides_first`` says how)
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"  # result: shape (W, *payload.shape), row j is rank j's payload
    ALLTOALL = "alltoall"  # payload (W, c): row j goes to rank j; result row j came from rank j
    BROADCAST = "broadcast"  # result: the root's payload (other ranks' payloads only give the shape)

    def ring_messages(self, world_size: int) -> int:
        """Messages one rank sends in turn for this collective under the ring algorithms: a
        reduce-scatter then an all-gather for an all-reduce, ``world_size - 1`` for the others."""
        return 2 * (world_size - 1) if self is Collective.ALLREDUCE else world_size - 1

    def wire_bytes(self, payload_bytes, world_size):
        """Bytes one rank sends for this collective under the bandwidth-optimal (ring) algorithms."""
        w = world_size
        if self is Collective.ALLREDUCE:
            return 2 * (w - 1) * payload_bytes // w
        if self is Collective.ALLGATHER:
            return (w - 1) * payload_bytes
        # All-to-all sends (W-1)/W of the payload; a pipelined broadcast forwards it W-1 times
        # among W ranks.
        return (w - 1) * payload_bytes // w


# Payload dtypes whose sum over ranks can overflow where their mean does not.
_REDUCED_PRECISION = (torch.float16, torch.bfloat16)


def divides_first(dtype: torch.dtype) -> bool:
    """Whether an all-reduce of ``dtype`` divides each rank's payload by the world size W before
    the sum (float16, bfloat16) rather than the sum after (float32, float64). Every backend
    follows it, so the mean of a reduced-precision payload is representable wherever each rank's
    entry and the mean are: float16 tops out at 65504, and two ranks' 30000 and 50000 sum to Inf
    but average to 40000. The rule is torch's ``fp16_compress_hook``
    (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``: ``div_(world_size)``
    before ``all_reduce``). Its price: entries below float16's normal range (6.1e-5) times W lose
    bits to the division, as under torch's hook."""
    return dtype in _REDUCED_PRECISION


@dataclass
class Round:
    payload: torch.Tensor
    collective: Collective
    then: Callable[[torch.Tensor], Union["Round", torch.Tensor]]
    # True when ``then`` returns the final gradient: a lone final all-reduce can ride
    # Horovod's own all-reduce in the stock optimizer.
    last: bool = False
    root: int = 0  # BROADCAST only


@dataclass
class Traffic:
    """Bytes handed to collectives, per step: what compression actually saved.

    ``compression_ratio`` compares bytes on the wire: what a float32 ring all-reduce of the
    same gradients would send, over what was sent. An all-gather's bytes grow with W, so its
    ratio honestly falls as ranks are added."""

    world_size: int = 1
    steps: int = 0
    dense_wire_bytes: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    # collective name -> [calls, payload bytes] since the start: what an alpha-beta model of
    # the exchange at another world size or link rate needs.
    by_collective: dict = field(default_factory=dict)
    # The last step's [float32 all-reduce wire bytes, payload bytes, wire bytes]: what per-step
    # metrics report (hvd_compress.metrics).
    last_step: list = field(default_factory=lambda: [0, 0, 0])
    # Host seconds of the last step's codec work, where ``hvd_compress.metrics`` times it.
    codec_seconds: Optional[float] = None
    _current: list = field(default_factory=lambda: [0, 0, 0])

    def add_gradient(self, grad):
        self._current[0] += Collective.ALLREDUCE.wire_bytes(grad.numel() * 4, self.world_size)

    def add_payload(self, payload, collective):
        nbytes = payload.numel() * payload.element_size()
        self._current[1] += nbytes
        self._current[2] += collective.wire_bytes(nbytes, self.world_size)
        counts = self.by_collective.setdefault(collective.value, [0, 0])
        counts[0] += 1
        counts[1] += nbytes

    def end_step(self):
        if self._current == [0, 0, 0]:
            return
        self.steps += 1
        self.dense_wire_bytes += self._current[0]
        self.payload_bytes += self._current[1]
        self.wire_bytes += self._current[2]
        self.last_step, self._current = self._current, [0, 0, 0]

    @property
    def ratio(self):
        return self.dense_wire_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def metrics(self):
        """The last step's numbers, flat: what ``GradientCompression.metrics`` starts from."""
        dense, payload, wire = self.last_step
        numbers = {
            "steps": self.steps,
            "bytes_sent": wire,
            "payload_bytes": payload,
            "float32_allreduce_bytes": dense,
            "ratio": dense / wire if wire else 1.0,
            "ratio_since_start": self.ratio,
        }
        if self.codec_seconds is not None:
            numbers["codec_seconds"] = self.codec_seconds
        return numbers

    def summary(self):
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "float32_allreduce_wire_bytes_per_step": self.dense_wire_bytes // steps,
            "payload_bytes_per_step": self.payload_bytes // steps,
            "wire_bytes_per_step": self.wire_bytes // steps,
            "compression_ratio": round(self.ratio, 2),
        }


def on_result(round_: Round, observe: Callable[[torch.Tensor], None]) -> Round:
    """``round_`` with ``observe`` called on the final gradient its chain returns."""
    then = round_.then

    def observed(result):
        following = then(result)
        if isinstance(following, Round):
            return on_result(following, observe)
        observe(following)
        return following

    return Round(round_.payload, round_.collective, observed, round_.last, round_.root)


def carrying(round_: Round, values: torch.Tensor, receive: Callable[[torch.Tensor], None]) -> Round:
    """``round_`` with ``values`` (1-D float32) appended to the payload of the first round of its
    chain that every rank contributes to; ``receive`` gets their mean over ranks (float32) just
    before that round's own continuation sees its result, unchanged.

    * All-reduce of a float32 or float64 payload: appended in its dtype (float64 holds float32
      values exactly). Of another floating dtype (float16): the round travels as float32 and
      its result is cast back, so such payloads double; no compressor sends one compressed.
    * All-gather: the values' bytes are appended to each rank's payload bytes, and the rows'
      values averaged on receipt.
    * All-to-all: the values' bytes are appended to every row (W times, as an all-gather sends
      them), and the received rows' values averaged.
    * Broadcast: only the root's payload travels, so the values wait for the next round.

    NaN is kept by the mean, so a NaN in any rank's values reaches every rank."""
    payload, collective = round_.payload, round_.collective
    count = values.numel()
    if collective is Collective.BROADCAST:

        def then(result):
            following = round_.then(result)
            if not isinstance(following, Round):
                raise NotImplementedError(
                    "a chain of rounds that ends on a broadcast cannot carry values from every rank"
                )
            return carrying(following, values, receive)

        carried = payload
    elif collective is Collective.ALLREDUCE:
        wire = payload.dtype if payload.dtype in (torch.float32, torch.float64) else torch.float32
        carried = torch.cat([payload.reshape(-1).to(wire), values.to(wire)])

        def then(result):
            receive(result[-count:].float())
            return round_.then(result[:-count].view(payload.shape).to(payload.dtype))
    elif collective is Collective.ALLGATHER:
        carried = torch.cat([payload.reshape(-1).view(torch.uint8), values.float().view(torch.uint8)])
        tail = 4 * count

        def then(rows):
            receive(rows[:, -tail:].contiguous().view(torch.float32).mean(dim=0))
            body = rows[:, :-tail].contiguous().view(payload.dtype)
            return round_.then(body.view(rows.shape[0], *payload.shape))
    elif collective is Collective.ALLTOALL:
        # Every row carries the values, so that each rank receives every rank's once.
        rows = payload.shape[0]
        body_bytes = payload.reshape(rows, -1).view(torch.uint8)
        carried = torch.cat([body_bytes, values.float().view(torch.uint8).expand(rows, -1)], dim=1)
        tail = 4 * count

        def then(received):
            receive(received[:, -tail:].contiguous().view(torch.float32).mean(dim=0))
            return round_.then(received[:, :-tail].contiguous().view(payload.dtype).view(payload.shape))
    else:
        raise NotImplementedError(f"a {collective.value} payload cannot carry values")
    return Round(carried, collective, then, round_.last, round_.root)

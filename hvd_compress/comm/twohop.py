"""The two hops of an all-reduce of encoded chunks: all-to-all, then all-gather.

Horovod's and torch's all-reduces sum only float16/32/64, so an exchange whose payload is
anything else (bfloat16 bits, packed low-bit codes) runs the two halves of a ring all-reduce
itself (ZeRO++'s qgZ, Wang et al. 2023, arXiv 2306.10209, section 4.3; 1-bit Adam's compressed
all-reduce, Tang et al. ICML 2021, section 4): a gradient of n entries is cut into W chunks of
``chunk_length`` entries, chunk j owned by rank j. BF16 and QuantizedAllReduce share this.
"""

from typing import Callable

import torch

from hvd_compress.comm.rounds import Collective, Round


def chunk_length(numel: int, size: int, multiple: int = 1) -> int:
    """Entries of each of ``size`` chunks of a gradient of ``numel`` entries: ceil(numel /
    size), rounded up to a multiple of ``multiple``. The last chunks are padded."""
    per_rank = -(-numel // size)
    return -(-per_rank // multiple) * multiple


def padded_chunks(flat: torch.Tensor, size: int, length: int) -> torch.Tensor:
    """The 1-D ``flat`` zero-padded to ``size * length`` entries, as (size, length) chunks."""
    pad = size * length - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(size, length)


def two_hop(
    rows: torch.Tensor,
    decode: Callable[[torch.Tensor], torch.Tensor],
    owner: Callable[[torch.Tensor], torch.Tensor],
    finish: Callable[[torch.Tensor], torch.Tensor],
) -> Round:
    """The exchange of this rank's encoded chunks ``rows`` (W, b), row j for rank j.

    Hop 1, all-to-all: rank j receives row j of every rank, (W, b) in rank order, and
    ``decode``s them to float32 (W, c); each divided by W first (``comm.rounds.divides_first``:
    a mean near float32's largest value survives where the sum would not), their sum over ranks
    in float32 (torch's sum over the rank dimension: one fixed order for a given W, c and
    device) is the mean of its chunk, (c,). ``owner(mean)`` is its hop-2 payload (one row, the same shape on every
    rank). Hop 2, all-gather: ``finish`` gets the W owners' payloads (W, ...) and returns the
    result. Every rank finishes from the same bytes, so results are bit-identical on every
    rank. Bytes one rank sends: (W-1)/W of ``rows`` plus (W-1) owner payloads."""
    size = rows.shape[0]

    def after_scatter(received):
        mean = decode(received).div_(size).sum(dim=0)
        return Round(owner(mean), Collective.ALLGATHER, finish)

    return Round(rows, Collective.ALLTOALL, after_scatter)

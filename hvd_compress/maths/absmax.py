"""Per-block absmax quantisation with round to nearest, row by row (ZeRO++'s qgZ, Wang et al.
2023, arXiv 2306.10209, section 4.3; the codec of 1-bit Adam's compressed all-reduce, Tang et
al. ICML 2021, with more than one bit).

A row of ``length`` entries is cut into blocks of ``block_size`` consecutive entries (the last
one shorter, read as zero-padded); each block has one float32 scale, its largest magnitude over
s = 2^(bits-1) - 1, and each entry the signed code round(x / scale) in [-s, s]. Rows are
independent: a row is what one rank sends another. Every function is a fixed sequence of
element-wise and reshape passes over whole tensors (no per-entry Python), for ``torch.compile``.

A block holding an Inf or NaN gets a non-finite scale, and every entry of it decodes
non-finite (0 x Inf is NaN): a payload is non-finite wherever its input was.
"""

from typing import Tuple

import torch

from hvd_compress.maths.packing import levels_for_bits, pack_codes, unpack_codes

# Bits whose codes pack whole into bytes (8 / bits codes a byte), so that each row of packed
# codes is a byte range of its own.
BYTE_ALIGNED_BITS = (2, 4, 8)
# Row lengths are multiples of this: the packed codes of a row then fill whole 4-byte words
# at every width of BYTE_ALIGNED_BITS, and the float32 scales after them stay aligned.
ROW_MULTIPLE = 32


def block_count(length: int, block_size: int) -> int:
    """Blocks (scales) of a row of ``length`` entries."""
    return -(-length // block_size)


def row_bytes(length: int, bits: int, block_size: int) -> int:
    """Bytes of one packed row (``pack_rows``): ``length`` codes of ``bits`` bits, then one
    float32 scale per block. ``length`` must be a multiple of ``ROW_MULTIPLE``."""
    return length * bits // 8 + 4 * block_count(length, block_size)


def _blocked(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(rows, length) as (rows, blocks, block_size), the last block zero-padded."""
    rows, length = x.shape
    pad = (-length) % block_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, -1, block_size)


def quantize_rows(x: torch.Tensor, bits: int, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of the float32 ``x``, shape (rows, length): int8 codes of shape (rows,
    length) in [-s, s], and float32 scales of shape (rows, blocks), each a block's largest
    magnitude over s. Rounds to nearest (ties to even): deterministic. A zero block has scale
    0 and codes 0."""
    rows, length = x.shape
    s = levels_for_bits(bits)
    blocks = _blocked(x, block_size)
    scales = blocks.abs().amax(dim=2).div_(s)
    # A zero scale's block is all zeros: divided by 1 its codes are 0, not NaN.
    divisors = torch.where(scales > 0, scales, 1.0).unsqueeze(2)
    codes = blocks.div(divisors).round_().clamp_(-s, s).to(torch.int8)
    return codes.reshape(rows, -1)[:, :length], scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """The float32 values (rows, length) of int8 ``codes`` (rows, length) with ``scales`` (rows,
    blocks): code x its block's scale."""
    rows, length = codes.shape
    values = _blocked(codes.to(torch.float32), block_size).mul_(scales.unsqueeze(2))
    return values.reshape(rows, -1)[:, :length]


def pack_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """One uint8 row of ``row_bytes`` per row of ``codes`` (rows, length; length a multiple of
    ``ROW_MULTIPLE``): its codes packed (``packing.pack_codes``), then its scales' bytes."""
    rows, length = codes.shape
    code_bytes = length * bits // 8
    payload = torch.empty(rows, code_bytes + 4 * scales.shape[1], dtype=torch.uint8, device=codes.device)
    packed = pack_codes(codes.reshape(-1), bits)
    payload[:, :code_bytes] = packed[: rows * code_bytes].view(rows, code_bytes)
    payload[:, code_bytes:].view(torch.float32).copy_(scales)
    return payload


def unpack_rows(payload: torch.Tensor, bits: int, length: int, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows`` undone: (int8 codes (rows, length), float32 scales (rows, blocks)) of the
    uint8 ``payload`` (rows, ``row_bytes``)."""
    rows = payload.shape[0]
    code_bytes = length * bits // 8
    codes = unpack_codes(payload[:, :code_bytes].reshape(-1), bits, rows * length).view(rows, length)
    scales = payload[:, code_bytes : code_bytes + 4 * block_count(length, block_size)].view(torch.float32)
    return codes, scales


def decode_rows(payload: torch.Tensor, bits: int, length: int, block_size: int) -> torch.Tensor:
    """The float32 values (rows, length) of packed rows (``pack_rows``)."""
    codes, scales = unpack_rows(payload, bits, length, block_size)
    return dequantize_rows(codes, scales, block_size)


def errors_and_energies(x: torch.Tensor, bits_options, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each of ``bits_options``, the error ||x - D(Q(x))|| and the kept energy
    ||D(Q(x))||^2 of ``quantize_rows`` on the float32 ``x`` (rows, length), each a float64
    tensor of shape (len(bits_options),) on ``x``'s device (sums of squares in float64)."""
    errors, energies = [], []
    for bits in bits_options:
        values = dequantize_rows(*quantize_rows(x, bits, block_size), block_size)
        energies.append(values.double().square().sum())
        errors.append(values.sub_(x).double().square().sum())
    return torch.stack(errors).sqrt(), torch.stack(energies)

"""QSGD stochastic quantisation and bit packing."""
import torch


def levels_for_bits(bits):
    """Magnitude levels s for a signed code of ``bits`` bits: codes lie in [-s, s]."""
    return (1 << (bits - 1)) - 1


def bucket_norms(x, bucket_size):
    """L2 norm of each bucket of ``bucket_size`` consecutive entries (last one padded)."""
    n = x.numel()
    pad = (-n) % bucket_size
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    return padded.view(-1, bucket_size).norm(dim=1)


def quantize(x, bits, bucket_size, generator):
    """QSGD (Alistarh et al.): per bucket, code = sign(x) * xi with xi in {0..s} drawn so that
    E[norm * code / s] = x. Returns (codes as int8 in [-s, s], norms as float32)."""
    s = levels_for_bits(bits)
    n = x.numel()
    norms = bucket_norms(x, bucket_size)
    scale = norms.repeat_interleave(bucket_size)[:n]
    level = x.abs() / torch.where(scale > 0, scale, torch.ones_like(scale)) * s
    lower = level.floor()
    up = torch.rand(n, generator=generator, device=x.device) < (level - lower)
    codes = (lower + up).to(torch.int8) * torch.sign(x).to(torch.int8)
    return codes, norms


def dequantize(codes, norms, bits, bucket_size):
    s = levels_for_bits(bits)
    scale = norms.repeat_interleave(bucket_size)[: codes.numel()]
    return codes.float() * scale / s


def pack_codes(codes, bits):
    """Packs signed codes of ``bits`` bits into bytes: floor(64 / bits) codes per 64-bit word."""
    per_word = 64 // bits
    offset = levels_for_bits(bits)
    unsigned = (codes.to(torch.int64) + offset)
    pad = (-unsigned.numel()) % per_word
    if pad:
        unsigned = torch.nn.functional.pad(unsigned, (0, pad))
    shifts = torch.arange(per_word, dtype=torch.int64, device=codes.device) * bits
    words = (unsigned.view(-1, per_word) << shifts).sum(dim=1)
    return words.view(torch.uint8)


def unpack_codes(packed, bits, count):
    per_word = 64 // bits
    offset = levels_for_bits(bits)
    words = packed.view(torch.int64)
    shifts = torch.arange(per_word, dtype=torch.int64, device=packed.device) * bits
    unsigned = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return (unsigned.flatten()[:count] - offset).to(torch.int8)


def packed_size(count, bits):
    """Bytes that ``count`` codes of ``bits`` bits occupy once packed."""
    per_word = 64 // bits
    return -(-count // per_word) * 8

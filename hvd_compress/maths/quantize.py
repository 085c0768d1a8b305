"""QSGD stochastic quantisation: codes and bucket norms, and their packed wire format.

On CPU, quantising and dequantising take several element-wise steps each; they run over
chunks of whole buckets small enough to stay in cache, so the gradient streams through
memory about once instead of once per step. Chunking changes no result: the chunks consume
the random stream in order. Other devices process the whole tensor at once.

``encode`` and ``decode_mean`` may run each chunk's arithmetic compiled (``compiled=True``,
``maths.compiled``): one fused loop over the chunk instead of an operator a step. The noise is
drawn eagerly, chunk by chunk, from the same stream, so only float rounding can differ from the
eager path (a norm's float64 sum in another order, a fused multiply-add).

The codes' bit packing is ``maths.packing``'s; its functions are named here too, as QSGD's wire
format.
"""

import math

import torch

from hvd_compress.maths.compiled import compilable
from hvd_compress.maths.packing import (
    levels_for_bits,
    pack_codes,
    pack_fields,
    packed_size,
    unpack_codes,
    unpack_fields,
)

__all__ = [
    "COMPILED_KERNELS",
    "bucket_norms",
    "decode_mean",
    "dequantize",
    "dequantize_mean",
    "draw_noise",
    "encode",
    "levels_for_bits",
    "noise_words",
    "pack_codes",
    "pack_fields",
    "packed_size",
    "quantize",
    "unpack_codes",
    "unpack_fields",
]

# Entries per chunk on CPU: the four 1 MiB temporaries of a chunk stay in the L2/L3 caches;
# smaller chunks pay more per-op overhead (measured on the benchmark machine).
_CPU_CHUNK = 1 << 18

_FLOAT32_MAX = torch.finfo(torch.float32).max
# random_(_INT64_MIN, None) draws all 64 bits of a word: four 16-bit noises.
_INT64_MIN = -(1 << 63)
_NOISE_PER_WORD = 4


def noise_words(count):
    """The 64-bit random words ``quantize`` draws for ``count`` entries (at least: its chunks
    round up to whole words)."""
    return -(-count // _NOISE_PER_WORD)


def draw_noise(words, generator):
    """Fills the int64 ``words`` with random bits from ``generator``, as ``quantize`` draws them."""
    return words.random_(_INT64_MIN, None, generator=generator)


def bucket_norms(x, bucket_size):
    """L2 norm of each bucket of ``bucket_size`` consecutive entries of the float32 (or
    narrower) ``x`` (last bucket padded), as float32.

    The squares are summed in float64, where no square of a float32 overflows or underflows,
    and the norm is rounded to float32 once: never 0 for a bucket with a nonzero entry, and never
    below the bucket's largest magnitude (a sum of squares is at least each of its terms), so
    |x| / norm <= 1 exactly. A finite norm beyond the float32 range becomes the largest float32,
    which still bounds every magnitude of its bucket (QSGD is unbiased with any such norm); a
    bucket with an Inf or NaN entry gets a non-finite norm. On CPU the
    float64 copy is made a chunk at a time, in cache; it costs about three float32 norms."""
    norms = torch.empty(-(-x.numel() // bucket_size), device=x.device)
    chunk, wide = _norm_scratch(x, bucket_size)
    for start in range(0, x.numel(), chunk):
        _chunk_norms(x[start : start + chunk], bucket_size, wide, norms[start // bucket_size :])
    return norms


def _norm_scratch(x, bucket_size, per_word=1):
    """(entries per chunk, the float64 buffer ``_chunk_norms`` uses for one)."""
    chunk = _chunk_entries(x.device, bucket_size, x.numel(), per_word)
    padded = -(-x.numel() // bucket_size) * bucket_size
    return chunk, torch.empty(min(chunk, padded), dtype=torch.float64, device=x.device)


def _chunk_norms(piece, bucket_size, wide, norms):
    """``bucket_norms`` of ``piece`` (whole buckets but perhaps the last) into the first of
    ``norms``, through ``wide``."""
    count = piece.numel()
    padded = -(-count // bucket_size) * bucket_size
    wide[:count].copy_(piece)
    # Padding only the partial bucket reduces exactly as padding the whole tensor would.
    wide[count:padded].zero_()
    wide_norms = torch.linalg.vector_norm(wide[:padded].view(-1, bucket_size), dim=1)
    # A finite norm beyond the float32 range is capped (rounding would give Inf); a bucket
    # holding Inf or NaN keeps a non-finite norm, so that the step is seen to be non-finite.
    norms[: padded // bucket_size] = torch.where(wide_norms.isinf(), wide_norms, wide_norms.clamp(max=_FLOAT32_MAX))


def quantize(x, bits, bucket_size, generator):
    """QSGD (Alistarh et al.): per bucket, code = sign(x) * xi with xi in {0..s} drawn so that
    E[norm * code / s] = x. Returns (codes as int8 in [-s, s], norms as float32).

    The code is floor(v + u) of the signed level v = x / norm * s and a uniform u: the two
    integers around v, the upper with probability frac(v), which is QSGD's sign(x) * xi in
    distribution. u is one of the 2^16 multiples of 2^-16 in [0, 1), 1/2 + i / 2^16 for a random
    int16 i, four of them from each 64-bit draw of ``generator``: a quarter of the draws of one
    float a code, which were half the quantiser's time; the rounding probability is frac(v) to
    within 2^-16. No norm is below a magnitude of its bucket (see ``bucket_norms``), so
    |v| <= s, v + u < s + 1 (float32 holds s + 1 - 2^-16 for s <= 127) and a code never leaves
    [-s, s]. The chunks draw the words in order, so chunking changes no code."""
    n = x.numel()
    norms = torch.empty(-(-n // bucket_size), device=x.device)
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    for _ in _quantized_chunks(x, bits, bucket_size, generator, norms, codes):
        pass
    return codes, norms


def encode(x, bits, bucket_size, generator, packed, norms, compiled=False):
    """``pack_codes(quantize(x, ...)[0], bits)`` into ``packed`` (uint8, ``packed_size`` bytes)
    and the norms into ``norms`` (float32, one a bucket), bit for bit, packing each chunk's
    codes while they are in cache: no gradient-sized codes are written and read back.
    ``compiled``: each chunk's norms, codes and packing in one compiled kernel
    (``_encode_chunk``), the same up to float rounding; may raise ``maths.compiled.CompileFailed``."""
    per_word = 64 // bits
    if compiled:
        _encode_compiled(x, bits, bucket_size, generator, packed, norms)
        return
    for start, codes in _quantized_chunks(x, bits, bucket_size, generator, norms, per_word=per_word):
        first = start // per_word * 8
        packed[first : first + packed_size(codes.numel(), bits)] = pack_codes(codes, bits)


def _quantized_chunks(x, bits, bucket_size, generator, norms, codes=None, per_word=1):
    """``quantize``'s work a chunk at a time, the norms written into ``norms``: yields (first
    entry, the chunk's int8 codes), the codes in ``codes`` where given, else in a buffer the
    next chunk reuses. Every chunk but the last is a multiple of ``per_word`` entries."""
    s = levels_for_bits(bits)
    n = x.numel()
    chunk, wide = _norm_scratch(x, bucket_size, per_word)
    level = torch.empty(min(chunk, n), device=x.device)
    words = torch.empty(noise_words(min(chunk, n)), dtype=torch.int64, device=x.device)
    scratch = torch.empty(min(chunk, n), dtype=torch.int8, device=x.device) if codes is None else None
    for start in range(0, n, chunk):
        piece = x[start : start + chunk]
        count = piece.numel()
        # The chunk's norms first, so that it is read from memory once for both.
        piece_norms = norms[start // bucket_size : (start + count - 1) // bucket_size + 1]
        _chunk_norms(piece, bucket_size, wide, piece_norms)
        piece_level = level[:count].copy_(piece)
        # A zero norm's bucket holds zeros only: divided by 1 they stay 0, not NaN.
        denominators = torch.where(piece_norms > 0, piece_norms, 1.0)
        _per_bucket(torch.Tensor.div_, piece_level, denominators, 0, bucket_size)
        noise = draw_noise(words[: noise_words(count)], generator)
        piece_level.mul_(s).add_(0.5).add_(noise.view(torch.int16)[:count], alpha=2**-16)
        piece_codes = codes[start : start + count] if codes is not None else scratch[:count]
        piece_codes.copy_(piece_level.floor_())
        yield start, piece_codes


def dequantize(codes, norms, bits, bucket_size):
    """norm * code / s per entry, as float32. Computed as (code / s) * norm: code / s lies in
    [-1, 1], so no product exceeds its bucket's norm and every finite norm decodes finitely."""
    return dequantize_mean([codes], [norms], bits, bucket_size)


def dequantize_mean(codes, norms, bits, bucket_size, out=None):
    """The mean over rows of ``dequantize(codes[i], norms[i], ...)`` as float32 (into ``out``, a
    flat float32 tensor of the codes' length, where given): the rows added in their order, then
    divided by their count (where over one). Each rank's row of an all-gather is decoded a chunk
    at a time, every row added and the sum divided while the chunk is in cache, not row by row
    over the whole gradient: the same operations in the same order, so bit for bit the row-by-row
    mean."""
    return _mean_of_rows(
        lambda row, start, stop: codes[row][start:stop],
        len(codes),
        norms,
        bits,
        bucket_size,
        codes[0].numel(),
        codes[0].device,
        out,
    )


def decode_mean(packed, norms, bits, bucket_size, count, out=None, compiled=False):
    """``dequantize_mean`` of the rows ``unpack_codes(packed[i], bits, count)``, bit for bit, each
    row's codes unpacked a chunk at a time where that chunk is decoded. ``packed`` and ``norms``:
    sequences of rows (lists, or 2-D tensors whose rows are contiguous: an all-gather's).
    ``compiled`` (2-D tensors only): each chunk's unpacking, scaling and mean of every row in one
    compiled kernel (``_decode_chunk``), the same up to float rounding; may raise
    ``maths.compiled.CompileFailed``."""
    if compiled:
        return _decode_mean_compiled(packed, norms, bits, bucket_size, count, out)

    def codes_of(row, start, stop):
        return unpack_codes(packed[row][start // per_word * 8 : packed_size(stop, bits)], bits, stop - start)

    per_word = 64 // bits
    return _mean_of_rows(codes_of, len(packed), norms, bits, bucket_size, count, packed[0].device, out, per_word)


def _mean_of_rows(codes_of, rows, norms, bits, bucket_size, n, device, out, per_word=1):
    """``dequantize_mean``'s work, row r's codes of entries [start, stop) read as
    ``codes_of(r, start, stop)``; chunks are multiples of ``per_word`` entries but the last."""
    s = levels_for_bits(bits)
    mean = torch.empty(n, device=device) if out is None else out
    chunk = _chunk_entries(device, bucket_size, n, per_word)
    row_values = torch.empty(min(chunk, n), device=device) if rows > 1 else None
    for start in range(0, n, chunk):
        piece = mean[start : start + chunk]
        stop = start + piece.numel()
        for row in range(rows):
            values = piece if row == 0 else row_values[: piece.numel()]
            values.copy_(codes_of(row, start, stop))
            values.div_(s)
            _per_bucket(torch.Tensor.mul_, values, norms[row], start, bucket_size)
            if row:
                piece.add_(values)
        if rows > 1:  # dividing by one would only cost a pass
            piece.div_(rows)
    return mean


def _chunk_entries(device, bucket_size, n, per_word=1):
    """Entries per chunk of ``n``: whole buckets, about ``_CPU_CHUNK`` of them on CPU, else every
    bucket (the last one padded). A multiple of ``_NOISE_PER_WORD`` buckets, so that every chunk
    but the last uses whole noise words, and of ``per_word`` entries, so that it packs into
    whole 64-bit words."""
    if torch.device(device).type != "cpu":
        return max(1, -(-n // bucket_size)) * bucket_size
    step = math.lcm(_NOISE_PER_WORD, per_word // math.gcd(per_word, bucket_size))
    buckets = -(-max(1, _CPU_CHUNK // bucket_size) // step) * step
    return buckets * bucket_size


def _per_bucket(op, values, per_bucket, start, bucket_size):
    """``op(values, per_bucket[b])`` in place for the entries of bucket b, where ``values``
    is the slice of the gradient that begins at entry ``start`` (a bucket boundary)."""
    first = start // bucket_size
    full = values.numel() // bucket_size
    if full:
        op(values[: full * bucket_size].view(full, bucket_size), per_bucket[first : first + full].unsqueeze(1))
    if full * bucket_size < values.numel():
        op(values[full * bucket_size :], per_bucket[first + full])


# ----- the compiled path -----------------------------------------------------------------------
def _packs_bytes(bits):
    """Whether ``bits`` divides 8: codes then pack into bytes (a byte holds 8 / bits of them,
    least significant first), which is what packing into 64-bit words leaves in memory on a
    little-endian machine, without shifting a field into an int64's sign bit."""
    return 8 % bits == 0


def _packed_view(packed, bits):
    """``packed`` (uint8, last dimension a multiple of 8 bytes) as the fields' container the
    compiled kernels read and write: itself where codes pack into bytes, else int64 words."""
    return packed if _packs_bytes(bits) else packed.view(torch.int64)


@compilable
def _encode_chunk(piece, noise, packed, bits: int, bucket_size: int):
    """``encode``'s work on one chunk (whole buckets but perhaps the last): ``piece`` (float32,
    n entries), ``noise`` (int16, at least n: the chunk's words), the codes into ``packed``
    (uint8, the chunk's ``packed_size(n, bits)`` bytes); returns the chunk's norms (float32,
    one a bucket; the caller copies them into the payload, whose float32 view of its bytes a
    compiled function cannot write). The same steps as ``_quantized_chunks`` and
    ``pack_codes``, fused."""
    s = levels_for_bits(bits)
    n = piece.shape[0]
    buckets = -(-n // bucket_size)
    wide = torch.nn.functional.pad(piece, (0, buckets * bucket_size - n)).to(torch.float64)
    wide_norms = wide.view(buckets, bucket_size).square().sum(dim=1).sqrt()
    # finfo, not the module's float: dynamo would make a global float a symbol and trace twice.
    largest = torch.finfo(torch.float32).max
    chunk_norms = torch.where(wide_norms.isinf(), wide_norms, wide_norms.clamp(max=largest)).to(torch.float32)
    denominators = torch.where(chunk_norms > 0, chunk_norms, 1.0)
    bucket = torch.arange(n, device=piece.device) // bucket_size
    level = piece / denominators[bucket] * s + 0.5 + noise[:n].to(torch.float32) * 2**-16
    unsigned = (level.floor() + s).to(torch.int64)
    per_field, field_bytes = (8 // bits, 1) if _packs_bytes(bits) else (64 // bits, 8)
    fields = torch.nn.functional.pad(unsigned, (0, packed.shape[0] // field_bytes * per_field - n)).view(-1, per_field)
    word = fields[:, 0]
    for field in range(1, per_field):
        word = word | (fields[:, field] << field * bits)
    packed.copy_(word.to(torch.uint8) if field_bytes == 1 else word.view(torch.uint8))
    return chunk_norms


def _encode_compiled(x, bits, bucket_size, generator, packed, norms):
    """``encode`` a chunk at a time through ``_encode_chunk``, drawing the noise as
    ``_quantized_chunks`` does."""
    n, per_word = x.numel(), 64 // bits
    chunk = _chunk_entries(x.device, bucket_size, n, per_word)
    words = torch.empty(noise_words(min(chunk, n)), dtype=torch.int64, device=x.device)
    for start in range(0, n, chunk):
        piece = x[start : start + chunk]
        count = piece.numel()
        noise = draw_noise(words[: noise_words(count)], generator).view(torch.int16)
        first = start // per_word * 8
        chunk_norms = _encode_chunk.compiled(
            piece, noise, packed[first : first + packed_size(count, bits)], bits, bucket_size
        )
        norms[start // bucket_size : start // bucket_size + chunk_norms.numel()] = chunk_norms


@compilable
def _decode_chunk(packed, norms, out, bits: int, bucket_size: int):
    """``decode_mean``'s work on one chunk of n entries (whole buckets but perhaps the last):
    ``packed`` (rows x the chunk's fields, ``_packed_view``), ``norms`` (rows x the chunk's
    buckets), the mean into ``out`` (float32, n). Rows are added in order, then divided by
    their count, as ``_mean_of_rows`` does."""
    s = levels_for_bits(bits)
    n = out.shape[0]
    mask = (1 << bits) - 1
    per_field = 8 // bits if _packs_bytes(bits) else 64 // bits
    bucket = torch.arange(n, device=out.device) // bucket_size
    total = None
    for row in range(packed.shape[0]):
        fields = packed[row].to(torch.int64)
        unsigned = torch.stack([(fields >> field * bits) & mask for field in range(per_field)], dim=1).view(-1)[:n]
        values = (unsigned - s).to(torch.float32) / s * norms[row][bucket]
        total = values if total is None else total + values
    out.copy_(total / packed.shape[0] if packed.shape[0] > 1 else total)


def _decode_mean_compiled(packed, norms, bits, bucket_size, n, out):
    """``decode_mean`` a chunk at a time through ``_decode_chunk``."""
    mean = torch.empty(n, device=packed.device) if out is None else out
    per_word = 64 // bits
    chunk = _chunk_entries(packed.device, bucket_size, n, per_word)
    fields = _packed_view(packed, bits)
    per_field = 1 if _packs_bytes(bits) else 8
    for start in range(0, n, chunk):
        piece = mean[start : start + chunk]
        first = start // per_word * 8
        _decode_chunk.compiled(
            fields[:, first // per_field : (first + packed_size(piece.numel(), bits)) // per_field],
            norms[:, start // bucket_size : (start + piece.numel() - 1) // bucket_size + 1],
            piece,
            bits,
            bucket_size,
        )
    return mean


#: The kernels ``encode`` and ``decode_mean`` run compiled.
COMPILED_KERNELS = (_encode_chunk, _decode_chunk)

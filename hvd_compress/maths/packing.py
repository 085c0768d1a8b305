"""Bit packing of codes: signed codes of ``bits`` bits in [-s, s] (``pack_codes``, QSGD's and
absmax's wire format) and unsigned fields below 2^bits (``pack_fields``), floor(64 / bits) to a
64-bit word, field i of a word at bits [i * bits, (i + 1) * bits).

Widths that divide 8 pack byte by byte (8 / bits fields a byte, least significant first), which
is the same memory as the 64-bit words on a little-endian machine: one multiplication gathers a
byte's fields and a few shifts spread them back (``_gathering``, ``_spreading``). Other widths
shift 64-bit words, on CPU a field at a time.
"""

import torch


def levels_for_bits(bits):
    """Magnitude levels s for a signed code of ``bits`` bits: codes lie in [-s, s]."""
    return (1 << (bits - 1)) - 1


def pack_codes(codes, bits):
    """Packs signed codes of ``bits`` bits (in [-s, s]) into bytes: each offset by s to be
    non-negative, then packed as ``pack_fields`` packs."""
    count = codes.numel()
    unsigned = _padded_fields(count, bits, codes.device)
    # uint8 arithmetic wraps, so code + s lands in [0, 2s] from the code's two's complement.
    torch.add(codes.view(torch.uint8), levels_for_bits(bits), out=unsigned[:count])
    return _packed(unsigned, bits)


def unpack_codes(packed, bits, count):
    """The first ``count`` signed codes of ``pack_codes``'s output, as int8."""
    # Subtracting s in wrapping uint8 arithmetic leaves the code's two's complement.
    return unpack_fields(packed, bits, count).sub(levels_for_bits(bits)).view(torch.int8)


def pack_fields(fields, bits):
    """Packs uint8 ``fields``, each below 2^bits, into ``packed_size`` bytes: floor(64 / bits)
    fields per 64-bit word, field i of a word at bits [i * bits, (i + 1) * bits).

    When ``bits`` divides 8 a word is exactly 8 / bits fields per byte, least significant
    first: the bytes of one packed byte's fields are read as one wider integer (a lane), and
    one multiplication gathers its fields into its top byte (``_gathering``). Other widths
    shift 64-bit words."""
    count = fields.numel()
    unsigned = _padded_fields(count, bits, fields.device)
    unsigned[:count] = fields.reshape(-1)
    return _packed(unsigned, bits)


def unpack_fields(packed, bits, count):
    """The first ``count`` fields of ``pack_fields``'s output, as uint8 (at 8 bits, a view of
    ``packed``)."""
    if 8 % bits:
        return _unpack_words(packed.view(torch.int64), bits).view(-1)[:count].view(torch.uint8)
    lanes = packed.to(_LANE_TYPES[8 // bits])
    for shift, mask in _spreading(bits):
        lanes = lanes.bitwise_or(lanes << shift).bitwise_and_(mask)
    return lanes.view(torch.uint8)[:count]


def _padded_fields(count, bits, device):
    """A zeroed uint8 buffer for ``count`` fields, rounded up to whole 64-bit words of them."""
    per_word = 64 // bits
    return torch.zeros(-(-count // per_word) * per_word, dtype=torch.uint8, device=device)


def _packed(unsigned, bits):
    """``pack_fields`` of the whole words of fields ``unsigned`` (``_padded_fields``)."""
    if 8 % bits:
        return _pack_words(unsigned.view(-1, 64 // bits), bits).view(torch.uint8)
    if bits == 8:
        return unsigned
    multiplier, top_byte = _gathering(bits)
    # Products wrap in the lane's width; the top byte keeps the gathered fields.
    return (unsigned.view(_LANE_TYPES[8 // bits]) * multiplier).bitwise_right_shift_(top_byte).to(torch.uint8)


# The integer that holds a packed byte's codes one byte each, by codes per byte.
_LANE_TYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _gathering(bits):
    """(multiplier, shift): a lane of 8 / bits bytes, code i in byte i (little-endian), times
    the multiplier holds code i at bits [i * bits, ...) of its top byte, at ``shift``. The
    multiplier's term 2^(shift - i * (8 - bits)) moves byte i's code there; every other term
    lands below the top byte on bits no other term uses (so no carry reaches it) or past the
    lane's width."""
    per_byte = 8 // bits
    shift = 8 * (per_byte - 1)
    return sum(1 << (shift - i * (8 - bits)) for i in range(per_byte)), shift


def _spreading(bits):
    """(shift, mask) of each step that spreads a byte of 8 / bits codes, read into a lane, one
    code to a byte (little-endian): the groups of 2^j codes move left by 2^j * (8 - bits), for
    j from the largest down, each step keeping every group's own bits."""
    lane_bits = 8 * (8 // bits)
    steps = []
    for step in reversed(range((8 // bits).bit_length() - 1)):
        group = 1 << step
        mask = sum(((1 << group * bits) - 1) << lane for lane in range(0, lane_bits, 8 * group))
        steps.append((group * (8 - bits), mask))
    return steps


def _pack_words(fields, bits):
    """int64 words from (words, 64 // bits) unsigned fields, field i at bits [i * bits, ...).
    On CPU a field at a time: shifting every field of every word at once (one operator each,
    what other devices do) writes a temporary of 8 bytes a code, and was 12x slower."""
    if fields.device.type != "cpu":
        shifts = torch.arange(fields.shape[1], dtype=torch.int64, device=fields.device) * bits
        return (fields.to(torch.int64) << shifts).sum(dim=1)
    packed = torch.zeros(fields.shape[0], dtype=torch.int64)
    field_bits = torch.empty_like(packed)
    for field in range(fields.shape[1]):
        field_bits.copy_(fields[:, field])
        packed.bitwise_or_(field_bits.bitwise_left_shift_(field * bits))
    return packed


def _unpack_words(words, bits):
    """``_pack_words`` undone: the (words, 64 // bits) fields as int8 (each below 2^7); on CPU a
    field at a time, as there."""
    per_word, mask = 64 // bits, (1 << bits) - 1
    if words.device.type != "cpu":
        shifts = torch.arange(per_word, dtype=torch.int64, device=words.device) * bits
        return ((words.unsqueeze(1) >> shifts) & mask).to(torch.int8)
    fields = torch.empty(words.numel(), per_word, dtype=torch.int8)
    field_bits = torch.empty_like(words)
    for field in range(per_word):
        torch.bitwise_right_shift(words, field * bits, out=field_bits)
        fields[:, field] = field_bits.bitwise_and_(mask)
    return fields


def packed_size(count, bits):
    """Bytes that ``count`` codes of ``bits`` bits occupy once packed."""
    per_word = 64 // bits
    return -(-count // per_word) * 8

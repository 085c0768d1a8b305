"""Every rank must run the same compressor with the same settings, or payloads disagree."""

import time

# Seconds a rank waits for the others' configurations before failing loudly: generous, since
# ranks reach their first step at different times (data loading, compilation).
AGREEMENT_TIMEOUT = 600.0


def verify_same_configuration(compression, transport, rank_name=None, compiled_ready=True):
    """All-gathers ``compression.describe()`` over ``transport`` (one of ``comm/transports.py``,
    among the ranks of its process set) and raises ValueError on every rank, naming what
    differs, if any rank disagrees. Collective: every rank of the set must call it; ranks
    outside it are never waited on. ``rank_name`` maps a rank within the set to the rank the
    error names (default: the rank within the set; HSDP names global ranks).

    ``compiled_ready``: whether this rank's compiled kernels compiled
    (``GradientCompression.prepare_compiled``), gathered in the same message; returns every
    rank's, in rank order, so that all ranks make the same choice."""
    rank_name = rank_name or (lambda rank: rank)
    mine = compression.describe()
    deadline = time.monotonic() + AGREEMENT_TIMEOUT
    everyone = transport.allgather(
        {"configuration": mine, "compiled_ready": compiled_ready},
        "hvd_compress.configuration",
        deadline,
        "the cross-rank configuration check",
    )
    for other_rank, theirs in enumerate(everyone):
        if theirs["configuration"] != mine:
            raise ValueError(
                describe_difference(mine, theirs["configuration"], rank_name(transport.rank), rank_name(other_rank))
            )
    return [theirs["compiled_ready"] for theirs in everyone]


def describe_difference(mine, theirs, my_rank, other_rank):
    where = f"on rank {my_rank} but"
    if mine["compressor"] != theirs["compressor"]:
        return (
            f"compression differs across ranks: {mine['compressor']} {where} "
            f"{theirs['compressor']} on rank {other_rank}"
        )
    cls = mine["compressor"]
    for key in sorted(set(mine["config"]) | set(theirs["config"])):
        a, b = mine["config"].get(key), theirs["config"].get(key)
        if _is_description(a) and _is_description(b) and a != b:  # a wrapped compressor's
            return describe_difference(a, b, my_rank, other_rank)
        if a != b:
            return f"{cls}: {key} is {a!r} {where} {b!r} on rank {other_rank}"
    for name in sorted(set(mine["settings"]) | set(theirs["settings"])):
        a, b = mine["settings"].get(name, "default"), theirs["settings"].get(name, "default")
        if a != b:
            return f"{cls}: parameter {name!r} has setting {a!r} {where} {b!r} on rank {other_rank}"
    return f"{cls}: configuration differs between rank {my_rank} and rank {other_rank}"


def _is_description(value):
    return isinstance(value, dict) and {"compressor", "config", "settings"} <= set(value)

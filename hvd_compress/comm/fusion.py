"""Fusion plans: which payloads travel together in one collective (ACP-SGD, section IV-B).

Compressed payloads are far smaller than gradients, so a buffer sized for dense gradients
fuses nearly everything and loses the overlap with backward. The threshold is therefore the
dense threshold times the compression rate, compressed bytes / dense bytes, so a buffer holds
about as many layers as it would uncompressed. A plan depends only on parameter names, shapes,
settings and the order given, so every rank computes the same plan without communicating.
"""

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Optional

from hvd_compress import arguments

logger = logging.getLogger(__name__)

# The dense buffer that gets scaled: ACP-SGD's (and PyTorch DDP's) 25 MB. On the emulated
# 1 Gbit/s cluster it landed closer to the best buffer than Horovod's 64 MiB (docs/fusion.md).
DEFAULT_DENSE_THRESHOLD = 25 * 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    members: tuple  # parameter names, in the order their gradients become ready
    nbytes: int  # payload bytes fused


@dataclass(frozen=True)
class FusionPlan:
    phase: str  # "P" or "Q" for ACP-SGD's alternate steps, "" otherwise
    threshold: int  # payload bytes per bucket at most (a larger single payload goes alone)
    buckets: tuple

    def bucket_of(self):
        return {name: i for i, bucket in enumerate(self.buckets) for name in bucket.members}

    def digest(self):
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def describe(self):
        lines = [
            f"fusion plan {self.digest()}{' for ' + self.phase + ' steps' if self.phase else ''}: "
            f"{len(self.buckets)} buckets under {self.threshold} bytes"
        ]
        lines += [
            f"  bucket {i}: {b.nbytes} bytes, {len(b.members)} members: {', '.join(b.members)}"
            for i, b in enumerate(self.buckets)
        ]
        return "\n".join(lines)


def scaled_threshold(dense_threshold, compressed_bytes, dense_bytes):
    """The dense threshold scaled by the compression rate (never below one byte)."""
    if dense_bytes <= 0:
        return dense_threshold
    return max(1, math.floor(dense_threshold * compressed_bytes / dense_bytes))


def plan_buckets(payloads, threshold, phase=""):
    """Greedy in ready order: a bucket closes when the next payload would cross ``threshold``.
    ``payloads``: (name, nbytes) pairs in the order gradients become ready in backward."""
    buckets, members, total = [], [], 0
    for name, nbytes in payloads:
        if members and total + nbytes > threshold:
            buckets.append(Bucket(tuple(members), total))
            members, total = [], 0
        members.append(name)
        total += nbytes
    if members:
        buckets.append(Bucket(tuple(members), total))
    return FusionPlan(phase, threshold, tuple(buckets))


@dataclass(frozen=True)
class ScaledFusion:
    """How ``hvd_compress.DistributedOptimizer`` fuses payloads.

    ``dense_threshold``: the buffer size for dense gradients (default: the paper's 25 MiB; not
    HOROVOD_FUSION_THRESHOLD, which sizes Horovod's own background fusion and is often set to 0
    so that it leaves these buckets alone); with ``scaled`` it is multiplied by the compression rate, otherwise
    used as is for payload bytes (``ScaledFusion(2**62, scaled=False)``: the whole model in one
    buffer). As in Horovod, 0 turns fusion off: every payload travels alone. Each new plan is
    logged on rank 0 at INFO (logger ``hvd_compress.comm.fusion``)."""

    dense_threshold: Optional[int] = None
    scaled: bool = True

    def __post_init__(self):
        if self.dense_threshold is not None:
            arguments.integer("ScaledFusion", "dense_threshold (bytes)", self.dense_threshold, low=0)
        arguments.flag("ScaledFusion", "scaled", self.scaled)


class FusionScheduler:
    """Plans each step's buckets from the payload sizes the compression reports for its next
    step (``next_payload_bytes``, the ``GradientCompression`` contract), in backward order
    (reverse registration order, as DDP's buckets). Sizes change when settings do (L-GreCo,
    GraVAC) or, for ACP-SGD, between P and Q steps, at the same step on every rank, so plans
    change together everywhere."""

    def __init__(self, compression, shapes, config, rank=0):
        self.compression = compression
        self.shapes = shapes  # name -> shape, in backward order
        self.config = config
        self.rank = rank
        self._cache = {}
        self._last_digest = None

    def plan(self):
        payloads = tuple(
            (name, self.compression.next_payload_bytes(name, shape)) for name, shape in self.shapes.items()
        )
        phase = self.compression.schedule_phase()
        key = (payloads, phase)
        if key not in self._cache:
            dense = sum(4 * math.prod(shape) for shape in self.shapes.values())
            threshold = self.config.dense_threshold
            if threshold is None:
                threshold = DEFAULT_DENSE_THRESHOLD
            if self.config.scaled:
                threshold = scaled_threshold(threshold, sum(b for _, b in payloads), dense)
            self._cache[key] = plan_buckets(payloads, threshold, phase)
        plan = self._cache[key]
        if self.rank == 0 and plan.digest() != self._last_digest:
            logger.info("%s", plan.describe())
        self._last_digest = plan.digest()
        return plan

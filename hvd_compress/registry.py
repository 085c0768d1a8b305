"""The one registry of methods: what the package offers, by command-line name.

The examples, the tests' parametrisation and the benchmarks all read it. Adding a compressor is
one file in ``compressors/`` plus one line in ``COMPRESSORS``; it is then exported as
``hvd_compress.<ClassName>`` (with Horovod's Compression API), tested by the generic tests, and
offered by the examples and benchmarks.

Each entry has:
  * ``defaults``: the documented default settings, as constructor keywords;
  * ``small``: settings that compress every weight of a small model (the digits CNN), for
    tests and quick runs: the defaults leave its small layers dense.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from hvd_compress.compressors import ACPSGD, BF16, FP16, QSGD, NoCompression, PowerSGD, ScaleCom, SignSGD, TopK
from hvd_compress.control.gravac import GraVAC
from hvd_compress.control.lgreco import LGreCo
from hvd_compress.integration.stock import horovod_compression

NamedParameters = Optional[Iterable[Tuple[str, torch.nn.Parameter]]]


@dataclass(frozen=True)
class Method:
    name: str
    core: type                     # the class in compressors/ or control/
    description: str
    defaults: Dict[str, Any] = field(default_factory=dict)
    small: Dict[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type:
        """The public class, ``hvd_compress.<ClassName>``: the core class with Horovod's
        Compression API, so that stock ``hvd.DistributedOptimizer`` accepts it."""
        return PUBLIC[self.core.__name__]

    def build(self, named_parameters: NamedParameters = None, *, small: bool = False,
              **overrides) -> Any:
        """A compressor at the default (or ``small``) settings, with ``overrides`` on top."""
        settings = dict(self.small if small else self.defaults, **overrides)
        return self.cls(named_parameters, **settings)


@dataclass(frozen=True)
class ControllerMethod:
    name: str
    core: type
    description: str
    wraps: Tuple[str, ...]         # the compressors it can control, by name

    @property
    def cls(self) -> type:
        return PUBLIC[self.core.__name__]

    def build(self, compressor, **options) -> Any:
        return self.cls(compressor, **options)


_COMPRESSOR_LIST = [
    Method("none", NoCompression, "uncompressed all-reduce (the baseline)"),
    Method("fp16", FP16, "float16 all-reduce: half the bytes"),
    Method("bf16", BF16, "bfloat16 reduce-scatter/all-gather: half the bytes, float32's range"),
    Method("powersgd", PowerSGD, "rank-r PowerSGD, two all-reduces per matrix",
           {"rank": 4}, {"rank": 2}),
    Method("acpsgd", ACPSGD, "ACP-SGD: PowerSGD's half-steps on alternate steps, one all-reduce",
           {"rank": 4}, {"rank": 4}),
    Method("qsgd", QSGD, "QSGD stochastic quantisation, all-gathered",
           {"bits": 4}, {"bits": 4, "bucket_size": 128}),
    Method("topk", TopK, "Top-K sparsification with error feedback, all-gathered",
           {"density": 0.01}, {"density": 0.05}),
    Method("scalecom", ScaleCom, "ScaleCom: cyclic local top-k, all-reduced",
           {"density": 0.01}, {"density": 0.05}),
    Method("signsgd", SignSGD, "EF-SignSGD: 1 bit per entry, error feedback, majority vote", {}, {}),
]
COMPRESSORS: Dict[str, Method] = {m.name: m for m in _COMPRESSOR_LIST}

CONTROLLERS: Dict[str, ControllerMethod] = {m.name: m for m in [
    ControllerMethod("lgreco", LGreCo, "L-GreCo: per-layer settings by DP under an error budget",
                     ("powersgd", "acpsgd", "topk", "qsgd")),
    ControllerMethod("gravac", GraVAC, "GraVAC: one compression factor, adapted to the gain",
                     ("powersgd", "acpsgd", "topk", "qsgd")),
]}

# hvd_compress.<ClassName>: every registered class with Horovod's Compression API.
PUBLIC: Dict[str, type] = {m.core.__name__: horovod_compression(m.core)
                           for m in [*COMPRESSORS.values(), *CONTROLLERS.values()]}


def build(name: str, named_parameters: NamedParameters = None, *, small: bool = False,
          **overrides) -> Any:
    """``build("powersgd", model.named_parameters(), rank=8)``; names as in ``COMPRESSORS``."""
    if name not in COMPRESSORS:
        raise ValueError(f"compressor name must be one of {sorted(COMPRESSORS)}, got {name!r}")
    return COMPRESSORS[name].build(named_parameters, small=small, **overrides)

"""The one registry of methods: what the package offers, by command-line name.

The examples, the tests' parametrisation and the benchmarks all read it. A compressor added to
``COMPRESSORS`` (or a controller to ``CONTROLLERS``) is exported as ``hvd_compress.<ClassName>``
(with Horovod's Compression API where Horovod is installed), tested by the generic tests, and
offered by the examples and
benchmarks; docs/layout.md ("Layout and contracts") says what else a new one needs.

Each compressor entry has:
  * ``defaults``: the documented default settings, as constructor keywords;
  * ``small``: settings that compress every weight of a small model (the digits CNN), for
    tests and quick runs: the defaults leave its small layers dense.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from hvd_compress.compressors import (
    ACPSGD,
    BF16,
    FP16,
    ChunkedTopK,
    QSGD,
    NoCompression,
    PowerSGD,
    QuantizedAllReduce,
    ScaleCom,
    SignSGD,
    TopK,
)
from hvd_compress.control.gravac import GraVAC
from hvd_compress.control.lgreco import LGreCo
from hvd_compress.control.warmup import DenseWarmup
from hvd_compress.control.wrapping import register_controllable
from hvd_compress.optional import horovod_available

NamedParameters = Optional[Iterable[Tuple[str, torch.nn.Parameter]]]


@dataclass(frozen=True)
class Method:
    name: str
    core: type  # the class in compressors/
    defaults: Dict[str, Any] = field(default_factory=dict)
    small: Dict[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type:
        """The public class, ``hvd_compress.<ClassName>`` (``public_class``)."""
        return PUBLIC[self.core.__name__]

    def build(self, named_parameters: NamedParameters = None, *, small: bool = False, **overrides) -> Any:
        """A compressor at the default (or ``small``) settings, with ``overrides`` on top."""
        settings = dict(self.small if small else self.defaults, **overrides)
        return self.cls(named_parameters, **settings)


@dataclass(frozen=True)
class ControllerMethod:
    """A controller; it wraps any compressor whose class is ``controllable`` (``controllable()``).

    ``small``: settings under which it acts within a few steps of a single-process run (the
    unit tests: decisions on rank 0 of a world of one, exchanged locally); ``ranks``: the same
    on real ranks, through the integration's own transport (the multi-rank, DDP and FSDP
    tests); ``simulated_ranks``: the largest simulated world (``comm.simulated``) it runs in
    at its ``small`` settings."""

    name: str
    core: type  # the class in control/
    small: Dict[str, Any] = field(default_factory=dict)
    ranks: Dict[str, Any] = field(default_factory=dict)
    simulated_ranks: int = 2

    @property
    def cls(self) -> type:
        return PUBLIC[self.core.__name__]

    def build(self, compressor: Any, *, small: bool = False, ranks: bool = False, **overrides) -> Any:
        """A controller of ``compressor`` at the default (or ``small``, or ``ranks``) settings,
        with ``overrides`` on top."""
        preset = self.small if small else self.ranks if ranks else {}
        return self.cls(compressor, **dict(preset, **overrides))


_COMPRESSOR_LIST = [
    Method("none", NoCompression),  # uncompressed all-reduce (the baseline)
    Method("fp16", FP16),  # float16 all-reduce: half the bytes
    Method("bf16", BF16),  # bfloat16 reduce-scatter/all-gather: float32's range
    Method("powersgd", PowerSGD, {"rank": 4}, {"rank": 2}),  # two all-reduces per matrix
    Method("acpsgd", ACPSGD, {"rank": 4}, {"rank": 4}),  # PowerSGD's half-steps, one all-reduce
    Method("qsgd", QSGD, {"bits": 4}, {"bits": 4, "bucket_size": 128}),  # all-gathered
    # Two-hop int8/int4 all-reduce, error feedback on both hops.
    Method("qallreduce", QuantizedAllReduce, {"bits": 8}, {"bits": 4, "block_size": 64}),
    Method("topk", TopK, {"density": 0.01}, {"density": 0.05}),  # all-gathered
    # Top-k within chunks, low-bit values, decaying error feedback: SparseLoCo's compressor.
    Method("chunkedtopk", ChunkedTopK, {"density": 0.02}, {"density": 0.05, "chunk": 512}),
    Method("scalecom", ScaleCom, {"density": 0.01}, {"density": 0.05}),  # cyclic local top-k, all-reduced
    Method("signsgd", SignSGD, {}, {}),  # 1 bit per entry, majority vote
]
COMPRESSORS: Dict[str, Method] = {m.name: m for m in _COMPRESSOR_LIST}

CONTROLLERS: Dict[str, ControllerMethod] = {
    m.name: m
    for m in [
        # Per-layer settings by dynamic programming under an error budget.
        # Decisions at steps 2, 5, 8, ..., each taking effect one step later; rank 0 decides, so a
        # simulated world (which has no transport) holds only rank 0.
        ControllerMethod(
            "lgreco",
            LGreCo,
            {"warmup_steps": 2, "decide_every": 3, "apply_delay": 1, "transport": "local"},
            {"warmup_steps": 2, "decide_every": 3, "apply_delay": 1},
            simulated_ranks=1,
        ),
        # One compression factor for the whole model, adapted to the compression gain.
        ControllerMethod(
            "gravac",
            GraVAC,
            {"theta_min": 2, "theta_max": 64, "window": 100, "smoothing": 1.0, "epsilon": 0.3},
            {"theta_min": 2, "theta_max": 64, "window": 3, "epsilon": 0.3},
        ),
    ]
}


def public_class(core: type) -> type:
    """``core`` as ``hvd_compress`` exports it, under the same name: where Horovod is installed,
    with Horovod's Compression API (a ``horovod.torch.compression.Compressor``), which stock
    ``hvd.DistributedOptimizer(compression=...)`` accepts; without Horovod, of ``core`` alone. Named
    ``hvd_compress.<ClassName>`` either way, so that a pickle made with Horovod loads without it."""
    bases = (core,)
    if horovod_available():
        from hvd_compress.integration.horovod.compression import StockCompression  # imports Horovod

        bases = (StockCompression, core)
    return type(
        core.__name__, bases, {"__module__": "hvd_compress", "__qualname__": core.__name__, "__doc__": core.__doc__}
    )


# hvd_compress.<ClassName>: every registered class, and the dense warm-up around any of them.
PUBLIC: Dict[str, type] = {
    m.core.__name__: public_class(m.core) for m in [*COMPRESSORS.values(), *CONTROLLERS.values()]
}
PUBLIC["DenseWarmup"] = public_class(DenseWarmup)


def controllable() -> List[str]:
    """The registered compressors that controllers can wrap, by name."""
    return [name for name, method in COMPRESSORS.items() if method.core.controllable]


# A controller refuses a compressor it cannot wrap naming these (control/ is below this module).
register_controllable(sorted(COMPRESSORS[name].core.__name__ for name in controllable()))

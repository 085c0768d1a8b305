"""What wrappers of a compressor share: the integration layer sees one ``GradientCompression``
with the wrapped compressor's names and traffic. Controllers (L-GreCo, GraVAC) also own its
settings, and use the compressor only through the controller protocol of
``compressors/tuning.py``; the dense warm-up (``warmup.py``) only chooses which gradients it
compresses."""

from typing import Any, Dict, Iterable, List, Optional, Sequence

from hvd_compress.compressors.base import Compressor, GradientCompression, Shape
from hvd_compress.compressors.config import MethodConfig

# The registered compressors a controller can wrap, by class name, for its error message. The
# registry (hvd_compress/registry.py, above this layer) is their one list and fills this in.
_REGISTERED_CONTROLLABLE: List[str] = []


def register_controllable(class_names: Sequence[str]) -> None:
    """Called by the registry with its controllable compressors' class names."""
    _REGISTERED_CONTROLLABLE[:] = class_names


class Wrapper(GradientCompression):
    """A ``GradientCompression`` around one compressor: its names, traffic, world and settings
    are the compressor's; subclasses decide how each gradient goes through it."""

    config: MethodConfig  # the wrapper's own; set by the subclass's constructor

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor):
            raise ValueError(
                f"{type(self).__name__}: compressor must be an hvd_compress compressor, got {type(compressor).__name__}"
            )
        self.inner = compressor
        self.parameters = compressor.parameters
        self.needs_parameter_names = compressor.needs_parameter_names
        self.traffic = compressor.traffic
        self.rank, self.size = 0, 1

    @property
    def wrapped(self) -> Compressor:
        return self.inner

    def setting(self, name: str) -> Any:
        return self.inner.setting(name)

    def set_setting(self, name: str, value: Any) -> None:
        self.inner.set_setting(name, value)

    def settings(self) -> Dict[str, Any]:
        return self.inner.settings()

    def bind_world(self, rank: int, size: int) -> None:
        self.inner.bind_world(rank, size)
        self.rank, self.size = rank, size

    def use_process_set(self, process_set: Any) -> None:
        self.inner.use_process_set(process_set)

    def write_results_into_gradients(self) -> None:
        self.inner.write_results_into_gradients()

    def prepare_compiled(self, shapes: Optional[Dict[str, Shape]] = None) -> bool:
        return self.inner.prepare_compiled(shapes)

    def use_compiled(self, ready: Sequence[bool]) -> None:
        self.inner.use_compiled(ready)

    def adopt_parameters(self, named: Dict[str, Any]) -> None:
        self.inner.adopt_parameters(named)  # self.parameters is the same dict

    def use_shards(self, local: Dict[str, Any]) -> None:
        self.inner.use_shards(local)

    def next_payload_bytes(self, name: str, shape: Shape) -> int:
        return self.inner.next_payload_bytes(name, shape)

    def schedule_phase(self) -> str:
        return self.inner.schedule_phase()

    def fixed_payload(self, shape: Shape) -> bool:
        return self.inner.fixed_payload(shape)  # controllers change settings, never this

    def reject_step(self) -> None:
        self.inner.reject_step()  # a controller drops its own updates when the inner step is dropped

    def _end_step(self, comm_seconds: Optional[float]) -> None:
        self.inner.end_step()

    def track(self, scaler: Any) -> "Controller":
        """As :meth:`Compressor.track`: the wrapped compressor follows ``scaler``'s loss scale,
        and so do this controller's statistics."""
        self.inner.track(scaler)
        return self

    def metrics(self) -> Dict[str, float]:
        """The wrapped compressor's metrics plus this controller's state (``Compressor.metrics``)."""
        return self.inner.metrics()

    def describe(self) -> Dict[str, Any]:
        """The controller's configuration, the wrapped compressor's description nested in it
        (``inner``): both must agree on every rank."""
        return {
            "compressor": type(self).__name__,
            "config": {"inner": self.inner.describe(), **self.config.describe()},
            "settings": {},
        }

    # ----- world changes: the wrapped compressor's state is nested under "inner" -------------
    def world_change_state(self, state_dict, *, own=None, rank=None, size=None) -> Dict[str, Any]:
        inner = self.inner.world_change_state(
            state_dict["inner"], own=None if own is None else own["inner"], rank=rank, size=size
        )
        return dict(state_dict, inner=inner)

    def restart_from(self, state_dict: Dict[str, Any], forget: Iterable[str] = ()) -> None:
        self.inner.restart_from(state_dict["inner"], forget)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.traffic = self.inner.traffic  # one Traffic, shared with the wrapped compressor


class Controller(Wrapper):
    """A wrapper that owns the wrapped compressor's per-parameter settings (L-GreCo, GraVAC)."""

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor) or not compressor.controllable:
            raise ValueError(
                f"{type(self).__name__}: compressor must be one of "
                f"{', '.join(_REGISTERED_CONTROLLABLE)} (a compressor with controllable "
                f"per-parameter settings), got {type(compressor).__name__}"
            )
        super().__init__(compressor)

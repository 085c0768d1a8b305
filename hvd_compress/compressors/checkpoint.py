"""A compressor's checkpoints and world changes: ``Checkpoint`` reads and writes the state a
``Compressor`` keeps (settings, per-parameter state, error feedback, skipped steps), made for
each call by the contract's ``state_dict``, ``load_state_dict``, ``world_change_state`` and
``restart_from`` (``GradientCompression.checkpoint_class``). A compressor that keeps more
(QuantizedAllReduce's owner residuals) subclasses it.

The layout is the compressor's own: only tensors, numbers, strings, lists and dicts, so that
``torch.load(path, weights_only=True)`` reads it."""

import logging
import math
from typing import Any, Dict, Iterable, Tuple

import torch

from hvd_compress.compressors.config import check_checkpoint, checkpoint_header, parameter_error
from hvd_compress.compressors.rollback import StepGuard

logger = logging.getLogger(__name__)

KEYS = ("rank", "world_size", "shapes", "settings", "state", "residuals", "skipped_steps")


class Checkpoint:
    """The checkpoints of ``compressor`` (a ``compressors.base.Compressor``)."""

    def __init__(self, compressor: Any):
        self.compressor = compressor

    def state_dict(self) -> Dict[str, Any]:
        """Everything that determines future outputs, with what it was taken from (the class,
        configuration, parameter shapes, and this process's rank and world size: error feedback
        is per rank, and a checkpoint loaded on another rank or world size starts it from zero).
        Tensors are copied, since state is updated in place."""
        c = self.compressor
        residuals = {} if c.feedback is None else c.feedback.state_dict()
        return {
            **checkpoint_header(type(c).__name__, c.config),
            "rank": c.rank,
            "world_size": c.size,
            "shapes": {name: list(shape) for name, shape in sorted(c._shapes.items())},
            "settings": dict(c._overrides),
            "state": {
                name: {key: value.clone() if torch.is_tensor(value) else value for key, value in vars(st).items()}
                for name, st in c.state.items()
            },
            "residuals": residuals,
            "skipped_steps": c.skipped_steps,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a ``state_dict``. Everything is checked before anything changes: a mismatch
        (class, configuration, a parameter's shape, a setting out of range) raises one
        ``ValueError`` naming it, and leaves the compressor as it was. Taken on another rank or
        world size (checked once the rank is known), all but the error feedback is restored."""
        c = self.compressor
        check_checkpoint(type(c).__name__, state_dict, KEYS, c.config)
        shapes = {name: tuple(shape) for name, shape in state_dict["shapes"].items()}
        self._check_shapes(shapes)
        for name, value in state_dict["settings"].items():
            shape = shapes.get(name) or (tuple(c.parameters[name].shape) if name in c.parameters else None)
            c.tuning.check_setting(name, value, None if shape is None else math.prod(shape))
        for name, residual in state_dict["residuals"].items():
            if c.feedback is None or name not in shapes or residual.numel() != math.prod(shapes[name]):
                raise parameter_error(c, name, "the checkpoint's error feedback does not fit this compressor")
        state = self._new_state(state_dict["state"])
        # Checked: now change everything, a step cut off midway (elastic restore) included.
        c.guard, c._step_scale = StepGuard(), None
        c._overrides = dict(state_dict["settings"])
        c.state = state
        c._shapes = dict(shapes)
        if c.feedback is not None:
            c.feedback.load_state_dict(state_dict["residuals"])
        c.skipped_steps = state_dict["skipped_steps"]
        expected_world = (state_dict["rank"], state_dict["world_size"])
        if c._bound:
            self.check_world(expected_world)
        else:  # checked when the integration binds it
            c._expected_world = expected_world

    def _check_shapes(self, shapes: Dict[str, Tuple[int, ...]]) -> None:
        """The checkpoint's gradient shapes against the parameters' and the gradients' seen."""
        c = self.compressor
        for name, shape in shapes.items():
            param = c.parameters.get(name)
            if c.parameters and param is None:
                raise parameter_error(c, name, "is in the checkpoint but is not one of the named_parameters")
            if param is not None and tuple(param.shape) != shape:
                raise parameter_error(c, name, f"has shape {tuple(param.shape)} here but {shape} in the checkpoint")
            seen = c._shapes.get(name)
            if param is None and seen is not None and seen != shape:
                raise parameter_error(c, name, f"had gradients of shape {seen} here but {shape} in the checkpoint")

    def _new_state(self, values: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
        """The per-parameter state objects (``compressor.state_type``) of a checkpoint's."""
        c = self.compressor
        cls = type(c).__name__
        try:
            return {
                name: c.state_type(
                    **{key: value.clone() if torch.is_tensor(value) else value for key, value in st.items()}
                )
                for name, st in values.items()
            }
        except TypeError as error:
            raise ValueError(
                f"{cls}.load_state_dict: the checkpoint's per-parameter state does not fit {cls}: {error}"
            ) from None

    def world_change_state(self, state_dict, *, own=None, rank=None, size=None) -> Dict[str, Any]:
        """As ``GradientCompression.world_change_state``."""
        changed: Dict[str, Any] = {"residuals": {} if own is None else own["residuals"]}
        if rank is not None:
            changed.update(rank=rank, world_size=size)
        return dict(state_dict, **changed)

    def restart_from(self, state_dict: Dict[str, Any], forget: Iterable[str] = ()) -> None:
        """As ``GradientCompression.restart_from``."""
        forget = set(forget)
        self.load_state_dict(
            dict(
                state_dict,
                **{
                    key: {name: value for name, value in state_dict[key].items() if name not in forget}
                    for key in ("shapes", "state", "residuals")
                },
            )
        )

    def check_world(self, expected: Tuple[int, int]) -> None:
        """Error feedback is per rank: a checkpoint from another rank, or another world size,
        brings everything but it (the residuals start from zero, as after a reset)."""
        c = self.compressor
        rank, size = expected
        if (rank, size) != (c.rank, c.size) and c.feedback is not None:
            logger.warning(
                "%s: the checkpoint was taken on rank %d of %d, but this is rank %d "
                "of %d; its error feedback is not this rank's and starts from zero",
                type(c).__name__,
                rank,
                size,
                c.rank,
                c.size,
            )
            c.feedback.load_state_dict({})


def state_to_device(state: Any, device: torch.device) -> None:
    """Moves the tensors of ``state`` (one parameter's state object, or None), loaded from a
    checkpoint mapped to another device (``map_location="cpu"``), to ``device``, once (error
    feedback moves itself)."""
    for key, value in ({} if state is None else vars(state)).items():
        if torch.is_tensor(value) and value.device != device:
            setattr(state, key, value.to(device))

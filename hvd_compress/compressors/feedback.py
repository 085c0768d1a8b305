"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019): the one component that owns
residuals, what compression left out of each parameter's gradient, to be added to its next one.

Every compressor with error feedback keeps its residuals here and only here, so that controllers
(``residual``, ``clear``) and checkpoints see one format, and so that non-finite steps are
handled in one place: a step's new residuals are staged, and become the residuals only when the
step is known to be finite everywhere (``commit``); otherwise they are dropped (``rollback``)
and the step leaves no trace.
"""

from typing import Dict, Optional, Sequence, Tuple

import torch


class StagedSums:
    """Tensors by name whose updates within a step are staged: ``commit`` keeps them, ``rollback``
    keeps the values from before the step. Updates are written into a second buffer per name,
    swapped in at commit, so a step costs no allocation and the same passes as in place."""

    def __init__(self):
        self.committed: Dict[str, torch.Tensor] = {}
        self._staged: Dict[str, torch.Tensor] = {}
        self._spare: Dict[str, torch.Tensor] = {}
        self._reused = set()  # names updated by ``add``, whose old buffer serves the next step
        self._dropped = set()  # names whose value is gone at commit

    def staged(self, name: str, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """This step's value so far (staged, else committed), or None. With ``device``, on that
        device: a value loaded from a checkpoint mapped elsewhere (``map_location="cpu"``)
        moves there, once."""
        if name in self._dropped:
            return None
        value = self._staged.get(name)
        return value if value is not None else self.committed_on(name, device)

    def committed_on(self, name: str, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """The committed value, or None; with ``device``, moved there (once) if it is elsewhere."""
        value = self.committed.get(name)
        if value is not None and device is not None and value.device != device:
            value = self.committed[name] = value.to(device)
        return value

    def add(
        self, name: str, value: torch.Tensor, *, current_weight: float = 1.0, value_weight: float = 1.0
    ) -> torch.Tensor:
        """Stages ``current_weight * current + value_weight * value`` in float32, shaped like
        ``value``; returns it. The caller may overwrite the returned tensor: what it leaves there
        is what gets committed. (One weight is always 1, so this is one fused pass.)"""
        current = self.staged(name, value.device)
        self._reused.add(name)
        self._dropped.discard(name)
        if current is None:
            staged = self._staged[name] = value.to(torch.float32, copy=True)
            return staged if value_weight == 1.0 else staged.mul_(value_weight)
        if name in self._staged:  # a second update within the step
            if current_weight != 1.0:
                current.mul_(current_weight)
            return current.add_(value, alpha=value_weight)
        buffer = self._spare.pop(name, None)
        if buffer is None or buffer.shape != current.shape:
            buffer = torch.empty_like(current)
        if value_weight == 1.0:
            torch.add(value, current, alpha=current_weight, out=buffer)
        else:
            torch.add(current, value, alpha=value_weight, out=buffer)
        self._staged[name] = buffer
        return buffer

    def stacked_spares(self, names: Sequence[str], shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 tensor of shape ``(len(names), *shape)`` whose slices are the buffers the
        names' next ``add`` writes into (made so, once, where they are not): a batched call then
        reads their sums, and leaves what it writes there, with no stacking copy. The two
        buffers a name alternates between are each a slice of one such stack after two steps."""
        spares = [self._spare.get(name) for name in names]
        base = getattr(spares[0], "_base", None)
        if (
            base is not None
            and base.shape == (len(names), *shape)
            and base.device == device
            and all(
                spare is not None and spare._base is base and spare.data_ptr() == row.data_ptr()
                for spare, row in zip(spares, base)
            )
        ):
            return base
        base = torch.empty((len(names), *shape), dtype=torch.float32, device=device)
        self._spare.update(zip(names, base))
        return base

    def put(self, name: str, value: torch.Tensor) -> None:
        """Stages ``value`` as the new value."""
        self._dropped.discard(name)
        self._staged[name] = value

    def drop(self, name: str) -> None:
        """Stages the removal of ``name``'s value."""
        self._staged.pop(name, None)
        self._reused.discard(name)
        self._dropped.add(name)

    def commit(self, scale: float = 1.0) -> None:
        """Keeps this step's values, divided by ``scale``."""
        for name, value in self._staged.items():
            if scale != 1.0:
                value.div_(scale)
            old = self.committed.get(name)
            self.committed[name] = value
            if name in self._reused and old is not None and old is not value:
                self._spare[name] = old
        for name in self._dropped:
            self.committed.pop(name, None)
            self._spare.pop(name, None)
        self._staged.clear()
        self._reused.clear()
        self._dropped.clear()

    def rollback(self) -> None:
        for name, value in self._staged.items():
            if name in self._reused:
                self._spare[name] = value
        self._staged.clear()
        self._reused.clear()
        self._dropped.clear()

    def clear(self) -> None:
        self.committed.clear()
        self._staged.clear()
        self._spare.clear()
        self._reused.clear()
        self._dropped.clear()


class ErrorFeedback:
    """Residuals by parameter name, in float32 on the gradient's device.

    A compressor asks for ``compensated(name, grad)``, the gradient plus the residual, and
    leaves its new residual behind: either in place in the tensor it was given (the common,
    allocation-free case) or by handing a new tensor to ``keep``. The new residuals take effect
    at ``commit`` (the step was finite on every rank) or are dropped at ``rollback``. With
    ``enabled=False`` the gradient comes back as a float32 copy and nothing is remembered.

    Memory: two float32 buffers per compressed parameter (the residual, and the one the next
    residual is built in).

    ``decay`` (beta in [0, 1]) multiplies the residual before the next input is added:
    ``compensated`` returns ``grad + beta * residual``. 1 is plain error feedback; below 1 the
    residual is a decaying sum of what was not sent, SparseLoCo's stand-in for DiLoCo's outer
    momentum (Sarfi et al. 2025, arXiv 2508.15706, section 3).

    Loss scaling: gradients under ``torch.amp.GradScaler`` arrive multiplied by the scale S in
    force, which changes between steps. Residuals are kept in unscaled units: ``compensated``
    returns ``grad + S * residual`` (in the gradient's units) and ``commit`` divides the new
    residuals by S. The owner sets ``loss_scale`` before each step (``Compressor.track``).
    """

    def __init__(self, enabled: bool = True, decay: float = 1.0):
        self.enabled = enabled
        self.decay = decay
        self.loss_scale = 1.0
        self._sums = StagedSums()

    def compensated(self, name: str, grad: torch.Tensor, *, in_place: bool = True) -> torch.Tensor:
        """``grad + residual`` as float32, shaped like ``grad``, which the caller may overwrite.

        ``in_place``: what the caller leaves in the returned tensor is the next residual.
        Otherwise the residual stays as it was until ``keep``."""
        if not self.enabled:
            return grad.to(torch.float32, copy=True)
        if in_place:
            return self._sums.add(name, grad, current_weight=self.decay * self.loss_scale)
        residual = self._sums.staged(name, grad.device)
        if residual is None:
            return grad.to(torch.float32, copy=True)
        return torch.add(grad, residual, alpha=self.decay * self.loss_scale)

    def stacked(self, names: Sequence[str], shape: Tuple[int, ...], device: torch.device) -> Optional[torch.Tensor]:
        """Where ``compensated`` will build the names' sums (each of ``shape``) in place, as the
        slices of one ``(len(names), *shape)`` tensor, returned; None without error feedback.
        Only a name with a residual is built there: check the sums' memory before relying on it."""
        return self._sums.stacked_spares(names, shape, device) if self.enabled else None

    def keep(self, name: str, residual: torch.Tensor) -> None:
        """Makes ``residual`` (float32, the shape ``compensated`` returned) the next residual."""
        if self.enabled:
            self._sums.put(name, residual)

    def residual(self, name: str, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """The residual waiting to be added to ``name``'s next gradient (unscaled), or None; with
        ``device`` (the gradient's), on it, as ``compensated`` moves it."""
        return self._sums.committed_on(name, device)

    def clear(self, name: str) -> None:
        """Forgets ``name``'s residual from the next step on (its gradient was sent whole), so
        that later dense steps add nothing and checkpoints hold nothing for it."""
        self._sums.drop(name)

    def commit(self) -> None:
        self._sums.commit(self.loss_scale)

    def rollback(self) -> None:
        self._sums.rollback()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        # Copies: residuals are updated in place, and a checkpoint must not change afterwards.
        return {name: residual.clone() for name, residual in self._sums.committed.items()}

    def load_state_dict(self, residuals: Dict[str, torch.Tensor]) -> None:
        self._sums.clear()
        self._sums.committed.update({name: residual.clone() for name, residual in residuals.items()})

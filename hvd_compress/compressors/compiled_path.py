"""Whether a compressor runs its kernels compiled (``compiled=True`` in its configuration), and
the work of getting there: ``CompiledPath`` compiles them before the first collective
(``prepare``), agrees with the other ranks (``use``), and falls back to eager where a compile
fails (``run``), so that every rank rounds alike."""

import logging
import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from hvd_compress.maths.compiled import CompileFailed, graphs, timed_warm_up

logger = logging.getLogger(__name__)


class CompiledPath:
    """One compressor's compiled path. ``owner``: its class name, for logs; ``wanted``: whether
    it runs compiled kernels at all (asked for, and it has some). ``compiles``: whether it still
    does (not given up); ``seconds``: spent compiling in ``prepare``."""

    def __init__(self, owner: str, wanted: bool):
        self.owner = owner
        self.compiles = wanted
        self.seconds = 0.0
        self._error: Optional[str] = None

    def prepare(self, compressor: Any, shapes: Optional[Dict[str, Tuple[int, ...]]] = None) -> bool:
        """Compiles ``compressor``'s kernels for the gradients of ``shapes`` ({name: shape};
        None: its parameters') it compresses, by its ``_warm_up``; returns whether they compiled
        (True where it runs none). As ``GradientCompression.prepare_compiled``."""
        if not self.compiles:
            return True
        # Parameters know their device; gradients of given shapes are taken to be on the CPU.
        devices = {name: param.device for name, param in compressor.parameters.items()}
        if shapes is None:
            shapes = {name: tuple(param.shape) for name, param in compressor.parameters.items()}
        layers = {
            (math.prod(shape), compressor.setting(name), devices.get(name, torch.device("cpu")))
            for name, shape in shapes.items()
            if compressor.tuning.compresses(shape, compressor.setting(name))
        }

        def warm():
            for numel, setting, device in sorted(layers, key=str):
                compressor._warm_up(numel, setting, device)

        seconds, self._error = timed_warm_up(warm)
        self.seconds += seconds
        if self._error is None:
            logger.info(
                "%s: compiled kernels ready for %d layer sizes in %.1f s (%d graphs)",
                self.owner,
                len(layers),
                seconds,
                graphs(compressor.compiled_kernels),
            )
        return self._error is None

    def use(self, ready: Sequence[bool]) -> None:
        """Every rank's ``prepare`` answer, in rank order: where any is False, the kernels run
        eagerly from now on (one log line)."""
        if self.compiles and not all(ready):
            self.fall_back(
                f"torch.compile failed on rank(s) {[r for r, ok in enumerate(ready) if not ok]}"
                + (f" (here: {self._error})" if self._error else "")
            )

    def fall_back(self, reason: str) -> None:
        self.compiles = False
        logger.warning("%s: compiled=True, but %s; its kernels run eagerly from now on", self.owner, reason)

    def run(self, run: Callable[[bool], Any]) -> Any:
        """``run(compiled)`` on the path in force. A compile that fails here, outside ``prepare``
        (an unbound compressor, a layer it did not know), falls back to eager in this process
        alone: bound ones compile every layer ahead, where all ranks agree."""
        if self.compiles:
            try:
                return run(True)
            except CompileFailed as error:
                self.fall_back(str(error.__cause__ or error))
        return run(False)

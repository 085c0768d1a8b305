"""Per-step metrics of a compression, exported to TensorBoard or a JSON-lines file.

``compression.metrics()`` (any compressor or controller) is one flat dict of numbers for the
last step: ``bytes_sent`` (what this rank sent), ``payload_bytes``, ``float32_allreduce_bytes``
(what an uncompressed float32 all-reduce would have sent), ``ratio`` (of the two),
``ratio_since_start``, ``skipped_steps`` (non-finite steps that left no trace), ``steps``, and
the controller's state: L-GreCo's ``lgreco_version`` and each layer's ``setting/<name>``,
GraVAC's ``gravac_factor``. An exporter that watches the compression adds ``codec_seconds``
(host seconds spent in the codec) and, if asked, ``relative_error``.

Each L-GreCo decision is written too, at the step it took effect, with what the solver saw per
layer (``compression.decision_records``): ``JsonLines`` writes it as one nested record,
``{"step": N, "decision": {..., "layers": {name: {"options", "bytes", "errors", "chosen",
"default", "gradient_norm", "residual_norm"}}}}``; ``TensorBoard`` as scalars
``decision/<name>/{setting,gradient_norm,residual_norm}`` and
``decision/<name>/{error,bytes}@<option>``.

Use::

    from torch.utils.tensorboard import SummaryWriter
    exporter = hvd_compress.metrics.TensorBoard(SummaryWriter(log_dir), every=10)
    compression = exporter.watch(hvd_compress.PowerSGD(model.named_parameters(), rank=4))

Tuning guide:
  * ``every``: steps between writes. Collecting is cheap (no tensor is read, the codec clock is
    a few host timer reads per layer), writing costs a file append per scalar; ``every=10`` or
    more keeps it well under 1% of a step for any model with more than a handful of layers.
  * ``all_ranks``: by default only rank 0 times and writes (its numbers describe every rank:
    bytes and settings agree across ranks); ``True`` lets every rank write, to its own file.
  * ``error_every``: every this many steps, the relative compression error of this rank's
    gradients, sqrt(sum ||C(g) - g||^2 / sum ||g||^2) over the compressed layers, before error
    feedback. It reads one number per layer on the host (a wait per layer on a GPU) and repeats
    the compression, so it is off (0) by default; a sample every few hundred steps is enough
    to watch a trend.
  * Without an exporter nothing is timed or sampled: an unwatched compression pays nothing.
"""

import json
import math
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from hvd_compress import arguments
from hvd_compress.comm.rounds import Round
from hvd_compress.compressors.base import GradientCompression, StepObserver


class Exporter(StepObserver):
    """Writes ``compression.metrics()`` every ``every`` steps once it ``watch``-es a compression
    (as one of its observers); subclasses say where (``write``)."""

    def __init__(self, every: int = 1, *, all_ranks: bool = False, error_every: int = 0):
        self.every = arguments.integer(type(self).__name__, "every", every, low=1)
        self.error_every = arguments.integer(type(self).__name__, "error_every", error_every, low=0)
        self.all_ranks = bool(all_ranks)
        self.step = 0
        self.compression = None
        self._codec_seconds = 0.0
        self._error = None  # [sum of squared errors, sum of squared norms] on a sampled step
        self._decisions_written = 0  # the version of the last decision written

    # ----- what subclasses provide ------------------------------------------------------------
    def write(self, step: int, numbers: Dict[str, float]) -> None:
        raise NotImplementedError

    def write_decision(self, step: int, record: Dict[str, Any]) -> None:
        """Writes a controller's decision (``decision_records``); by default as flat numbers."""
        self.write(step, decision_numbers(record))

    def close(self) -> None:
        """Stops watching and closes the output."""
        if self.compression is not None:
            self.compression.remove_observer(self)
            self.compression.traffic.codec_seconds = None
            self.compression = None

    # ----- watching -------------------------------------------------------------------------
    def watch(self, compression: GradientCompression) -> GradientCompression:
        """Times ``compression``'s codec and writes its metrics at the end of every ``every``-th
        step, on rank 0 only unless ``all_ranks``. Returns ``compression``. One exporter watches
        one compression; a watched compression pickles unwatched."""
        if self.compression is not None:
            raise ValueError(
                f"{type(self).__name__}.watch: already watching a "
                f"{type(self.compression).__name__}; use one exporter per compression"
            )
        if not (isinstance(compression, GradientCompression) and callable(getattr(compression, "metrics", None))):
            raise ValueError(
                f"{type(self).__name__}.watch: compression must be an hvd_compress "
                f"compressor or controller, got {type(compression).__name__}"
            )
        self.compression = compression
        compression.add_observer(self)
        return compression

    def _active(self):
        return self.all_ranks or self.compression.rank == 0

    def observe_begin(self, name, grad, begin):
        if not self._active():
            return begin()
        if self.error_every and (self.step + 1) % self.error_every == 0:
            self._sample_error(name, grad)
        started = time.perf_counter()
        round_ = begin()
        self._codec_seconds += time.perf_counter() - started
        return self._timed(round_)

    def _timed(self, round_):
        then = round_.then

        def timed(result):
            started = time.perf_counter()
            following = then(result)
            self._codec_seconds += time.perf_counter() - started
            return self._timed(following) if isinstance(following, Round) else following

        return Round(round_.payload, round_.collective, timed, round_.last, round_.root)

    def _sample_error(self, name, grad):
        core = self.compression.wrapped or self.compression
        setting = core.setting(name)
        if not (core.controllable and core.tuning.compresses(grad.shape, setting)):
            return
        (error,) = core.tuning.errors(grad.detach(), [setting])
        sums = self._error = self._error or [0.0, 0.0]
        sums[0] += float(error) ** 2
        sums[1] += float(grad.detach().double().norm()) ** 2

    def step_ended(self, comm_seconds):
        if not self._active():
            return
        self.step += 1
        self.compression.traffic.codec_seconds, self._codec_seconds = self._codec_seconds, 0.0
        for record in self.compression.decision_records(self._decisions_written):
            self.write_decision(self.step, record)
            self._decisions_written = record["version"]
        if self.step % self.every:
            return
        numbers = self.compression.metrics()
        if self._error is not None:
            squared_error, squared_norm = self._error
            numbers["relative_error"] = math.sqrt(squared_error / squared_norm) if squared_norm else 0.0
            self._error = None
        self.write(self.step, numbers)


def decision_numbers(record: Dict[str, Any]) -> Dict[str, float]:
    """A decision record as flat numbers: per layer its setting (where a number), window norms,
    and its error and bytes rows by option."""
    numbers = {
        "decision/version": record["version"],
        "decision/total_bytes": record["total_bytes"],
        "decision/uniform_bytes": record["uniform_bytes"],
    }
    for name, layer in record["layers"].items():
        chosen = layer["options"][layer["chosen"]]
        if isinstance(chosen, (int, float)):
            numbers[f"decision/{name}/setting"] = chosen
        numbers[f"decision/{name}/gradient_norm"] = layer["gradient_norm"]
        numbers[f"decision/{name}/residual_norm"] = layer["residual_norm"]
        for option, error, size in zip(layer["options"], layer["errors"], layer["bytes"]):
            numbers[f"decision/{name}/error@{option}"] = error
            numbers[f"decision/{name}/bytes@{option}"] = size
    return numbers


class TensorBoard(Exporter):
    """Scalars under ``hvd_compress/<metric>`` at the exporter's own step count, in ``writer``: a
    ``torch.utils.tensorboard.SummaryWriter``, or a directory for one, made at the first write,
    so only the writing rank makes an event file (``pip install hvd_compress[tensorboard]``)."""

    def __init__(
        self,
        writer: Any,
        every: int = 1,
        *,
        all_ranks: bool = False,
        error_every: int = 0,
        prefix: str = "hvd_compress",
    ):
        super().__init__(every, all_ranks=all_ranks, error_every=error_every)
        if isinstance(writer, (str, Path)):
            self.directory, self.writer = Path(writer), None
            _summary_writer_class()  # a missing tensorboard fails here, not at the first write
        elif callable(getattr(writer, "add_scalar", None)):
            self.directory, self.writer = None, writer
        else:
            raise ValueError(
                f"TensorBoard: writer must be a directory or have add_scalar(), like "
                f"torch.utils.tensorboard.SummaryWriter; got {type(writer).__name__}"
            )
        self.prefix = prefix

    def write(self, step, numbers):
        if self.writer is None:
            self.writer = _summary_writer_class()(str(self.directory))
        for key, value in numbers.items():
            self.writer.add_scalar(f"{self.prefix}/{key}", value, step)

    def close(self):
        super().close()
        if self.writer is not None:
            self.writer.flush()
            if self.directory is not None:
                self.writer.close()


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            f"hvd_compress.metrics.TensorBoard needs the tensorboard package "
            f"(pip install tensorboard, or hvd_compress[tensorboard]): {error}"
        ) from None
    return SummaryWriter


class JsonLines(Exporter):
    """One JSON object per written step (``{"step": N, <metric>: value, ...}``) appended to
    ``path``, flushed as written, so a crashed run keeps its lines."""

    def __init__(self, path: Union[str, Path], every: int = 1, *, all_ranks: bool = False, error_every: int = 0):
        super().__init__(every, all_ranks=all_ranks, error_every=error_every)
        self.path = Path(path)
        self._file: Optional[Any] = None

    def write(self, step, numbers):
        self._append({"step": step, **numbers})

    def write_decision(self, step, record):
        self._append({"step": step, "decision": record})

    def _append(self, line):
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self):
        super().close()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_json_lines(path: Union[str, Path]) -> list:
    """The records a ``JsonLines`` exporter wrote, oldest first."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

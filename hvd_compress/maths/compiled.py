"""Maths functions that may run through ``torch.compile`` (inductor) instead of eagerly.

A codec's work between two collectives is a chain of element-wise operators, each a pass
through memory when run eagerly; compiled, inductor fuses the chain into a few loops that read
each input once. ``@compilable`` marks such a function: ``kernel(...)`` runs it eagerly and
``kernel.compiled(...)`` compiled, so that a caller picks per call (a compressor's agreed
``compiled`` setting). Only pure tensor work goes in: no collective, no random generator (draw
the noise eagerly and pass it in), no host read of a tensor; ``fullgraph=True`` refuses a
graph break rather than silently splitting the function.

Graphs are bounded: shapes are dynamic, so one graph serves every layer size, and a new graph
is compiled only for what the function specialises on (a Python int that picks a branch, such
as QSGD's bits, or the number of rows gathered). Each kernel counts the graphs it compiled in
this process (``graphs``), through the backend that hands them to inductor.

Compiled and eager results may differ in the last bit (inductor may reorder a reduction or fuse
a multiply-add); each is deterministic, so ranks that agree on the path agree on the bytes.
Inductor keeps what it built in its on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default
under the system's temporary folder), so a second process compiles the same graphs much faster.
"""

import functools
import time
from typing import Any, Callable, Iterable, Optional, Tuple

import torch


class CompileFailed(RuntimeError):
    """No compiler works here for a kernel (no C++ compiler, an inductor error): the caller
    runs eagerly instead."""


class Compilable:
    """A pure tensor function that runs eagerly (calling the object) or compiled
    (``compiled``). The compiled function is made at its first call."""

    def __init__(self, fn: Callable[..., Any]):
        functools.update_wrapper(self, fn)
        self.eager = fn
        self.graphs = 0  # graphs handed to inductor for this kernel in this process (built or cached)
        self._compiled: Optional[Callable[..., Any]] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.eager(*args, **kwargs)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        """Inductor, counting each graph it is handed."""
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs)

    def compiled(self, *args: Any, **kwargs: Any) -> Any:
        """The function's result, computed by its compiled form; ``CompileFailed`` where a graph
        cannot be compiled (the error's cause says why)."""
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, backend=self._backend, dynamic=True, fullgraph=True)
        # Views enter detached (the same memory, written in place alike): dynamo guards on a
        # view's base, so a chunk of a gradient reshaped from 2-D would take a graph per base shape.
        args = tuple(arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as error:  # inductor's and the C++ compiler's errors have no common base
            if _is_compile_error(error):
                raise CompileFailed(f"{self.__name__}: torch.compile failed: {error}") from error
            raise


def _is_compile_error(error: BaseException) -> bool:
    """Whether ``error`` comes from compiling (dynamo, inductor, the C++ compiler), not from
    running a graph on bad inputs."""
    from torch._dynamo import exc

    compile_errors = tuple(
        kind
        for kind in (
            getattr(exc, "BackendCompilerFailed", None),
            getattr(exc, "Unsupported", None),
            getattr(exc, "InternalTorchDynamoError", None),
        )
        if kind is not None
    )
    inductor = type(error).__module__.startswith("torch._inductor")
    return isinstance(error, compile_errors) or inductor or isinstance(error, OSError)


def compilable(fn: Callable[..., Any]) -> Compilable:
    """Marks ``fn`` (pure tensor work, see the module docstring) as able to run compiled."""
    return Compilable(fn)


def graphs(kernels: Iterable[Compilable]) -> int:
    """Graphs compiled in this process for ``kernels`` (each counted once)."""
    return sum(kernel.graphs for kernel in {id(k): k for k in kernels}.values())


def timed_warm_up(warm: Callable[[], None]) -> Tuple[float, Optional[str]]:
    """Runs ``warm()`` (calls of compiled kernels on a compressor's layer shapes, so that no
    rank compiles while the others wait in a collective): (its seconds, None), or (seconds,
    why) where a kernel failed to compile (``CompileFailed``)."""
    started = time.perf_counter()
    try:
        warm()
    except CompileFailed as error:
        return time.perf_counter() - started, str(error.__cause__ or error)
    return time.perf_counter() - started, None

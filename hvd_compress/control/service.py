"""The rank-0 decision service.

Rank 0 computes a decision in a background thread while training goes on. At a step fixed in
advance, every rank takes part in one exchange: rank 0 broadcasts the decision (or the error
that stopped it, or, when it is still computing and may postpone, the later step at which to
exchange again), then all ranks all-gather a digest and fail loudly if any disagree. Every
wait has a deadline, so a dead or stalled rank 0 makes the others raise instead of hang.

The exchange runs over a transport of ``comm/transports.py`` (``transport="auto"``: Horovod's
collectives under ``horovodrun``, with either controller, ``torch.distributed`` under DDP).
"""

import atexit
import hashlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

from hvd_compress import arguments
from hvd_compress.comm.transports import TRANSPORTS, DecisionTimeout, make_transport


# Decision threads, abandoned ones included. A daemon thread killed inside a torch operation
# when the interpreter exits aborts the process (C++ std::terminate), so a run that ends while a
# decision computes would exit with SIGABRT: at exit, each is joined first (up to its timeout).
_THREADS = weakref.WeakSet()


@atexit.register
def _join_running_decisions():
    for thread in list(_THREADS):
        thread.join(thread.timeout)


def digest(obj):
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Postponed:
    """What ``exchange`` returns on every rank when rank 0 was still computing: exchange again
    at ``step``."""

    step: int


class DecisionService:
    """``submit`` (rank 0 only) starts a computation in the background; ``exchange`` (every rank,
    at the same step) returns its result on every rank, verified identical everywhere."""

    def __init__(self, transport="auto", timeout=60.0):
        arguments.choice("LGreCo", "transport", transport, TRANSPORTS)
        arguments.real("LGreCo", "timeout (seconds)", timeout, low=0, low_open=True)
        self.kind = transport
        self.timeout = timeout
        self._transport = None
        self._process_set = None
        self._thread = None
        self._outcome = None
        self._lock = threading.Lock()
        self._started = 0.0

    @property
    def transport(self):
        """The transport exchanges run over: made at the first exchange, None before it."""
        return self._transport

    def use_process_set(self, process_set):
        """Exchanges from now on run among ``process_set``'s ranks (None: all of them)."""
        if process_set is not self._process_set:
            self._process_set, self._transport = process_set, None

    def __getstate__(self):
        # Communicators and threads cannot be checkpointed; they are rebuilt on first use.
        state = dict(self.__dict__)
        state.update(_transport=None, _process_set=None, _thread=None, _outcome=None, _lock=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def submit(self, compute):
        def run():
            try:
                outcome = ("ok", compute())
            except BaseException as error:  # even SystemExit: carried to every rank by exchange()
                outcome = ("error", f"{type(error).__name__}: {error}")
            with self._lock:
                if self._thread is threading.current_thread():  # else abandoned
                    self._outcome = outcome

        thread = threading.Thread(target=run, name="hvd_compress-decision", daemon=True)
        thread.timeout = self.timeout
        with self._lock:
            self._outcome, self._thread = None, thread
        self._started = time.monotonic()
        thread.start()
        _THREADS.add(thread)

    def reconnect(self):
        """The next exchange forms a new transport (the one it had knew an older world)."""
        self._transport = None

    def rejoin(self):
        """The world changed (an elastic reset): a computation still running is abandoned, and
        the next exchange forms a new transport."""
        self._abandon()
        self.reconnect()

    def _abandon(self):
        with self._lock:  # a thread no longer current never sets its outcome
            self._thread, self._outcome = None, None

    def running(self):
        """Whether a submitted computation is still running."""
        return self._thread is not None and self._thread.is_alive()

    def finished_outcome(self):
        """The outcome of the submitted computation, waiting for it if it runs: ("ok", result),
        ("error", message), or None if nothing was submitted. For checkpoints."""
        if self._thread is not None:
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                raise DecisionTimeout(f"the decision computation did not finish in {self.timeout} s")
        return self._outcome

    def restore(self, outcome):
        """Makes ``outcome`` (from ``finished_outcome``) the result the next exchange sends."""
        self._abandon()
        self._outcome = outcome

    def exchange(self, version, effective_step, postpone: Optional[Callable[[float], Optional[int]]] = None):
        """The submitted computation's result on every rank, or ``Postponed(step)`` on every
        rank when rank 0 is still computing and ``postpone`` (rank 0's policy: the seconds the
        computation has run -> a later step, or None to wait) chose a later step. A computation
        that has run longer than ``timeout`` is an error on every rank, postponed or not."""
        if self._transport is None:
            self._transport = make_transport(self.kind, self._process_set)
        transport = self._transport
        deadline = time.monotonic() + self.timeout
        what = f"L-GreCo decision {version} (effective at step {effective_step}), rank {transport.rank}"
        outcome = None
        if transport.rank == 0 and self.running() and postpone is not None:
            elapsed = time.monotonic() - self._started
            later = None if elapsed > self.timeout else postpone(elapsed)
            if later is not None:
                outcome = ("later", later)
            elif elapsed > self.timeout:
                outcome = ("error", f"the computation has run {elapsed:.1f} s, over the timeout of {self.timeout} s")
                self._abandon()
        if transport.rank == 0 and outcome is None:
            if self._thread is not None:
                self._thread.join(max(0.0, deadline - time.monotonic()))
                if self._thread.is_alive():
                    raise DecisionTimeout(f"{what}: rank 0 did not finish its computation in {self.timeout} s")
            with self._lock:
                outcome = self._outcome or ("error", "rank 0 has no computed decision to send")
                self._thread, self._outcome = None, None
        outcome = transport.broadcast(outcome, 2 * version, deadline, what)
        if outcome[0] == "error":
            raise RuntimeError(f"{what}: the computation failed on rank 0: {outcome[1]}")
        result = Postponed(outcome[1]) if outcome[0] == "later" else outcome[1]
        mine = (version, effective_step, digest(result))
        everyone = transport.allgather(mine, 2 * version + 1, deadline, what)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(f"{what}: ranks disagree on the decision: {mine} here, {theirs} on rank {rank}")
        return result

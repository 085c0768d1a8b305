"""Runs compressors' rounds on a backend, overlapped and deadlock-free."""
import torch

from hvd_compress.comm.rounds import Round


class RoundDriver:
    """Starts each gradient's first round as soon as the gradient is ready, starts the next
    round as soon as the previous one lands, and finishes everything in name order.

    Why it cannot hang: all ranks start the same set of gradients before ``finish``; every
    wait is on the current round of the smallest unfinished name, which every rank submits
    without waiting on anything else first.
    """

    def __init__(self, backend, traffic):
        self.backend = backend
        self.traffic = traffic
        self._inflight = {}  # name -> (round, handle, round_index)
        self._results = {}

    def start(self, name, grad, round_):
        self.traffic.add_gradient(grad)
        self._submit(name, round_, 0)

    def poll(self):
        """Advances every exchange whose collective has landed; never blocks."""
        for name, (round_, handle, index) in list(self._inflight.items()):
            if self.backend.done(handle):
                self._advance(name, round_, self.backend.wait(handle), index)

    def finish(self):
        """Waits for every exchange started since the last finish; returns {name: gradient}."""
        while self._inflight:
            name = min(self._inflight)
            round_, handle, index = self._inflight[name]
            self._advance(name, round_, self.backend.wait(handle), index)
        results, self._results = self._results, {}
        return results

    def _submit(self, name, round_, index):
        self.traffic.add_payload(round_.payload, round_.collective)
        handle = self.backend.start(f"hvd_compress.{name}.round{index}", round_)
        self._inflight[name] = (round_, handle, index)

    def _advance(self, name, round_, result, index):
        del self._inflight[name]
        following = round_.then(result)
        if isinstance(following, Round):
            self._submit(name, following, index + 1)
        else:
            assert isinstance(following, torch.Tensor)
            self._results[name] = following

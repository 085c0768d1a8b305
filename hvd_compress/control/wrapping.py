"""What controllers that wrap a compressor (L-GreCo, GraVAC) share: they own its settings, and
the integration layer sees one object with the wrapped compressor's names and traffic."""
from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.lowrank import LowRankCompressor
from hvd_compress.compressors.qsgd import QSGD
from hvd_compress.compressors.topk import TopK


class Controller(Compressor):
    def __init__(self, compressor):
        if not isinstance(compressor, (LowRankCompressor, TopK, QSGD)):
            raise ValueError(f"{type(self).__name__}: compressor must be PowerSGD, ACPSGD, TopK or "
                             f"QSGD, got {type(compressor).__name__}")
        self.inner = compressor
        self.parameters, self.min_numel = compressor.parameters, compressor.min_numel
        self.traffic = compressor.traffic
        self.rank, self.size = 0, 1

    def setting(self, name):
        return self.inner.setting(name)

    def set_setting(self, name, value):
        self.inner.set_setting(name, value)

    def settings(self):
        return self.inner.settings()

    def bind_world(self, rank, size):
        self.inner.bind_world(rank, size)
        self.rank, self.size = rank, size

    def describe(self):
        return {"compressor": type(self).__name__, "config": self.config(), "settings": {}}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.traffic = self.inner.traffic  # one Traffic, shared with the wrapped compressor

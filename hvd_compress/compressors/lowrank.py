"""State and checks shared by the low-rank compressors (PowerSGD, ACP-SGD)."""
from dataclasses import dataclass

import torch

from hvd_compress.compressors.base import Compressor, check_positive_int, dense_round
from hvd_compress.maths import lowrank


@dataclass
class LowRankState:
    p: torch.Tensor       # n x r, warm start for ACP-SGD's Q steps
    q: torch.Tensor       # m x r, warm start for the next P = M Q
    memory: torch.Tensor  # n x m error feedback, float32
    step: int = 0


class LowRankCompressor(Compressor):
    setting_name = "rank"

    def __init__(self, named_parameters=None, rank=4, *, min_compression_rate=2.0,
                 start_step=0, error_feedback=True, warm_start=True, seed=0, min_numel=1024):
        if min_compression_rate <= 0:
            raise ValueError(f"{type(self).__name__}: min_compression_rate must be > 0, "
                             f"got {min_compression_rate!r}")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"{type(self).__name__}: start_step must be a non-negative integer, "
                             f"got {start_step!r}")
        self.min_compression_rate = min_compression_rate
        self.start_step = start_step
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        super().__init__(named_parameters, default=rank, min_numel=min_numel)

    def config(self):
        return dict(super().config(), min_compression_rate=self.min_compression_rate,
                    start_step=self.start_step, error_feedback=self.error_feedback,
                    warm_start=self.warm_start, seed=self.seed)

    def _check_setting(self, name, value, numel):
        check_positive_int(self, name, "rank", value)

    def _compressible(self, shape, setting):
        if len(shape) < 2:
            return False
        n, m = lowrank.matrix_shape(shape)
        r = lowrank.effective_rank(setting, n, m)
        return lowrank.worth_compressing(n, m, r, self.min_compression_rate)

    def _factor_elements(self, shape, setting):
        n, m = lowrank.matrix_shape(shape)
        return n, m, lowrank.effective_rank(setting, n, m)

    def _new_state_from(self, values):
        return LowRankState(**values)

    def _prepare(self, name, grad):
        """Returns (state, M, rank) with M = gradient + error feedback as an n x m float32
        matrix, or None while the dense warm-up (``start_step``) lasts."""
        n, m = lowrank.matrix_shape(grad.shape)
        r = lowrank.effective_rank(self.setting(name), n, m)
        st = self.state.get(name)
        if st is None:
            device = grad.device
            st = LowRankState(p=lowrank.seeded_normal(n, r, self.seed, name, "p").to(device),
                              q=lowrank.seeded_normal(m, r, self.seed, name, "q").to(device),
                              memory=torch.zeros(n, m, device=device))
            self.state[name] = st
        if st.q.shape[1] != r:
            st.p = lowrank.resize_columns(st.p, r, self.seed, f"{name}.p")
            st.q = lowrank.resize_columns(st.q, r, self.seed, f"{name}.q")
        st.step += 1
        if st.step <= self.start_step:
            return None
        matrix = grad.reshape(n, m)
        if self.error_feedback:
            # M is built in the error-feedback buffer itself, and ``_remember`` leaves the new
            # residual there: no gradient-sized allocation (and page faults) per step.
            return st, st.memory.add_(matrix.float()), r
        return st, matrix.float(), r

    def _remember(self, st, matrix, p, q):
        """Error feedback: what this rank failed to send, M - P Q^T, is added to its next
        gradient. ``matrix`` is M in the error-feedback buffer; nothing reads M afterwards."""
        if self.error_feedback:
            matrix.addmm_(p, q.t(), alpha=-1)

    def state_dict(self):
        """As :meth:`Compressor.state_dict`, with tensors copied: error feedback is updated in
        place, and a checkpoint must not change as training goes on."""
        return _copy_tensors(super().state_dict())

    def load_state_dict(self, state_dict):
        super().load_state_dict(_copy_tensors(state_dict))

    def _reused(self, st, name, which):
        """The factor (``"p"`` or ``"q"``) to start this step from: last step's (warm start), or
        without warm start a fresh random one, identical on every rank."""
        factor = getattr(st, which)
        if self.warm_start:
            return factor
        return lowrank.seeded_normal(*factor.shape, self.seed, name, f"{which}{st.step}").to(factor)

    def _begin(self, name, grad):
        prepared = self._prepare(name, grad)
        if prepared is None:
            return dense_round(grad)
        return self._rounds(name, grad, *prepared)

    def _rounds(self, name, grad, st, matrix, r):
        raise NotImplementedError


def _copy_tensors(state_dict):
    return {"settings": dict(state_dict["settings"]),
            "state": {name: {key: value.clone() if torch.is_tensor(value) else value
                             for key, value in values.items()}
                      for name, values in state_dict["state"].items()}}

"""PowerSGD (Vogels et al., 2019): one step of warm-started subspace iteration per step."""

from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.lowrank import LowRankCompressor, factor_bytes
from hvd_compress.maths import lowrank


class PowerSGD(LowRankCompressor):
    """Rank-r PowerSGD with error feedback and warm-started Q: two all-reduces per matrix
    (P, then Q), each a factor n*m / ((n+m)*r) smaller than the gradient.

    Tuning guide:
      * ``rank``: 1-4 is enough for CNNs on image classification; transformers usually want
        8-32. Raise it if accuracy lags uncompressed training; the bytes grow linearly. The
        default rank 4 is too low for a small transformer; what each rank cost and kept on a
        character LM is in docs/choosing.md and
        docs/benchmarks/quality-against-bytes.md (``python -m benchmarks quality``).
      * ``start_step``: dense steps before compression starts (torch's ``start_powerSGD_iter``).
        A few hundred to a thousand steps helps when the learning rate is warming up.
      * ``min_compression_rate``: matrices that would not shrink by this factor are sent
        dense, which also keeps the small matrices' start-up cost out of the budget.
      * ``min_numel``: gradients smaller than this (and all 1-D gradients) are sent dense.
      * Q starts from a seeded normal matrix identical on every rank; ``seed`` must agree.

    Per-parameter rank: ``set_setting(name, rank)`` (L-GreCo and GraVAC use it). The warm
    start keeps the first columns when the rank changes.
    """

    def _compressed_bytes(self, shape, setting):
        return factor_bytes(shape, setting, "pq")

    def _rounds(self, name, grad, st, matrix, r):
        p = lowrank.project_right(matrix, self._reused(st, name, "q"))
        payload, restore = lowrank.sendable(p)

        def after_p(p_mean):
            p_hat = lowrank.orthogonalize(restore(p_mean))
            q = lowrank.project_left(matrix, p_hat)
            self._remember(matrix, p_hat, q)

            def after_q(q_mean_t):
                st.q = q_mean_t.t()  # column-major, as the next P = M Q wants it
                self.guard.bound_by(name, q_mean_t, lowrank.orthonormal_product_growth(r))
                return self._decompressed(p_hat, st.q, grad)

            # Q travels as Q^T (r x m), the layout P^T M made it in: no copy.
            return Round(q.t(), Collective.ALLREDUCE, after_q, last=True)

        return Round(payload, Collective.ALLREDUCE, after_p)

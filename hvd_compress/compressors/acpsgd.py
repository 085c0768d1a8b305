"""ACP-SGD (Zhang et al., 2023): PowerSGD's two half-steps on alternate training steps."""
from hvd_compress.comm.rounds import Collective, Round
from hvd_compress.compressors.lowrank import LowRankCompressor, factor_bytes
from hvd_compress.maths import lowrank


class ACPSGD(LowRankCompressor):
    """Alternate compressed PowerSGD: even steps send P = M Q_hat, odd steps send
    Q = M^T P_hat, so each matrix needs exactly one all-reduce per step. The other factor is
    reused from the previous step (identical on every rank), and error feedback carries
    what the approximation missed.

    Because each step is one additive, non-blocking all-reduce, ACP-SGD overlaps with backward
    and fuses like plain S-SGD; half the compute and bytes of PowerSGD per step.

    Tuning guide: as for :class:`PowerSGD`. The paper uses rank 4 for CNNs and 32-256 for
    BERT; both reuse and error feedback are needed for accuracy (its Fig. 7). Compare it with
    PowerSGD at equal bytes, i.e. at twice PowerSGD's rank: ACP-SGD rank 2r sends what
    PowerSGD rank r sends. How the two compared at equal bytes on a character LM: docs/choosing.md
    and docs/benchmarks.md "Quality against bytes"
    (``python -m benchmarks quality``).
    """

    def _compressed_bytes(self, shape, setting):
        return factor_bytes(shape, setting, "pq") // 2  # P and Q on alternate steps

    def next_payload_bytes(self, name, shape):
        setting = self.setting(name)
        if not self.compresses(shape, setting):
            return self.payload_bytes(shape, setting)
        return factor_bytes(shape, setting, self.phase(name).lower())

    def _rounds(self, name, grad, st, matrix, r):
        if st.step % 2 == 1:  # P step
            q_hat = lowrank.orthogonalize(self._reused(st, name, "q"))
            p = lowrank.project_right(matrix, q_hat)
            self._remember(matrix, p, q_hat)
            payload, restore = lowrank.sendable(p)

            def after_p(p_mean):
                p_mean = restore(p_mean)
                st.p, st.q = p_mean, q_hat
                self._result_bounded_by(name, p_mean, lowrank.orthonormal_product_growth(r))
                return self._decompressed(p_mean, q_hat, grad)

            return Round(payload, Collective.ALLREDUCE, after_p, last=True)

        p_hat = lowrank.orthogonalize(self._reused(st, name, "p"))
        q = lowrank.project_left(matrix, p_hat)
        self._remember(matrix, p_hat, q)

        def after_q(q_mean_t):
            st.p, st.q = p_hat, q_mean_t.t()
            self._result_bounded_by(name, q_mean_t, lowrank.orthonormal_product_growth(r))
            return self._decompressed(p_hat, st.q, grad)

        # Q travels as Q^T (r x m), the layout P^T M made it in: no copy.
        return Round(q.t(), Collective.ALLREDUCE, after_q, last=True)

    def phase(self, name: str) -> str:
        """'P' or 'Q': what parameter ``name`` sends at its next step."""
        st = self.state.get(name)
        return "P" if st is None or st.step % 2 == 0 else "Q"

    def schedule_phase(self):
        """The phase of the next step, from any compressed parameter (all move together)."""
        return self.phase(next(iter(self.state), None))

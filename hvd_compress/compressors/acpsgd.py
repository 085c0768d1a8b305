"""ACP-SGD (Zhang et al., 2023): PowerSGD's two half-steps on alternate training steps."""

import torch

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
    and docs/benchmarks/quality-against-bytes.md (``python -m benchmarks quality``).

    Same-shape layers of one fusion bucket (a transformer block's q, k, v and output
    projections) take each half-step together: one batched QR, projection and residual per
    (shape, rank), where the integrations begin a bucket's gradients together (``begin_many``;
    stock Horovod's optimizer hands them over one at a time). Fewer operators to launch, which
    is what a GPU pays per layer; on a CPU the whole step ran as fast as one layer at a time
    (docs/benchmarks/same-shape-batching.md).
    """

    batches_layers = True

    def _compressed_bytes(self, shape, setting):
        return factor_bytes(shape, setting, "pq") // 2  # P and Q on alternate steps

    def next_payload_bytes(self, name, shape):
        setting = self.setting(name)
        if not self.tuning.compresses(shape, setting):
            return self.tuning.payload_bytes(shape, setting)
        return factor_bytes(shape, setting, self.phase(name).lower())

    def _rounds(self, name, grad, st, matrix, r):
        if st.step % 2 == 1:  # P step
            q_hat = lowrank.orthogonalize(self._reused(st, name, "q"))
            p = lowrank.project_right(matrix, q_hat)
            self._remember(matrix, p, q_hat)
            payload, restore = lowrank.sendable(p)

            def after_p(p_mean):
                return self._after_p(name, grad, st, r, restore(p_mean), q_hat)

            return Round(payload, Collective.ALLREDUCE, after_p, last=True)

        p_hat = lowrank.orthogonalize(self._reused(st, name, "p"))
        q = lowrank.project_left(matrix, p_hat)
        self._remember(matrix, p_hat, q)

        def after_q(q_mean_t):
            return self._after_q(name, grad, st, r, q_mean_t, p_hat)

        # Q travels as Q^T (r x m), the layout P^T M made it in: no copy.
        return Round(q.t(), Collective.ALLREDUCE, after_q, last=True)

    def _after_p(self, name, grad, st, r, p_mean, q_hat):
        """A P step's end, from the ranks' mean P and this step's orthogonalised Q: the state
        both half-steps reuse, the result's bound, and the result."""
        st.p, st.q = p_mean, q_hat
        self.guard.bound_by(name, p_mean, lowrank.orthonormal_product_growth(r))
        return self._decompressed(p_mean, q_hat, grad)

    def _after_q(self, name, grad, st, r, q_mean_t, p_hat):
        """A Q step's end, from the ranks' mean Q^T and this step's orthogonalised P."""
        st.p, st.q = p_hat, q_mean_t.t()
        self.guard.bound_by(name, q_mean_t, lowrank.orthonormal_product_growth(r))
        return self._decompressed(p_hat, st.q, grad)

    def _batch_key(self, st):
        return (st.step + 1) % 2  # 1: a P step

    def _new_batch(self, names, n, m, r, device):
        return _HalfSteps(self, names, n, m, r, device)

    def phase(self, name: str) -> str:
        """'P' or 'Q': what parameter ``name`` sends at its next step."""
        st = self.state.get(name)
        return "P" if st is None or st.step % 2 == 0 else "Q"

    def schedule_phase(self):
        """The phase of the next step, from any compressed parameter (all move together)."""
        return self.phase(next(iter(self.state), None))


class _HalfSteps:
    """One half-step (P or Q) of same-shape matrices at one rank in batched calls: the QR of the
    reused factors, the projection, and error feedback's residual, each one call for the group,
    on the members' sums as error feedback stacked them (``ErrorFeedback.stacked``). Each
    member keeps its own round, continuation, state and result, as ``ACPSGD._rounds`` makes
    them; the results are the same maths in batched operators (every rank batches alike)."""

    def __init__(self, compressor, names, n, m, r, device):
        self.compressor, self.names = compressor, names
        self.p_step = compressor.state[names[0]].step % 2 == 0  # the step about to be taken is odd
        self.stack = compressor.feedback.stacked(names, (n, m), device)
        self.members = []  # (name, state, sum M) in order of ``add``
        if self.p_step:
            self.transposed = lowrank.right_projection_is_transposed(n, m, r, device)
            shape = lowrank.projection_batch_shape(len(names), n, m, r, device)
        else:
            shape = (len(names), r, m)  # Q^T, as ``ACPSGD._rounds`` sends it
        self.payloads = torch.empty(shape, dtype=torch.float32, device=device)
        self.factors = None  # the orthogonalised reused factors, (k, m, r) or (k, n, r), by ``run``

    def add(self, name, grad):
        st, matrix, r = self.compressor._prepare(name, grad)
        index = len(self.members)
        self.members.append((name, st, matrix))
        compressor = self.compressor
        # The factors exist once ``run`` has been called: read at the round's end.
        if self.p_step:

            def after_p(received):
                p_mean = received.t() if self.transposed else received
                return compressor._after_p(name, grad, st, r, p_mean, self.factors[index])

            return Round(self.payloads[index], Collective.ALLREDUCE, after_p, last=True)

        def after_q(q_mean_t):
            return compressor._after_q(name, grad, st, r, q_mean_t, self.factors[index])

        return Round(self.payloads[index], Collective.ALLREDUCE, after_q, last=True)

    def run(self):
        """The group's shared work, once every member was added: fills their payloads."""
        count = len(self.members)
        if count == 0:
            return
        sums = [matrix for _, _, matrix in self.members]
        stacked = (
            count == len(self.names)
            and self.stack is not None
            and all(matrix.data_ptr() == row.data_ptr() for matrix, row in zip(sums, self.stack))
        )
        # A member without a residual yet has its sum elsewhere: copied in, and its residual back.
        matrices = self.stack if stacked else torch.stack(sums)
        payloads = self.payloads[:count]
        reuse = "q" if self.p_step else "p"
        factors = lowrank.orthogonalize_batch(
            torch.stack([self.compressor._reused(st, name, reuse) for name, st, _ in self.members])
        )
        self.factors = factors
        if self.p_step:
            p = lowrank.project_right_batch(matrices, factors, out=payloads)
            matrices.baddbmm_(p, factors.transpose(1, 2), alpha=-1)
        else:
            torch.bmm(factors.transpose(1, 2), matrices, out=payloads)
            matrices.baddbmm_(factors, payloads, alpha=-1)
        if not stacked:
            for matrix, row in zip(sums, matrices):
                matrix.copy_(row)

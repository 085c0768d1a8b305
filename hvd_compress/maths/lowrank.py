"""Low-rank maths shared by PowerSGD and ACP-SGD."""

import math
import zlib

import torch


def matrix_shape(shape):
    """The (n, m) matrix a gradient of ``shape`` is viewed as: first dim by the rest,
    so a conv kernel (out, in, kh, kw) becomes out x (in*kh*kw), as in the PowerSGD paper."""
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return n, m


def effective_rank(rank, n, m):
    """A rank above min(n, m) cannot approximate anything better; clip it."""
    return min(rank, n, m)


def factor_shapes(shape, rank):
    """(n, m, r): P is n x r and Q is m x r for a gradient of ``shape`` at ``rank``. Bytes per
    step follow from these: PowerSGD sends both factors, ACP-SGD one of them."""
    n, m = matrix_shape(shape)
    return n, m, effective_rank(rank, n, m)


def rank_for_factor(shape, factor):
    """The largest rank whose factors are at least ``factor`` times smaller than the matrix
    (at least 1): n m / ((n + m) r) >= factor."""
    n, m = matrix_shape(shape)
    return max(1, math.floor(n * m / ((n + m) * factor)))


def worth_compressing(n, m, rank, min_compression_rate):
    """True when sending P (n x r) and Q (m x r) is at least ``min_compression_rate`` times
    smaller than sending the n x m matrix."""
    return n * m >= (n + m) * rank * min_compression_rate


def orthogonalize(matrix, eps=1e-8):
    """Orthonormal columns spanning ``matrix`` (n x r).

    Rank 1 is a normalisation. For r >= 2 a reduced QR is used: on CPU it is faster than
    the paper's Gram-Schmidt and numerically stable for rank-deficient inputs."""
    if matrix.shape[1] == 1:
        return matrix / (matrix.norm() + eps)
    return torch.linalg.qr(matrix, mode="reduced").Q


def orthonormal_product_growth(rank):
    """How many times the largest magnitude of A an entry of A B^T can reach, where B has
    ``rank`` orthonormal columns (``orthogonalize``): a row of A has norm at most sqrt(rank)
    times A's largest entry, and a row of B at most 1 (Cauchy-Schwarz)."""
    return math.sqrt(rank)


def project_left(matrix, p_hat):
    """Q = M^T P, computed as (P^T M)^T: one pass over M in row-major order, several
    times faster on CPU than the transposed product. Q comes back column-major (a transposed
    view of the r x m product): ``Q.t()`` is contiguous, the form to send and to keep."""
    return (p_hat.t() @ matrix).t()


# Where the CPU's BLAS (MKL) ran P = M Q faster as (Q^T M^T)^T, its transposed form, at one torch
# thread: 1.7-3.5x at ranks 2-3 on every matrix measured; 0.96-2.1x at ranks 4-6 (at most 4% slower,
# on BERT's 2.4 M-entry feed-forward matrices); at rank 8 1.2-1.6x on matrices of up to 2^18 entries
# and 0.7-0.9x on larger ones; 0.5-1.0x at rank 1, slower at 16 and 32. docs/benchmarks/
# low-rank-products-by-layout.md (``python -m benchmarks layouts``).
_TRANSPOSED_RANKS = range(2, 7)
_TRANSPOSED_SMALL_RANKS, _SMALL_NUMEL = range(2, 9), 1 << 18


def right_projection_is_transposed(n, m, rank, device):
    """Whether ``project_right`` (and ``project_right_batch``) makes P = M Q, M n x m, in its
    transposed form on ``device``: the same answer on every rank for the same shape."""
    if torch.device(device).type != "cpu":  # measured on the CPU's BLAS only
        return False
    return rank in _TRANSPOSED_RANKS or (rank in _TRANSPOSED_SMALL_RANKS and n * m <= _SMALL_NUMEL)


def project_right(matrix, q):
    """P = M Q with Q's columns contiguous (copied so when Q is row-major, an m x r copy):
    at ranks 2-8 the CPU's BLAS (MKL) ran M Q 1.5-5.7x slower with a row-major Q on an AMD EPYC.

    Where the CPU's BLAS runs it faster so, P is made as (Q^T M^T)^T and comes back
    column-major (a transposed view of the r x n product); ``sendable`` gives the form to send.
    Every rank takes the same form for the same shape, rank and device."""
    if q.stride(0) != 1:  # row-major (a stride check: no operator where Q is column-major already)
        q = q.t().contiguous().t()
    if right_projection_is_transposed(*matrix.shape, q.shape[1], matrix.device):
        return (q.t() @ matrix.t()).t()
    return matrix @ q


def orthogonalize_batch(matrices, eps=1e-8):
    """``orthogonalize`` of each matrix of a (k, n, r) stack, in one call."""
    if matrices.shape[2] == 1:
        return matrices / (torch.linalg.vector_norm(matrices, dim=(1, 2), keepdim=True) + eps)
    return torch.linalg.qr(matrices, mode="reduced").Q


def projection_batch_shape(k, n, m, rank, device):
    """The shape of ``project_right_batch``'s ``out`` for k n x m matrices at ``rank``."""
    return (k, rank, n) if right_projection_is_transposed(n, m, rank, device) else (k, n, rank)


def project_right_batch(matrices, q, out):
    """P = M Q for each matrix of a (k, n, m) stack and its (k, m, r) factors, into ``out`` (of
    ``projection_batch_shape``: (k, r, n) where ``right_projection_is_transposed``, returned as
    its transposed view, as ``project_right`` does, else (k, n, r))."""
    _, n, m = matrices.shape
    if right_projection_is_transposed(n, m, q.shape[2], matrices.device):
        return torch.bmm(q.transpose(1, 2), matrices.transpose(1, 2), out=out).transpose(1, 2)
    return torch.bmm(matrices, q, out=out)


def sendable(factor):
    """(payload, restore): ``factor`` as a contiguous tensor to send (itself, or where it is a
    transposed view, its contiguous transpose), and the function that gives a received tensor of
    the payload's form back in ``factor``'s orientation."""
    if factor.is_contiguous():
        return factor, _same
    if not factor.t().is_contiguous():
        raise ValueError(f"factor: a matrix or a transposed view of one is sendable, got strides {factor.stride()}")
    return factor.t(), torch.t


def _same(tensor):
    return tensor


def seeded_normal(rows, cols, seed, name, salt=""):
    """A standard-normal matrix that every rank draws identically from (seed, name):
    PowerSGD's Q must start equal everywhere, and so must columns added when a rank grows."""
    key = zlib.crc32(f"{seed}:{name}:{salt}".encode())
    generator = torch.Generator().manual_seed(key)
    return torch.randn(rows, cols, generator=generator)


def resize_columns(matrix, rank, seed, name):
    """Keeps the warm-started columns when a rank changes: truncate, or append seeded
    random columns (identical on every rank)."""
    have = matrix.shape[1]
    if rank <= have:
        return matrix[:, :rank].contiguous()
    extra = seeded_normal(matrix.shape[0], rank - have, seed, name, salt=f"grow{rank}")
    return torch.cat([matrix, extra.to(matrix)], dim=1)

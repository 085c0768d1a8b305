"""Chunk-wise top-k (ScaleCom, following Shi et al.): split the vector into chunks and select
within each, which parallelises and avoids one large selection."""

import torch

from hvd_compress.maths.scratch import scratch


def chunked_topk_indices(values, k, chunks):
    """Indices of k entries of large magnitude of the vector ``values`` (0 <= k <= its length n):
    the p largest magnitudes of each of c = min(chunks, k, n) chunks of ceil(n / c) entries,
    then the k largest of those candidates. p is ceil(k / c), raised just enough that the
    chunks hold k candidates: the last chunks are short or only padding (1024 entries in 62
    chunks of 17 leave a chunk of 4 and an empty one), so ceil(k / c) from each may be too few.
    Deterministic; close to the exact top-k when the large entries are spread over the vector.
    The magnitudes are taken into a padded buffer kept between calls (``maths.scratch``)."""
    n = values.numel()
    if not 0 <= k <= n:
        raise ValueError(f"chunked_topk_indices: k must lie in [0, {n}], got {k}")
    c = max(1, min(chunks, k, n))
    width = -(-n // c)
    full, rest = divmod(n, width)  # `full` chunks of `width` real entries, then one of `rest`
    per_chunk = min(width, -(-k // c))
    while full * per_chunk + min(per_chunk, rest) < k:  # ends by per_chunk = width: n >= k
        per_chunk += 1
    padded = scratch(c * width, values.dtype, values.device)
    torch.abs(values, out=padded[:n])
    # Padding is -inf, below every magnitude, so with k real candidates it is never chosen.
    padded[n:] = float("-inf")
    magnitudes, local = padded.view(c, width).topk(per_chunk, dim=1, sorted=False)
    candidates = (local + torch.arange(c, device=values.device).unsqueeze(1) * width).flatten()
    magnitudes = magnitudes.flatten()
    if candidates.numel() > k:
        keep = magnitudes.topk(k, sorted=False).indices
        candidates = candidates[keep]
    return candidates

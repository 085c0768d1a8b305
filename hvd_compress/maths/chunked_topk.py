"""Chunk-wise top-k (ScaleCom, following Shi et al.): split the vector into chunks and select
within each, which parallelises and avoids one large selection."""
import torch


def chunked_topk_indices(magnitudes, k, chunks):
    """Indices of k large entries: the ceil(k / c) largest of each of c = min(chunks, k) chunks,
    then the k largest of those candidates. Deterministic; close to the exact top-k when the
    large entries are spread over the vector."""
    n = magnitudes.numel()
    c = max(1, min(chunks, k, n))
    width = -(-n // c)
    per_chunk = min(width, -(-k // c))
    # Padding is -1, below every magnitude, so it is never chosen while real entries remain.
    padded = torch.nn.functional.pad(magnitudes, (0, c * width - n), value=-1.0).view(c, width)
    values, local = padded.topk(per_chunk, dim=1, sorted=False)
    candidates = (local + torch.arange(c, device=magnitudes.device).unsqueeze(1) * width).flatten()
    values = values.flatten()
    if candidates.numel() > k:
        keep = values.topk(k, sorted=False).indices
        candidates = candidates[keep]
    return candidates

"""Top-k selection."""
import torch

# Below this size, or when k is a large fraction of n, torch.topk is as fast as anything.
_THRESHOLD_MIN_NUMEL = 1 << 15
_THRESHOLD_MAX_DENSITY = 0.05
_SAMPLE_SIZE = 1 << 12


def topk_indices(magnitudes, k):
    """Indices of the k largest entries of a 1-D tensor of magnitudes (order unspecified).

    For large tensors at low density, a threshold estimated from a fixed random sample keeps
    a candidate set a few times larger than k in one pass; an exact top-k over the candidates
    then gives the same answer as a full ``torch.topk`` (up to ties), much faster."""
    n = magnitudes.numel()
    if n < _THRESHOLD_MIN_NUMEL or k > _THRESHOLD_MAX_DENSITY * n:
        return torch.topk(magnitudes, k, sorted=False).indices
    generator = torch.Generator().manual_seed(n)
    sample = magnitudes[torch.randint(n, (_SAMPLE_SIZE,), generator=generator).to(magnitudes.device)]
    fraction = min(1.0, 2.0 * k / n)
    while True:
        # The sample quantile at twice the target density leaves margin for sampling error.
        position = max(0, _SAMPLE_SIZE - 1 - int(fraction * _SAMPLE_SIZE))
        threshold = sample.kthvalue(position + 1).values if position > 0 else sample.min()
        candidates = (magnitudes >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:
            break
        if fraction >= 1.0:
            return torch.topk(magnitudes, k, sorted=False).indices
        fraction = min(1.0, fraction * 4)
    chosen = torch.topk(magnitudes[candidates], k, sorted=False).indices
    return candidates[chosen]

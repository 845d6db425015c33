"""The next frontier of the device-side draft loops without a sort (CUDA-graph friendly, no host sync).

``best_k`` is the stable descending sort's first k indices of a short vector (ties: the earlier
entry): each entry's rank is a count of the entries ahead of it, one fused comparison, and the first
k ranks are scattered to their indices. On CUDA ``torch.sort(stable=True)`` runs cub's segmented
sort (two scan-by-key kernels and more a call; ~46 µs of the EAGLE expansion at depth 6, 2026-11-27
profile in specdec/PERF.md); under ``torch.compile`` this is one or two fused kernels.
"""

from __future__ import annotations

import torch

__all__ = ["best_k"]


def best_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest ``scores``, largest first, ties to the earlier index.

    Equals ``torch.sort(scores, descending=True, stable=True).indices[:k]`` for scores without NaN.

    Args:
        scores: float ``[n]`` (n up to a few hundred: the comparison is ``[n, n]``).
        k: 1 <= k <= n.

    Returns:
        int64 ``[k]``.
    """
    n = scores.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= {n} (the number of scores), got {k}")
    i = torch.arange(n, device=scores.device)
    ahead = (scores[None, :] > scores[:, None]) | ((scores[None, :] == scores[:, None]) & (i[None, :] < i[:, None]))
    rank = ahead.sum(dim=1)  # a permutation of 0 .. n - 1
    return torch.empty_like(i).scatter_(0, rank, i)[:k]

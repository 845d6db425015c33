"""Selections of the device-side draft loops in few kernels (CUDA-graph friendly, no host sync).

``row_topk`` is ``torch.topk`` over the last dimension of a few long rows (a depth's draft logits):
on CUDA ``torch.topk`` there runs a multi-block radix select of about a dozen kernels (~35 µs a call
at ``[8, 32768]`` on an H100, ~210 µs of the EAGLE expansion at depth 6: specdec/PERF.md); two
Triton kernels (``drafters.topk_kernels``: each chunk's best k as packed value / column keys, then
each row's best k of those) do it in two launches.

``best_k`` is the stable descending sort's first k indices of a short vector (ties: the earlier
entry): each entry's rank is a count of the entries ahead of it, one fused comparison, and the first
k ranks are scattered to their indices. On CUDA ``torch.sort(stable=True)`` runs cub's segmented
sort (two scan-by-key kernels and more a call; ~46 µs of the EAGLE expansion at depth 6, 2026-11-27
profile in specdec/PERF.md); under ``torch.compile`` this is one or two fused kernels.
``stable_ranks`` is that count itself (each entry's place in the order): the EAGLE drafter's
device re-rank keeps the entries ranked within its budget.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["IMPLS", "RANK_MAX", "best_k", "row_topk", "stable_ranks"]

#: ``best_k`` counts ranks for at most this many scores (a depth's candidates: top-8 x 8 = 64 by
#: default); more (a wide frontier times many children) take the stable sort.
RANK_MAX = 1024
#: ``row_topk`` implementations: "auto" (Triton on CUDA for rows of at least ``TRITON_MIN_COLUMNS``,
#: else torch), "triton" (CUDA, or the CPU under ``TRITON_INTERPRET=1``), "torch" (``torch.topk``).
IMPLS = ("auto", "triton", "torch")
#: Shorter rows go to ``torch.topk`` under "auto" (one single-block kernel there already).
TRITON_MIN_COLUMNS = 4096
#: Columns per program of the first kernel, and the largest k it serves.
BLOCK = 2048
MAX_K = 64


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def row_topk(x: torch.Tensor, k: int, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row and their columns, largest first, ties to the smaller column.

    Args:
        x: float ``[r, n]``.
        k: 1 <= k <= n.
        impl: one of ``IMPLS``.

    Returns:
        ``(values [r, k] in x's dtype, columns [r, k] int64)``: ``torch.topk(x, k, dim=-1)``'s values;
        its columns wherever the values are distinct (torch leaves the order of equal values open).
    """
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x: expected a float tensor of shape [r, n], got {x.dtype} {tuple(x.shape)}")
    r, n = x.shape
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k: expected an int in [1, {n}] (the row length), got {k!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if x.is_cuda and n >= TRITON_MIN_COLUMNS and k <= MAX_K and _has_triton_topk() else "torch"
    if impl == "torch":
        return torch.topk(x, k, dim=-1)
    if k > MAX_K:
        raise ValueError(f"k: expected at most {MAX_K} for impl='triton', got {k}")
    vals, cols = row_topk_op(x.contiguous(), k)
    return vals.to(x.dtype), cols


@functools.lru_cache(maxsize=None)
def _has_triton_topk() -> bool:
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "topk")


@torch.library.custom_op("drafters::row_topk", mutates_args=())
def row_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_topk``'s Triton path as a custom op (opaque to ``torch.compile``): x float contiguous
    ``[r, n]`` -> (float32 values ``[r, k]``, int64 columns ``[r, k]``)."""
    from drafters.topk_kernels import chunk_topk_kernel, merge_topk_kernel

    r, n = x.shape
    big_k = _next_pow2(k)
    chunks = -(-n // BLOCK)
    keys = torch.empty(r, chunks, big_k, dtype=torch.int64, device=x.device)
    chunk_topk_kernel[(r, chunks)](x, keys, n, x.stride(0), chunks, K=big_k, BLOCK=BLOCK, num_warps=4)
    vals = torch.empty(r, k, dtype=torch.float32, device=x.device)
    cols = torch.empty(r, k, dtype=torch.int64, device=x.device)
    m = chunks * big_k
    merge_topk_kernel[(r,)](keys, vals, cols, m, k, K=big_k, BLOCK=_next_pow2(m), num_warps=4)
    return vals, cols


@row_topk_op.register_fake
def _row_topk_fake(x, k):
    return x.new_empty(x.shape[0], k, dtype=torch.float32), x.new_empty(x.shape[0], k, dtype=torch.int64)


def stable_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's place in the stable descending order of ``scores`` (0: the largest; ties: the
    earlier index first): the inverse permutation of ``torch.sort(scores, descending=True,
    stable=True).indices``, for scores without NaN.

    Args:
        scores: float ``[..., n]``, each row ranked on its own (the comparison is ``[..., n, n]``:
            above ``RANK_MAX`` entries, a stable sort).

    Returns:
        int64 ``[..., n]``, in each row a permutation of ``0 .. n - 1``.
    """
    n = scores.shape[-1]
    i = torch.arange(n, device=scores.device)
    if n > RANK_MAX:  # the [n, n] comparison would outgrow the sort
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        return torch.empty_like(order).scatter_(-1, order, i.expand_as(order))
    a, b = scores[..., None, :], scores[..., :, None]
    ahead = (a > b) | ((a == b) & (i[None, :] < i[:, None]))
    return ahead.sum(dim=-1)


def best_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest ``scores``, largest first, ties to the earlier index.

    Equals ``torch.sort(scores, descending=True, stable=True).indices[:k]`` for scores without NaN.

    Args:
        scores: float ``[..., n]``, each row on its own (the comparison is ``[..., n, n]``: above
            ``RANK_MAX`` entries, a stable sort).
        k: 1 <= k <= n.

    Returns:
        int64 ``[..., k]``.
    """
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= {n} (the number of scores), got {k}")
    if n > RANK_MAX:  # the [n, n] comparison would outgrow the sort
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    ranks = stable_ranks(scores)
    i = torch.arange(n, device=scores.device).expand_as(ranks)
    return torch.empty_like(ranks).scatter_(-1, ranks, i)[..., :k]

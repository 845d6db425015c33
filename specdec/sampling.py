"""Target-distribution transforms applied before stochastic verification: temperature, top-k, top-p.

Same semantics and order as transformers' ``TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper`` (what ``generate(do_sample=True)`` applies), so speculative sampling draws
from exactly the distribution ``generate`` samples from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CDF_BLOCK", "SamplingConfig", "logits_to_probs", "sample_inverse_cdf", "warp_logits"]


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature > 0``; ``top_k = 0`` disables top-k; ``top_p = 1.0`` disables nucleus sampling."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature: expected a finite float > 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")


def warp_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p.

    Args:
        logits: float ``[..., V]``.
        config: the transform.

    Returns:
        float32 ``[..., V]``: scaled logits, ``-inf`` where a token was filtered out (at least one
        token per row survives).
    """
    x = logits.float() / config.temperature
    vocab = x.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(x, config.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if config.top_p < 1.0:
        # As transformers: drop the tokens whose ascending cumulative mass is <= 1 - top_p, keep the top one.
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - config.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    return x


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """float32 ``[..., V]`` probabilities of the warped logits (rows sum to 1)."""
    return warp_logits(logits, config).softmax(dim=-1)


#: Tokens per block of the bonus sampler (``sample_inverse_cdf``): a float64 sum per block, then a float64
#: cumulative sum over the blocks and over the one block drawn, instead of over the whole vocabulary.
CDF_BLOCK = 1024


def sample_inverse_cdf(rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: per row r, ``min{i : cdf_r(i) > u[r] * total_r}``, on float64 sums, in two levels.

    Level 1 draws a block of ``CDF_BLOCK`` tokens by inverse CDF over the float64 block sums, level 2
    the token inside it by inverse CDF over the block's float64 cumulative sum. Token i comes out with
    probability ``rows[r, i] / rows[r].sum()`` (up to float64 rounding: the block's mass over the
    total, times the token's over the block's), never a zero-probability token; a row with no mass
    (or NaN) gives ``V``. Work: one read of ``rows`` for the block sums (a float64 cumulative sum over
    all ``R x V`` entries took 0.67 ms a step for 16 trees of 16 nodes at V = 151,936 on the H100,
    PERF.md v17) and ``R x CDF_BLOCK`` gathered entries. No host sync (CUDA-graph safe).

    Args:
        rows: float ``[R, V]``: unnormalised non-negative masses (e.g. probabilities).
        u: float64 ``[R]`` uniforms in ``[0, 1)``, one per row.
    """
    R, vocab = rows.shape
    block = min(CDF_BLOCK, vocab)
    full, blocks = vocab // block, -(-vocab // block)
    rows = rows.contiguous()
    sums = rows[:, : full * block].reshape(R, full, block).sum(-1, dtype=torch.float64)  # [R, full]
    if blocks > full:
        sums = torch.cat([sums, rows[:, full * block :].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    cdf = sums.cumsum(-1)  # [R, blocks]
    total = cdf[:, -1:]
    # u < 1, but u * total can round up to total: the largest float64 below total is the cap
    at = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(cdf, at, right=True).clamp_(max=blocks - 1)  # the block whose range holds `at`
    prev = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(at))  # mass before it
    pos = b * block + torch.arange(block, device=rows.device)  # [R, block]
    inside = pos < vocab
    within = (rows.gather(1, pos.clamp(max=vocab - 1)).double() * inside).cumsum(-1)
    last = within[:, -1:]
    # the block's two sums may round apart: stay below its own cumulative total (a token of mass > 0)
    t = torch.minimum(at - prev, torch.nextafter(last, torch.zeros_like(last)))
    idx = b * block + torch.searchsorted(within, t, right=True)
    return torch.where(total > 0, idx, vocab).squeeze(1)

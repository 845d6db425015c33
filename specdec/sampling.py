"""Target-distribution transforms applied before stochastic verification: temperature, top-k, top-p.

Same semantics and order as transformers' ``TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper`` (what ``generate(do_sample=True)`` applies), so speculative sampling draws
from exactly the distribution ``generate`` samples from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "warp_logits", "logits_to_probs"]


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

"""How the draft-model drafter draws a node's children, shared by its host loop and its device loop.

``SAMPLING_PROPOSALS`` names the kinds; ``_allot`` fixes how many sampled children each frontier node
keeps before they are drawn (what keeps stochastic verification lossless); ``_gumbel_top_k`` /
``_multinomial`` draw without / with replacement. The loops call these through this module
(``draft_sampling._gumbel_top_k(...)``), so that a test that replaces one replaces it for both loops.
"""

from __future__ import annotations

import heapq
import math

import torch

__all__ = ["SAMPLING_PROPOSALS"]

#: How children are chosen when the engine samples: deterministic top-k of the warped draft, or drawn.
SAMPLING_PROPOSALS = ("topk", "iid", "no_replacement")


def _allot(parent_scores: list[float], ranked_logq: list[list[float]], cap: int) -> list[int]:
    """How many of its sampled children each frontier node keeps, ``cap`` in all.

    Lossless stochastic verification of a node's sampled children needs their number to be fixed
    before they are drawn: keeping a child because of its own drawn value (or a later sibling
    because an earlier one scored low) biases the draws the verifier sees. So a node's k-th child
    slot is valued by what is known before drawing -- the node's score plus its draft
    distribution's k-th largest log-probability -- and the ``cap`` best slots are kept.

    Args:
        parent_scores: cumulative draft log-probability of each frontier node.
        ranked_logq: per frontier node, its draft's ``width`` largest log-probabilities, descending.
        cap: slots to keep in all (>= 0).

    Returns:
        per frontier node, the number of its first draws to keep.
    """
    slots = [(-(s + v), q, k) for q, (s, row) in enumerate(zip(parent_scores, ranked_logq))
             for k, v in enumerate(row) if v > -math.inf]
    counts = [0] * len(parent_scores)
    for _, q, _ in heapq.nsmallest(max(cap, 0), slots):  # ties: earlier node, then earlier slot
        counts[q] += 1
    return counts


def _gumbel_top_k(logq: torch.Tensor, k: int, generator: torch.Generator | torch.Tensor | None) -> torch.Tensor:
    """``k`` draws without replacement from ``exp(logq)`` per row, in draw order (Gumbel top-k).

    ``generator``: where the uniforms come from: a generator (None: torch's default; drawn on its
    device), or the uniforms themselves (a float tensor of ``logq``'s shape, e.g. drawn before a
    CUDA graph's replay; not modified).
    """
    if isinstance(generator, torch.Tensor):
        u = generator.to(logq.device).clamp(min=1e-20, max=1.0 - 1e-7)
    else:
        dev = generator.device if generator is not None else logq.device
        u = torch.rand(logq.shape, generator=generator, device=dev).to(logq.device)
        u.clamp_(min=1e-20, max=1.0 - 1e-7)
    gumbel = -torch.log(-torch.log(u))
    return torch.topk(logq + gumbel, k, dim=-1).indices


def _multinomial(probs: torch.Tensor, k: int, generator: torch.Generator | torch.Tensor | None) -> torch.Tensor:
    """``k`` i.i.d. draws per row from ``probs`` (rows need not be normalized).

    ``generator``: a generator (None: torch's default): ``torch.multinomial`` on its device; or
    uniforms ``[R, k]`` in [0, 1): inverse-CDF draws (float64 cumulative sums; a token without mass
    is never drawn), a pure function of the uniforms for fixed-shape / CUDA-graph use.
    """
    if isinstance(generator, torch.Tensor):
        cdf = probs.double().cumsum(dim=-1)
        at = generator.to(probs.device).double() * cdf[:, -1:]
        return torch.searchsorted(cdf, at, right=True).clamp(max=probs.shape[-1] - 1)
    dev = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(dev), k, replacement=True, generator=generator).to(probs.device)

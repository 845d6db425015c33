"""Verification of a token tree against the target's per-node outputs.

Greedy: accept the longest root-to-node path whose every token is the target's argmax at its
parent. Stochastic (lossless: the emitted tokens are distributed exactly as sampling the target
token by token), walking down from the root; at each node the children are tried in proposal
order against the current target distribution ``p`` (fresh at every accepted node):

- ``iid`` (multi-step speculative sampling, SpecInfer): accept child x with probability
  ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))``.
- ``no_replacement`` (Sequoia): as ``iid`` but after rejecting x also ``q(x) <- 0, q <- norm(q)``
  (the next child was drawn from q without x).
- ``topk`` (deterministic children, EAGLE): accept x with probability ``p(x)``; on rejection
  ``p(x) <- 0, p <- norm(p)``.

When no child is accepted (or the node is a leaf) the bonus token is sampled from ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.tree import TokenTree

__all__ = ["Verdict", "greedy_verdict", "verify_greedy", "verify_stochastic"]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one tree.

    Attributes:
        path: accepted node indices from the root: ``path[0] == 0``, ``path[j]`` the child of
            ``path[j - 1]``; ``len(path) - 1`` draft tokens were accepted.
        bonus_token: the token the target emits after the path's last node.
    """

    path: tuple[int, ...]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root excluded)."""
        return len(self.path) - 1

    def new_tokens(self, tree: TokenTree) -> list[int]:
        """The tokens this step emits: the accepted draft tokens, then the bonus token."""
        return tree.path_tokens(self.path[1:]) + [self.bonus_token]


def _check_scores(tree: TokenTree, scores: torch.Tensor, name: str) -> None:
    if not isinstance(tree, TokenTree):
        raise ValueError(f"tree: expected a specdec.TokenTree, got {type(tree).__name__}")
    if not isinstance(scores, torch.Tensor) or not scores.dtype.is_floating_point or scores.dim() != 2:
        got = f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{name}: expected a float tensor of shape [n, V], got {got}")
    if scores.shape[0] != tree.n:
        raise ValueError(f"{name}: expected {tree.n} rows (one per tree node), got {scores.shape[0]}")
    vocab = scores.shape[1]
    if tree.draft_probs is not None and tree.draft_probs.shape[1] != vocab:
        raise ValueError(
            f"tree.draft_probs: expected the target's vocabulary size V = {vocab}, got {tree.draft_probs.shape[1]}"
        )
    if max(tree.token_list) >= vocab:
        raise ValueError(f"tree.tokens: expected ids < V = {vocab} (target vocabulary), got {max(tree.token_list)}")


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """Longest path of target-argmax tokens, plus the target's argmax after it.

    Args:
        tree: the proposed tree (n nodes).
        target_logits: float ``[n, V]``; row i = the target's logits after node i's path.

    Returns:
        ``Verdict``; among siblings with the same token the first is followed.
    """
    _check_scores(tree, target_logits, "target_logits")
    return greedy_verdict(tree, target_logits.argmax(dim=-1).tolist())


def greedy_verdict(tree: TokenTree, argmax: list[int]) -> Verdict:
    """``verify_greedy`` from the target's argmax tokens, on the host (no checks).

    Args:
        tree: the proposed tree (n nodes).
        argmax: host ints, at least n: ``argmax[i]`` = the target's argmax token after node i's
            path (entries past n are ignored: e.g. a padded row of a batched argmax).

    Returns:
        ``Verdict``; among siblings with the same token the first is followed.
    """
    tokens, parents = tree.token_list, tree.parent_list
    path, node, want = [0], 0, argmax[0]
    # Depth-first order: node's children come after it, in proposal order, and the subtree of the
    # child taken comes before the child's later siblings; so one pass in index order follows the path.
    for i in range(1, len(tokens)):
        if parents[i] == node and tokens[i] == want:
            path.append(i)
            node, want = i, argmax[i]
    return Verdict(tuple(path), want)


def verify_stochastic(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Lossless stochastic verification for the tree's proposal kind (see the module docstring).

    Args:
        tree: the proposed tree; ``"iid"`` and ``"no_replacement"`` trees need ``draft_probs``
            ``[n, V]`` (moved to ``target_probs``' device if elsewhere).
        target_probs: float ``[n, V]``; row i = the target distribution after node i's path, after
            temperature / top-k / top-p (``specdec.sampling.logits_to_probs``). Rows sum to 1.
        generator: source of randomness (``None``: torch's default generator); uniforms and the
            bonus sample are drawn on its device.

    Returns:
        ``Verdict`` with the accepted path and the bonus token sampled from the final residual.
    """
    _check_scores(tree, target_probs, "target_probs")
    kind = tree.proposal
    q_all = tree.draft_probs
    if kind != "topk" and tree.n > 1:
        if q_all is None:
            raise ValueError(f"tree.draft_probs: expected [n, V] proposal probabilities for a {kind!r} tree, got None")
        q_all = q_all.to(target_probs.device)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    tokens = tree.token_list
    path = [0]
    while True:
        node = path[-1]
        p = target_probs[node].float()
        q = None if kind == "topk" or not tree.children[node] else q_all[node].float()
        accepted = None
        for child in tree.children[node]:
            x = tokens[child]
            u = float(torch.rand((), generator=generator, device=gen_device))
            if kind == "topk":
                if u < float(p[x]):
                    accepted = child
                    break
                rest = p.clone()
                rest[x] = 0.0
                p = _normalized(rest, fallback=p)
            else:
                px, qx = float(p[x]), float(q[x])
                if u * qx < px:  # u < p(x) / q(x), also right for q(x) = 0
                    accepted = child
                    break
                p = _normalized((p - q).clamp_(min=0.0), fallback=p)
                if kind == "no_replacement":
                    rest = q.clone()
                    rest[x] = 0.0
                    q = _normalized(rest, fallback=q)
        if accepted is None:
            return Verdict(tuple(path), _sample(p, generator, gen_device))
        path.append(accepted)


def _normalized(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``x / x.sum()``; ``fallback`` if ``x`` has no mass left (only reachable through rounding)."""
    total = float(x.sum())
    return x / total if total > 0 else fallback


def _sample(p: torch.Tensor, generator: torch.Generator | None, device: torch.device) -> int:
    return int(torch.multinomial(p.to(device), 1, generator=generator))

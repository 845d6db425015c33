"""Helpers shared by the drafters: turn nodes in creation order into a depth-first ``TokenTree``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.tree import TokenTree
from treeattn.layout import depth_first_order

__all__ = ["make_tree", "root_only"]


def make_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    proposal: str = "topk",
) -> tuple[TokenTree, list[int]]:
    """A ``TokenTree`` from nodes in creation order, and the order used (``order[new] = old``).

    Args:
        tokens: token of each node, node 0 the root.
        parents: parent of each node (``parents[0] = -1``, ``parents[i] < i``).
        draft_probs: optional float ``[n, V]`` rows in creation order (moved with their nodes).
        proposal: the tree's ``proposal`` kind.
    """
    order = depth_first_order(list(parents))
    new_index = {old: new for new, old in enumerate(order)}
    tok = torch.tensor([tokens[o] for o in order], dtype=torch.int64)
    par = torch.tensor([-1] + [new_index[parents[o]] for o in order[1:]], dtype=torch.int64)
    probs = None
    if draft_probs is not None:
        probs = draft_probs[torch.tensor(order, device=draft_probs.device)]
    return TokenTree(tok, par, probs, proposal), order


def root_only(root: int) -> TokenTree:
    """The tree with just the root (plain decoding for this step)."""
    return TokenTree(torch.tensor([root], dtype=torch.int64), torch.tensor([-1], dtype=torch.int64))

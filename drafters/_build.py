"""Helpers shared by the drafters: a dynamic tree under construction (``NodePool``); turn nodes in
creation order into a depth-first ``TokenTree``; pick a dynamic tree's best nodes (``best_first``,
EAGLE-2's re-ranking); map an accepted path to the expanded nodes whose KV a drafter keeps
(``expanded_path``)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.tree import TokenTree
from treeattn.layout import depth_first_order

__all__ = ["NodePool", "best_first", "expanded_path", "make_tree", "root_only"]



@dataclass(eq=False)
class NodePool:
    """A dynamic draft tree under construction, nodes in creation order (node 0 = the root).

    Per node: ``tok`` its token, ``par`` its parent (-1 for the root), ``score`` its cumulative
    draft log-probability, ``dep`` its depth, ``exp`` its expanded index (the drafter's own
    bookkeeping: 0 for the root, -1 until expanded), ``children`` its children in creation order.
    """

    tok: list[int]
    par: list[int] = field(default_factory=lambda: [-1])
    score: list[float] = field(default_factory=lambda: [0.0])
    dep: list[int] = field(default_factory=lambda: [0])
    exp: list[int] = field(default_factory=lambda: [0])
    children: list[list[int]] = field(default_factory=lambda: [[]])

    @classmethod
    def rooted(cls, root: int) -> "NodePool":
        """A pool holding only the root token."""
        return cls([root])

    def add(self, parent: int, token: int, logp: float, depth: int) -> int:
        """Append a child of ``parent`` (score = parent's + ``logp``, not expanded); return its index."""
        node = len(self.tok)
        self.tok.append(token)
        self.par.append(parent)
        self.score.append(self.score[parent] + logp)
        self.dep.append(depth)
        self.exp.append(-1)
        self.children.append([])
        self.children[parent].append(node)
        return node

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


def best_first(children: list[list[int]], score: list[float], dep: list[int], budget: int) -> list[int]:
    """Pick ``budget`` nodes best-first by cumulative score; each node's children form a prefix.

    A node becomes a candidate once its parent and its previous sibling are picked, so the result
    is ancestor-closed and keeps every node's children as a prefix of their order (draw order for
    sampled children; descending score for top-k children, where this equals the global top-k).
    Returns pool indices in pick order (root first; parents and earlier siblings before a node).
    """
    picked = [0]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, depth, node, parent, sibling rank)
    if children[0]:
        first = children[0][0]
        heapq.heappush(heap, (-score[first], dep[first], first, 0, 0))
    while heap and len(picked) <= budget:
        _, _, node, parent, rank = heapq.heappop(heap)
        picked.append(node)
        if rank + 1 < len(children[parent]):
            sib = children[parent][rank + 1]
            heapq.heappush(heap, (-score[sib], dep[sib], sib, parent, rank + 1))
        if children[node]:
            c = children[node][0]
            heapq.heappush(heap, (-score[c], dep[c], c, node, 0))
    return picked


def expanded_path(path: Sequence[int], node_exp: Sequence[int]) -> list[int]:
    """The expanded-node indices of an accepted ``path`` (tree nodes, root first), cut at the first
    node that was never expanded (``node_exp[node] < 0``: a leaf, whose KV the drafter never
    computed). The root is always expanded node 0."""
    out = [0]
    for node in path[1:]:
        e = node_exp[node]
        if e < 0:
            break
        out.append(e)
    return out

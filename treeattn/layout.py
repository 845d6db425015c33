"""Token-tree layout: parents -> ancestor-or-self bit words (64 tree tokens per int64 word).

A tree of ``n`` nodes is flattened depth-first: node 0 is the root, ``parents[0] == -1`` and
``0 <= parents[i] < i`` for every other node. For query node ``i`` and tree-KV block ``b``
(64 nodes per block), bit ``j`` of word ``[i, b]`` is set iff node ``64 * b + j`` is ``i`` or an
ancestor of ``i``. The packed words are the only mask the kernels read; no dense mask is built
on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS_PER_WORD = 64

__all__ = ["BITS_PER_WORD", "TreeMask", "depth_first_order", "num_words", "pack_bits", "random_tree_parents"]


def num_words(n: int) -> int:
    """Words per query for a tree of ``n`` nodes: ``ceil(n / 64)``."""
    return (n + BITS_PER_WORD - 1) // BITS_PER_WORD


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[..., ceil(n / 64)]``: bit ``j`` of word ``w`` is ``mask[..., 64 * w + j]`` (bool ``[..., n]``).

    The layout of ``TreeMask.words`` for any bool matrix (e.g. an ancestor set that is not a tree's,
    built on the device). The bits are disjoint, so their sum is the OR (bit 63 wraps to the sign bit).
    """
    n = mask.shape[-1]
    words = num_words(n)
    padded = torch.nn.functional.pad(mask, (0, words * BITS_PER_WORD - n)).view(*mask.shape[:-1], words, BITS_PER_WORD)
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int64, device=mask.device)
    return (padded.to(torch.int64) << shifts).sum(-1)


def _validate_parents(parents: torch.Tensor) -> torch.Tensor:
    """Return ``parents`` as a CPU int64 ``[B, n]`` tensor or raise a ValueError naming the bad node."""
    if not isinstance(parents, torch.Tensor):
        raise ValueError(f"parents: expected a torch.Tensor of int64 node indices, got {type(parents).__name__}")
    if parents.dtype.is_floating_point or parents.dtype == torch.bool or parents.is_complex():
        raise ValueError(f"parents: expected an integer tensor, got dtype {parents.dtype}")
    if parents.dim() not in (1, 2):
        raise ValueError(f"parents: expected shape [n] or [B, n], got {tuple(parents.shape)}")
    p = parents.detach().to("cpu", torch.int64)
    if p.dim() == 1:
        p = p.unsqueeze(0)
    batch, n = p.shape
    if n == 0:
        raise ValueError("parents: expected at least one node (the root), got n = 0")
    for b in range(batch):
        row = p[b]
        if row[0].item() != -1:
            raise ValueError(f"parents[{b}][0] = {row[0].item()}: node 0 must be the root (parent -1)")
        if n == 1:
            continue
        rest = row[1:]
        idx = torch.arange(1, n)
        bad = (rest < 0) | (rest >= idx)
        if bool(bad.any()):
            i = int(idx[bad][0])
            v = int(row[i])
            if v == -1:
                why = "a second root (only node 0 may have parent -1)"
            elif v < 0 or v >= n:
                why = f"out of range [0, {n})"
            else:
                why = "a parent must come before its child (depth-first order; this also rules out cycles)"
            raise ValueError(f"parents[{b}][{i}] = {v}: expected 0 <= parent < {i}; {why}")
    return p


@dataclass(frozen=True)
class TreeMask:
    """Ancestor-or-self bit words and depths of a batch of token trees.

    Attributes:
        words: int64 ``[B, n, ceil(n / 64)]``; bit ``j`` of ``words[b, i, w]`` is set iff node
            ``64 * w + j`` is node ``i`` or one of its ancestors in tree ``b``.
        depth: int64 ``[B, n]``; distance of each node to the root (root = 0). A node's position
            id is ``prefix_len + depth``.
    """

    words: torch.Tensor
    depth: torch.Tensor

    def __post_init__(self) -> None:
        w, d = self.words, self.depth
        if not isinstance(w, torch.Tensor) or w.dtype != torch.int64 or w.dim() != 3:
            got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"words: expected an int64 tensor [B, n, ceil(n/64)], got {got}")
        batch, n, nw = w.shape
        if nw != num_words(n):
            raise ValueError(f"words: expected {num_words(n)} words per query for n = {n}, got {nw}")
        if not isinstance(d, torch.Tensor) or d.dtype != torch.int64 or tuple(d.shape) != (batch, n):
            got = f"{d.dtype} {tuple(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
            raise ValueError(f"depth: expected an int64 tensor of shape {(batch, n)}, got {got}")

    @classmethod
    def from_parents(cls, parents: torch.Tensor, device: torch.device | str | None = None) -> "TreeMask":
        """Build the mask from parent indices.

        Args:
            parents: integer ``[n]`` or ``[B, n]``; ``-1`` at the root (node 0), ``parents[i] < i``.
            device: where to put ``words`` and ``depth`` (default: ``parents.device``).

        Returns:
            A ``TreeMask`` with ``words [B, n, ceil(n/64)]`` and ``depth [B, n]`` (``B = 1`` for 1-D input).

        Raises:
            ValueError: naming the first bad node (no root, a second root, a parent out of range
                or not before its child).
        """
        out_device = parents.device if device is None and isinstance(parents, torch.Tensor) else device
        p = _validate_parents(parents)
        batch, n = p.shape
        ar = torch.arange(n)
        # Walk up the tree from every node at once; step k visits each node's k-th ancestor.
        anc = torch.zeros(batch, n, num_words(n) * BITS_PER_WORD, dtype=torch.bool)
        depth = torch.zeros(batch, n, dtype=torch.int64)
        cur = ar.expand(batch, n).clone()
        bidx = torch.arange(batch).unsqueeze(1).expand(batch, n)
        live = torch.ones(batch, n, dtype=torch.bool)
        while bool(live.any()):
            anc[bidx[live], ar.expand(batch, n)[live], cur[live]] = True
            nxt = torch.where(live, p.gather(1, cur.clamp(min=0)), torch.full_like(cur, -1))
            live = nxt >= 0
            depth += live.long()
            cur = nxt
        words = pack_bits(anc)
        return cls(words=words.to(out_device), depth=depth.to(out_device))

    @property
    def batch_size(self) -> int:
        return self.words.shape[0]

    @property
    def n(self) -> int:
        """Number of tree nodes (queries) per sequence."""
        return self.words.shape[1]

    def to(self, device: torch.device | str) -> "TreeMask":
        return TreeMask(words=self.words.to(device), depth=self.depth.to(device))

    def to_dense(self) -> torch.Tensor:
        """bool ``[B, n, n]``: ``[b, i, j]`` is True iff node j is node i or an ancestor of it."""
        shifts = torch.arange(BITS_PER_WORD, dtype=torch.int64, device=self.words.device)
        bits = (self.words.unsqueeze(-1) >> shifts) & 1
        return bits.flatten(2)[..., : self.n].bool()

    def position_ids(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, n]``: ``prefix_lens[b] + depth[b, i]`` (``prefix_lens``: int ``[B]``)."""
        return prefix_lens.to(self.depth.device, torch.int64).unsqueeze(1) + self.depth


def random_tree_parents(n: int, max_depth: int = 8, generator: torch.Generator | None = None) -> torch.Tensor:
    """int64 ``[n]`` parents of a random tree of ``n`` nodes and depth <= ``max_depth``, depth-first.

    Every non-root node picks a uniformly random parent among the nodes of depth < ``max_depth``
    created before it; the nodes are then renumbered in depth-first order.
    """
    if n < 1:
        raise ValueError(f"n: expected >= 1, got {n}")
    if max_depth < 1 and n > 1:
        raise ValueError(f"max_depth: expected >= 1 for n > 1, got {max_depth}")
    parent = [-1]
    depth = [0]
    for i in range(1, n):
        open_nodes = [j for j in range(i) if depth[j] < max_depth]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=generator))]
        parent.append(p)
        depth.append(depth[p] + 1)
    order = depth_first_order(parent)
    new_id = {old: new for new, old in enumerate(order)}
    return torch.tensor([-1] + [new_id[parent[old]] for old in order[1:]], dtype=torch.int64)


def depth_first_order(parents: list[int]) -> list[int]:
    """Depth-first order of a tree given in any order with ``parents[i] < i`` (node 0 the root).

    Children keep their relative order. Returns ``order`` with ``order[new_index] = old_index``.
    Raises ValueError for a parent that does not precede its child.
    """
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: expected 0 <= parent < {i}")
        children[p].append(i)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    return order

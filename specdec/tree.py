"""The token tree every drafter returns and the verifier consumes."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from treeattn.layout import depth_first_order

__all__ = ["PROPOSALS", "TokenTree"]

#: How the children of a node were chosen from that node's proposal distribution (``draft_probs``):
#: ``"topk"``: deterministically (top-k of the draft, a static tree, prompt lookup; ``draft_probs``
#: is not needed); ``"iid"``: sampled independently with replacement, children in draw order,
#: duplicates kept; ``"no_replacement"``: sampled one after another without replacement, in draw order.
PROPOSALS = ("topk", "iid", "no_replacement")


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A token tree proposed for one sequence.

    Attributes:
        tokens: int64 ``[n]``; ``tokens[0]`` is the root, the last committed token (its KV is not
            yet in the cache); ``tokens[i]`` is the token at node i.
        parents: int64 ``[n]``; ``parents[0] = -1`` and ``0 <= parents[i] < i``, nodes in
            depth-first order (each node's subtree directly follows it; siblings keep the order
            in which they were proposed, which stochastic verification relies on).
        draft_probs: float ``[n, V]`` or None; row i is the proposal distribution the children of
            node i were drawn from (rows of leaves are ignored). Needed for stochastic verification
            of ``"iid"`` and ``"no_replacement"`` trees.
        proposal: one of ``PROPOSALS``.
        token_list, parent_list: ``tokens`` / ``parents`` as host ints (set at construction; not
            arguments).

    Validation happens at construction (host-side, O(n)); bad input raises ``ValueError``. The
    host copies (``token_list``, ``parent_list``, ``children``) are made once, so the tensors must
    not be changed in place afterwards.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    proposal: str = "topk"
    token_list: list[int] = field(init=False, repr=False)
    parent_list: list[int] = field(init=False, repr=False)
    #: the deepest node's depth (0: the root alone), from the validation's walk
    depth: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        t, p, q = self.tokens, self.parents, self.draft_probs
        for name, x in (("tokens", t), ("parents", p)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.dtype != torch.int64 or x.dim() != 1:
                raise ValueError(f"{name}: expected an int64 tensor of shape [n], got {x.dtype} {tuple(x.shape)}")
        n = t.shape[0]
        if n == 0:
            raise ValueError("tokens: expected at least the root node, got n = 0")
        if p.shape[0] != n:
            raise ValueError(f"parents: expected shape [{n}] (tokens' length), got {tuple(p.shape)}")
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal: expected one of {PROPOSALS}, got {self.proposal!r}")
        toks, par = t.tolist(), p.tolist()
        if min(toks) < 0:
            raise ValueError(f"tokens: expected non-negative token ids, got minimum {min(toks)}")
        if q is not None:
            if not isinstance(q, torch.Tensor) or not q.dtype.is_floating_point or q.dim() != 2 or q.shape[0] != n:
                got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
                raise ValueError(f"draft_probs: expected a float tensor of shape [{n}, V], got {got}")
            if max(toks) >= q.shape[1]:
                raise ValueError(f"tokens: expected ids < V = {q.shape[1]} (draft_probs' vocab), got {max(toks)}")
        depth = _check_dfs(par)
        object.__setattr__(self, "token_list", toks)  # the validation's host copies, kept for the engine
        object.__setattr__(self, "parent_list", par)
        object.__setattr__(self, "depth", depth)

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None, proposal: str = "topk") -> "TokenTree":
        """A single path: ``tokens[0]`` is the root, each node the child of the previous one."""
        n = tokens.shape[0]
        return cls(tokens, torch.arange(-1, n - 1, device=tokens.device), draft_probs, proposal)

    @classmethod
    def from_any_order(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        proposal: str = "topk",
    ) -> "TokenTree":
        """Build a tree from nodes in any order with ``parents[i] < i`` (e.g. breadth-first).

        Reorders to depth-first order keeping sibling order; ``draft_probs`` rows move with their nodes.
        """
        par = parents.tolist()
        order = depth_first_order(par)
        new_index = {old: new for new, old in enumerate(order)}
        perm = torch.tensor(order, dtype=torch.int64, device=tokens.device)
        new_parents = torch.tensor([-1] + [new_index[par[o]] for o in order[1:]], dtype=torch.int64,
                                   device=parents.device)
        probs = None if draft_probs is None else draft_probs[perm.to(draft_probs.device)]
        return cls(tokens[perm], new_parents, probs, proposal)

    @property
    def n(self) -> int:
        """Number of nodes, root included."""
        return self.tokens.shape[0]

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[i]``: node i's children in proposal order (host ints)."""
        out: list[list[int]] = [[] for _ in range(self.n)]
        for i, p in enumerate(self.parent_list[1:], start=1):
            out[p].append(i)
        return tuple(tuple(c) for c in out)

    def path_tokens(self, path: tuple[int, ...] | list[int]) -> list[int]:
        """Tokens at the given nodes (host ints)."""
        toks = self.token_list
        return [toks[i] for i in path]


def _check_dfs(parents: list[int]) -> int:
    """Raise unless ``parents`` is a rooted tree in depth-first order; return its deepest node's depth."""
    if parents[0] != -1:
        raise ValueError(f"parents[0] = {parents[0]}: node 0 must be the root (parent -1)")
    stack = [0]  # the path from the root to the previous node
    deepest = 1
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: expected 0 <= parent < {i}")
        while stack and stack[-1] != p:
            stack.pop()
        if not stack:
            raise ValueError(
                f"parents[{i}] = {p}: nodes are not in depth-first order (node {p} is not on the path "
                f"to node {i - 1}); TokenTree.from_any_order reorders them"
            )
        stack.append(i)
        deepest = max(deepest, len(stack))
    return deepest - 1

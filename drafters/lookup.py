"""Prompt-lookup drafter: n-gram matches against the prompt and the generated text, as a token tree.

Code repeats itself (identifiers, signatures, the problem's own examples), so the tokens that
followed earlier occurrences of the current suffix are good guesses (prompt lookup decoding,
Saxena 2023; HF ``prompt_lookup_num_tokens`` proposes one such chain). This drafter proposes
*several*: for n = ``max_ngram`` down to ``min_ngram`` it finds every earlier occurrence of the
last n committed tokens, most recent first, and takes the (up to ``max_depth``) tokens that
followed each as a candidate continuation. Continuations are inserted into a trie in that
priority order -- longer matches first, then more recent ones -- so continuations sharing a
prefix share nodes and differing ones become branches; insertion stops when the node budget is
spent (the last continuation is cut). No match: a root-only tree (plain decoding for this step).

The n-gram index is built incrementally per sequence (each committed token is indexed once).
Children are deterministic (``"topk"``), so stochastic verification stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafters._build import make_tree, root_only
from specdec.drafting import BaseDrafter, DraftContext
from specdec.tree import TokenTree

__all__ = ["LookupDrafter"]


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    # n -> n-gram -> positions p (ascending) with tokens[p - n : p] == n-gram and p < len(tokens)
    grams: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    indexed: int = 0  # positions p < indexed are in the index


class LookupDrafter(BaseDrafter):
    """Token trees from n-gram matches in the sequence's own history (prompt + generated text).

    Args:
        max_ngram: longest suffix to match (>= min_ngram).
        min_ngram: shortest suffix to match (>= 1).
        max_depth: tokens taken after each match (the tree's maximum depth).
        max_matches: at most this many continuations per step (None: until the budget is spent).
        tree_size: optional cap on the nodes per step (the engine's budget applies anyway).
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_depth: int = 10,
                 max_matches: int | None = None, tree_size: int | None = None) -> None:  # fmt: skip
        for name, val in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("max_depth", max_depth)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram: expected <= max_ngram = {max_ngram}, got {min_ngram}")
        if max_matches is not None and (not isinstance(max_matches, int) or max_matches < 1):
            raise ValueError(f"max_matches: expected None or an int >= 1, got {max_matches!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_depth = max_depth
        self.max_matches = max_matches
        self.tree_size = tree_size
        self._index: dict[int, _Index] = {}

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        self._index = {}

    def _new_index(self) -> _Index:
        return _Index(grams={n: {} for n in range(self.min_ngram, self.max_ngram + 1)})

    def _extend(self, idx: _Index, tokens: list[int]) -> None:
        """Index the positions of ``tokens`` not indexed yet."""
        idx.tokens = tokens
        for p in range(max(idx.indexed, 1), len(tokens)):
            for n, table in idx.grams.items():
                if p >= n:
                    table.setdefault(tuple(tokens[p - n : p]), []).append(p)
        idx.indexed = max(idx.indexed, len(tokens))

    def _indexed(self, seq: int, tokens: list[int]) -> _Index:
        idx = self._index.get(seq)
        if idx is None or tokens[: len(idx.tokens)] != idx.tokens:  # new or different history: rebuild
            idx = self._index[seq] = self._new_index()
        self._extend(idx, tokens)
        return idx

    def _candidates(self, idx: _Index, tokens: list[int]):
        length = len(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length < n:
                continue
            for p in reversed(idx.grams[n].get(tuple(tokens[length - n :]), ())):
                yield tokens[p : p + self.max_depth]

    def propose(self, context: DraftContext) -> TokenTree:
        tokens = context.tokens.tolist()
        root = tokens[-1]
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        if budget <= 0:
            return root_only(root)
        idx = self._indexed(context.seq, tokens)
        node_tokens, parents = [root], [-1]
        children: list[dict[int, int]] = [{}]
        used = 0
        for cont in self._candidates(idx, tokens):
            if len(node_tokens) - 1 >= budget or (self.max_matches is not None and used >= self.max_matches):
                break
            node, added = 0, False
            for tok in cont:
                nxt = children[node].get(tok)
                if nxt is None:
                    if len(node_tokens) - 1 >= budget:
                        break
                    nxt = len(node_tokens)
                    node_tokens.append(tok)
                    parents.append(node)
                    children.append({})
                    children[node][tok] = nxt
                    added = True
                node = nxt
            used += added
        if len(node_tokens) == 1:
            return root_only(root)
        return make_tree(node_tokens, parents)[0]

"""The EAGLE drafter's device-side tree growth: one step's expansion, depth by depth, on the device.

``ExpansionPlan`` is the static shape of a step's expansion (frontier width, children per node,
depth) and re-ranks its record on the host (``ExpansionPlan.tree``, numpy). ``expand_depths`` is the
loop: per depth the LM head, log-softmax (after the target's warping when sampling), per-row
top-``w``, float64 cumulative scores, a stable sort for the next frontier, its ancestor rows and
mask, and one head forward. ``rerank_record`` is the same re-rank as ``ExpansionPlan.tree`` in torch
ops on the record's device (static shapes, no host sync; the budget a device scalar), writing the
tree's tokens, parents and expanded indices. ``Expansion`` runs the loop (and with ``rerank`` the
re-rank after it) over one sequence's head cache at fixed addresses, or over B sequences' caches at
once (copied into a batch cache and back: one head forward of all their rows a depth), eagerly or
recorded once as a CUDA graph and replayed, with the step's catch-up fused in front when it is short
(``CatchUp``); the records, or with ``rerank`` the re-ranked trees, come back to the host in one copy.

They reach the head through the drafter (``drafters.eagle.EagleDrafter``), whatever offers the
methods ``ExpansionHost`` lists.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from drafters.selection import best_k, row_topk, stable_ranks
from specdec.attention import TreeState
from specdec.graphs import graph_capture
from specdec.kv import KVCache
from specdec.sampling import SamplingConfig, warp_logits
from specdec.tree import TokenTree
from treeattn.layout import pack_bits

__all__ = ["CatchUp", "Expansion", "ExpansionHost", "ExpansionPlan", "expand_depths", "rerank_record", "rerank_rows"]


class ExpansionHost(Protocol):
    """What an expansion calls on its drafter (``drafters.eagle.EagleDrafter``)."""

    device: torch.device
    head: Any  # the EagleHead: its ``fc.weight`` (dtype, device) and ``hidden_size``
    attention: str  # "tree": each depth's forward through the tree kernel (``expand_depths``' ``tree``)
    _depth_loop: Any  # ``expand_depths``, or a torch.compile of it
    _rerank: Any  # ``rerank_rows``, or a torch.compile of it

    def _draft_logits(self, feats: torch.Tensor) -> torch.Tensor: ...

    def _token_ids(self, idx: torch.Tensor) -> torch.Tensor: ...

    def _forward(self, cache: KVCache, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor: ...  # fmt: skip

    def _tree_forward(self, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                      state: TreeState) -> torch.Tensor: ...  # fmt: skip

    def _mark(self, phase: str) -> None: ...

    @staticmethod
    def _catch_up_visible(keep, m, rows: int, kv_len: int, padded: bool, device: torch.device) -> torch.Tensor: ...


@dataclass(frozen=True)
class ExpansionPlan:
    """The static shape of one step's expansion: a function of (frontier width, children, depth).

    Depth d = 1 .. ``depth`` draws ``cand[d - 1] = rows[d - 1] * width`` candidates: the top-``width``
    children of each of the ``rows[d - 1]`` nodes expanded at depth d - 1 (``rows[0] = 1``: the
    root), in row order. For d < ``depth`` the best ``rows[d] = min(topk, cand[d - 1])`` of them
    are expanded by one head forward of ``rows[d]`` queries, with expanded indices (and cache slots
    ``base + index``) ``offsets[d] + q`` in frontier order (``offsets[0] = 0``: the root). ``rows[d]``
    is ``topk`` unless the vocabulary is smaller than ``topk``: then the former host loop expanded
    fewer nodes, and so does this plan (no dead rows: every row is a real node).

    The record (int64, ``record_size``): candidate tokens ``[depth, n_max]``, then their cumulative
    scores ``[depth, n_max]`` (float64 bits), then the candidate picked for each frontier row
    ``[depth - 1, topk]``; rows hold ``cand[d - 1]`` / ``rows[d]`` valid entries.
    """

    topk: int
    width: int
    depth: int
    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    cand: tuple[int, ...]

    @classmethod
    @functools.lru_cache(maxsize=256)
    def make(cls, topk: int, width: int, depth: int) -> "ExpansionPlan":
        """The plan of these sizes (one object per sizes: ``tree``'s index arrays are computed once)."""
        rows, offsets, cand = [1], [0], []
        for d in range(1, depth + 1):
            cand.append(rows[-1] * width)
            if d < depth:
                offsets.append(offsets[-1] + rows[-1])
                rows.append(min(topk, cand[-1]))
        return cls(topk, width, depth, tuple(rows), tuple(offsets), tuple(cand))

    @property
    def expanded(self) -> int:
        """Expanded nodes (head outputs) per step, the root included."""
        return self.offsets[-1] + self.rows[-1]

    @property
    def row_depths(self) -> list[int]:
        """The depth of expanded nodes 1 .. E - 1 (the tree rows of ``attention="tree"``)."""
        return [d for d in range(1, self.depth) for _ in range(self.rows[d])]

    @property
    def n_max(self) -> int:
        return max(self.cand)

    @property
    def record_size(self) -> int:
        return 2 * self.depth * self.n_max + (self.depth - 1) * self.topk

    def views(self, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [..., depth, n_max] int64, scores [..., depth, n_max] float64, picks [..., depth - 1,
        topk] int64)``, views of ``record [..., record_size]`` (device or host; rows contiguous)."""
        size, lead = self.depth * self.n_max, record.shape[:-1]
        tok = record[..., :size].view(*lead, self.depth, self.n_max)
        score = record[..., size : 2 * size].view(torch.float64).view(*lead, self.depth, self.n_max)
        pick = record[..., 2 * size :].view(*lead, self.depth - 1, self.topk)
        return tok, score, pick

    @functools.cached_property
    def _index(self) -> dict[str, np.ndarray]:
        """Fixed index arrays of ``tree`` over the P pool nodes (computed once per plan); ``*_at``:
        positions in the int64 record. ``tok_at`` / ``score_at`` ``[P]``: each node's token / score
        (the root's: any entry); ``pick_at`` ``[P]``: the pick of its parent's frontier row (nodes of
        depth <= 1: any entry), ``parent_base`` ``[P]``: the first node of its parent's depth (depth
        <= 1: 0, and the root's parent is itself); ``frontier_at`` / ``frontier_base`` /
        ``frontier_exp``: per real frontier row of depths 1 .. depth - 1, its pick, the first node of
        its depth and its expanded index; ``first`` ``[depth + 2]``: the first node of each depth;
        ``anc`` ``[depth, P]``: each node itself at row depth - 1, -1 elsewhere."""
        size, first = self.depth * self.n_max, np.cumsum([0, 1, *self.cand])
        tok_at, score_at, pick_at, parent_base = [[0] for _ in range(4)]
        frontier_at, frontier_base, frontier_exp = [], [], []
        for d, c in enumerate(self.cand, start=1):
            tok_at += range((d - 1) * self.n_max, (d - 1) * self.n_max + c)
            score_at += range(size + (d - 1) * self.n_max, size + (d - 1) * self.n_max + c)
            row = np.arange(c) // self.width  # the frontier row of depth d - 1 each candidate comes from
            pick_at += (2 * size + (d - 2) * self.topk + row).tolist() if d >= 2 else [0] * c
            parent_base += [int(first[d - 1]) if d >= 2 else 0] * c
            if d < self.depth:
                frontier_at += range(2 * size + (d - 1) * self.topk, 2 * size + (d - 1) * self.topk + self.rows[d])
                frontier_base += [int(first[d])] * self.rows[d]
                frontier_exp += range(self.offsets[d], self.offsets[d] + self.rows[d])
        anc = np.full((self.depth, int(first[-1])), -1, dtype=np.int64)
        for d in range(1, self.depth + 1):
            anc[d - 1, first[d] : first[d + 1]] = np.arange(first[d], first[d + 1])
        arrays = dict(tok_at=tok_at, score_at=score_at, pick_at=pick_at, parent_base=parent_base,
                      frontier_at=frontier_at, frontier_base=frontier_base, frontier_exp=frontier_exp)  # fmt: skip
        return {k: np.array(v, dtype=np.int64) for k, v in arrays.items()} | {"first": first, "anc": anc}

    def tree(self, record: torch.Tensor, root: int, budget: int) -> tuple[TokenTree, list[int]]:
        """The re-ranked tree from a host copy of the record, and each tree node's expanded index
        (-1: a node never expanded). Equals ``drafters._build.best_first`` + ``make_tree`` over the
        former host loop's node pool, vectorized.

        The pool, in creation order: the root, then depth by depth the candidates of each frontier
        row (rows in frontier order, children in top-``width`` order), ``score`` = the device's
        float64 cumulative scores. Kept: the first ``budget + 1`` nodes by (score descending,
        creation index) -- what ``best_first``'s heap pops, as its key (-score, depth, node) orders
        like (-score, node) here (creation order is by depth) and increases strictly from a node to
        its first child (log-probs <= 0, float64 sums: score never rises; ties: one level deeper) and
        to its next sibling (top-k order: score never rises; ties: a later node): so every node's
        generator is popped before it, the pops come in key order, and the kept set is ancestor-closed.
        The tree is their depth-first order, children in creation order (= ``best_first``'s pick order
        among siblings, which ``make_tree`` keeps): a lexicographic sort by each node's ancestors.
        """
        ix = self._index
        rec = record.numpy()
        scores = rec[ix["score_at"]].view(np.float64)
        scores[0] = 0.0
        kept = np.argsort(-scores, kind="stable")[: budget + 1]
        pick = rec[ix["pick_at"]]
        pick[: 1 + self.cand[0]] = 0
        parent = ix["parent_base"] + pick  # the root: itself
        # anc[k - 1, i]: node i's ancestor-or-self at depth k, -1 beyond its depth (parents sort first)
        anc, first = ix["anc"].copy(), ix["first"]
        for d in range(2, self.depth + 1):
            nodes = slice(first[d], first[d + 1])
            anc[: d - 1, nodes] = anc[: d - 1, parent[nodes]]
        order = kept[np.lexsort(anc[::-1, kept])]
        new = np.full(len(parent), -1, dtype=np.int64)  # a parent not kept would stay -1: TokenTree raises
        new[order] = np.arange(len(order))
        parents = new[parent[order]]
        parents[0] = -1
        tokens = rec[ix["tok_at"][order]]
        tokens[0] = root
        exp = np.full(len(parent), -1, dtype=np.int64)
        exp[ix["frontier_base"] + rec[ix["frontier_at"]]] = ix["frontier_exp"]
        exp[0] = 0
        return TokenTree(torch.from_numpy(tokens), torch.from_numpy(parents)), exp[order].tolist()

    @property
    def pool_size(self) -> int:
        """P: the re-rank's node pool, the root and every candidate."""
        return 1 + sum(self.cand)

    def device_index(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``rerank_record``'s fixed index tensors on ``device`` (``_index``'s, plus ``deep`` ``[P]``
        bool: nodes of depth >= 2, whose parent is read from a pick; ``root`` ``[P]`` bool: node 0;
        ``exp_init`` ``[P]``: 0 at the root, -1 elsewhere)."""
        ix, p = self._index, self.pool_size
        exp_init = np.full(p, -1, dtype=np.int64)
        exp_init[0] = 0
        keys = ("tok_at", "score_at", "pick_at", "parent_base", "frontier_at", "frontier_base", "frontier_exp")
        out = {k: torch.from_numpy(ix[k]).to(device) for k in keys}
        out["root"] = (torch.arange(p) == 0).to(device)
        out["deep"] = (torch.arange(p) >= 1 + self.cand[0]).to(device)
        out["exp_init"] = torch.from_numpy(exp_init).to(device)
        return out

    def ranked_tree(self, ranked: torch.Tensor, root: int, budget: int) -> tuple[TokenTree, list[int]]:
        """``tree``'s result from a host copy of ``rerank_record``'s output (int64 ``[3, P]``): its
        first ``min(budget + 1, P)`` columns, the root's token and parent set here."""
        n = min(budget + 1, self.pool_size)
        tokens, parents = ranked[0, :n].clone(), ranked[1, :n].clone()
        tokens[0], parents[0] = root, -1
        return TokenTree(tokens, parents), ranked[2, :n].tolist()


def expand_depths(drafter: ExpansionHost, cache: KVCache, plan: ExpansionPlan, sampling: SamplingConfig | None,
                  kv_lens: tuple[int, ...], scalars: torch.Tensor, feat: torch.Tensor, tok: torch.Tensor,
                  score_out: torch.Tensor, pick_out: torch.Tensor,
                  tree: "tuple[torch.Tensor, ...] | None" = None) -> None:  # fmt: skip
    """Depths 1 .. ``plan.depth`` of the expansions of B sequences at once on the device: candidates,
    the next frontier, its head forward (``Expansion``'s loop; a module function of tensors and
    fixed-shape inputs so one ``torch.compile`` of it serves every expansion of the same shapes).
    Each sequence (row b) draws its own tree, as it would alone: the head's GEMMs and the top-k run
    over the rows of all B at once, the frontier picks per row.

    Args:
        cache: the head's cache of the B sequences (batch size B).
        scalars: int64 ``[B, >= 2]`` on the device: per row (slot of the root's pair ``base``, the
            root's position).
        feat: ``[B, E, H]``; ``[:, 0]`` holds the roots' output features, ``[:, plan.offsets[d] ..]``
            get the features of the nodes expanded at depth d.
        tok, score_out, pick_out: the records' views (``ExpansionPlan.views`` of ``[B, record_size]``),
            written in place.
        kv_lens: ``kv_lens[d - 1]``: the cache slots ``[0, kv_lens[d - 1])`` the head forward of
            the nodes picked at depth d attends to (the whole capacity with static shapes).
        tree: None: each depth's forward runs its picked nodes as queries under an explicit mask
            over ``kv_lens`` slots (``MaskedState``). Else ``attention="tree"``'s buffers (``Expansion``):
            ``(ids [B, E - 1], inputs [B, E - 1, H], positions [B, E - 1], slots [B, E - 1], prefix [B],
            words [B, E - 1, nw], depths [B, E - 1])``: each depth's forward runs ALL expanded nodes
            after the root through the tree kernel (``specdec.attention.TreeState``): the committed
            pairs and the root form the prefix, row j is expanded node j + 1 with its ancestors-or-self
            as words. Rows of earlier depths recompute the keys / values they wrote (same inputs, same
            values); rows of later depths write the slots their own depth overwrites; the depth keeps
            its own rows' outputs. At a few dozen rows the head's GEMMs still only stream weights.
    """
    dev, width, expanded = feat.device, plan.width, plan.expanded
    batch, hidden = feat.shape[0], feat.shape[-1]
    base, root_pos = scalars[:, 0], scalars[:, 1]
    cols = torch.arange(expanded, device=dev)
    anc = (cols == 0).expand(batch, 1, expanded)  # [B, rows, E]: each frontier row's expanded ancestors-or-self
    feats = feat[:, :1]  # output features of the frontier rows
    score = torch.zeros(batch, 1, dtype=torch.float64, device=dev)  # their cumulative draft log-probabilities
    if tree is not None:
        ids, inputs, tree_pos, tree_slots, prefix, words, depths = tree
        prefix.copy_(base + 1)
        tree_slots.copy_(base[:, None] + cols[1:])
        tree_pos.copy_(root_pos[:, None] + depths)
        state = TreeState(cache, tree_slots, prefix, words, depths)
    for d in range(1, plan.depth + 1):
        n, frontier = plan.cand[d - 1], feats.shape[1]
        logits = drafter._draft_logits(feats.reshape(batch * frontier, hidden))  # [B * rows, V or N]
        logq = torch.log_softmax(logits if sampling is None else warp_logits(logits, sampling), dim=-1)
        vals, idx = row_topk(logq, width)
        # float64 sums, as the former host loop added Python floats: same scores, same order
        cand_score = (score[:, :, None] + vals.double().view(batch, frontier, width)).reshape(batch, n)
        cand_tok = drafter._token_ids(idx).reshape(batch, n)
        tok[:, d - 1, :n].copy_(cand_tok)
        score_out[:, d - 1, :n].copy_(cand_score)
        if d == plan.depth:
            break
        rows, off = plan.rows[d], plan.offsets[d]
        # the best `rows` candidates of each sequence; stable: equal scores keep candidate order (the host loop's)
        pick = best_k(cand_score, rows)
        pick_out[:, d - 1, :rows].copy_(pick)
        parent = torch.div(pick, width, rounding_mode="floor")  # frontier row of depth d - 1
        own = off + torch.arange(rows, device=dev)  # expanded indices of the new rows
        anc = anc.gather(1, parent[:, :, None].expand(batch, rows, expanded)) | (cols == own[:, None])
        picked = cand_tok.gather(1, pick)
        parent_feats = feats.gather(1, parent[:, :, None].expand(batch, rows, hidden))
        if tree is None:
            rel = torch.arange(kv_lens[d - 1], device=dev) - base[:, None]  # [B, kv]: slot - base, expanded index
            seen = anc.gather(2, rel.clamp(0, expanded - 1)[:, None, :].expand(batch, rows, rel.shape[1]))
            visible = (rel < 0)[:, None, :] | (seen & (rel < expanded)[:, None, :])
            positions = (root_pos + d)[:, None].expand(batch, rows)
            out = drafter._forward(cache, picked, parent_feats, positions, base[:, None] + own, visible)
        else:  # this depth's rows of the tree: tokens, input features, ancestors-or-self (the root dropped)
            lo = off - 1
            ids[:, lo : lo + rows].copy_(picked)
            inputs[:, lo : lo + rows].copy_(parent_feats)
            words[:, lo : lo + rows].copy_(pack_bits(anc[:, :, 1:]))
            out = drafter._tree_forward(ids, inputs, tree_pos, state)[:, lo : lo + rows]
        feat[:, off : off + rows].copy_(out)
        feats = feat[:, off : off + rows]
        score = cand_score.gather(1, pick)


def rerank_record(plan: ExpansionPlan, index: dict[str, torch.Tensor], record: torch.Tensor, budget: torch.Tensor,
                  out: torch.Tensor) -> None:  # fmt: skip
    """``ExpansionPlan.tree`` on the record's device: torch ops of fixed shapes, no host sync (so a
    CUDA graph can hold it after the expansion, and one ``torch.compile`` of it serves every step of
    the same plan).

    Args:
        plan: the expansion's plan; P = ``plan.pool_size`` pool nodes (the root, then every candidate
            in creation order, as ``ExpansionPlan.tree`` numbers them).
        index: ``plan.device_index(record.device)``.
        record: int64 ``[plan.record_size]``, the expansion's record (``ExpansionPlan``).
        budget: int64 0-d tensor: the tree keeps ``min(budget + 1, P)`` nodes, the root included.
        out: int64 ``[3, P]``, written in place: column i < ``min(budget + 1, P)`` is tree node i in
            depth-first order: (its token, its parent's tree index, its expanded index or -1); the
            root's token and parent (column 0) are left to the host (``ExpansionPlan.ranked_tree``);
            later columns hold unspecified values.

    The same nodes and order as ``ExpansionPlan.tree`` (its docstring says why the kept set is
    ancestor-closed), computed without sorting by ancestors: kept = the nodes whose place in the
    stable descending order of scores (``stable_ranks``) is at most ``budget``; the children of a
    frontier row are ``plan.width`` consecutive pool nodes (siblings in creation order), so a kept
    node's depth-first index is its parent's plus one plus the kept subtree sizes of its earlier
    siblings (subtree sizes summed bottom-up depth by depth, the siblings' offsets a cumulative sum
    per group of ``width``, the indices top-down depth by depth). Under ``torch.compile`` (inductor,
    on a CPU) it is two fused kernels at (top-8, 8 children, depth 6); eagerly about 80 small ops.
    """
    p, width, dev = plan.pool_size, plan.width, record.device
    first = [0, 1]
    for c in plan.cand:
        first.append(first[-1] + c)
    levels = [slice(first[d], first[d + 1]) for d in range(plan.depth + 1)]  # the pool nodes of each depth
    score = torch.where(index["root"], 0.0, record.view(torch.float64)[index["score_at"]])
    kept = stable_ranks(score) <= budget
    pick = torch.where(index["deep"], record[index["pick_at"]], 0)  # the parent's place in its depth
    # kept nodes in each subtree, bottom-up (a node not kept has none: the kept set is ancestor-closed):
    # node r of depth d - 1 adds the sizes of the group of width children of the frontier row that
    # picked it (picks are distinct; a dense comparison rather than a scatter-add: fusable, deterministic)
    size = [kept[levels[plan.depth]].long()]
    for d in range(plan.depth, 1, -1):
        rows = pick[levels[d]].view(-1, width)[:, 0]  # each frontier row's node at depth d - 1
        at = torch.arange(plan.cand[d - 2], device=dev)
        below = ((rows[None, :] == at[:, None]) * size[0].view(-1, width).sum(1)[None, :]).sum(1)
        size.insert(0, kept[levels[d - 1]].long() + below)
    sib = torch.cat(size).view(-1, width)  # depths 1 .. depth, in sibling groups of creation order
    offset = (1 + sib.cumsum(1) - sib).view(-1)  # 1 + the kept nodes of the earlier siblings' subtrees
    pos = [offset[: first[2] - 1]]  # depth-first indices, top-down
    for d in range(2, plan.depth + 1):
        pos.append(pos[-1][pick[levels[d]]] + offset[first[d] - 1 : first[d + 1] - 1])
    pos = torch.cat([offset.new_zeros(1), *pos])
    node = torch.arange(p, device=dev)
    order = torch.zeros(p + 1, dtype=torch.int64, device=dev).scatter_(0, torch.where(kept, pos, p), node)[:p]
    parent = index["parent_base"] + pick  # the root: itself
    exp = index["exp_init"].scatter(0, index["frontier_base"] + record[index["frontier_at"]], index["frontier_exp"])
    out[0].copy_(record[index["tok_at"][order]])
    out[1].copy_(pos[parent[order]])
    out[2].copy_(exp[order])


def rerank_rows(plan: ExpansionPlan, index: dict[str, torch.Tensor], record: torch.Tensor, budget: torch.Tensor,
                out: torch.Tensor) -> None:  # fmt: skip
    """``rerank_record`` of every row: record int64 ``[B, plan.record_size]``, budget int64 ``[B]``, out
    int64 ``[B, 3, P]`` (one function over the B rows: one compile for them all, not one per row's view)."""
    for b in range(record.shape[0]):
        rerank_record(plan, index, record[b], budget[b], out[b])


class Expansion:
    """One plan's expansion of B sequences (rows) at fixed addresses: one sequence's head cache (B = 1),
    or B sequences' caches (``sources``) copied into a batch cache of its own and back around the loop.

    Inputs, refilled in place every step (``launch``): ``scalars [B, 5]`` = per row (slot of the root's
    pair ``base``, the root's position, the catch-up's ``keep`` and ``m``, the node budget) and
    ``feat[:, 0]`` = the roots' output features (from the catch-up). Outputs: ``feat [B, E, H]`` = the
    output features of the ``E = plan.expanded`` expanded nodes of each row (index e at cache slot
    ``base + e``), ``record [B, record_size]`` (see ``ExpansionPlan``) and with ``rerank`` ``ranked``
    (int64 ``[B, 3, P]``, ``rerank_record``'s trees). ``_body`` -- with ``sources`` their copy in, the
    whole loop (one head forward of all rows per depth after the root), their copy back, then with
    ``rerank`` the rows' re-rank (``rerank_rows``) -- reads nothing but these buffers, the head's weights and the
    caches, never syncs with the host and has shapes fixed by (B, plan, cache capacity) when run over
    the whole capacity: ``capture=True`` records it once as a CUDA graph and replays it;
    ``capture=False`` runs the same body eagerly (what CPU tests check).
    """

    def __init__(self, drafter: ExpansionHost, cache: KVCache | Sequence[KVCache], plan: ExpansionPlan,
                 sampling: SamplingConfig | None, capture: bool, width: int = 0, rerank: bool = False,
                 batch_cache: KVCache | None = None) -> None:  # fmt: skip
        """``cache``: one sequence's head cache, or B sequences' caches (``sources``): then the body
        works in ``batch_cache`` (B sequences of their capacity, buffers allocated; one may serve every
        expansion of the same sources: their bodies run one after another), a new one if None."""
        dev, w = drafter.device, drafter.head.fc.weight
        self.drafter, self.plan, self.sampling, self.capture = drafter, plan, sampling, capture
        #: the B sequences' own caches when B > 1 (copied into ``cache`` and back by the body); None: B = 1
        self.sources: list[KVCache] | None = None
        if isinstance(cache, KVCache):
            self.cache = cache
        else:
            self.sources = list(cache)
            if len({c.capacity for c in self.sources}) != 1 or any(not c.layer_indices for c in self.sources):
                raise ValueError("cache: expected the sequences' caches of one capacity, every one written")
            if batch_cache is None:
                batch_cache = KVCache(len(self.sources), self.sources[0].capacity, num_layers=1)
                batch_cache.allocate_like(self.sources[0])
            if (batch_cache.batch_size, batch_cache.capacity) != (len(self.sources), self.sources[0].capacity):
                raise ValueError(f"batch_cache: expected {len(self.sources)} sequences of {self.sources[0].capacity} "
                                 f"slots, got {batch_cache.batch_size} of {batch_cache.capacity}")  # fmt: skip
            self.cache = batch_cache
        rows = self.cache.batch_size
        self.width = width  # rows of the fused catch-up; 0: not fused
        #: the re-rank on the device, inside the body (``rerank_record``); False: on the host from the record
        self.rerank = rerank
        # the step's int64 inputs: per row (base, root_pos, keep, m, budget), then when fused the catch-up's
        # [3, width] (token ids, positions, slots); the scalars in a tensor of their own, so that the compiled
        # depth loop sees the same input at every catch-up width (a view into a width-sized block would not)
        self.scalars = torch.zeros(rows, 5, dtype=torch.int64, device=dev)
        self.catch_ints = torch.zeros(rows, 3, width, dtype=torch.int64, device=dev)
        self.catch_feat = torch.zeros(rows, width, drafter.head.hidden_size, dtype=w.dtype, device=dev)
        self.feat = torch.zeros(rows, plan.expanded, drafter.head.hidden_size, dtype=w.dtype, device=dev)
        self.record = torch.zeros(rows, plan.record_size, dtype=torch.int64, device=dev)
        # the depth loop's outputs in buffers of their own, packed into the record after it: the record's
        # float64 score view aliases its int64 storage, which a compiled loop may not write through at B > 1
        # ("input mutations on views with different dtypes")
        self.tok, self.score, self.pick = (torch.zeros_like(v) for v in plan.views(self.record))
        self.index = plan.device_index(dev) if rerank else None
        self.ranked = torch.zeros(rows, 3, plan.pool_size, dtype=torch.int64, device=dev) if rerank else None
        i64 = dict(dtype=torch.int64, device=dev)
        #: ``attention="tree"``: the tree rows' buffers (``expand_depths``' ``tree``); None otherwise
        self.tree: tuple[torch.Tensor, ...] | None = None
        #: ``attention="tree"`` and a catch-up of at most E + 1 rows: its forward through the tree kernel
        #: (``_catch_up_body``): (slots [B, width], prefix [B], causal words, row ids [B, width]); else None
        self.catch_tree: tuple[torch.Tensor, ...] | None = None
        if drafter.attention == "tree" and 0 < width <= plan.expanded + 1:
            causal = pack_bits(torch.ones(width, width, dtype=torch.bool, device=dev).tril())
            self.catch_tree = (torch.zeros(rows, width, **i64), torch.zeros(rows, **i64),
                               causal.expand(rows, width, causal.shape[-1]).contiguous(),
                               torch.arange(width, **i64).expand(rows, width).contiguous())  # fmt: skip
        if drafter.attention == "tree" and plan.depth > 1:
            n = plan.expanded - 1
            depths = torch.tensor([plan.row_depths], **i64).expand(rows, n).contiguous()
            words = pack_bits(torch.eye(n, dtype=torch.bool, device=dev)).expand(rows, n, -1).contiguous()
            inputs = torch.zeros(rows, n, drafter.head.hidden_size, dtype=w.dtype, device=dev)
            self.tree = (torch.zeros(rows, n, **i64), inputs, torch.zeros(rows, n, **i64), torch.zeros(rows, n, **i64),
                         torch.zeros(rows, **i64), words, depths)  # fmt: skip
        self.graph = None  # torch.cuda.CUDAGraph once captured
        #: seconds the capture took (warm-up forwards + recording), None before / without it
        self.capture_s: float | None = None
        self._host: torch.Tensor | None = None  # pinned host copy of the records / ranked trees (GPU)

    @torch.no_grad()
    def launch(self, base: Sequence[int], root_pos: Sequence[int], root_feat: Sequence[torch.Tensor] | None,
               kv_lens: Sequence[int], catch_up: "Sequence[CatchUp] | None" = None,
               budget: Sequence[int] = ()) -> "torch.cuda.Event | None":  # fmt: skip
        """Load the step's inputs, one entry per row, and expand; on a GPU queue the copy of the records,
        or with ``rerank`` of the re-ranked trees of ``budget`` nodes (``ranked``), to a pinned host
        buffer and return an event recorded behind it (None on a CPU). ``fetch`` waits for it: the
        step's one sync, so several expansions can be launched before the first is read.

        ``kv_lens[d - 1]``: attention reads cache slots ``[0, kv_lens[d - 1])`` at depth d (eager
        only, B = 1; a captured graph reads the whole capacity). Unfused: ``root_feat`` holds the
        catch-ups' outputs for the roots. Fused: ``catch_up`` holds the catch-ups' inputs (padded to
        ``width`` rows), and the body runs them first (``root_feat`` is None).
        """
        rows = self.cache.batch_size
        if any(len(x) != rows for x in (base, root_pos, budget, *([catch_up] if catch_up is not None else []))):
            raise ValueError(f"launch: expected one entry per row ({rows})")
        if any(self.width != c.width for c in catch_up or ()) or (catch_up is None) != (self.width == 0):
            raise RuntimeError("catch_up: expected it exactly for a fused expansion, of its width")
        head, ints = [], []
        for b in range(rows):
            c = catch_up[b] if catch_up is not None else None
            head += [base[b], root_pos[b]] + ([c.keep, c.m] if c is not None else [0, 0]) + [budget[b]]
            ints += c.ints if c is not None else []
        stage = torch.tensor(head + ints, dtype=torch.int64)
        if self.scalars.is_cuda:
            stage = stage.pin_memory()
        self.scalars.view(-1).copy_(stage[: 5 * rows], non_blocking=True)
        if catch_up is not None:
            self.catch_ints.view(-1).copy_(stage[5 * rows :], non_blocking=True)
            for b, c in enumerate(catch_up):
                self.catch_feat[b, : c.m].copy_(c.feats)
        else:
            for b, f in enumerate(root_feat):
                self.feat[b, 0].copy_(f)
        if self.capture:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            self._body(kv_lens)
        self.drafter._mark("expand")
        out = self.ranked if self.rerank else self.record
        if not out.is_cuda:
            return None
        if self._host is None:
            self._host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        self._host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def fetch(self, done: "torch.cuda.Event | None") -> torch.Tensor:
        """The host copy ``launch`` queued (it returned ``done``), once it landed, ``[B, ...]``; read
        it with ``host_tree`` before this expansion's next ``launch``."""
        if done is None:  # on a CPU the same tensor (still the one copy per step the tests count)
            host = (self.ranked if self.rerank else self.record).cpu()
        else:
            done.synchronize()
            host = self._host
        self.drafter._mark("copy")
        return host

    def host_tree(self, host: torch.Tensor, root: int, budget: int) -> tuple[TokenTree, list[int]]:
        """The tree of ``budget`` nodes (``root`` at node 0) and each tree node's expanded index (-1:
        never expanded) from one row of ``fetch``'s host copy: ``ExpansionPlan.ranked_tree`` of the
        device's re-rank (``rerank``; ``budget`` must be ``launch``'s), else ``ExpansionPlan.tree`` of
        the record."""
        if self.rerank:
            return self.plan.ranked_tree(host, root, budget)
        return self.plan.tree(host, root, budget)

    def _catch_up_body(self) -> None:
        """The fused catch-ups: ``width`` rows a sequence, each root's output to ``feat[:, 0]``.

        Through the tree kernel (``catch_tree``): the committed slots ``[0, keep)`` are the prefix,
        row j writes slot ``keep + j`` and sees rows 0 .. j; the padding rows after the root write
        slots ``base + 1 ..`` (at most E of them: expanded slots, which every depth's forward writes
        before anything reads them, and the one after). Otherwise under an explicit mask over the
        whole cache, the padding rows writing and reading the scratch slot only.
        """
        keep, m = self.scalars[:, 2], self.scalars[:, 3]
        if self.catch_tree is not None:
            slots, prefix, words, rows = self.catch_tree
            slots.copy_(keep[:, None] + rows)
            prefix.copy_(keep)
            state = TreeState(self.cache, slots, prefix, words, rows)
            out = self.drafter._tree_forward(self.catch_ints[:, 0], self.catch_feat, self.catch_ints[:, 1], state)
        else:
            visible = self.drafter._catch_up_visible(keep, m, self.width, self.cache.capacity, padded=True,
                                                     device=self.feat.device)  # fmt: skip
            out = self.drafter._forward(self.cache, self.catch_ints[:, 0], self.catch_feat, self.catch_ints[:, 1],
                                        self.catch_ints[:, 2], visible)  # fmt: skip
        last = (m - 1)[:, None, None].expand(-1, 1, out.shape[-1])
        self.feat[:, :1].copy_(out.gather(1, last))

    def _copy(self, into_batch: bool) -> None:
        """The B sequences' KV buffers into this expansion's batch cache (``into_batch``), or back."""
        for layer in self.cache.layer_indices:
            batch = self.cache.buffers(layer)
            for b, source in enumerate(self.sources):
                for mine, theirs in zip(batch, source.buffers(layer)):
                    (mine[b] if into_batch else theirs[0]).copy_(theirs[0] if into_batch else mine[b])

    def _body(self, kv_lens: Sequence[int]) -> None:
        """(With ``sources``: their KV in, then) (fused: the catch-ups, then) depths 1 .. plan.depth on
        the device (``expand_depths``, compiled with ``compile_head``), (the KV back,) then with
        ``rerank`` the rows' re-rank (``rerank_rows``, compiled likewise)."""
        if self.sources is not None:
            self._copy(into_batch=True)
        if self.width:
            self._catch_up_body()
        self.drafter._depth_loop(self.drafter, self.cache, self.plan, self.sampling, tuple(kv_lens), self.scalars,
                                 self.feat, self.tok, self.score, self.pick, self.tree)  # fmt: skip
        for packed, out in zip(self.plan.views(self.record), (self.tok, self.score, self.pick)):
            packed.copy_(out)
        if self.sources is not None:
            self._copy(into_batch=False)
        if self.rerank:
            self.drafter._rerank(self.plan, self.index, self.record, self.scalars[:, 4], self.ranked)

    def _capture(self) -> None:
        """Warm up (current stream, then a side stream), then record ``_body`` over the whole cache.

        The body is idempotent for fixed inputs (it rewrites the same cache slots and outputs), so
        the warm-up runs change nothing the replay right after the capture does not redo.
        """
        dev = self.feat.device
        kv_lens = [self.cache.capacity] * (self.plan.depth - 1)
        with torch.cuda.device(dev):
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            self._body(kv_lens)
            layers = list(self.cache.layer_indices)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._body(kv_lens)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph):
                self._body(kv_lens)
            if list(self.cache.layer_indices) != layers:
                raise RuntimeError("cache: KV buffers were allocated during the CUDA-graph capture")
            torch.cuda.synchronize(dev)
            self.capture_s = time.perf_counter() - start
        self.graph = graph


@dataclass
class CatchUp:
    """A fused catch-up's inputs: ``ints`` = token ids, positions, slots (``3 * width`` host ints,
    padding rows: token 0, position 0, the scratch slot), ``feats [m, H]`` the real rows' features
    (device), ``keep`` the committed slots they attend to, ``m`` the real rows."""

    width: int
    ints: list[int]
    feats: torch.Tensor
    keep: int
    m: int

    def padded(self, width: int, scratch: int) -> "CatchUp":
        """The same catch-up padded to ``width >= self.width`` rows (padding: token 0, position 0,
        slot ``scratch``), for a batch whose widest catch-up needs them."""
        pad, w = width - self.width, self.width
        tokens, positions, slots = self.ints[:w], self.ints[w : 2 * w], self.ints[2 * w :]
        return CatchUp(width, tokens + [0] * pad + positions + [0] * pad + slots + [scratch] * pad, self.feats,
                       self.keep, self.m)  # fmt: skip


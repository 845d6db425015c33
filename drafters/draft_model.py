"""A small draft LM that grows a dynamic token tree (EAGLE-2 style) over its own reused KV cache.

Per step and sequence (``propose``), with root r = the last committed token:

1. **Catch up.** The draft's cache holds the KV of the committed tokens up to some point (the
   prompt after the first step; later everything up to the last accepted token it had drafted).
   The tokens it has not seen yet -- accepted drafts it never expanded, the bonus token, the root
   -- run as one causal chain forward over that cache. This is the only forward whose length
   depends on the context; it also yields the root's distribution.
2. **Expand, one forward per depth.** Every node whose children are drafted is "expanded": the
   draft runs it once. At depth d the frontier (the ``topk`` depth-d candidates with the best
   cumulative draft log-probability) runs as ONE forward of ``topk`` queries, each attending to
   the committed prefix and, through an explicit tree mask, to its own ancestors among the nodes
   expanded by earlier forwards (``specdec.hf.masked_forward``: keys / values written into the
   draft's ``specdec.KVCache`` right after the committed prefix, root first). Each expanded node
   contributes its ``w`` best children as candidates (greedy / ``"topk"``), or ``w`` children
   sampled from the warped draft distribution (``"iid"`` / ``"no_replacement"``, in draw order).
3. **Re-rank.** The tree keeps ``tree_size`` candidates by cumulative draft log-probability (best
   first; with sampled children a node's children are kept as a prefix of their draw order, which
   keeps stochastic verification lossless). A child never scores above its parent, so the kept set
   is ancestor-closed.
4. **Commit** (``update``): the accepted path's nodes that the draft expanded are moved next to the
   committed prefix with ``KVCache.commit``; the rest of the tree region is overwritten next step.

Cost per step: ``depth`` draft forwards (one catch-up / root forward and ``depth - 1`` frontier
forwards of ``topk`` tokens). Children per expanded node: ``w = max(topk, ceil(tree_size / E))``
with ``E = 1 + topk * (depth - 1)`` expanded nodes, so the candidate pool (``E * w`` nodes) always
holds ``tree_size`` nodes: trees of t = 32 ... 256 and beyond come out with exactly t nodes (if the
vocabulary is large enough). The default depth is shallow (3): a 0.5B draft costs about a third of
a 1.5B target per forward, so deep drafting eats the gain.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from drafters._build import NodePool, best_first as _best_first, make_tree, root_only
from specdec.drafting import BaseDrafter, DraftContext
from specdec import hf
from specdec.graphs import GraphedMaskedForward, replay_modes
from specdec.kv import KVCache
from specdec.sampling import warp_logits
from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = ["DraftModelDrafter", "SAMPLING_PROPOSALS"]

#: How children are chosen when the engine samples: deterministic top-k of the warped draft, or drawn.
SAMPLING_PROPOSALS = ("topk", "iid", "no_replacement")


@dataclass
class _SeqState:
    cache: KVCache
    committed: list[int]  # tokens whose KV is at slots [0, len(committed))
    node_exp: list[int]  # for the last proposed tree: tree node -> expanded index (-1: not expanded)
    base: int = 0  # slot of the root (expanded index 0) in the last propose
    fwd: GraphedMaskedForward | None = None  # fixed-shape forward over ``cache`` (static shapes)


class DraftModelDrafter(BaseDrafter):
    """Draft LM drafter building an EAGLE-2-style dynamic tree with one batched forward per depth.

    Args:
        draft_model: a HuggingFace causal LM with the target's vocabulary (e.g. Qwen2.5-Coder-0.5B
            for -1.5B). Its attention is routed through specdec (``specdec.hf.prepare_model``).
        tree_size: default node budget, used when the engine asks for more (the engine passes its
            own ``tree_size`` per step; the tree has ``min(context budget, tree_size)`` nodes).
            None = always the engine's budget.
        depth: tree depth = draft forwards per step (>= 1).
        topk: frontier width: nodes expanded per depth after the root (>= 1).
        sampling_proposal: how children are chosen under sampling: ``"no_replacement"`` (default,
            Sequoia), ``"iid"`` (SpecInfer) or ``"topk"`` (deterministic, EAGLE). Greedy decoding
            always uses top-k children.
        reuse_kv: keep the draft's KV across steps (False recomputes the whole context every
            step: a reference for tests, never faster).
        static_shapes: run every draft forward after the prompt's prefill (catch-up chain and each
            depth's frontier) as one ``[1, max(topk, depth + 1)]`` forward over the whole draft
            cache (``specdec.graphs.GraphedMaskedForward``: fixed buffers, padded rows); default
            True on CUDA. Chains longer than that width run as plain forwards.
        cuda_graphs: replay those fixed-shape forwards as CUDA graphs (one capture per sequence
            and cache size); default True when ``static_shapes`` and the draft is on one CUDA
            device, unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``.
        compile: run those fixed-shape forwards through ``torch.compile`` before their capture
            (True: inductor, or a backend name; needs static shapes). Default False.

    Draft forwards attend with SDPA under an explicit mask (``specdec.hf.MaskedState``): the
    queries of a depth are a few frontier nodes, not the whole tree the tree-attention kernel
    expects. The draft's KV lives in one ``specdec.KVCache`` per sequence, grown (by copying the
    committed part) when a step would not fit; with static shapes its last slot is scratch for
    padding rows.
    """

    def __init__(
        self,
        draft_model,
        tree_size: int | None = None,
        depth: int = 3,
        topk: int = 8,
        *,
        sampling_proposal: str = "no_replacement",
        reuse_kv: bool = True,
        static_shapes: bool | None = None,
        cuda_graphs: bool | None = None,
        compile: bool | str = False,
    ) -> None:
        hf.prepare_model(draft_model, "draft_model")
        for name, val in (("depth", depth), ("topk", topk)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if tree_size is not None and (not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0):
            raise ValueError(f"tree_size: expected None or an int >= 0, got {tree_size!r}")
        if sampling_proposal not in SAMPLING_PROPOSALS:
            raise ValueError(f"sampling_proposal: expected one of {SAMPLING_PROPOSALS}, got {sampling_proposal!r}")
        self.model = draft_model
        self.tree_size = tree_size
        self.depth = depth
        self.topk = topk
        self.sampling_proposal = sampling_proposal
        self.reuse_kv = reuse_kv
        self.vocab_size = hf.vocab_size(draft_model)
        self.device = hf.input_device(draft_model)
        self.static_shapes, self.cuda_graphs, self.compile = replay_modes(
            draft_model, static_shapes, cuda_graphs, compile, "the draft model")
        #: rows of the fixed-shape draft forward: a frontier, or a catch-up chain of up to depth + 1 tokens
        self.static_width = max(topk, depth + 1)
        self._states: dict[int, _SeqState] = {}
        #: draft forwards run by the last ``propose`` (for tests and accounting)
        self.last_forwards = 0

    # ------------------------------------------------------------------ protocol

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """New ``generate`` call: forget every sequence's draft KV (buffers are reused when they fit)."""
        old = self._states
        self._states = {}
        for b, prompt in enumerate(input_ids):
            prev = old.get(b)
            cache = prev.cache if prev is not None else self._new_cache(len(prompt) + 64)
            cache.reset()
            # The fixed-shape forward (and its CUDA graph) stays valid as long as the cache does.
            self._states[b] = _SeqState(cache, [], [], fwd=prev.fwd if prev is not None else None)

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        tokens = context.tokens.tolist()
        root = tokens[-1]
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        self.last_forwards = 0
        if budget <= 0:
            return root_only(root)
        st = self._state(context.seq, len(tokens))
        depth = min(self.depth, budget)
        frontier_width = min(self.topk, budget)
        expanded_max = 1 + frontier_width * (depth - 1)
        width = min(self.vocab_size, max(frontier_width, math.ceil(budget / expanded_max)))
        base = len(tokens) - 1
        self._ensure_capacity(st, base + expanded_max + int(self.static_shapes))  # + the scratch slot

        sampling = context.sampling
        proposal = "topk" if sampling is None else self.sampling_proposal

        # Node pool (host lists), node 0 = root. exp[i] = expanded index (slot base + exp[i]) or -1.
        pool = NodePool.rooted(root)
        tok, par, score, dep, exp, children = pool.tok, pool.par, pool.score, pool.dep, pool.exp, pool.children
        rows: dict[int, torch.Tensor] = {}  # pool node -> proposal distribution of its children
        exp_anc: list[list[int]] = [[0]]  # expanded index -> expanded indices of ancestors-or-self
        exp_depth = [0]

        logits = self._catch_up(st, tokens)  # [1, V]: the root's next-token logits
        frontier = [0]
        left = budget  # sampled children: nodes still allowed below the levels kept so far
        for d in range(1, depth + 1):
            cap = None
            if proposal != "topk":  # decided before any of this level's draws is looked at
                after = depth - d  # levels that may follow this one
                cap = left - min(after * frontier_width * width, left * after // (after + 1))
            new = self._add_children(frontier, logits, width, sampling, proposal, context.generator, pool, rows, d,
                                     cap)  # fmt: skip
            left -= len(new)
            if d == depth or not new or (proposal != "topk" and left <= 0):
                break
            frontier = sorted(new, key=lambda i: (-score[i], i))[:frontier_width]
            for i in frontier:
                exp[i] = len(exp_anc)
                exp_anc.append(exp_anc[exp[par[i]]] + [exp[i]])
                exp_depth.append(d)
            logits = self._expand(st, base, frontier, d, tok, exp, exp_anc, exp_depth)

        # Sampled children were pruned level by level as they were drawn (the pool is the tree);
        # top-k children are pruned here, best-first over the whole pool.
        keep = _best_first(children, score, dep, budget) if proposal == "topk" else list(range(len(tok)))
        index = {old: new for new, old in enumerate(keep)}
        tree_tokens = [tok[i] for i in keep]
        tree_parents = [-1] + [index[par[i]] for i in keep[1:]]
        probs = None
        if proposal != "topk":
            probs = torch.zeros(len(keep), self.vocab_size, dtype=torch.float32, device=self.device)
            for i in keep:
                if i in rows:
                    probs[index[i]] = rows[i]
        tree, order = make_tree(tree_tokens, tree_parents, probs, proposal)
        st.node_exp = [exp[keep[o]] for o in order]
        st.base = base
        return tree

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Commit the KV of the accepted path's expanded nodes (root first) after the committed prefix."""
        st = self._states.get(context.seq)
        if st is None or not self.reuse_kv or len(st.node_exp) != tree.n:
            return
        path = [0]
        for node in verdict.path[1:]:
            e = st.node_exp[node]
            if e < 0:
                break
            path.append(e)
        st.cache.lengths = [st.base]
        st.cache.commit([path])
        st.committed = context.tokens.tolist() + tree.path_tokens(verdict.path[1 : len(path)])
        st.node_exp = []

    # ------------------------------------------------------------------ internals

    def _new_cache(self, need: int) -> KVCache:
        """A cache of at least ``need`` slots (a power of two >= 256), all layers in one tensor."""
        return KVCache(1, max(256, 1 << max(need - 1, 1).bit_length()), num_layers=hf.num_layers(self.model))

    def _state(self, seq: int, length: int) -> _SeqState:
        st = self._states.get(seq)
        if st is None:
            st = self._states[seq] = _SeqState(self._new_cache(length + 64), [], [])
        return st

    def _ensure_capacity(self, st: _SeqState, need: int) -> None:
        """Grow the draft cache (copying the committed KV) when a step would not fit."""
        if need <= st.cache.capacity:
            return
        old = st.cache
        new = self._new_cache(need)
        keep = len(st.committed)
        for layer in old.layer_indices:
            k, v = old.buffers(layer)
            if keep:
                new.write(layer, k[:, :, :keep], v[:, :, :keep], torch.arange(keep, device=k.device)[None])
        st.cache = new

    def _catch_up(self, st: _SeqState, tokens: list[int]) -> torch.Tensor:
        """Run the tokens the draft has not seen (ending with the root) as a causal chain."""
        known = st.committed if self.reuse_kv else []
        c = min(len(known), len(tokens) - 1)
        if known[:c] != tokens[:c]:  # a different history: keep only the common prefix
            c = next(i for i, (a, b) in enumerate(zip(known, tokens)) if a != b)
        n = len(tokens)
        pending = torch.tensor([tokens[c:]], dtype=torch.int64)
        if c == 0:  # nothing cached (first step): a plain causal prefill (SDPA's causal kernels)
            pos = torch.arange(n, device=self.device)[None]
            state = hf.ForwardState(cache=st.cache, slots=pos, positions=pos)
            logits = hf.run_state(self.model, pending.to(self.device), pos, state, logits_to_keep=1)
        else:
            slots = torch.arange(c, n, dtype=torch.int64)[None]
            visible = torch.arange(n)[None, None, :] <= slots[:, :, None]  # causal over [0, n)
            logits = self._masked(st, pending, slots, slots, visible, torch.arange(n)[None])[:, -1:]
        self.last_forwards += 1
        st.committed = tokens[:-1]  # the root's KV (slot n - 1) is expanded node 0 of this step
        st.cache.lengths = [n - 1]
        return logits[0]

    def _expand(self, st, base, frontier, d, tok, exp, exp_anc, exp_depth) -> torch.Tensor:
        """One forward of the frontier nodes (depth d) over the prefix and their expanded ancestors."""
        m = len(frontier)
        total = len(exp_anc)  # expanded nodes including this frontier
        ids = torch.tensor([[tok[i] for i in frontier]], dtype=torch.int64)
        slots = torch.tensor([[base + exp[i] for i in frontier]], dtype=torch.int64)
        positions = torch.full((1, m), base + d, dtype=torch.int64)
        tree_vis = torch.zeros(1, m, total, dtype=torch.bool)
        for q, i in enumerate(frontier):
            tree_vis[0, q, exp_anc[exp[i]]] = True
        visible = torch.cat([torch.ones(1, m, base, dtype=torch.bool), tree_vis], dim=2)
        key_positions = torch.cat([torch.arange(base), base + torch.tensor(exp_depth)])[None]
        logits = self._masked(st, ids, positions, slots, visible, key_positions)
        self.last_forwards += 1
        return logits[0]

    def _masked(self, st, ids, positions, slots, visible, key_positions) -> torch.Tensor:
        """``hf.masked_forward`` (host inputs) -> logits ``[1, m, V]``; through the sequence's
        fixed-shape forward when static shapes are on and the m tokens fit its width."""
        m = ids.shape[1]
        if not self.static_shapes or m > self.static_width:
            return hf.masked_forward(self.model, ids, positions, slots, visible, st.cache, key_positions=key_positions)
        if st.fwd is None or st.fwd.cache is not st.cache:  # first use, or the cache was grown
            st.fwd = GraphedMaskedForward(self.model, st.cache, 1, self.static_width, capture=self.cuda_graphs,
                                          compile=self.compile)  # fmt: skip
        st.fwd.load(ids, positions, slots, visible, key_positions)
        logits, _ = st.fwd.forward()
        return logits[:, :m]

    def _add_children(self, frontier, logits, width, sampling, proposal, generator, pool: NodePool, rows, d,
                      cap=None) -> list[int]:  # fmt: skip
        """Add up to ``width`` children under each frontier node; return the new pool indices.

        ``cap`` (sampled children only): at most this many new nodes in all, allotted before the
        draws are looked at (see ``_allot``); each node keeps a prefix of its draws.
        """
        logits = logits.float()
        if sampling is None:
            logq = torch.log_softmax(logits, dim=-1)
        else:
            logq = torch.log_softmax(warp_logits(logits, sampling), dim=-1)
        counts = [width] * len(frontier)
        if proposal == "topk":
            vals, idx = torch.topk(logq, width, dim=-1)
        else:
            counts = _allot([pool.score[i] for i in frontier], torch.topk(logq, width, dim=-1).values.tolist(), cap)
            if proposal == "no_replacement":
                idx = _gumbel_top_k(logq, width, generator)  # sequential draws without replacement, in order
            else:  # iid
                idx = _multinomial(logq.exp(), width, generator)
            vals = logq.gather(1, idx)
            for q, i in enumerate(frontier):
                rows[i] = logq[q].exp()
        new = []
        for q, (vrow, irow) in enumerate(zip(vals.tolist(), idx.tolist())):
            parent = frontier[q]
            for v, t in zip(vrow[: counts[q]], irow[: counts[q]]):
                if proposal != "topk" and v == -math.inf:
                    break  # no mass left to draw from (top-k / top-p filtered)
                new.append(pool.add(parent, t, v, d))
        return new


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


def _gumbel_top_k(logq: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` draws without replacement from ``exp(logq)`` per row, in draw order (Gumbel top-k)."""
    dev = generator.device if generator is not None else logq.device
    u = torch.rand(logq.shape, generator=generator, device=dev).to(logq.device)
    gumbel = -torch.log(-torch.log(u.clamp_(min=1e-20, max=1.0 - 1e-7)))
    return torch.topk(logq + gumbel, k, dim=-1).indices


def _multinomial(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` i.i.d. draws per row (on the generator's device)."""
    dev = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(dev), k, replacement=True, generator=generator).to(probs.device)

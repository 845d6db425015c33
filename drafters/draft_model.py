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

**Where it runs (issue 14).** Steps 1 (after the first step of a sequence) and 2 and the choice
of nodes run on the device (``_DeviceLoop``, the default for every proposal kind): fixed ``topk``
rows per depth (rows without a live node are padding that nobody attends to), top-k / draws /
scores / the next frontier in device tensors, the ancestor matrix and the masks over the draft
cache built by tensor indexing; no host sync between depths, and ONE device-to-host copy at the
end, after which the host rebuilds the node pool (``drafters._build.NodePool``) and picks the tree
exactly as before. On CUDA the step (catch-up + ``depth - 1`` frontier forwards + bookkeeping) is
replayed as one CUDA graph per sequence and shape. Greedy / ``"topk"`` trees are exactly those of
the host-driven loop (``device_loop=False``, one forward and one host sync per depth, kept as the
reference): the same float32 values, float64 cumulative scores and tie order. Sampled children are
drawn from the same distributions with the same budget rules (``_allot`` on the device), from
uniforms drawn before the loop.

Cost per step: ``depth`` draft forwards (one catch-up / root forward and ``depth - 1`` frontier
forwards of ``topk`` tokens). Children per expanded node: ``w = max(topk, ceil(tree_size / E))``
with ``E = 1 + topk * (depth - 1)`` expanded nodes, so the candidate pool (``E * w`` nodes) always
holds ``tree_size`` nodes: trees of t = 32 ... 256 and beyond come out with exactly t nodes (if the
vocabulary is large enough). The default depth is shallow (3): a 0.5B draft costs about a third of
a 1.5B target per forward, so deep drafting eats the gain.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from drafters._build import NodePool, best_first as _best_first, expanded_path, make_tree, root_only
from specdec.drafting import BaseDrafter, DraftContext
from specdec import hf
from specdec.graphs import (DEFAULT_PREFILL_WIDTH, GraphedForward, GraphedMaskedForward, Replayed, compile_fixed_shapes,
                            prefill_chunks, replay_modes)
from specdec.kv import KVCache
from specdec.sampling import warp_logits
from specdec.tree import TokenTree
from specdec.verify import Verdict
from treeattn.layout import pack_bits
from treeattn.ops import tree_attention_op

__all__ = ["DraftModelDrafter", "SAMPLING_PROPOSALS", "ATTENTIONS", "pick_attention"]

#: How children are chosen when the engine samples: deterministic top-k of the warped draft, or drawn.
SAMPLING_PROPOSALS = ("topk", "iid", "no_replacement")

#: How the device loop's draft forwards attend: SDPA under a dense mask over the whole cache, or treeattn's kernel.
ATTENTIONS = ("sdpa", "tree")


@dataclass
class _SeqState:
    cache: KVCache
    committed: list[int]  # tokens whose KV is at slots [0, len(committed))
    node_exp: list[int]  # for the last proposed tree: tree node -> expanded index (-1: not expanded)
    base: int = 0  # slot of the root (expanded index 0) in the last propose
    fwd: GraphedMaskedForward | None = None  # fixed-shape forward over ``cache`` (static shapes)
    prefill: GraphedForward | None = None  # the fixed-shape prompt prefill over ``cache`` (``prefill_width``)
    #: device loops over ``cache``, one per (frontier width, children, depth, proposal, sampling transform)
    loops: dict = field(default_factory=dict)


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
        static_shapes: with the host-driven loop (``device_loop=False``), run every draft forward
            after the prompt's prefill (catch-up chain and each depth's frontier) as one ``[1,
            max(topk, depth + 1)]`` forward over the whole draft cache
            (``specdec.graphs.GraphedMaskedForward``: fixed buffers, padded rows; chains longer than
            that run as plain forwards); default True on CUDA. Turns CUDA graphs on by default.
            (The device loop always has fixed shapes: its catch-up stage takes chains of up to
            ``max(topk, depth + 1)`` tokens, longer ones run before it as plain forwards.)
        cuda_graphs: replay the device loop (or those fixed-shape forwards) as CUDA graphs (one
            capture per sequence, cache size and loop shape); default True when ``static_shapes``
            and the draft is on one CUDA device, unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``.
        compile: run the device loop (or those fixed-shape forwards) through ``torch.compile``
            before their capture (True: inductor, or a backend name; needs static shapes). Default False.
        device_loop: run each proposal in ``_DeviceLoop`` (default: catch-up chain and every depth
            in one CUDA graph, one host sync per step); False = the host-driven loop (one forward,
            masks built on the host and one host sync per depth), kept as the reference the device
            loop is tested against.
        prefill_width: with the device loop and static shapes, a sequence's first proposal writes the
            prompt's KV (all but the root) in chunks of this many tokens through one fixed-shape
            forward (``specdec.graphs.GraphedForward``, captured like the loop; the engine's
            chunked prefill), and the root then runs as the loop's catch-up, so the step needs no
            eager forward of the draft. Default ``DEFAULT_PREFILL_WIDTH`` (256; measured on the H100:
            a call's first draft step 107 -> 14 ms, PERF.md v13); 0 or None = one eager causal
            forward over the prompt (what dynamic shapes always use).
        attention: how the device loop's forwards attend: ``"sdpa"`` (SDPA under a dense mask over
            the whole draft cache, every layer kind), ``"tree"`` (treeattn's kernel: the committed
            prefix read up to its length, split over many thread blocks, the expanded nodes through
            ancestor bit words, every level's forward over all of them; no sliding-window or
            soft-capped layers) or ``"auto"`` (default): ``"tree"`` on a CUDA device when the
            draft's config allows it, else ``"sdpa"`` (on a CPU a forward's cost grows with its
            rows, and a tree level runs ``topk * (depth - 1)`` of them). Measured on the H100 (PERF.md
            v14): ``"tree"`` took the 0.5B's step from 9.9 to 9.0 ms on HumanEval and from 11.5 to
            9.3 ms on APPS's longer prompts. The host-driven loop always uses SDPA.

    Counters of the last ``propose`` (for benchmarks: draft ms per step come from the engine's
    ``StepStats.draft_s``): ``last_forwards`` (draft forwards, catch-up included), ``last_depth``
    (levels drafted), ``last_device_loop``.

    Draft forwards attend with SDPA under an explicit mask (``specdec.attention.MaskedState``): the
    queries of a depth are a few frontier nodes, not the whole tree the tree-attention kernel
    expects. The draft's KV lives in one ``specdec.KVCache`` per sequence, grown (by copying the
    committed part) when a step would not fit; with static shapes its last slot is scratch for
    the catch-up's padding rows.
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
        device_loop: bool = True,
        attention: str = "auto",
        prefill_width: int | None = DEFAULT_PREFILL_WIDTH,
    ) -> None:
        hf.prepare_model(draft_model, "draft_model")
        if attention != "auto" and attention not in ATTENTIONS:
            raise ValueError(f"attention: expected 'auto' or one of {ATTENTIONS}, got {attention!r}")
        if prefill_width is not None and (not isinstance(prefill_width, int) or isinstance(prefill_width, bool)
                                          or prefill_width < 0):  # fmt: skip
            raise ValueError(f"prefill_width: expected None or an int >= 0 (0 or None: the eager prefill), got {prefill_width!r}")
        if not isinstance(device_loop, bool):
            raise ValueError(f"device_loop: expected True or False, got {device_loop!r}")
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
        #: the least capacity of a new draft cache (``warmup`` raises it to what its requests need)
        self._min_cache = 256
        self.device_loop = device_loop
        #: the device loop's attention in effect ("auto" resolved)
        self.attention = pick_attention(attention, draft_model, self.device)
        self.prefill_width = prefill_width
        #: draft forwards run by the last ``propose`` (catch-up included; for tests and accounting)
        self.last_forwards = 0
        #: levels drafted by the last ``propose`` (0 for a root-only tree)
        self.last_depth = 0
        #: whether the last ``propose`` grew its tree in the device loop (else: the host-driven loop)
        self.last_device_loop = False

    # ------------------------------------------------------------------ protocol

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """New ``generate`` call: forget every sequence's draft KV (buffers are reused when they fit)."""
        old = self._states
        self._states = {}
        for b, prompt in enumerate(input_ids):
            prev = old.get(b)
            cache = prev.cache if prev is not None else self._new_cache(len(prompt) + 64)
            cache.reset()
            # The fixed-shape forward and loops (and their CUDA graphs) stay valid as long as the cache does.
            self._states[b] = _SeqState(cache, [], [], fwd=prev.fwd if prev is not None else None,
                                        prefill=prev.prefill if prev is not None else None,
                                        loops=prev.loops if prev is not None else {})  # fmt: skip

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_len: int | None = None, log=None) -> None:
        """Size the draft caches for requests of up to ``max_len`` tokens per sequence (prompt and new
        tokens; called by ``SpecDecoder.warmup``): a cache that grows mid-run drops its device loops,
        so their captures (and, with ``compile``, the level forward's compile for the new capacity)
        would come back inside a timed call. ``batch_sizes`` and ``log`` are not used."""
        if max_len is not None:
            self._min_cache = max(self._min_cache, max_len + self.topk * self.depth + 2)
            for b, st in list(self._states.items()):
                if st.cache.capacity < self._min_cache:
                    self._states[b] = _SeqState(self._new_cache(self._min_cache), [], [])

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        tokens = context.tokens.tolist()
        root = tokens[-1]
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        self.last_forwards = 0
        self.last_depth = 0
        self.last_device_loop = False
        if budget <= 0:
            return root_only(root)
        st = self._state(context.seq, len(tokens))
        depth = min(self.depth, budget)
        frontier_width = min(self.topk, budget)
        expanded_max = 1 + frontier_width * (depth - 1)
        width = min(self.vocab_size, max(frontier_width, math.ceil(budget / expanded_max)))
        base = len(tokens) - 1
        scratch = self.static_shapes or self.device_loop  # the last slot: padding rows of a catch-up chain
        self._ensure_capacity(st, base + expanded_max + int(scratch))

        sampling = context.sampling
        proposal = "topk" if sampling is None else self.sampling_proposal
        loop = None
        if self.device_loop:
            chain = None
            seen = self._seen(st, tokens)
            if seen == 0 and len(tokens) > 1 and self.prefill_width and self.static_shapes:
                seen = self._chunked_prefill(st, tokens[:-1])
            if 0 < seen and len(tokens) - seen <= self.static_width:  # the catch-up runs inside the loop
                chain = tokens[seen:]
                self.last_forwards += 1
                st.committed = tokens[:-1]  # the root's KV (slot base) is expanded node 0 of this step
                st.cache.lengths = [base]
                logits = None
            else:  # first step (a plain prefill) or a long chain
                logits = self._catch_up(st, tokens)  # [1, V]: the root's next-token logits
            pool, loop = self._grow_on_device(st, logits, chain, root, base, depth, frontier_width, width, budget,
                                              sampling, proposal, context.generator)  # fmt: skip
        else:
            logits = self._catch_up(st, tokens)  # [1, V]: the root's next-token logits
            pool, rows = self._grow_on_host(st, logits, root, base, depth, frontier_width, width, budget, sampling,
                                            proposal, context.generator)  # fmt: skip
        tok, par, score, dep, exp, children = pool.tok, pool.par, pool.score, pool.dep, pool.exp, pool.children

        # Sampled children were pruned level by level as they were drawn (the pool is the tree);
        # top-k children are pruned here, best-first over the whole pool.
        keep = _best_first(children, score, dep, budget) if proposal == "topk" else list(range(len(tok)))
        index = {old: new for new, old in enumerate(keep)}
        tree_tokens = [tok[i] for i in keep]
        tree_parents = [-1] + [index[par[i]] for i in keep[1:]]
        probs = None
        if proposal != "topk" and loop is not None:  # expanded nodes' rows of the loop's ``probs``, else zeros
            at = torch.tensor([exp[i] if exp[i] >= 0 else loop.expanded for i in keep], dtype=torch.int64)
            probs = loop.probs.index_select(0, at.to(loop.probs.device))
        elif proposal != "topk":
            probs = torch.zeros(len(keep), self.vocab_size, dtype=torch.float32, device=self.device)
            for i in keep:
                if i in rows:
                    probs[index[i]] = rows[i]
        tree, order = make_tree(tree_tokens, tree_parents, probs, proposal)
        st.node_exp = [exp[keep[o]] for o in order]
        st.base = base
        return tree

    def _grow_on_device(self, st, logits, chain, root, base, depth, frontier_width, width, budget, sampling,
                        proposal, generator) -> tuple[NodePool, "_DeviceLoop"]:  # fmt: skip
        """Every level in the sequence's ``_DeviceLoop`` (one host sync), then the same node pool as
        ``_grow_on_host`` (same creation order, scores, expanded nodes and early stops). ``chain``:
        the catch-up tokens the loop runs first (else ``logits`` are the root's, from ``_catch_up``)."""
        chain_width = self.static_width if chain is not None else 0
        key = (frontier_width, width, depth, proposal, sampling, chain_width)
        loop = st.loops.get(key)
        if loop is None:
            loop = st.loops[key] = _DeviceLoop(self.model, st.cache, topk=frontier_width, width=width, depth=depth,
                                               proposal=proposal, sampling=sampling, chain=chain_width,
                                               capture=self.cuda_graphs, compile=self.compile,
                                               attention=self.attention)  # fmt: skip
        levels = loop.run(logits, base, budget, generator, chain=chain)
        self.last_device_loop = True
        self.last_forwards += depth - 1  # run on the device even where the host stops early (sampled)
        pool = NodePool.rooted(root)
        rows = [0]  # pool node of each live parent row of the level
        left = budget
        for d, (toks, vals, kept, chosen) in enumerate(levels, start=1):
            slot_node: dict[int, int] = {}  # candidate (q * w + k) -> pool node
            for q, parent in enumerate(rows):
                for c in range(width):
                    if kept[q][c]:
                        slot_node[q * width + c] = pool.add(parent, toks[q][c], vals[q][c], d)
            left -= len(slot_node)
            if chosen is None or not slot_node or (proposal != "topk" and left <= 0):
                self.last_depth = d
                break
            live = chosen[: min(frontier_width, len(slot_node))]
            if any(i not in slot_node for i in live):
                raise RuntimeError("draft_model: the device loop chose a frontier node that was not drafted "
                                   "(non-finite draft logits?)")
            rows = [slot_node[i] for i in live]
            for r, i in enumerate(rows):
                pool.exp[i] = loop.expanded_index(d, r)
        return pool, loop

    def _grow_on_host(self, st, logits, root, base, depth, frontier_width, width, budget, sampling, proposal,
                      generator) -> tuple[NodePool, dict]:  # fmt: skip
        """The host-driven loop: one forward and one host sync per depth (every proposal kind)."""
        # Node pool (host lists), node 0 = root. exp[i] = expanded index (slot base + exp[i]) or -1.
        pool = NodePool.rooted(root)
        tok, par, score, exp = pool.tok, pool.par, pool.score, pool.exp
        rows: dict[int, torch.Tensor] = {}  # pool node -> proposal distribution of its children
        exp_anc: list[list[int]] = [[0]]  # expanded index -> expanded indices of ancestors-or-self
        exp_depth = [0]
        frontier = [0]
        left = budget  # sampled children: nodes still allowed below the levels kept so far
        for d in range(1, depth + 1):
            cap = None
            if proposal != "topk":  # decided before any of this level's draws is looked at
                after = depth - d  # levels that may follow this one
                cap = left - min(after * frontier_width * width, left * after // (after + 1))
            new = self._add_children(frontier, logits, width, sampling, proposal, generator, pool, rows, d,
                                     cap)  # fmt: skip
            left -= len(new)
            self.last_depth = d
            if d == depth or not new or (proposal != "topk" and left <= 0):
                break
            frontier = sorted(new, key=lambda i: (-score[i], i))[:frontier_width]
            for i in frontier:
                exp[i] = len(exp_anc)
                exp_anc.append(exp_anc[exp[par[i]]] + [exp[i]])
                exp_depth.append(d)
            logits = self._expand(st, base, frontier, d, tok, exp, exp_anc, exp_depth)
        return pool, rows

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Commit the KV of the accepted path's expanded nodes (root first) after the committed prefix."""
        st = self._states.get(context.seq)
        if st is None or not self.reuse_kv or len(st.node_exp) != tree.n:
            return
        path = expanded_path(verdict.path, st.node_exp)
        st.cache.lengths = [st.base]
        st.cache.commit([path])
        st.committed = context.tokens.tolist() + tree.path_tokens(verdict.path[1 : len(path)])
        st.node_exp = []

    # ------------------------------------------------------------------ internals

    def _new_cache(self, need: int) -> KVCache:
        """A cache of at least ``need`` slots (a power of two, at least ``_min_cache``), all layers in one tensor."""
        need = max(need, self._min_cache)
        return KVCache(1, 1 << max(need - 1, 1).bit_length(), num_layers=hf.num_layers(self.model))

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
        st.loops = {}  # fixed to the old cache's buffers (the catch-up forward is replaced on its next use)
        st.prefill = None

    def _chunked_prefill(self, st: _SeqState, prompt: list[int]) -> int:
        """Write the KV of ``prompt`` (the committed tokens before the root) into the empty draft cache
        as chains of at most W = ``prefill_width`` tokens through the sequence's fixed-shape forward
        (``specdec.graphs.prefill_chunks``: the engine's rules; a chunk's padding nodes write slots
        past the tokens prefilled so far, which later chunks, the root's catch-up and the tree's
        levels overwrite before anything reads them). Returns ``len(prompt)``: the tokens now seen."""
        cap = st.cache.capacity
        width = min(self.prefill_width, cap)
        if st.prefill is None or st.prefill.n != width:
            st.prefill = GraphedForward(self.model, st.cache, 1, width, capture=self.cuda_graphs, logits_to_keep=1)
        for start, stop in prefill_chunks(len(prompt), width, cap):
            st.prefill.run([TokenTree.chain(torch.tensor(prompt[start:stop], dtype=torch.int64))], [start])
            self.last_forwards += 1
        st.committed = list(prompt)
        st.cache.lengths = [len(prompt)]
        return len(prompt)

    def _seen(self, st: _SeqState, tokens: list[int]) -> int:
        """How many leading ``tokens`` have their KV in the draft cache (never the root)."""
        known = st.committed if self.reuse_kv else []
        c = min(len(known), len(tokens) - 1)
        if known[:c] != tokens[:c]:  # a different history: keep only the common prefix
            c = next(i for i, (a, b) in enumerate(zip(known, tokens)) if a != b)
        return c

    def _catch_up(self, st: _SeqState, tokens: list[int]) -> torch.Tensor:
        """Run the tokens the draft has not seen (ending with the root) as a causal chain."""
        c = self._seen(st, tokens)
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


def pick_attention(attention: str, model, device: torch.device) -> str:
    """``DraftModelDrafter``'s ``attention`` in effect: ``"auto"`` is ``"tree"`` on a CUDA device when
    ``model``'s config has neither soft-capped attention nor a sliding-window layer (the limits of
    treeattn's kernels, which ``hf.shared_prefix_obstacle`` reads for the cascade too), else
    ``"sdpa"``; ``"sdpa"`` / ``"tree"`` are kept as given."""
    if attention != "auto":
        return attention
    if torch.device(device).type != "cuda":
        return "sdpa"
    return "tree" if hf.shared_prefix_obstacle(model, hf.max_positions(model) or 1 << 30) is None else "sdpa"


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


@dataclass(frozen=True, eq=False)
class _GroupedMaskedState(hf.MaskedState):
    """``hf.MaskedState`` whose attention folds each KV head's query heads into the query rows.

    ``F.scaled_dot_product_attention`` with an explicit mask and ``enable_gqa`` (what
    ``MaskedState`` calls) runs PyTorch's math backend on CUDA: the keys and values of the whole
    cache repeated per query head, the scores materialized, ~8 kernels per layer. Here the m rows of
    the ``group = Hq / Hkv`` query heads of a KV head become ``group * m`` rows of one head (the
    tree-attention kernel's layout), so SDPA sees plain multi-head attention with an additive mask
    (built once per forward, in the query dtype) and can take its fused memory-efficient kernel.
    The same function as ``MaskedState.attend`` up to rounding; sliding-window and soft-capped
    layers (and models split across devices) keep ``MaskedState.attend``. Call ``clear`` whenever
    ``visible`` changed.
    """

    _bias: dict = field(default_factory=dict, repr=False)

    def clear(self) -> None:
        """Forget the additive masks built from ``visible``."""
        self._bias.clear()

    def attend(self, module, query, key, value, scaling, sliding_window, softcap) -> tuple[torch.Tensor, None]:
        batch, heads, m, dim = query.shape
        kv_heads, kv_len = key.shape[1], self.visible.shape[2]
        plain = softcap is None and (sliding_window is None or sliding_window >= kv_len)
        if not plain or heads % kv_heads or query.device != self.visible.device:
            return super().attend(module, query, key, value, scaling, sliding_window, softcap)
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None:
            raise ValueError(f"module: {type(module).__name__} has no layer_idx; cannot address its KV cache")
        k_buf, v_buf = self.cache.write(layer_idx, key, value, self.slots)
        group = heads // kv_heads
        bias = self._bias.get((group, query.dtype))
        if bias is None:  # [B, 1, group * m, kv_len]: row (g, i) is query row i's mask
            vis = self.visible[:, None, None].expand(batch, 1, group, m, kv_len).reshape(batch, 1, group * m, kv_len)
            bias = torch.zeros(vis.shape, dtype=query.dtype, device=query.device).masked_fill_(~vis, -math.inf)
            self._bias[(group, query.dtype)] = bias
        scale = dim**-0.5 if scaling is None else float(scaling)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(batch, kv_heads, group * m, dim), k_buf[:, :, :kv_len], v_buf[:, :, :kv_len],
            attn_mask=bias, scale=scale)  # fmt: skip
        return out.reshape(batch, heads, m, dim).transpose(1, 2), None


class _TreeState:
    """Attention of one fixed-shape draft forward through treeattn's tree kernel (``attention="tree"``).

    The draft's cache is laid out as the kernel expects: the committed prefix at ``[0, prefix_lens)``
    and then ``n`` "tree" slots, each query seeing the prefix and the tree slots its mask words set.
    The prefix length is a device tensor, so the kernel reads only the committed part of the cache
    (split over many blocks) where SDPA under a dense mask (``_GroupedMaskedState``) reads the whole
    capacity in two thread blocks. Two uses:

    - a level of the tree: the prefix is the committed tokens and the root (``base + 1``), the tree
      the ``n = E - 1`` expanded nodes after it, and the forward runs ALL of them as queries (each
      with its ancestors-or-self as words): rows of earlier levels recompute what they wrote before
      (same tokens, positions, ancestors and shapes: the same values), rows of later levels write
      slots their own level overwrites. A forward of E - 1 rows costs what one of K rows does
      (the draft's GEMMs stream weights at either size), and the queries need no placement;
    - the catch-up chain: ``n`` = the chain width, causal words; the chain starts at
      ``prefix_lens``, padding rows after it write the next (expanded) slots, which the levels overwrite.

    Attributes: cache; slots ``[1, n]`` (where this forward's keys / values go); prefix_lens int64
    ``[1]``; words int64 ``[1, n, ceil(n / 64)]``; depth int64 ``[1, n]`` (``TreeMask.depth``, not
    read by the kernel). All updated in place by the loop. Sliding-window and soft-capped layers
    are refused (``attention="sdpa"`` handles them).
    """

    def __init__(self, cache: KVCache, slots, prefix_lens, words, depth) -> None:
        self.cache, self.slots, self.prefix_lens, self.words, self.depth = cache, slots, prefix_lens, words, depth

    def clear(self) -> None:
        """Nothing is cached between forwards (the loop updates the tensors in place)."""

    def attend(self, module, query, key, value, scaling, sliding_window, softcap) -> tuple[torch.Tensor, None]:
        """Write this layer's keys / values at ``slots`` and attend. query ``[1, Hq, n, D]``; returns
        ``([1, n, Hq, D], None)`` as transformers' attention functions do."""
        if softcap is not None or (sliding_window is not None and sliding_window < self.cache.capacity):
            raise ValueError("attention: 'tree' has no sliding-window or soft-capped layers (the draft model has "
                             "them); use attention='sdpa'")  # fmt: skip
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None:
            raise ValueError(f"module: {type(module).__name__} has no layer_idx; cannot address its KV cache")
        k_buf, v_buf = self.cache.write(layer_idx, key, value, self.slots)
        dim = query.shape[-1]
        scale = dim**-0.5 if scaling is None else float(scaling)
        out = tree_attention_op(query, k_buf, v_buf, self.prefix_lens, self.words, self.depth, scale, "auto")
        return out.transpose(1, 2), None


@functools.lru_cache(maxsize=None)
def _compiled_run_state(backend: bool | str):
    """``hf.run_state`` through ``torch.compile`` (True: inductor; or a backend name), fixed shapes:
    one compile per (model, input shapes, cache), shared by every loop of the process."""
    return compile_fixed_shapes(hf.run_state, backend)


class _DeviceLoop(Replayed):
    """One sequence's whole draft step on the device: fixed shapes, no host sync inside.

    ``propose``'s forwards and choices -- the catch-up chain (``chain > 0``: up to ``chain`` tokens
    ending with the root; without it, the root's logits are an input, e.g. after the prompt's
    prefill) and levels 1..D of the tree -- as one function of fixed device buffers (``_body``),
    so that it can be replayed as ONE CUDA graph (``capture=True``; the capture pattern of
    ``specdec.graphs``: warm-up, side stream, private memory pool) or run eagerly on the same
    buffers (``capture=False``: what CPU tests run). The catch-up stage is ``propose``'s
    ``_catch_up`` at fixed shapes (chain tokens at slots and positions ``base - m + 1 .. base``,
    causal over the cache; padding rows write and read the scratch slot S - 1 only). Per level
    d, with R parent rows (the root at d = 1, then the K frontier rows of level d - 1; rows past
    the live ones are dead):

    - the parents' children's log-probabilities (float32; warped as the target's under sampling);
    - ``"topk"``: each live row's top-``w`` children. ``"no_replacement"`` / ``"iid"``: the row's
      distribution goes to ``probs``; how many of its draws each row keeps is allotted first (the
      host's ``_allot``: the ``cap`` best slots ``score + k-th largest log-probability``, stable
      order, ``cap`` from the nodes ``left`` as in the host loop), then ``w`` draws per row
      (``_gumbel_top_k`` / ``_multinomial`` on uniforms drawn by ``load``), of which each row keeps
      that many (a prefix of its draw order; a draw without mass ends it, as on the host);
    - cumulative scores in float64 (exactly the host's ``score[parent] + value``); below the last
      level the next frontier: the K best kept candidates by score (a stable sort over the
      candidates in creation order, i.e. ties to the earlier one, as ``sorted(key=(-score, i))``;
      dropped and dead candidates score -inf and come last);
    - the frontier's ancestor rows over the E expanded nodes (parent's row | own bit), its mask
      over the draft cache (committed prefix ``[0, base)`` + expanded ancestors at ``base + e``),
      and its forward: K tokens at position ``base + d`` writing slots ``base + e``.

    The host loop's early stops (no node kept, no budget left) need no branch here: the next
    levels then keep nothing, and the host ignores them (``run``'s caller replays the stops).
    Layout: the root is expanded index 0 (slot ``base``, written by the catch-up); frontier row r of
    level d is expanded index ``1 + (d - 1) K + r``. The outputs (tokens, values as float64 bits,
    kept flags, frontier choices) are one int64 vector, read by ``run`` with ONE device-to-host
    copy; ``probs`` (sampled proposals) stays on the device. Inputs, updated in place by ``load``:
    the chain (one pinned host-to-device copy) or ``root_logits``, ``base`` (the root's slot),
    ``budget``, the uniforms; the proposal kind, sampling transform and shapes are fixed per
    instance. Attention: ``_GroupedMaskedState`` (explicit masks over the whole cache).
    """

    def __init__(self, model, cache: KVCache, *, topk: int, width: int, depth: int, proposal: str = "topk",
                 sampling=None, chain: int = 0, capture: bool = False, compile: bool | str = False,
                 warmup: int = 2, attention: str = "sdpa") -> None:  # fmt: skip
        # the model forward of one level (and of the catch-up) goes through torch.compile, not the whole
        # body: compiling the loop unrolled (depth x the draft's layers in one graph) took over 7 minutes
        # for the 0.5B at depth 4 on an H100; per forward, every level shares one compile
        super().__init__(model, cache, 1, topk, capture=capture, warmup=warmup, compile=False, n_name="topk")
        self._run_state = _compiled_run_state(compile) if compile else hf.run_state
        for name, val in (("width", width), ("depth", depth)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if not isinstance(chain, int) or isinstance(chain, bool) or not 0 <= chain < cache.capacity:
            raise ValueError(f"chain: expected an int in [0, {cache.capacity}) (0: no catch-up stage), got {chain!r}")
        if proposal not in SAMPLING_PROPOSALS:
            raise ValueError(f"proposal: expected one of {SAMPLING_PROPOSALS}, got {proposal!r}")
        if proposal != "topk" and sampling is None:
            raise ValueError(f"sampling: a {proposal!r} proposal needs the sampling transform, got None")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
        k, w, cap = topk, width, cache.capacity
        self.topk, self.width, self.depth, self.proposal, self.sampling = k, w, depth, proposal, sampling
        self.expanded = e = 1 + k * (depth - 1)  # E
        #: rows of the catch-up stage (0: none); its padding rows write the scratch slot S - 1
        self.chain = chain
        self._room = cap - (1 if chain else 0)  # slots the committed prefix and the E expanded nodes may use
        if e > self._room:
            raise ValueError(f"depth: expected 1 + topk * (depth - 1) <= {self._room} (the cache capacity "
                             f"{cap}{' minus the scratch slot' if chain else ''}), got {e}")
        dev = self.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.base = torch.zeros(1, **i64)
        self.budget = torch.zeros(1, **i64)
        self.root_logits: torch.Tensor | None = None  # [1, V], the draft's logits dtype (first ``load``)
        self.tokens = torch.zeros(1, k, **i64)
        self.positions = torch.zeros(1, k, **i64)
        self.slots = torch.zeros(1, k, **i64)
        self.visible = torch.zeros(1, k, cap, dtype=torch.bool, device=dev)
        self.key_positions = torch.zeros(1, cap, **i64)
        self._exp_depth = torch.tensor([0] + [d for d in range(1, depth) for _ in range(k)], **i64)  # per expanded node
        self.attention = attention
        if attention == "tree" and depth > 1:
            # the levels: all E - 1 expanded nodes after the root as queries (row r = expanded index r + 1),
            # each with its ancestors-or-self over them as words; the root ends the prefix
            self.tree_prefix = torch.zeros(1, **i64)
            self.tree_tokens = torch.zeros(1, e - 1, **i64)
            self.tree_positions = torch.zeros(1, e - 1, **i64)
            self.tree_slots = torch.zeros(1, e - 1, **i64)
            self.words = pack_bits(torch.eye(e - 1, dtype=torch.bool, device=dev))[None]  # [1, E - 1, nw]
            #: per level d, the rows whose logits the level's forward keeps (its K frontier rows)
            self._level_rows = {d: (d - 1) * k + torch.arange(k, **i64) for d in range(1, depth)}
            self.state = _TreeState(cache, self.tree_slots, self.tree_prefix, self.words, self._exp_depth[None, 1:])
        else:
            self.state = _GroupedMaskedState(cache, self.slots, self.positions, self.visible, self.key_positions)
        #: the catch-up through the tree kernel: the chain's padding rows write the slots after the root
        #: (expanded nodes, overwritten by the levels), which must exist: chain <= E + 1
        self._chain_tree = attention == "tree" and chain <= e + 1
        if chain:  # the catch-up stage: its tokens, then their count, in one vector (one host-to-device copy)
            self.chain_in = torch.zeros(chain + 1, **i64)
            self._chain_host = torch.zeros(chain + 1, dtype=torch.int64, pin_memory=dev.type == "cuda")
            self.chain_positions = torch.zeros(1, chain, **i64)
            self.chain_slots = torch.zeros(1, chain, **i64)
            self.chain_visible = torch.zeros(1, chain, cap, dtype=torch.bool, device=dev)
            self._chain_ids = torch.arange(chain, **i64)
            if self._chain_tree:  # causal words: row j sees chain rows 0..j (padding rows included)
                self.chain_prefix = torch.zeros(1, **i64)
                causal = torch.ones(chain, chain, dtype=torch.bool, device=dev).tril()
                self.chain_state = _TreeState(cache, self.chain_slots, self.chain_prefix,
                                              pack_bits(causal)[None], self._chain_ids[None])
            else:
                self.chain_state = _GroupedMaskedState(cache, self.chain_slots, self.chain_positions,
                                                       self.chain_visible, self.key_positions)  # fmt: skip
        vocab = hf.vocab_size(model)
        #: sampled proposals: row e = the distribution expanded node e's children were drawn from;
        #: row E stays zero (nodes never expanded)
        self.probs = torch.zeros(e + 1, vocab, dtype=torch.float32, device=dev) if proposal != "topk" else None
        #: uniforms of the draws, row e for expanded node e (``[E, V]`` Gumbel noise without
        #: replacement, ``[E, w]`` inverse-CDF draws i.i.d.)
        self.noise = None
        if proposal != "topk":
            self.noise = torch.zeros(e, vocab if proposal == "no_replacement" else w, dtype=torch.float32, device=dev)
        # constants
        self._slot_ids = torch.arange(cap, **i64)
        self._exp_ids = torch.arange(e, **i64)
        self._zero_score = torch.zeros(1, dtype=torch.float64, device=dev)
        self._root_anc = torch.zeros(1, e, dtype=torch.bool, device=dev)
        self._root_anc[0, 0] = True
        self._root_live = torch.ones(1, dtype=torch.bool, device=dev)
        self._rank = torch.arange(max(k, w) * k, **i64)  # slot ranks, row and draw indices
        self._own: dict[int, torch.Tensor] = {}  # level d -> bool [K, E]: row r's own expanded index
        for d in range(1, depth):
            own = torch.zeros(k, e, dtype=torch.bool)
            own[torch.arange(k), 1 + (d - 1) * k + torch.arange(k)] = True
            self._own[d] = own.to(dev)

    def expanded_index(self, level: int, row: int) -> int:
        """Expanded index (slot ``base + index``) of frontier row ``row`` chosen at ``level``."""
        return 1 + (level - 1) * self.topk + row

    def _rows(self, level: int) -> slice:
        """Expanded indices of the parents of ``level`` (the root, then a frontier of K)."""
        return slice(0, 1) if level == 1 else slice(1 + (level - 2) * self.topk, 1 + (level - 1) * self.topk)

    def load(self, root_logits: torch.Tensor | None, base: int, budget: int = 0,
             generator: torch.Generator | None = None, chain: list[int] | None = None) -> None:  # fmt: skip
        """Set the inputs in place: the root's slot and the node budget (host ints); with a catch-up
        stage the ``chain`` of tokens it runs (1 to ``self.chain`` ids ending with the root, at slots
        up to ``base``), else the root's logits ``[1, V]`` (device); for sampled proposals fresh
        uniforms from ``generator`` (None: torch's default generator of the draft's device), drawn
        on the generator's device. Callers read the previous outputs (``run`` does) first."""
        if not 0 <= base or base + self.expanded > self._room:
            raise ValueError(f"base: expected 0 <= base <= {self._room - self.expanded} (cache capacity "
                             f"minus {self.cache.capacity - self._room + self.expanded} slots), got {base}")
        if self.chain:
            if chain is None or not 1 <= len(chain) <= min(self.chain, base + 1):
                got = None if chain is None else f"{len(chain)} tokens"
                raise ValueError(f"chain: expected 1 to {min(self.chain, base + 1)} tokens (the loop's catch-up stage), "
                                 f"got {got}")  # fmt: skip
            staged = list(chain) + [0] * (self.chain - len(chain)) + [len(chain)]
            self._chain_host.copy_(torch.tensor(staged, dtype=torch.int64))
            self.chain_in.copy_(self._chain_host, non_blocking=self._chain_host.is_pinned())
        elif root_logits is None:
            raise ValueError("root_logits: expected the root's logits [1, V] (the loop has no catch-up stage), got None")
        elif self.root_logits is None:
            self.root_logits = root_logits.detach().to(self.device).clone()
        else:
            self.root_logits.copy_(root_logits)
        self.base.fill_(base)
        self.budget.fill_(budget)
        if self.noise is not None:
            dev = generator.device if generator is not None else self.device
            self.noise.copy_(torch.rand(self.noise.shape, generator=generator, device=dev))

    def run(self, root_logits: torch.Tensor | None, base: int, budget: int = 0,
            generator: torch.Generator | None = None, chain: list[int] | None = None) -> list[tuple]:  # fmt: skip
        """``load``, forward, one device-to-host copy; per level d = 1..D: ``(tokens, values, kept, chosen)``.

        ``tokens`` / ``values`` / ``kept`` (``list[list[int | float | bool]]``): per parent row (R of them, dead ones included), its ``w``
        children (ids, float32 draft log-probabilities as floats, whether the child is a node: top-k
        children all are, for live rows). ``chosen``: below the last level, the next frontier (K rows)
        as indices into that level's candidates (row-major ``q * w + k``), best first; its first
        ``min(K, kept children)`` are the live rows. None at the last level.
        """
        self.load(root_logits, base, budget, generator, chain)
        out, _ = self.forward()
        host = out.cpu()  # the proposal's one host sync
        w, k = self.width, self.topk
        n = w * self.expanded
        rec, vals = host.tolist(), host[n : 2 * n].view(torch.float64).tolist()
        levels = []
        at = 0
        for d in range(1, self.depth + 1):
            rows = 1 if d == 1 else k
            cut = lambda xs, off=0: [xs[off + at + q * w : off + at + (q + 1) * w] for q in range(rows)]  # noqa: E731
            chosen = None if d == self.depth else rec[3 * n + (d - 1) * k : 3 * n + d * k]
            kept = [[bool(x) for x in row] for row in cut(rec, 2 * n)]
            levels.append((cut(rec), cut(vals), kept, chosen))
            at += rows * w
        return levels

    def _catch_up(self) -> torch.Tensor:
        """The catch-up stage: the chain's m tokens at slots / positions ``base - m + 1 .. base``, each
        attending causally to the cache; padding rows write and read the scratch slot S - 1 only.
        Returns the root's logits ``[1, V]`` (the chain's last row)."""
        wc, cap = self.chain, self.cache.capacity
        count = self.chain_in[wc:]  # [1]: m
        live = self._chain_ids < count
        if self._chain_tree:  # contiguous from the chain's start; padding rows write the slots after the root
            start = self.base - count + 1
            slots = start + self._chain_ids
            self.chain_prefix.copy_(start)
        else:
            slots = torch.where(live, self.base - count + 1 + self._chain_ids, cap - 1)
            self.chain_visible[0].copy_(torch.where(live[:, None], self._slot_ids[None] <= slots[:, None],
                                                    self._slot_ids[None] == cap - 1))  # fmt: skip
        self.chain_slots[0].copy_(slots)
        self.chain_positions[0].copy_(torch.where(live, slots, 0))
        self.chain_state.clear()
        logits = self._run_state(self.model, self.chain_in[None, :wc], self.chain_positions, self.chain_state)[0]
        return logits.to(self.device).index_select(0, count - 1)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 log-probabilities of the children: the draft's, warped as the target's under sampling."""
        x = logits.float()
        if self.sampling is not None:
            x = warp_logits(x, self.sampling)
        return torch.log_softmax(x, dim=-1)

    def _children(self, d: int, logq: torch.Tensor, score: torch.Tensor, live: torch.Tensor,
                  left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Level d's children of R rows: ``(token ids [R, w], values [R, w] float32, kept [R, w])``."""
        w = self.width
        if self.proposal == "topk":
            vals, idx = torch.topk(logq, w, dim=-1)
            return idx, vals, live[:, None].expand(idx.shape)
        rows = logq.shape[0]
        self.probs[self._rows(d)].copy_(logq.exp())
        # How many draws each row keeps: the host's _allot (the ``cap`` best slots known before drawing).
        ranked = torch.topk(logq, w, dim=-1).values
        slot = torch.where(live[:, None] & (ranked > -math.inf), score[:, None] + ranked.double(), -math.inf).flatten()
        after = self.depth - d  # levels that may follow this one
        cap = left - torch.clamp(torch.div(left * after, after + 1, rounding_mode="floor"),
                                 max=after * self.topk * w)  # fmt: skip
        order = torch.sort(slot, descending=True, stable=True).indices
        take = (self._rank[: rows * w] < cap) & (slot[order] > -math.inf)
        counts = torch.zeros_like(take).scatter(0, order, take).view(rows, w).sum(dim=1)  # [R]
        noise = self.noise[self._rows(d)]
        if self.proposal == "no_replacement":
            idx = _gumbel_top_k(logq, w, noise)
        else:
            idx = _multinomial(logq.exp(), w, noise)
        vals = logq.gather(1, idx)
        # a row keeps its first ``counts`` draws, up to a draw without mass (as the host loop)
        has_mass = (vals > -math.inf).to(torch.int64).cummin(dim=1).values.bool()
        kept = (self._rank[:w][None, :] < counts[:, None]) & has_mass
        return idx, vals, kept

    def _body(self) -> tuple[torch.Tensor, None]:
        k, w, cap = self.topk, self.width, self.cache.capacity
        base = self.base
        tree_slots = base + self._exp_ids  # [E]: slot of every expanded node
        tree = self.attention == "tree"
        if tree and self.depth > 1:  # every level's forward: the E - 1 expanded nodes at fixed slots / positions
            self.tree_prefix.copy_(base + 1)
            self.tree_slots[0].copy_(tree_slots[1:])
            self.tree_positions[0].copy_(base + self._exp_depth[1:])
        if not tree:
            keypos = self.key_positions[0]
            keypos.copy_(self._slot_ids)
            keypos.index_copy_(0, tree_slots, base + self._exp_depth)
            prefix = self._slot_ids < base  # [S]: the committed tokens
        logits = self._catch_up() if self.chain else self.root_logits  # [1, V]: the root's
        score, anc = self._zero_score, self._root_anc
        live, left = self._root_live, self.budget
        toks, vals, keeps, sels = [], [], [], []
        for d in range(1, self.depth + 1):
            logq = self._log_probs(logits)  # [R, V]
            idx, v, kept = self._children(d, logq, score, live, left)  # [R, w] each
            toks.append(idx.flatten())
            vals.append(v.double().flatten())
            keeps.append(kept.flatten().to(torch.int64))
            if d == self.depth:
                break
            rows = logq.shape[0]
            cand = torch.where(kept, score[:, None] + v.double(), -math.inf).flatten()
            ctok = idx.flatten()
            if cand.numel() < k:  # level 1 with w < K (vocabulary smaller than K): dead candidates
                cand = torch.cat([cand, cand.new_full((k - cand.numel(),), -math.inf)])
                ctok = torch.cat([ctok, ctok.new_zeros(k - ctok.numel())])
            order = torch.sort(cand, descending=True, stable=True).indices[:k]  # [K]: the next frontier
            sels.append(order)
            n_kept = kept.sum()
            left = left - n_kept
            live = self._rank[:k] < n_kept  # dead rows: fewer kept candidates than K
            score = cand[order]
            anc = anc[torch.clamp(order // w, max=rows - 1)] | self._own[d]  # [K, E] ancestors-or-self
            if tree:  # this level's rows: their tokens and ancestors-or-self (the root, in the prefix, dropped)
                lo = (d - 1) * k
                self.tree_tokens[0, lo : lo + k].copy_(ctok[order])
                self.words[0, lo : lo + k].copy_(pack_bits(anc[:, 1:]))
                logits = self._run_state(self.model, self.tree_tokens, self.tree_positions, self.state,
                                         logits_to_keep=self._level_rows[d])  # fmt: skip
            else:
                self.tokens[0].copy_(ctok[order])
                self.positions[0].copy_((base + d).expand(k))
                self.slots[0].copy_(tree_slots[1 + (d - 1) * k : 1 + d * k])
                vis = self.visible[0]
                vis.copy_(prefix.expand(k, cap))
                vis.index_copy_(1, tree_slots, anc)
                self.state.clear()
                logits = self._run_state(self.model, self.tokens, self.positions, self.state)
            logits = logits[0].to(self.device)  # [K, V]
        out = torch.cat([*toks, *[x.view(torch.int64) for x in vals], *keeps, *sels])
        return out, None

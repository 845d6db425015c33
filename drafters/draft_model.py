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

**Where it runs.** Steps 1 (after the first step of a sequence) and 2 and the choice
of nodes run on the device (``DeviceLoop``, the default for every proposal kind): fixed ``topk``
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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from drafters import draft_sampling
from drafters._build import NodePool, best_first as _best_first, expanded_path, make_tree, root_only
from drafters.draft_model_loop import ATTENTIONS, DeviceLoop, layer_wise
from drafters.draft_sampling import SAMPLING_PROPOSALS
from specdec.drafting import BaseDrafter, DraftContext
from specdec import hf
from specdec.graphs import (DEFAULT_PREFILL_WIDTH, GraphedForward, GraphedMaskedForward, Replayed, prefill_chunks,
                            replay_modes)
from specdec.kv import KVCache
from specdec.sampling import warp_logits
from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = ["DraftModelDrafter", "SAMPLING_PROPOSALS", "ATTENTIONS", "pick_attention"]


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


def _build_seconds(st: _SeqState) -> float:
    """The one-time seconds (first runs, captures) of a sequence's fixed-shape forwards so far."""
    forwards = [st.fwd, st.prefill, *st.loops.values()]
    return sum(f.build_s for f in forwards if isinstance(f, Replayed))


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
        compile: run the device loop's forwards (or those fixed-shape forwards) through
            ``torch.compile`` before their capture (needs static shapes): True (inductor) or a backend
            name compiles each forward of the draft as one function; ``"layers"`` (or
            ``"layers:BACKEND"``; the device loop with ``attention="tree"`` only) compiles one forward
            per decoder-layer kind shared by all its layers, as the engine's ``compile=True`` does for
            the target (a fraction of the compile time; fused kernels per layer). Default False.
        device_loop: run each proposal in ``DeviceLoop`` (default: catch-up chain and every depth
            in one CUDA graph, one host sync per step); False = the host-driven loop (one forward,
            masks built on the host and one host sync per depth), kept as the reference the device
            loop is tested against.
        prefill_width: with the device loop and static shapes, a sequence's first proposal writes the
            prompt's KV (all but the root) in chunks of this many tokens through one fixed-shape
            forward (``specdec.graphs.GraphedForward``, captured like the loop; the engine's
            chunked prefill), and the root then runs as the loop's catch-up, so the step needs no
            eager forward of the draft. Default ``DEFAULT_PREFILL_WIDTH`` (256; docs/ENGINE.md, "Draft
            model"); 0 or None = one eager causal forward over the prompt (what dynamic shapes always use).
        attention: how the device loop's forwards attend: ``"sdpa"`` (SDPA under a dense mask over
            the whole draft cache, every layer kind), ``"tree"`` (treeattn's kernel: the committed
            prefix read up to its length, split over many thread blocks, the expanded nodes through
            ancestor bit words, every level's forward over all of them; no sliding-window or
            soft-capped layers) or ``"auto"`` (default): ``"tree"`` on a CUDA device when the
            draft's config allows it, else ``"sdpa"`` (on a CPU a forward's cost grows with its
            rows, and a tree level runs ``topk * (depth - 1)`` of them; docs/ENGINE.md, "Draft model").
            The host-driven loop always uses SDPA.

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
        #: seconds its proposals spent on first runs and captures of its forwards (the ``Drafter``
        #: protocol's running total: the budget rule leaves those steps out of its costs)
        self.captured_s = 0.0
        #: the least capacity of a new draft cache (``warmup`` raises it to what its requests need)
        self._min_cache = 256
        self.device_loop = device_loop
        #: the device loop's attention in effect ("auto" resolved)
        self.attention = pick_attention(attention, draft_model, self.device)
        if layer_wise(self.compile) and not (device_loop and self.attention == "tree"):
            raise ValueError(f"compile: {self.compile!r} (each decoder layer compiled) needs the device loop with "
                             f"attention='tree', got device_loop={device_loop!r}, attention={self.attention!r}")  # fmt: skip
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

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_len: int | None = None, log=None,
               tree_sizes: Sequence[int] = ()) -> None:  # fmt: skip
        """Size the draft caches for requests of up to ``max_len`` tokens per sequence (prompt and new
        tokens; called by ``SpecDecoder.warmup``): a cache that grows mid-run drops its device loops,
        so their captures (and, with ``compile``, the level forward's compile for the new capacity)
        would come back inside a timed call. With static shapes and ``tree_sizes`` (the budgets the
        engine will ask with), each sequence slot of up to ``max(batch_sizes)`` also makes, on a dummy
        prompt of up to 64 tokens, a first and a later greedy proposal at each size: the chunked
        prefill and the device loops a call's steps replay (sampled calls make their own loops on
        first use). The next ``reset`` starts every slot afresh, keeping them. ``log`` is not used."""
        if max_len is not None:
            self._min_cache = max(self._min_cache, max_len + self.topk * self.depth + 2)
            for b, st in list(self._states.items()):
                if st.cache.capacity < self._min_cache:
                    self._states[b] = _SeqState(self._new_cache(self._min_cache), [], [])
        sizes = [n for n in tree_sizes if n > 0]
        prompt = min(64, (max_len or 0) - max(sizes, default=0) - 2)
        if not (self.static_shapes and sizes and prompt >= 2):
            return
        rows = max(batch_sizes)
        tokens = torch.zeros(prompt, dtype=torch.int64)
        self.reset([tokens.clone() for _ in range(rows)])
        for b in range(rows):
            for n in sizes:
                for seen in (tokens, torch.cat([tokens, tokens.new_zeros(1)])):  # a first step, then a later one
                    self.propose(DraftContext(seen, n, b))

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        st = self._states.get(context.seq)
        before = 0.0 if st is None else _build_seconds(st)
        try:
            return self._propose(context)
        finally:  # the Drafter protocol's running total of captures (and their compiles) inside proposals
            st = self._states.get(context.seq)
            self.captured_s += max(0.0, (0.0 if st is None else _build_seconds(st)) - before)

    def _propose(self, context: DraftContext) -> TokenTree:
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
                        proposal, generator) -> tuple[NodePool, "DeviceLoop"]:  # fmt: skip
        """Every level in the sequence's ``DeviceLoop`` (one host sync), then the same node pool as
        ``_grow_on_host`` (same creation order, scores, expanded nodes and early stops). ``chain``:
        the catch-up tokens the loop runs first (else ``logits`` are the root's, from ``_catch_up``)."""
        chain_width = self.static_width if chain is not None else 0
        key = (frontier_width, width, depth, proposal, sampling, chain_width)
        loop = st.loops.get(key)
        if loop is None:
            loop = st.loops[key] = DeviceLoop(self.model, st.cache, topk=frontier_width, width=width, depth=depth,
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
            counts = draft_sampling._allot([pool.score[i] for i in frontier], torch.topk(logq, width, dim=-1).values.tolist(), cap)
            if proposal == "no_replacement":
                idx = draft_sampling._gumbel_top_k(logq, width, generator)  # sequential draws without replacement, in order
            else:  # iid
                idx = draft_sampling._multinomial(logq.exp(), width, generator)
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

"""The draft-model drafter's device loop: a whole proposal (catch-up chain and every depth) on the device.

``DeviceLoop`` runs one proposal's forwards, top-k / draws, scores and next frontiers in device
tensors with fixed shapes, one device-to-host copy at the end; captured as one CUDA graph per
sequence and shape on CUDA. Its attention: ``GroupedMaskedState`` (explicit masks, query heads
folded into rows) or ``TreeState`` (the tree-attention kernel over the draft cache); with the
layer-wise compile (``compile="layers"``) the same kernel through ``hf.ForwardState``, whose
``layer_backend`` runs each decoder layer through one compiled forward (``hf.compile_layers``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from drafters import draft_sampling
from drafters.draft_sampling import SAMPLING_PROPOSALS
from drafters.selection import best_k, row_topk
from specdec import hf
from specdec.attention import MaskedState, TreeState
from specdec.graphs import LAYERS, Replayed, compile_fixed_shapes, compile_plan
from specdec.kv import KVCache
from specdec.sampling import warp_logits
from treeattn.layout import TreeMask, pack_bits

__all__ = ["ATTENTIONS", "DeviceLoop", "GroupedMaskedState", "layer_wise"]

#: How the device loop's draft forwards attend: SDPA under a dense mask over the whole cache, or treeattn's kernel.
ATTENTIONS = ("sdpa", "tree")

@dataclass(frozen=True, eq=False)
class GroupedMaskedState(MaskedState):
    """``specdec.attention.MaskedState`` whose attention folds each KV head's query heads into the query rows.

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


def layer_wise(compile: bool | str) -> bool:
    """Whether a draft ``compile=`` option is the layer-wise compile (``"layers"`` / ``"layers:BACKEND"``;
    for the draft, True is the per-forward compile)."""
    return isinstance(compile, str) and (compile == LAYERS or compile.startswith(LAYERS + ":"))


@functools.lru_cache(maxsize=None)
def _compiled_run_state(backend: bool | str):
    """``hf.run_state`` through ``torch.compile`` (True: inductor; or a backend name), fixed shapes:
    one compile per (model, input shapes, cache), shared by every loop of the process."""
    return compile_fixed_shapes(hf.run_state, backend)


class DeviceLoop(Replayed):
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
    instance. Attention: ``GroupedMaskedState`` (explicit masks over the whole cache) or, with
    ``attention="tree"``, treeattn's kernel (``TreeState``).

    ``compile``: False; a torch.compile backend (True: inductor) for each forward of the draft as one
    compiled function (``hf.run_state`` through ``compile_fixed_shapes``); or ``"layers"`` /
    ``"layers:BACKEND"`` (needs ``attention="tree"``): every decoder layer through one forward
    compiled for all layers of its kind, the target's layer-wise compile (``hf.compile_layers``; its
    compiled code is shared with any model of the same layer class, one variant per shape). The
    catch-up and the levels then attend through ``hf.ForwardState`` (the tree kernel, as ``TreeState``),
    which hands each layer its ``LayerState``; a catch-up chain too long for the tree layout stays
    uncompiled.
    """

    def __init__(self, model, cache: KVCache, *, topk: int, width: int, depth: int, proposal: str = "topk",
                 sampling=None, chain: int = 0, capture: bool = False, compile: bool | str = False,
                 warmup: int = 2, attention: str = "sdpa") -> None:  # fmt: skip
        # the model forward of one level (and of the catch-up) goes through torch.compile, not the whole
        # body: compiling the loop unrolled (depth x the draft's layers in one graph) took over 7 minutes
        # for the 0.5B at depth 4 on an H100; per forward, every level shares one compile
        per_layer = layer_wise(compile)
        if per_layer and attention != "tree":
            raise ValueError(f"compile: {compile!r} (each decoder layer compiled) needs attention='tree', "
                             f"got attention={attention!r}")  # fmt: skip
        super().__init__(model, cache, 1, topk, capture=capture, warmup=warmup, compile=compile if per_layer else False,
                         n_name="topk")  # fmt: skip
        #: the layers' torch.compile backend with the layer-wise compile, else None
        self.layer_backend = compile_plan(compile)[0] if per_layer else None
        self._run_state = _compiled_run_state(compile) if compile and not per_layer else hf.run_state
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
            self.state = self._tree_state(self.tree_slots, self.tree_positions, self.tree_prefix, self.words,
                                          self._exp_depth[None, 1:])  # fmt: skip
        else:
            self.state = GroupedMaskedState(cache, self.slots, self.positions, self.visible, self.key_positions)
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
                self.chain_state = self._tree_state(self.chain_slots, self.chain_positions, self.chain_prefix,
                                                    pack_bits(causal)[None], self._chain_ids[None])  # fmt: skip
            else:
                self.chain_state = GroupedMaskedState(cache, self.chain_slots, self.chain_positions,
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

    def _tree_state(self, slots, positions, prefix_lens, words, depth):
        """The attention state of a forward through the tree kernel (all tensors updated in place):
        ``TreeState``, or with the layer-wise compile the ``hf.ForwardState`` that runs the same kernel
        and hands each compiled layer its buffers."""
        if self.layer_backend is None:
            return TreeState(self.cache, slots, prefix_lens, words, depth)
        return hf.ForwardState(self.cache, slots, positions, TreeMask(words, depth), prefix_lens,
                               layer_backend=self.layer_backend)  # fmt: skip

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
        if not self._chain_tree:  # the mask changed (the tree states read their tensors as they are)
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
            vals, idx = row_topk(logq, w)
            return idx, vals, live[:, None].expand(idx.shape)
        rows = logq.shape[0]
        self.probs[self._rows(d)].copy_(logq.exp())
        # How many draws each row keeps: the host's _allot (the ``cap`` best slots known before drawing).
        ranked = row_topk(logq, w)[0]
        slot = torch.where(live[:, None] & (ranked > -math.inf), score[:, None] + ranked.double(), -math.inf).flatten()
        after = self.depth - d  # levels that may follow this one
        cap = left - torch.clamp(torch.div(left * after, after + 1, rounding_mode="floor"),
                                 max=after * self.topk * w)  # fmt: skip
        order = torch.sort(slot, descending=True, stable=True).indices
        take = (self._rank[: rows * w] < cap) & (slot[order] > -math.inf)
        counts = torch.zeros_like(take).scatter(0, order, take).view(rows, w).sum(dim=1)  # [R]
        noise = self.noise[self._rows(d)]
        if self.proposal == "no_replacement":
            idx = draft_sampling._gumbel_top_k(logq, w, noise)
        else:
            idx = draft_sampling._multinomial(logq.exp(), w, noise)
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
            order = best_k(cand, k)  # [K]: the next frontier (stable: ties to the earlier candidate)
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

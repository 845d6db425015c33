"""EAGLE-style feature-level drafting: a one-layer head on the target's own hidden states.

**The head** (``EagleHead``, EAGLE-1's architecture). Write ``t_p`` for the token at position p and
``f_p`` for the target's final hidden state there (the LM head's input, after the final norm; the
target turns ``f_p`` into the distribution of ``t_{p+1}``). The head reads the *pair* of the token
at p and the feature before it::

    x_p   = fc(concat(embed(t_p), f_{p-1}))            fc: Linear(2H -> H), trained
    y_p   = decoder_layer(x_p | the pairs up to p)      one layer of the target's own architecture
    logits of t_{p+1} = lm_head(y_p)                    the target's frozen LM head

and ``y_p`` is trained to be ``f_p`` (``drafters.eagle_train``). So the head at position p mirrors
the target at p one feature late: it sees the target's feature up to p - 1 plus the token at p
and predicts the target's next feature. Positions the head drafted itself have no target feature:
there the pair reads the head's own prediction ``y_{p-1}`` instead (EAGLE's autoregression over
features), which is what the unrolled "training-time test" of ``eagle_train`` prepares it for.

- The decoder layer is built by transformers from a copy of the target's text config (the class of
  the target's own decoder layers, ``layer_idx=0``, full attention); no modeling code is copied.
  Its attention runs through a registered attention function (``ATTENTION_NAME``) that hands each
  call to the ``specdec.hf.MaskedState`` (drafting: the head's KV cache + an explicit tree mask)
  or training state passed in the call, else behaves as SDPA (causal).
- **No final norm**: as in EAGLE-1 the layer's output (the residual stream) is the predicted
  feature itself and goes straight into the target's LM head, so it is regressed on ``f_p`` in the
  space the LM head reads. (EAGLE-1 also drops the layer's input norm; here the stock layer keeps
  its ``input_layernorm``, a trained RMSNorm after ``fc``: harmless, and no module surgery.)
- The target's input embedding, rotary embedding and LM head are used frozen and never stored:
  ``eagle_head.safetensors`` holds only ``fc.*`` and ``layer.*`` (float32), next to
  ``eagle_config.json`` (hidden size, vocabulary, the target's architecture / model type / layer
  count / decoder-layer class, training notes). Loading checks them against the target.

**The drafter** (``EagleDrafter``, EAGLE-2's dynamic tree). Per sequence the head keeps its own
KV cache (one layer: keys / values of the pairs it has seen, ``specdec.KVCache``). Per step, with
root r = the last committed token at position L - 1:

1. **Catch up**: one causal forward over the pairs the cache lacks, ending with the root's pair
   ``(f_{L-2}, r)``; its output ``y_{L-1}`` gives the root's children. Features come from the
   engine (``DraftContext.hidden``) where it has them, else from the head's own predictions kept
   from the last step; a pair with neither is skipped (the head simply never attends to it).
2. **Expand, one forward per depth**: the ``topk`` candidates of best cumulative draft
   log-probability at depth d run as one forward of ``topk`` queries (pair = their token and their
   parent's output feature), attending to the committed pairs and, through an explicit tree mask,
   to their expanded ancestors (written into the cache right after the committed pairs, root
   first). Each expanded node contributes its top-``w`` children.
3. **Re-rank**: the best ``tree_size`` candidates by cumulative draft log-probability
   (``drafters._build.best_first``: ancestor-closed). Children are deterministic (``"topk"``), so
   stochastic verification stays lossless without ``draft_probs``.
4. **Commit** (``update``): the accepted path's expanded nodes keep their KV (``KVCache.commit``);
   the last one's output feature is kept for the next step's catch-up.

Cost per step: ``depth`` head forwards (one layer + the LM head on at most ``topk`` rows each) and
one host sync per depth (the top-k). The forwards are eager today; with ``static_shapes`` they
already have fixed shapes, ready for a CUDA-graph capture like the draft model's.

What the engine provides today (``specdec.drafting``) is **one** feature per step: ``f_{L-2}``,
the target's hidden state that predicted the root. So the pairs of the prompt are skipped (the
first step attends to the root's pair only), the accepted drafted tokens keep the pairs the head
computed from its own predicted features, an accepted leaf (never expanded) gets its parent's
predicted feature, and the root's pair always gets the target's real feature. That is a degraded
EAGLE catch-up; verification -- and so greedy equality and lossless sampling -- does not depend on
it. The full catch-up needs the target's features of *every* committed token: ``propose`` already
accepts ``DraftContext.hidden`` of shape ``[m, H]`` = the features at positions
``L - 1 - m .. L - 2`` (e.g. the whole prompt's at the first step, the accepted path's later) and
then recomputes those pairs with the real features.
"""

from __future__ import annotations

import bisect
import copy
import inspect
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafters._build import NodePool, best_first, make_tree, root_only
from specdec import hf
from specdec.drafting import BaseDrafter, DraftContext
from specdec.kv import KVCache
from specdec.sampling import warp_logits
from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = [
    "ATTENTION_NAME",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "EagleConfig",
    "EagleDrafter",
    "EagleHead",
    "TargetParts",
]

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "eagle_head.safetensors"
#: transformers attention-registry name of the head's attention (see ``_head_attention``).
ATTENTION_NAME = "specdec_eagle_head"


# ----------------------------------------------------------------------------------------------
# the target's frozen parts


def _decoder_layer_class(target) -> type:
    """The class of the target's decoder layers (the first module with ``self_attn`` named ``*DecoderLayer``)."""
    for module in target.modules():
        if type(module).__name__.endswith("DecoderLayer") and hasattr(module, "self_attn"):
            return type(module)
    raise ValueError(f"target: expected a transformers causal LM with *DecoderLayer modules, "
                     f"got {type(target).__name__}")


@dataclass(frozen=True, eq=False)
class TargetParts:
    """The target's frozen modules the head uses (never stored with it).

    Attributes:
        embed: input embedding (token ids ``[..]`` -> ``[.., H]``).
        lm_head: output embedding (``[.., H]`` -> ``[.., V]``).
        rotary: the target's rotary embedding module (``(x, position_ids) -> (cos, sin)``).
        rope_layer_type: passed as ``layer_type`` to rotary modules that take one (Gemma 3), else None.
    """

    embed: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    rope_layer_type: str | None = None

    @classmethod
    def of(cls, target) -> "TargetParts":
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or lm_head is None or getattr(lm_head, "weight", None) is None:
            raise ValueError(f"target: expected a causal LM with input and output embeddings, "
                             f"got {type(target).__name__}")
        rotary = None
        for module in target.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                rotary = module
                break
        if rotary is None:
            raise ValueError(f"target: expected a model with a rotary position embedding, got {type(target).__name__}")
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        return cls(embed, lm_head, rotary, "full_attention" if takes_type else None)

    def position_embeddings(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for int64 ``positions [B, m]`` in ``x``'s dtype."""
        if self.rope_layer_type is not None:
            return self.rotary(x, positions, self.rope_layer_type)
        return self.rotary(x, positions)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's LM head on ``features [.., H]`` (cast to its dtype) -> ``[.., V]``."""
        return self.lm_head(features.to(self.lm_head.weight.dtype))


def _head_attention(module, query, key, value, attention_mask, **kwargs):
    """The head layer's attention: the call's state (``specdec_state=``) attends, else plain SDPA."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    state = kwargs.pop(hf.STATE_KWARG, None)
    if state is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    return state.attend(module, query, key, value, kwargs.get("scaling"), kwargs.get("sliding_window"),
                        kwargs.get("softcap"))  # fmt: skip


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _head_attention)


# ----------------------------------------------------------------------------------------------
# the head


@dataclass(frozen=True)
class EagleConfig:
    """What a head is made for; saved in ``eagle_config.json`` and checked against the target.

    Attributes:
        hidden_size: the target's hidden size H.
        vocab_size: rows of the target's LM head V.
        architecture: the target's class name (e.g. ``Qwen2ForCausalLM``).
        model_type: the target's ``config.model_type``.
        num_target_layers: the target's decoder layers (heads learn one model's features).
        layer_class: the decoder-layer class the head's layer is built from.
    """

    hidden_size: int
    vocab_size: int
    architecture: str
    model_type: str
    num_target_layers: int
    layer_class: str

    @classmethod
    def from_target(cls, target) -> "EagleConfig":
        text = target.config.get_text_config()
        return cls(
            hidden_size=int(text.hidden_size),
            vocab_size=hf.vocab_size(target),
            architecture=type(target).__name__,
            model_type=str(text.model_type),
            num_target_layers=int(text.num_hidden_layers),
            layer_class=_decoder_layer_class(target).__name__,
        )

    def check(self, target, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` unless this head fits ``target``."""
        want = EagleConfig.from_target(target)
        for f in fields(self):
            got, expected = getattr(self, f.name), getattr(want, f.name)
            if got != expected:
                raise ValueError(f"{name}: expected a head for the target's {f.name} = {expected!r}, got {got!r} "
                                 "(the head was made for another model)")  # fmt: skip


class EagleHead(nn.Module):
    """EAGLE-1 draft head: ``fc`` (2H -> H) and one decoder layer of the target's architecture.

    Args:
        target: the target causal LM; only its config and decoder-layer class are read here (the
            frozen embedding / rotary / LM head are passed to ``forward`` as ``TargetParts``).

    Parameters start from PyTorch's default initialization (float32, CPU); ``.to()`` as needed.
    """

    def __init__(self, target) -> None:
        super().__init__()
        self.config = EagleConfig.from_target(target)
        cfg = copy.deepcopy(target.config.get_text_config())
        if getattr(cfg, "layer_types", None):  # the head's one layer always attends to everything
            cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
        _register_attention()
        cfg._attn_implementation = ATTENTION_NAME
        self.layer_config = cfg
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = _decoder_layer_class(target)(cfg, layer_idx=0)
        self.meta: dict[str, Any] = {}

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, parts: TargetParts, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                state: Any = None) -> torch.Tensor:  # fmt: skip
        """Predicted features of the pairs ``(features[b, i], input_ids[b, i])``.

        Args:
            parts: the target's frozen modules.
            input_ids: int64 ``[B, m]``, the token of each pair (``t_p``).
            features: float ``[B, m, H]`` (any dtype), the feature before it (``f_{p-1}`` or a
                predicted one).
            positions: int64 ``[B, m]``, the pairs' positions p (rotary embedding).
            state: None = causal self-attention over the m pairs (SDPA); else an object with
                ``attend(module, query, key, value, scaling, sliding_window, softcap)`` (e.g.
                ``specdec.hf.MaskedState`` over the head's KV cache), handed every attention call.

        Returns:
            ``[B, m, H]`` in the head's dtype: the predicted ``f_p`` (the LM head's input).
        """
        w = self.fc.weight
        emb = parts.embed(input_ids.to(parts.embed.weight.device))
        x = self.fc(torch.cat([emb.to(w.dtype), features.to(w.dtype)], dim=-1))
        pe = parts.position_embeddings(x, positions.to(x.device))
        extra = {} if state is None else {hf.STATE_KWARG: state}
        out = self.layer(x, attention_mask=None, position_ids=positions.to(x.device), position_embeddings=pe, **extra)
        return out[0] if isinstance(out, tuple) else out

    def save(self, out_dir: str | os.PathLike[str], **meta: Any) -> Path:
        """Write ``eagle_head.safetensors`` (float32, ``fc.*`` and ``layer.*``) and ``eagle_config.json``."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        doc = {**asdict(self.config), "head": "eagle-1: fc(2H -> H) + 1 decoder layer, no final norm; the target's "
               "embedding, rotary embedding and LM head are used frozen and not stored", **meta}  # fmt: skip
        (out / CONFIG_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], target, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None, name: str = "path") -> "EagleHead":  # fmt: skip
        """Load a head saved by :meth:`save` for ``target`` (``path``: the directory).

        Raises ``ValueError`` naming ``name`` when a file is missing or the head was made for a
        model of another hidden size, vocabulary, architecture or depth.
        """
        from safetensors.torch import load_file

        p = Path(path)
        cfg_file, weights = p / CONFIG_NAME, p / WEIGHTS_NAME
        if not cfg_file.is_file() or not weights.is_file():
            raise ValueError(f"{name}: expected a directory with {CONFIG_NAME} and {WEIGHTS_NAME}, got {str(p)!r}")
        doc = json.loads(cfg_file.read_text())
        try:
            saved = EagleConfig(**{f.name: doc[f.name] for f in fields(EagleConfig)})
        except KeyError as e:
            raise ValueError(f"{name}: {cfg_file} lacks the entry {e.args[0]!r}") from None
        saved.check(target, name)
        head = cls(target)
        try:
            head.load_state_dict(load_file(str(weights)))
        except RuntimeError as e:
            first = str(e).splitlines()[0]
            raise ValueError(f"{name}: {weights} does not fit the target's decoder layer: {first}") from None
        head.meta = doc
        return head.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------
# the drafter


@dataclass
class _Proposal:
    """The last proposed tree of a sequence, for ``update``."""

    n: int  # tree nodes
    node_exp: list[int]  # tree node -> expanded index (-1: a leaf the head never ran)
    exp_feat: torch.Tensor  # [E, H] output features of the expanded nodes, index 0 = the root
    base: int  # cache slot of expanded node 0 (the root's pair); expanded node e sits at base + e
    root_pos: int  # position of the root


@dataclass
class _SeqState:
    cache: KVCache  # the head's KV; slots [0, len(slot_pos)) hold committed pairs
    slot_pos: list[int] = field(default_factory=list)  # position of the pair in each committed slot (ascending)
    tokens: list[int] = field(default_factory=list)  # tokens the committed pairs were computed for
    feats: dict[int, torch.Tensor] = field(default_factory=dict)  # position q -> predicted f_q (for pair q + 1)
    last: _Proposal | None = None


class EagleDrafter(BaseDrafter):
    """EAGLE-2-style dynamic trees from an ``EagleHead`` on the target's hidden states.

    Args:
        target: the target causal LM (its embedding, rotary embedding and LM head are used frozen).
        head: an ``EagleHead`` made for ``target`` (moved to the target's LM-head device; its dtype
            is kept, so load it in the target's dtype: ``EagleHead.load(..., dtype=...)``).
        tree_size: default node budget when the engine asks for more (None = the engine's).
        depth: tree depth = head forwards per step (one catch-up / root forward, then one per depth).
        topk: frontier width: nodes expanded per depth after the root; each expanded node offers
            ``max(topk, ceil(tree_size / expanded))`` children so that trees fill their budget.
        static_shapes: run every head forward with ``max(topk, 2)`` query rows (padding rows write
            a scratch slot) over the whole cache (``kv_len`` = capacity): fixed shapes for a later
            CUDA-graph capture. Default: True on CUDA. Longer catch-up chains run unpadded.

    Needs ``DraftContext.hidden`` (``needs_hidden_states``): ``[H]`` = the target's feature that
    predicted the root (what the engine passes), or ``[m, H]`` = the features at positions
    ``L - 1 - m .. L - 2`` (full catch-up, see the module doc). Without it the tree is root-only.
    """

    needs_hidden_states = True

    def __init__(self, target, head: EagleHead, tree_size: int | None = None, depth: int = 6, topk: int = 8, *,
                 static_shapes: bool | None = None) -> None:  # fmt: skip
        hf.check_causal_lm(target, "target")
        if not isinstance(head, EagleHead):
            raise ValueError(f"head: expected a drafters.eagle.EagleHead, got {type(head).__name__}")
        head.config.check(target, "head")
        for name, val in (("depth", depth), ("topk", topk)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if tree_size is not None and (not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0):
            raise ValueError(f"tree_size: expected None or an int >= 0, got {tree_size!r}")
        self.parts = TargetParts.of(target)
        self.device = self.parts.lm_head.weight.device
        self.head = head.to(self.device).eval()
        self.vocab_size = hf.vocab_size(target)
        self.tree_size = tree_size
        self.depth = depth
        self.topk = topk
        self.static_shapes = self.device.type == "cuda" if static_shapes is None else bool(static_shapes)
        self.static_width = max(topk, 2)
        self._states: dict[int, _SeqState] = {}
        #: head forwards run by the last ``propose`` (tests and accounting)
        self.last_forwards = 0

    # ------------------------------------------------------------------ protocol

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """New ``generate`` call: forget every sequence (cache buffers are reused)."""
        old, self._states = self._states, {}
        for b in range(len(input_ids)):
            prev = old.get(b)
            cache = prev.cache if prev is not None else self._new_cache(len(input_ids[b]) + 64)
            cache.reset()
            self._states[b] = _SeqState(cache)

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        tokens = context.tokens.tolist()
        n_tok, root = len(tokens), tokens[-1]
        root_pos = n_tok - 1
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        self.last_forwards = 0
        st = self._states.get(context.seq)
        if st is None:
            st = self._states[context.seq] = _SeqState(self._new_cache(n_tok + 64))
        st.last = None
        real = self._real_features(context.hidden, n_tok)
        # The settled pairs still valid: those of a common token prefix (another history resets).
        c = min(len(st.tokens), n_tok - 1)
        if st.tokens[:c] != tokens[:c]:
            c = next(i for i, (a, b) in enumerate(zip(st.tokens, tokens)) if a != b)
        predicted = st.feats if c == len(st.tokens) else {}
        root_feat = real.get(root_pos - 1, predicted.get(root_pos - 1))
        if budget <= 0 or root_feat is None:
            return root_only(root)

        # 1. catch up: pairs from `start` on are (re)computed, real features first
        start = min([c] + [q + 1 for q in real])
        keep = bisect.bisect_left(st.slot_pos, start)
        pending = []  # (position, feature)
        for p in range(max(start, 1), n_tok):
            f = real.get(p - 1, predicted.get(p - 1))
            if f is not None:
                pending.append((p, f))
        depth = min(self.depth, budget)
        frontier_width = min(self.topk, budget)
        expanded_max = 1 + frontier_width * (depth - 1)
        width = min(self.vocab_size, max(frontier_width, math.ceil(budget / expanded_max)))
        base = keep + len(pending) - 1  # slot of the root's pair
        self._ensure_capacity(st, keep, base + expanded_max + int(self.static_shapes))  # + the scratch slot
        m = len(pending)
        visible = torch.ones(m, base + 1, dtype=torch.bool)
        visible[:, keep:] = torch.ones(m, m, dtype=torch.bool).tril()
        out = self._run(st, [tokens[p] for p, _ in pending], torch.stack([f for _, f in pending]),
                        [p for p, _ in pending], list(range(keep, base + 1)), visible)  # fmt: skip
        st.slot_pos = st.slot_pos[:keep] + [p for p, _ in pending[:-1]]
        st.tokens = tokens[:-1]
        st.feats = {}
        st.cache.lengths = [base]

        # 2. expand depth by depth (EAGLE-2): pool node 0 = the root = expanded node 0
        pool = NodePool.rooted(root)
        tok, par, score, dep, exp, children = pool.tok, pool.par, pool.score, pool.dep, pool.exp, pool.children
        exp_feat = [out[-1]]
        exp_anc: list[list[int]] = [[0]]  # expanded index -> expanded indices of ancestors-or-self
        logits = self.parts.logits(out[-1:])  # [1, V]
        frontier = [0]
        for d in range(1, depth + 1):
            new = self._add_children(frontier, logits, width, context.sampling, pool, d)
            if d == depth or not new:
                break
            frontier = sorted(new, key=lambda i: (-score[i], i))[:frontier_width]
            for i in frontier:
                exp[i] = len(exp_anc)
                exp_anc.append(exp_anc[exp[par[i]]] + [exp[i]])
            visible = torch.zeros(len(frontier), base + len(exp_anc), dtype=torch.bool)
            visible[:, :base] = True
            for q, i in enumerate(frontier):
                visible[q, [base + e for e in exp_anc[exp[i]]]] = True
            out = self._run(st, [tok[i] for i in frontier], torch.stack([exp_feat[exp[par[i]]] for i in frontier]),
                            [root_pos + d] * len(frontier), [base + exp[i] for i in frontier], visible)  # fmt: skip
            exp_feat.extend(out.unbind(0))
            logits = self.parts.logits(out)

        # 3. re-rank: the best `budget` nodes by cumulative draft log-probability
        keep_nodes = best_first(children, score, dep, budget)
        index = {old: new for new, old in enumerate(keep_nodes)}
        tree, order = make_tree([tok[i] for i in keep_nodes], [-1] + [index[par[i]] for i in keep_nodes[1:]])
        st.last = _Proposal(tree.n, [exp[keep_nodes[o]] for o in order], torch.stack(exp_feat), base, root_pos)
        return tree

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the KV of the accepted path's expanded nodes; keep the last one's output feature."""
        st = self._states.get(context.seq)
        if st is None or st.last is None or st.last.n != tree.n:
            return
        prop, st.last = st.last, None
        path = [0]
        for node in verdict.path[1:]:
            e = prop.node_exp[node]
            if e < 0:
                break
            path.append(e)
        st.cache.lengths = [prop.base]
        st.cache.commit([path])
        st.slot_pos += [prop.root_pos + j for j in range(len(path))]
        st.tokens = context.tokens.tolist() + tree.path_tokens(verdict.path[1 : len(path)])
        # predicts the token after the last committed pair: an accepted leaf's, or the next root's
        st.feats = {prop.root_pos + len(path) - 1: prop.exp_feat[path[-1]]}

    # ------------------------------------------------------------------ internals

    def _real_features(self, hidden: torch.Tensor | None, n_tok: int) -> dict[int, torch.Tensor]:
        """Position -> the target's feature there, from ``DraftContext.hidden`` (``[H]`` or ``[m, H]``)."""
        if hidden is None:
            return {}
        h = self.head.hidden_size
        rows = hidden[None] if hidden.dim() == 1 else hidden
        if rows.dim() != 2 or rows.shape[1] != h or not 1 <= rows.shape[0] <= n_tok - 1:
            raise ValueError(f"hidden: expected [{h}] or [m, {h}] with 1 <= m <= {n_tok - 1}, "
                             f"got {tuple(hidden.shape)}")
        first = n_tok - 1 - rows.shape[0]
        return {first + i: row for i, row in enumerate(rows.to(self.device).unbind(0))}

    def _new_cache(self, need: int) -> KVCache:
        """A one-layer cache of at least ``need`` slots (a power of two >= 256)."""
        return KVCache(1, max(256, 1 << max(need - 1, 1).bit_length()), num_layers=1)

    def _ensure_capacity(self, st: _SeqState, keep: int, need: int) -> None:
        """Grow the cache (copying its first ``keep`` slots) when ``need`` slots would not fit."""
        if need <= st.cache.capacity:
            return
        old, st.cache = st.cache, self._new_cache(need)
        if keep and old.layer_indices:
            k, v = old.buffers(0)
            st.cache.write(0, k[:, :, :keep], v[:, :, :keep], torch.arange(keep, device=k.device)[None])

    def _run(self, st: _SeqState, ids: list[int], feats: torch.Tensor, positions: list[int], slots: list[int],
             visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One head forward of m pairs over the sequence's cache.

        Args:
            ids, positions, slots: per pair its token, position and the cache slot its KV goes to.
            feats: ``[m, H]``, the feature of each pair.
            visible: bool ``[m, kv_len]``, the slots each pair attends to (its own included).

        Returns:
            ``[m, H]`` output features. With ``static_shapes`` (and m <= ``static_width``) the
            forward has ``static_width`` rows over ``kv_len = capacity``; padding rows attend to the
            scratch slot (the last one) only.
        """
        m, kv_len = visible.shape
        cap = st.cache.capacity
        if self.static_shapes and m <= self.static_width:
            pad = self.static_width - m
            scratch = cap - 1
            ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [scratch] * pad
            feats = torch.cat([feats, feats.new_zeros(pad, feats.shape[1])])
            full = torch.zeros(m + pad, cap, dtype=torch.bool)
            full[:m, :kv_len] = visible
            full[m:, scratch] = True
            visible = full
        dev = self.device
        pos = torch.tensor([positions], dtype=torch.int64, device=dev)
        state = hf.MaskedState(st.cache, torch.tensor([slots], dtype=torch.int64, device=dev), pos,
                               visible[None].to(dev))  # fmt: skip
        out = self.head(self.parts, torch.tensor([ids], dtype=torch.int64, device=dev), feats[None], pos, state)
        self.last_forwards += 1
        return out[0, :m]

    def _add_children(self, frontier, logits, width, sampling, pool: NodePool, d) -> list[int]:
        """Add the top-``width`` children of each frontier node (by the draft's log-probability,
        after the target's warping when sampling); return the new pool indices."""
        logits = logits.float()
        logq = torch.log_softmax(logits if sampling is None else warp_logits(logits, sampling), dim=-1)
        vals, idx = torch.topk(logq, width, dim=-1)
        new = []
        for q, (vrow, irow) in enumerate(zip(vals.tolist(), idx.tolist())):
            parent = frontier[q]
            new.extend(pool.add(parent, t, v, d) for v, t in zip(vrow, irow))
        return new

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
  count / decoder-layer class, training notes). Loading checks them against the target. Heads trained
  by ``train-eagle`` also carry ``draft_vocab.safetensors``: every token id ranked by its count in
  the training answers (``token_ids`` int32 ``[V]``, most frequent first, ties by smaller id) and
  those counts (``counts`` int64 ``[V]``); ``eagle_config.json`` names it (``"token_frequencies"``).
  Older code ignores both; a head without them loads with ``token_ids = None``.

**The drafter** (``EagleDrafter``, EAGLE-2's dynamic tree). Per sequence the head keeps its own
KV cache (one layer: keys / values of the pairs it has seen, ``specdec.KVCache``). Per step, with
root r = the last committed token at position L - 1:

1. **Catch up**: one causal forward over the pairs the cache lacks, ending with the root's pair
   ``(f_{L-2}, r)``; its output ``y_{L-1}`` gives the root's children. Features come from the
   engine (``DraftContext.hidden``) where it has them, else from the head's own predictions kept
   from the last step; a pair with neither is skipped (the head simply never attends to it).
   With static shapes a chain of at most ``FUSED_CATCH_UP`` pairs (the accepted path of every step;
   the prompt at the first step unless it is longer) runs padded -- to ``static_width`` rows or the
   next power-of-two multiple of it, one expansion (and graph) per width -- at the start of the
   expansion below, inside its CUDA graph; a longer one runs on its own first.
2. **Expand, one forward per depth, on the device**: the ``topk`` candidates of best cumulative
   draft log-probability at depth d (ties: the earlier candidate) run as one forward of ``topk``
   queries (pair = their token and their parent's output feature, position = root's + d), attending
   to the committed pairs and, through an explicit tree mask, to their expanded ancestors (written
   into the cache right after the committed pairs, root first). Each expanded node contributes its
   top-``w`` children. Everything between two forwards stays on the device (``_Expansion``): the
   LM head, log-softmax (after the target's warping when sampling), per-row top-``w``, cumulative
   scores (float64, as the former host loop added them), a stable sort for the next frontier, the
   frontier's ancestor rows (parent's row | its own bit) and from them the mask. Shapes depend only
   on (``topk``, ``w``, depth) and the cache, so the loop is one CUDA graph (``cuda_graphs``).
   Per depth the candidates' tokens, scores and the picked frontier go to one preallocated record,
   copied to the host once after the loop: the step's only device-to-host transfer.
3. **Re-rank** (host, vectorized over the record: ``_Plan.tree``): the best ``tree_size`` candidates
   by cumulative draft log-probability, ties to the earlier candidate -- the nodes and order of
   ``drafters._build.best_first`` over the former host loop's node pool (ancestor-closed), then
   depth-first. Children are deterministic (``"topk"``), so stochastic verification stays lossless
   without ``draft_probs``.
4. **Commit** (``update``): the accepted path's expanded nodes keep their KV (``KVCache.commit``);
   the last one's output feature is kept for the next step's catch-up.

Cost per step: ``depth`` head forwards (one layer + the LM head on at most ``topk`` rows each), the
step's integer inputs staged once in pinned memory (two host-to-device copies with a fused catch-up:
the scalars, its rows; plus the features' device copy) and one device-to-host copy of the record
(the only sync); with CUDA graphs, one replay for the catch-up and
the expansion together; the re-rank then picks from the record the nodes the former per-depth host
loop's pool and ``best_first`` picked (``_Plan.tree``), so trees are identical to it. ``last_forwards`` / ``last_draft_s`` (and the
running ``draft_s`` / ``proposals``) let a benchmark report drafting time per step; ``profile=True``
splits it into phases (``last_phase_s``, below).

**Reduced draft vocabulary** (EAGLE-3's idea; ``EagleDrafter(draft_vocab=N)``): the head drafts only
among the N most frequent tokens of its training answers (``EagleHead.token_ids``, counted by
``train-eagle`` and saved beside the head as ``draft_vocab.safetensors``). The rows of the target's
frozen LM head for those tokens are gathered once (``[N, H]``, ids sorted ascending), every draft
logit is computed from them, the top-k runs over the subset and the indices map back to token ids:
the LM-head read per depth drops from V x H to N x H. Log-probabilities are renormalized over the
subset, and with a sampling transform the warping (temperature, top-k, top-p) is applied to the
subset's logits: the draft distribution is then the warped distribution *of the subset*. Children
stay deterministic top-k, so verification stays lossless; tokens outside the subset are simply
never drafted. This covers the root's children too (they come from the first depth of the expansion,
on the catch-up's root feature). **Prompt tokens** (``prompt_vocab``, default on): the training
answers hold few distinct tokens (about 5k for MBPP's), so a larger subset ends in never-seen ones,
while answers copy identifiers from their prompt; every ``reset`` therefore puts the prompts' tokens
that the subset lacks in place of its least frequent ones, regathered into the same buffers (the
captured graphs stay valid).

**Profiling** (``EagleDrafter(profile=True)``): ``propose`` synchronizes the device at its phase
boundaries and keeps ``last_phase_s`` = seconds of ``catch_up`` (host preparation; an unfused
catch-up's input copy and forward), ``expand`` (loading the expansion's inputs and the expansion:
graph replay or eager loop, a fused catch-up and any capture included), ``copy`` (the record to the
host), ``host_tree`` (re-rank, ``TokenTree``); ``update`` adds ``update`` (KV commit of
the accepted path) to the same dict. The syncs serialize host and device work a normal step overlaps, so the sum is an
upper bound of the unprofiled step. Off (default): no sync, ``last_phase_s`` stays None.

What the engine provides today (``specdec.drafting``; ``needs_hidden_states = "all"``): the
target's features of *every* committed token, each once per ``generate`` call, as
``DraftContext.hidden`` of shape ``[m, H]`` = the features at positions ``L - 1 - m .. L - 2``: the
whole prompt's but its last token at the first step, afterwards the accepted path's (the root and
the accepted drafted nodes; the last row predicted the new root). So every committed pair is built
from the target's real feature: the catch-up recomputes the pairs of accepted drafted tokens
(computed from the head's own predicted features while drafting) with the real ones, as EAGLE
does. A one-token prompt has no feature at its first step (the tree is root-only). ``propose``
also takes fewer rows (e.g. ``[H]``: only ``f_{L-2}``); pairs without a real feature then use the
head's own predictions or are skipped -- a degraded catch-up. Verification -- and so greedy
equality and lossless sampling -- does not depend on it.
"""

from __future__ import annotations

import bisect
import copy
import functools
import inspect
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from drafters._build import expanded_path, root_only
from specdec import hf
from specdec.drafting import BaseDrafter, DraftContext
from specdec.graphs import _clear_cublas_workspaces, compile_fixed_shapes
from specdec.kv import KVCache
from specdec.sampling import SamplingConfig, warp_logits
from specdec.transfer import to_device
from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = [
    "ATTENTION_NAME",
    "CONFIG_NAME",
    "DRAFT_PHASES",
    "FUSED_CATCH_UP",
    "VOCAB_NAME",
    "WEIGHTS_NAME",
    "EagleConfig",
    "EagleDrafter",
    "EagleHead",
    "TargetParts",
    "rank_tokens",
]

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "eagle_head.safetensors"
#: Token frequencies of the training answers (``token_ids`` ranked, ``counts``), beside the head.
VOCAB_NAME = "draft_vocab.safetensors"
#: ``EagleDrafter.last_phase_s`` keys of one ``propose`` (``update`` adds ``"update"``).
DRAFT_PHASES = ("catch_up", "expand", "copy", "host_tree")
#: Longest chain of pairs a step's catch-up runs inside the expansion's graph (padded to a power-of-two
#: multiple of ``static_width``): every accepted path, and prompts up to this length, so that no head
#: forward runs eagerly (on the H100 eager catch-ups of a merged drafter took 44-140 ms; session 7,
#: specdec/PERF.md v6). Longer prompts run eagerly before the expansion. One graph per width.
FUSED_CATCH_UP = 2048
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


def rank_tokens(counts: torch.Tensor) -> torch.Tensor:
    """Token ids by decreasing ``counts`` (int ``[V]``, indexed by id), ties to the smaller id: the
    ranking ``draft_vocab`` (and ``train-eagle --train-vocab``) takes its N most frequent tokens from."""
    return torch.sort(-counts, stable=True).indices


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
        #: int64 ``[V]`` (CPU): every token id by decreasing count in the training answers (ties: the
        #: smaller id first), or None (a head saved without frequencies); not part of ``state_dict``
        self.token_ids: torch.Tensor | None = None
        #: int64 ``[V]``: the counts of ``token_ids`` (non-increasing), or None
        self.token_counts: torch.Tensor | None = None

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

    def set_token_counts(self, counts: torch.Tensor | Sequence[int]) -> None:
        """Rank the vocabulary by ``counts`` (int ``[V]``, indexed by token id; e.g. the training
        answers' token counts): sets ``token_ids`` / ``token_counts`` (what ``draft_vocab`` draws from)."""
        counts = torch.as_tensor(counts).detach().to("cpu", torch.int64).flatten()
        if counts.numel() != self.config.vocab_size or bool((counts < 0).any()):
            raise ValueError(f"counts: expected {self.config.vocab_size} counts >= 0 (one per token id), got "
                             f"{counts.numel()} values, min {int(counts.min()) if counts.numel() else None}")  # fmt: skip
        order = rank_tokens(counts)
        self.token_ids, self.token_counts = order, counts[order]

    def save(self, out_dir: str | os.PathLike[str], **meta: Any) -> Path:
        """Write ``eagle_head.safetensors`` (float32, ``fc.*`` and ``layer.*``) and ``eagle_config.json``,
        and ``draft_vocab.safetensors`` when the head has token frequencies (``set_token_counts``)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        doc = {**asdict(self.config), "head": "eagle-1: fc(2H -> H) + 1 decoder layer, no final norm; the target's "
               "embedding, rotary embedding and LM head are used frozen and not stored", **meta}  # fmt: skip
        if self.token_ids is not None:
            ranked = {"token_ids": self.token_ids.to(torch.int32).contiguous(), "counts": self.token_counts.contiguous()}
            save_file(ranked, str(out / VOCAB_NAME), metadata={"format": "pt"})
            doc["token_frequencies"] = {"file": VOCAB_NAME, "seen_tokens": int((self.token_counts > 0).sum()),
                                        "counted_tokens": int(self.token_counts.sum())}  # fmt: skip
        else:
            (out / VOCAB_NAME).unlink(missing_ok=True)  # a stale file from an earlier save
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
        vocab = p / VOCAB_NAME
        if vocab.is_file():
            saved_vocab = load_file(str(vocab))
            ids, counts = saved_vocab.get("token_ids"), saved_vocab.get("counts")
            n = saved.vocab_size
            if (ids is None or counts is None or ids.shape != (n,) or counts.shape != (n,)
                    or not torch.equal(torch.sort(ids.long()).values, torch.arange(n))):
                raise ValueError(f"{name}: {vocab} does not rank the target's {n} token ids (expected token_ids and "
                                 f"counts of shape [{n}])")  # fmt: skip
            head.token_ids, head.token_counts = ids.long(), counts.long()
        elif "token_frequencies" in doc:
            raise ValueError(f"{name}: {cfg_file} names {VOCAB_NAME}, but it is missing from {str(p)!r}")
        return head.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------
# the drafter


@dataclass(frozen=True)
class _Plan:
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
    def make(cls, topk: int, width: int, depth: int) -> "_Plan":
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
    def n_max(self) -> int:
        return max(self.cand)

    @property
    def record_size(self) -> int:
        return 2 * self.depth * self.n_max + (self.depth - 1) * self.topk

    def views(self, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [depth, n_max] int64, scores [depth, n_max] float64, picks [depth - 1, topk] int64)``,
        views of ``record`` (device or host)."""
        size = self.depth * self.n_max
        tok = record[:size].view(self.depth, self.n_max)
        score = record[size : 2 * size].view(torch.float64).view(self.depth, self.n_max)
        pick = record[2 * size :].view(self.depth - 1, self.topk)
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


def _expand_depths(drafter: "EagleDrafter", cache: KVCache, plan: _Plan, sampling: SamplingConfig | None,
                   kv_lens: tuple[int, ...], scalars: torch.Tensor, feat: torch.Tensor, tok: torch.Tensor,
                   score_out: torch.Tensor, pick_out: torch.Tensor) -> None:  # fmt: skip
    """Depths 1 .. ``plan.depth`` of an expansion on the device: candidates, the next frontier, its
    head forward (``_Expansion``'s loop; a module function of tensors and fixed-shape inputs so one
    ``torch.compile`` of it serves every expansion of the same shapes).

    Args:
        scalars: int64 ``[>= 2]`` on the device: (slot of the root's pair ``base``, the root's position).
        feat: ``[E, H]``; row 0 holds the root's output feature, rows ``plan.offsets[d] ..`` get
            the features of the nodes expanded at depth d.
        tok, score_out, pick_out: the record's views (``_Plan.views``), written in place.
        kv_lens: ``kv_lens[d - 1]``: the cache slots ``[0, kv_lens[d - 1])`` the head forward of
            the nodes picked at depth d attends to (the whole capacity with static shapes).
    """
    dev, width, expanded = feat.device, plan.width, plan.expanded
    base, root_pos = scalars[0], scalars[1]
    cols = torch.arange(expanded, device=dev)
    anc = (cols == 0)[None]  # [rows, E]: each frontier row's expanded ancestors-or-self (the root: itself)
    feats = feat[:1]  # output features of the frontier rows
    score = torch.zeros(1, dtype=torch.float64, device=dev)  # their cumulative draft log-probabilities
    for d in range(1, plan.depth + 1):
        n = plan.cand[d - 1]
        logits = drafter._draft_logits(feats)  # [rows, V] or, with draft_vocab, [rows, N] over the subset
        logq = torch.log_softmax(logits if sampling is None else warp_logits(logits, sampling), dim=-1)
        vals, idx = torch.topk(logq, width, dim=-1)
        # float64 sums, as the former host loop added Python floats: same scores, same order
        cand_score = (score[:, None] + vals.double()).reshape(n)
        cand_tok = drafter._token_ids(idx).reshape(n)
        tok[d - 1, :n].copy_(cand_tok)
        score_out[d - 1, :n].copy_(cand_score)
        if d == plan.depth:
            break
        rows, off = plan.rows[d], plan.offsets[d]
        # the best `rows` candidates; stable: equal scores keep candidate order (the host loop's)
        pick = torch.sort(cand_score, descending=True, stable=True).indices[:rows]
        pick_out[d - 1, :rows].copy_(pick)
        parent = torch.div(pick, width, rounding_mode="floor")  # frontier row of depth d - 1
        own = off + torch.arange(rows, device=dev)  # expanded indices of the new rows
        anc = anc[parent] | (cols[None] == own[:, None])
        rel = torch.arange(kv_lens[d - 1], device=dev) - base  # slot - base: expanded index
        visible = (rel < 0)[None] | (anc[:, rel.clamp(0, expanded - 1)] & (rel < expanded)[None])
        positions = (root_pos + d).expand(1, rows)
        out = drafter._forward(cache, cand_tok[pick], feats[parent], positions, base + own, visible)
        feat[off : off + rows].copy_(out)
        feats = feat[off : off + rows]
        score = cand_score[pick]


class _Expansion:
    """One plan's expansion over one sequence's head cache, at fixed addresses.

    Inputs, refilled in place every step (``run``): ``scalars`` = (slot of the root's pair ``base``,
    the root's position) and ``feat[0]`` = the root's output feature (from the catch-up). Outputs:
    ``feat [E, H]`` = the output features of the ``E = plan.expanded`` expanded nodes (index e at
    cache slot ``base + e``) and ``record`` (see ``_Plan``). ``_body`` -- the whole loop, one head
    forward per depth after the root -- reads nothing but these buffers, the head's weights and
    the cache, never syncs with the host and has shapes fixed by (plan, cache capacity) when run
    over the whole capacity: ``capture=True`` records it once as a CUDA graph and replays it;
    ``capture=False`` runs the same body eagerly (what CPU tests check).
    """

    def __init__(self, drafter: "EagleDrafter", cache: KVCache, plan: _Plan, sampling: SamplingConfig | None,
                 capture: bool, width: int = 0) -> None:  # fmt: skip
        dev, w = drafter.device, drafter.head.fc.weight
        self.drafter, self.cache, self.plan, self.sampling, self.capture = drafter, cache, plan, sampling, capture
        self.width = width  # rows of the fused catch-up; 0: not fused
        # the step's int64 inputs: (base, root_pos, keep, m), then when fused the catch-up's [3, width]
        # (token ids, positions, slots); the scalars in a tensor of their own, so that the compiled depth
        # loop sees the same input at every catch-up width (a view into a width-sized block would not)
        self.scalars = torch.zeros(4, dtype=torch.int64, device=dev)
        self.catch_ints = torch.zeros(3, width, dtype=torch.int64, device=dev)
        self.catch_feat = torch.zeros(width, drafter.head.hidden_size, dtype=w.dtype, device=dev)
        self.feat = torch.zeros(plan.expanded, drafter.head.hidden_size, dtype=w.dtype, device=dev)
        self.record = torch.zeros(plan.record_size, dtype=torch.int64, device=dev)
        self.tok, self.score, self.pick = plan.views(self.record)
        self.graph = None  # torch.cuda.CUDAGraph once captured
        #: seconds the capture took (warm-up forwards + recording), None before / without it
        self.capture_s: float | None = None

    @torch.no_grad()
    def run(self, base: int, root_pos: int, root_feat: torch.Tensor | None, kv_lens: Sequence[int],
            catch_up: "_CatchUp | None" = None) -> torch.Tensor:  # fmt: skip
        """Load the step's inputs, expand, return the record on the host (the step's one sync).

        ``kv_lens[d - 1]``: attention reads cache slots ``[0, kv_lens[d - 1])`` at depth d (eager
        only; a captured graph reads the whole capacity). Unfused: ``root_feat`` is the catch-up's
        output for the root. Fused: ``catch_up`` holds the catch-up's inputs (padded to
        ``width`` rows), and the body runs it first (``root_feat`` is None).
        """
        if self.width != (catch_up.width if catch_up is not None else 0):
            raise RuntimeError("catch_up: expected it exactly for a fused expansion, of its width")
        head = [base, root_pos] + ([catch_up.keep, catch_up.m] if catch_up is not None else [0, 0])
        stage = torch.tensor(head + (catch_up.ints if catch_up is not None else []), dtype=torch.int64)
        if self.scalars.is_cuda:
            stage = stage.pin_memory()
        self.scalars.copy_(stage[:4], non_blocking=True)
        if catch_up is not None:
            self.catch_ints.view(-1).copy_(stage[4:], non_blocking=True)
            self.catch_feat[: catch_up.m].copy_(catch_up.feats)
        else:
            self.feat[0].copy_(root_feat)
        if self.capture:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            self._body(kv_lens)
        self.drafter._mark("expand")
        host = self.record.cpu()
        self.drafter._mark("copy")
        return host

    def _catch_up_body(self) -> None:
        """The fused catch-up: ``width`` rows over the whole cache, the root's output to ``feat[0]``."""
        keep, m = self.scalars[2], self.scalars[3]
        cap = self.cache.capacity
        visible = self.drafter._catch_up_visible(keep, m, self.width, cap, padded=True,
                                                 device=self.feat.device)  # fmt: skip
        out = self.drafter._forward(self.cache, self.catch_ints[0], self.catch_feat, self.catch_ints[1:2],
                                    self.catch_ints[2], visible)  # fmt: skip
        self.feat[:1].copy_(out.index_select(0, (m - 1).view(1)))

    def _body(self, kv_lens: Sequence[int]) -> None:
        """(Fused: the catch-up, then) depths 1 .. plan.depth on the device (``_expand_depths``,
        compiled with ``compile_head``)."""
        if self.width:
            self._catch_up_body()
        self.drafter._depth_loop(self.drafter, self.cache, self.plan, self.sampling, tuple(kv_lens), self.scalars,
                                 self.feat, self.tok, self.score, self.pick)  # fmt: skip

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
            _clear_cublas_workspaces()  # the capture allocates its own, inside the graph's pool
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._body(kv_lens)
            _clear_cublas_workspaces()  # later eager work on this stream must not use the graph's
            if list(self.cache.layer_indices) != layers:
                raise RuntimeError("cache: KV buffers were allocated during the CUDA-graph capture")
            torch.cuda.synchronize(dev)
            self.capture_s = time.perf_counter() - start
        self.graph = graph


@dataclass
class _CatchUp:
    """A fused catch-up's inputs: ``ints`` = token ids, positions, slots (``3 * width`` host ints,
    padding rows: token 0, position 0, the scratch slot), ``feats [m, H]`` the real rows' features
    (device), ``keep`` the committed slots they attend to, ``m`` the real rows."""

    width: int
    ints: list[int]
    feats: torch.Tensor
    keep: int
    m: int


class _PhaseClock:
    """Seconds per phase: ``mark(phase)`` waits for ``device``, then adds the time since the previous
    mark (or the start) to ``seconds[phase]``."""

    def __init__(self, device: torch.device, start: float | None = None) -> None:
        self.device = device
        self.t = time.perf_counter() if start is None else start
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.t
        self.t = now


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (no copy), or a host copy of a device one."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


@dataclass
class _Proposal:
    """The last proposed tree of a sequence, for ``update``."""

    n: int  # tree nodes
    node_exp: list[int]  # tree node -> expanded index (-1: a leaf the head never ran)
    exp_feat: torch.Tensor  # [E, H] output features of the expanded nodes, index 0 = the root (a reused buffer)
    base: int  # cache slot of expanded node 0 (the root's pair); expanded node e sits at base + e
    root_pos: int  # position of the root


@dataclass
class _SeqState:
    cache: KVCache  # the head's KV; slots [0, len(slot_pos)) hold committed pairs
    slot_pos: list[int] = field(default_factory=list)  # position of the pair in each committed slot (ascending)
    #: the tokens the committed pairs were computed for (int64, a copy: compared with each step's history)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    feats: dict[int, torch.Tensor] = field(default_factory=dict)  # position q -> predicted f_q (for pair q + 1)
    last: _Proposal | None = None
    #: (plan, sampling) -> its expansion over ``cache`` (buffers and CUDA graph; dropped with the cache)
    expansions: dict[tuple[_Plan, SamplingConfig | None], _Expansion] = field(default_factory=dict)


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
        static_shapes: every head forward attends over the whole cache (``kv_len`` = capacity), and
            the catch-up runs ``max(topk, 2)`` query rows (padding rows write a scratch slot; longer
            chains run unpadded): fixed shapes. Default: True on CUDA.
        cuda_graphs: replay each step's expansion loop (every head forward after the catch-up, the
            top-k and the frontier selection between them) as one CUDA graph, captured per sequence,
            (topk, children, depth, sampling transform) and cache; needs ``static_shapes`` and the
            head on CUDA. Default: True there unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``
            (False on other devices; True there raises).
        draft_vocab: None = draft over the whole vocabulary; N = only over the head's N most frequent
            training-answer tokens (``EagleHead.token_ids``; the LM-head rows of those tokens are
            gathered once, ``[N, H]`` in the LM head's dtype; see the module doc). Needs a head saved
            with token frequencies (``train-eagle``); 1 <= N <= V.
        prompt_vocab: with ``draft_vocab``, every ``reset`` (each ``generate`` call) puts the prompts'
            tokens missing from the subset in place of its least frequent ones (a subset larger than
            the training answers' distinct tokens ends in never-seen ones), so that identifiers the
            answer copies from its prompt can be drafted. Default True.
        profile: synchronize the device at the phase boundaries of every ``propose`` / ``update``
            and keep their seconds in ``last_phase_s`` (keys ``DRAFT_PHASES`` + ``"update"``).
        compile_head: run the expansion's depth loop (every head forward after the root's, the LM
            head, top-k and frontier selection) through ``torch.compile`` (True: inductor; or a
            backend name) before its capture: fewer, fused kernels per depth. Compiled once per
            (plan, sampling transform, cache capacity) and shared by the catch-up widths (the
            catch-up stays uncompiled). Needs ``static_shapes``. Default False.

    Needs ``DraftContext.hidden`` (``needs_hidden_states = "all"``): ``[m, H]`` = the features at
    positions ``L - 1 - m .. L - 2`` (what the engine passes: those not given before; full catch-up,
    see the module doc), or ``[H]`` = only the one that predicted the root. Without it the tree is
    root-only.
    """

    needs_hidden_states = "all"  # every committed token's target feature (specdec.drafting.HIDDEN_ALL)

    def __init__(self, target, head: EagleHead, tree_size: int | None = None, depth: int = 6, topk: int = 8, *,
                 static_shapes: bool | None = None, cuda_graphs: bool | None = None, draft_vocab: int | None = None,
                 profile: bool = False, compile_head: bool | str = False,
                 prompt_vocab: bool = True) -> None:  # fmt: skip
        hf.check_causal_lm(target, "target")
        if not isinstance(head, EagleHead):
            raise ValueError(f"head: expected a drafters.eagle.EagleHead, got {type(head).__name__}")
        head.config.check(target, "head")
        for name, val in (("depth", depth), ("topk", topk)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if tree_size is not None and (not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0):
            raise ValueError(f"tree_size: expected None or an int >= 0, got {tree_size!r}")
        for name, val in (("static_shapes", static_shapes), ("cuda_graphs", cuda_graphs)):
            if val is not None and not isinstance(val, bool):
                raise ValueError(f"{name}: expected None, True or False, got {val!r}")
        if not isinstance(profile, bool):
            raise ValueError(f"profile: expected True or False, got {profile!r}")
        if not isinstance(prompt_vocab, bool):
            raise ValueError(f"prompt_vocab: expected True or False, got {prompt_vocab!r}")
        if not isinstance(compile_head, (bool, str)) or compile_head == "":
            raise ValueError(f"compile_head: expected a bool or a torch.compile backend name, got {compile_head!r}")
        if draft_vocab is not None:
            if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 1:
                raise ValueError(f"draft_vocab: expected None or an int >= 1, got {draft_vocab!r}")
            if head.token_ids is None:
                raise ValueError(f"draft_vocab: expected a head saved with token frequencies ({VOCAB_NAME}, written "
                                 f"by train-eagle), got one without; retrain it or leave draft_vocab=None")  # fmt: skip
            if draft_vocab > len(head.token_ids):
                raise ValueError(f"draft_vocab: expected at most the head's {len(head.token_ids)} ranked token ids, "
                                 f"got {draft_vocab}")  # fmt: skip
        self.parts = TargetParts.of(target)
        self.device = self.parts.lm_head.weight.device
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs: True needs the target's LM head (and the head) on a CUDA device, "
                             f"got {self.device}")  # fmt: skip
        if cuda_graphs and static_shapes is False:
            raise ValueError("cuda_graphs: True needs static_shapes, got static_shapes=False")
        self.head = head.to(self.device).eval()
        self.vocab_size = hf.vocab_size(target)
        self.draft_vocab = draft_vocab
        #: the subset's token ids (int64 ``[N]``, ascending) and LM-head rows (``[N, H]``, bias ``[N]``)
        #: (fixed buffers: ``prompt_vocab`` regathers them in place, so captured graphs stay valid)
        self._vocab_ids = self._vocab_weight = self._vocab_bias = None
        self.prompt_vocab = prompt_vocab
        if draft_vocab is not None:
            lm = self.parts.lm_head
            ranked = head.token_ids[:draft_vocab].long().to(self.device)  # most frequent first
            #: per token id, its place among the N most frequent training-answer tokens (0 = most
            #: frequent), N for every other token (int64 ``[V]``, on the device; ``prompt_subset``)
            self._vocab_rank = torch.full((max(self.vocab_size, lm.weight.shape[0]),), draft_vocab, dtype=torch.int64,
                                          device=self.device)  # fmt: skip
            self._vocab_rank[ranked] = torch.arange(draft_vocab, device=self.device)
            self._vocab_ids = torch.empty(draft_vocab, dtype=torch.int64, device=self.device)
            self._vocab_weight = lm.weight.detach().new_empty(draft_vocab, lm.weight.shape[1])
            bias = getattr(lm, "bias", None)
            self._vocab_bias = None if bias is None else bias.detach().new_empty(draft_vocab)
            self._set_vocab(ranked)
        self.profile = profile
        #: seconds per phase of the last ``propose`` (``DRAFT_PHASES``; ``update`` adds ``"update"``)
        #: with ``profile``, a new dict per call; else None
        self.last_phase_s: dict[str, float] | None = None
        self._clock: _PhaseClock | None = None
        self.tree_size = tree_size
        self.depth = depth
        self.topk = topk
        self.static_shapes = (on_cuda or bool(cuda_graphs)) if static_shapes is None else static_shapes
        if cuda_graphs is None:
            cuda_graphs = self.static_shapes and on_cuda and os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0"
        self.cuda_graphs = bool(cuda_graphs)
        if compile_head and not self.static_shapes:
            raise ValueError("compile_head: needs static_shapes, got static_shapes=False")
        #: the depth loop (``_expand_depths``) as run by every expansion: compiled with ``compile_head``
        self._depth_loop = compile_fixed_shapes(_expand_depths, compile_head) if compile_head else _expand_depths
        self.static_width = max(topk, 2)
        self._states: dict[int, _SeqState] = {}
        #: the least capacity of a new head cache (``warmup`` raises it to what its requests need)
        self._min_cache = 256
        #: head forwards run by the last ``propose`` (tests and accounting)
        self.last_forwards = 0
        #: wall-clock seconds of the last ``propose`` (it ends with its one device-to-host copy, so the
        #: device's drafting work is included), and of any CUDA-graph capture inside it (0.0 if none)
        self.last_draft_s = 0.0
        self.last_capture_s = 0.0
        #: running totals over ``propose`` calls since construction (``draft_s`` includes captures)
        self.draft_s = 0.0
        self.proposals = 0

    # ------------------------------------------------------------------ protocol

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """New ``generate`` call: forget every sequence (cache buffers and captured expansions are
        reused); with ``draft_vocab`` and ``prompt_vocab``, the subset takes in the prompts' tokens."""
        if self._vocab_ids is not None and self.prompt_vocab:
            self._set_vocab(self.prompt_subset(input_ids))
        old, self._states = self._states, {}
        for b in range(len(input_ids)):
            prev = old.get(b)
            if prev is None:
                self._states[b] = _SeqState(self._new_cache(len(input_ids[b]) + 64))
            else:
                prev.cache.reset()
                self._states[b] = _SeqState(prev.cache, expansions=prev.expansions)

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_len: int | None = None, log=None) -> None:
        """Size the head caches for requests of up to ``max_len`` tokens per sequence (prompt and new
        tokens; called by ``SpecDecoder.warmup``): a cache that grows mid-run drops its expansions,
        so their captures (and, with ``compile_head``, the depth loop's compile for the new
        capacity) would come back inside a timed call. ``batch_sizes`` and ``log`` are not used."""
        if max_len is not None:
            self._min_cache = max(self._min_cache, max_len + self.topk * self.depth + 2)
            for b, st in list(self._states.items()):
                if st.cache.capacity < self._min_cache:
                    self._states[b] = _SeqState(self._new_cache(self._min_cache))

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        start = time.perf_counter()
        self.last_forwards, self.last_capture_s = 0, 0.0
        self._clock = _PhaseClock(self.device, start) if self.profile else None
        try:
            tree = self._propose(context)
            if self._clock is not None:
                self._clock.mark("host_tree")
                self.last_phase_s = {p: self._clock.seconds.get(p, 0.0) for p in DRAFT_PHASES}
        finally:
            self._clock = None
        self.last_draft_s = time.perf_counter() - start
        self.draft_s += self.last_draft_s
        self.proposals += 1
        return tree

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the KV of the accepted path's expanded nodes; keep the last one's output feature."""
        clock = _PhaseClock(self.device) if self.profile else None
        self._update(context, tree, verdict)
        if clock is not None and self.last_phase_s is not None:
            clock.mark("update")
            self.last_phase_s["update"] = self.last_phase_s.get("update", 0.0) + clock.seconds["update"]

    def _update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        st = self._states.get(context.seq)
        if st is None or st.last is None or st.last.n != tree.n:
            return
        prop, st.last = st.last, None
        path = expanded_path(verdict.path, prop.node_exp)
        st.cache.lengths = [prop.base]
        st.cache.commit([path])
        st.slot_pos += [prop.root_pos + j for j in range(len(path))]
        accepted = _host_array(tree.tokens)[list(verdict.path[1 : len(path)])]
        st.tokens = np.concatenate([_host_array(context.tokens), accepted])
        # predicts the token after the last committed pair: an accepted leaf's, or the next root's
        # (a copy: the expansion's feature buffer is rewritten by the next step)
        st.feats = {prop.root_pos + len(path) - 1: prop.exp_feat[path[-1]].clone()}

    # ------------------------------------------------------------------ internals

    def _propose(self, context: DraftContext) -> TokenTree:
        tokens = _host_array(context.tokens)
        n_tok, root = len(tokens), int(tokens[-1])
        root_pos = n_tok - 1
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        st = self._states.get(context.seq)
        if st is None:
            st = self._states[context.seq] = _SeqState(self._new_cache(n_tok + 64))
        st.last = None
        real = self._real_features(context.hidden, n_tok)
        # The settled pairs still valid: those of a common token prefix (another history resets).
        c = min(len(st.tokens), n_tok - 1)
        if not np.array_equal(st.tokens[:c], tokens[:c]):
            c = int(np.flatnonzero(st.tokens[:c] != tokens[:c])[0])
        predicted = st.feats if c == len(st.tokens) else {}
        root_feat = real.get(root_pos - 1, predicted.get(root_pos - 1))
        if budget <= 0 or root_feat is None:
            self._mark("catch_up")
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
        width = min(self.draft_vocab or self.vocab_size, max(frontier_width, math.ceil(budget / expanded_max)))
        plan = _Plan.make(frontier_width, width, depth)
        base = keep + len(pending) - 1  # slot of the root's pair
        self._ensure_capacity(st, keep, base + expanded_max + int(self.static_shapes))  # + the scratch slot
        # a chain of at most FUSED_CATCH_UP pairs runs inside the expansion (its graph); a longer one
        # (a long prompt) or dynamic shapes run it here first
        fused = self._fused_width(len(pending))
        if fused:
            catch_up, root_out = self._catch_up_inputs(st, tokens, pending, keep, base, fused), None
        else:
            catch_up, root_out = None, self._catch_up(st, tokens, pending, keep, base)[-1]
        del st.slot_pos[keep:]
        st.slot_pos += [p for p, _ in pending[:-1]]
        st.tokens = tokens[:-1].copy()
        st.feats = {}
        st.cache.lengths = [base]
        self._mark("catch_up")

        # 2. expand depth by depth (EAGLE-2) on the device; 3. re-rank: the best `budget` nodes
        tree, node_exp, exp_feat = self._expand(st, plan, context.sampling, base, root_pos, root_out, root, catch_up,
                                                budget)  # fmt: skip
        st.last = _Proposal(tree.n, node_exp, exp_feat, base, root_pos)
        return tree

    def _expand(self, st: _SeqState, plan: _Plan, sampling: SamplingConfig | None, base: int, root_pos: int,
                root_feat: torch.Tensor | None, root: int, catch_up: "_CatchUp | None",
                budget: int) -> tuple[TokenTree, list[int], torch.Tensor]:  # fmt: skip
        """Steps 2 and 3 of the module doc (with ``catch_up``: step 1 first, fused): the tree of the
        best ``budget`` nodes, each tree node's expanded index (-1: never expanded) and the ``[E, H]``
        expanded features (device).

        The loop runs on the device (``_Expansion``, a CUDA-graph replay with ``cuda_graphs``); its
        record comes back in one copy, from which ``_Plan.tree`` re-ranks.
        """
        width = catch_up.width if catch_up is not None else 0
        key = (plan, sampling, width)
        exp = st.expansions.get(key)
        if exp is None:
            exp = st.expansions[key] = _Expansion(self, st.cache, plan, sampling, self.cuda_graphs, width)
        cap = st.cache.capacity
        kv_lens = [cap if self.static_shapes else base + plan.offsets[d] + plan.rows[d] for d in range(1, plan.depth)]
        captured = exp.graph is not None
        record = exp.run(base, root_pos, root_feat, kv_lens, catch_up)
        if exp.capture and not captured:
            self.last_capture_s = exp.capture_s or 0.0
        self.last_forwards += plan.depth - 1 + int(catch_up is not None)
        return (*plan.tree(record, root, budget), exp.feat)

    def _mark(self, phase: str) -> None:
        """With ``profile``: the time since the last mark (device synchronized) goes to ``phase``."""
        if self._clock is not None:
            self._clock.mark(phase)

    def prompt_subset(self, input_ids: Sequence[torch.Tensor]) -> torch.Tensor:
        """The draft vocabulary for these prompts (``draft_vocab`` needed): int64 ``[N]``, ascending,
        on the drafter's device: the N most frequent training-answer tokens with the last k replaced
        by the k prompt tokens (smallest ids first, at most N) that they lack.

        Computed on the device without a host sync (it runs on every ``reset``): the N smallest of a
        per-token key -- a token's frequency rank, or ``id - V`` (below every rank) for a prompt
        token outside the N most frequent.
        """
        n, key = self.draft_vocab, self._vocab_rank.clone()
        prompt = torch.cat([torch.as_tensor(p).flatten() for p in input_ids]).to(self.device, torch.int64)
        ranks = key[prompt]
        key[prompt] = torch.where(ranks >= n, prompt - key.numel(), ranks)
        return torch.sort(torch.topk(key, n, largest=False, sorted=False).indices).values

    def _set_vocab(self, ids: torch.Tensor) -> None:
        """Gather the subset ``ids`` (int64 ``[N]``, distinct) into the fixed buffers, ascending."""
        ids = torch.sort(ids).values.to(self.device)
        lm = self.parts.lm_head
        self._vocab_ids.copy_(ids)
        torch.index_select(lm.weight.detach(), 0, ids, out=self._vocab_weight)
        if self._vocab_bias is not None:
            torch.index_select(lm.bias.detach(), 0, ids, out=self._vocab_bias)

    def _draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """float32 draft logits of the output features ``feats [r, H]``: ``[r, V]``, or ``[r, N]`` over
        the ``draft_vocab`` subset (its gathered LM-head rows; column j is token ``_vocab_ids[j]``)."""
        if self._vocab_weight is None:
            return self.parts.logits(feats).float()
        w = self._vocab_weight
        return F.linear(feats.to(w.dtype), w, self._vocab_bias).float()

    def _token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids of the columns ``idx`` of ``_draft_logits`` (a device gather with ``draft_vocab``)."""
        return idx if self._vocab_ids is None else self._vocab_ids[idx]

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
        """A one-layer cache of at least ``need`` slots (a power of two >= 256 and >= the warmed size)."""
        need = max(need, self._min_cache)
        return KVCache(1, 1 << max(need - 1, 1).bit_length(), num_layers=1)

    def _ensure_capacity(self, st: _SeqState, keep: int, need: int) -> None:
        """Grow the cache (copying its first ``keep`` slots) when ``need`` slots would not fit."""
        if need <= st.cache.capacity:
            return
        old, st.cache = st.cache, self._new_cache(need)
        st.expansions = {}  # their buffers and graphs belong to the old cache
        if keep and old.layer_indices:
            k, v = old.buffers(0)
            st.cache.write(0, k[:, :, :keep], v[:, :, :keep], torch.arange(keep, device=k.device)[None])

    def _catch_up(self, st: _SeqState, tokens: np.ndarray, pending: list[tuple[int, torch.Tensor]], keep: int,
                  base: int) -> torch.Tensor:  # fmt: skip
        """One causal forward of the ``pending`` pairs (position, feature) into slots ``keep .. base``.

        Each pair attends to the committed slots ``[0, keep)`` and to the pending pairs up to itself
        (``_catch_up_visible``). Inputs go to the device in one asynchronous copy; the mask is built
        there. Runs unpadded: a chain of at most ``FUSED_CATCH_UP`` pairs under ``static_shapes`` runs
        padded inside the expansion instead (``_fused_width``, ``_catch_up_inputs``,
        ``_Expansion._catch_up_body``).
        Returns the ``[m, H]`` output features (the last one: the root's).
        """
        positions = [p for p, _ in pending]
        ids = tokens[positions].tolist()
        feats = torch.stack([f.to(self.head.fc.weight.dtype) for _, f in pending])
        ints = to_device(torch.tensor([ids, positions, list(range(keep, base + 1))], dtype=torch.int64), self.device)
        m = len(pending)
        visible = self._catch_up_visible(keep, m, m, base + 1, padded=False, device=self.device)
        out = self._forward(st.cache, ints[0], feats, ints[1:2], ints[2], visible)
        self.last_forwards += 1
        return out

    def _catch_up_inputs(self, st: _SeqState, tokens: np.ndarray, pending: list[tuple[int, torch.Tensor]], keep: int,
                         base: int, width: int) -> _CatchUp:  # fmt: skip
        """The padded catch-up's inputs: ``width`` (``_fused_width(m)``) rows; padding rows (token 0,
        position 0) write and attend to the scratch slot (the cache's last) only."""
        m, pad, scratch = len(pending), width - len(pending), st.cache.capacity - 1
        positions = [p for p, _ in pending]
        ints = (tokens[positions].tolist() + [0] * pad + positions + [0] * pad
                + list(range(keep, base + 1)) + [scratch] * pad)  # fmt: skip
        feats = torch.stack([f.to(self.head.fc.weight.dtype) for _, f in pending])
        return _CatchUp(width, ints, feats, keep, m)

    def _fused_width(self, m: int) -> int:
        """Rows of the fused catch-up of ``m`` pairs: ``static_width`` times the smallest power of two
        that holds them; 0 (run it unfused) without static shapes or beyond ``FUSED_CATCH_UP`` pairs."""
        if not self.static_shapes or m > max(FUSED_CATCH_UP, self.static_width):
            return 0
        width = self.static_width
        while width < m:
            width *= 2
        return width

    @staticmethod
    def _catch_up_visible(keep, m, rows: int, kv_len: int, padded: bool, device: torch.device) -> torch.Tensor:
        """bool ``[rows, kv_len]``: row i < m sees the committed slots ``[0, keep)`` and the pending
        slots ``keep .. keep + i``; with ``padded``, rows >= m see only the scratch slot ``kv_len - 1``.
        ``keep`` / ``m``: ints or 0-d device tensors (a captured graph's inputs)."""
        row = torch.arange(rows, device=device)[:, None]
        col = torch.arange(kv_len, device=device)[None]
        visible = (col < keep) | ((col >= keep) & (col <= keep + row))
        if padded:
            visible = torch.where(row < m, visible, col == kv_len - 1)
        return visible

    def _forward(self, cache: KVCache, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One head forward of r pairs over ``cache`` (device tensors, no host sync).

        Args:
            ids: int64 ``[r]``, the pairs' tokens.
            feats: ``[r, H]``, the pairs' features.
            positions: int64 ``[1, r]``, their positions.
            slots: int64 ``[r]``, the cache slots their KV goes to.
            visible: bool ``[r, kv_len]``, the slots each pair attends to (its own included).

        Returns:
            ``[r, H]`` output features.
        """
        state = hf.MaskedState(cache, slots[None], positions, visible[None])
        return self.head(self.parts, ids[None], feats[None], positions, state)[0]

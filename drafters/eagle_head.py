"""The EAGLE head: a one-layer draft head on the target's own hidden states (EAGLE-1's architecture).

Write ``t_p`` for the token at position p and ``f_p`` for the target's final hidden state there (the
LM head's input, after the final norm; the target turns ``f_p`` into the distribution of
``t_{p+1}``). The head reads the *pair* of the token at p and the feature before it::

    x_p   = fc(concat(embed(t_p), f_{p-1}))            fc: Linear(2H -> H), trained
    y_p   = decoder_layer(x_p | the pairs up to p)      one layer of the target's own architecture
    logits of t_{p+1} = lm_head(y_p)                    the target's frozen LM head

and ``y_p`` is trained to be ``f_p``. So the head at position p mirrors the target at p one feature
late: it sees the target's feature up to p - 1 plus the token at p and predicts the target's next
feature. Positions the head drafted itself have no target feature: there the pair reads the head's
own prediction ``y_{p-1}`` instead (EAGLE's autoregression over features), which is what the
unrolled "training-time test" of the EAGLE training prepares it for.

- The decoder layer is built by transformers from a copy of the target's text config (the class of
  the target's own decoder layers, ``layer_idx=0``, full attention); no modeling code is copied.
  Its attention runs through a registered attention function (``ATTENTION_NAME``) that hands each
  call to the ``specdec.attention.MaskedState`` (drafting: the head's KV cache + an explicit tree
  mask) or training state passed in the call, else behaves as SDPA (causal).
- **No final norm**: as in EAGLE-1 the layer's output (the residual stream) is the predicted
  feature itself and goes straight into the target's LM head, so it is regressed on ``f_p`` in the
  space the LM head reads. (EAGLE-1 also drops the layer's input norm; here the stock layer keeps
  its ``input_layernorm``, a trained RMSNorm after ``fc``: harmless, and no module surgery.)
- **Multi-layer features** (EAGLE-3; ``EagleConfig.feature_layers``): a head may read, instead of
  ``f_p``, the concatenated outputs ``g_p`` of k decoder layers of the target (the residual stream
  after each, before the final norm; ``[k * H]``), which a trained ``fuse`` (Linear ``kH -> H``, no
  bias) brings down to H before the pair projection::

      x_p = fc(concat(embed(t_p), fuse(g_{p-1})))       committed tokens (the target's features exist)
      x_p = fc(concat(embed(t_p), y_{p-1}))             drafted tokens: the head's own output, as above

  so ``fuse`` only ever sees the target's features and the rest of the head is unchanged; ``y_p`` is
  still regressed on the final feature ``f_p`` and read by the target's LM head. EAGLE-3's choice,
  ``default_feature_layers(L)``: a low, a middle and a high layer, the outputs of layers 2, L // 2
  and L - 3 (0-based; e.g. 2, 14, 25 for a 28-layer target). ``feature_layers = None`` (every head
  saved before the field existed) is the single final feature above: no ``fuse``, same outputs.
  The engine supplies the layers' outputs (``specdec.drafting``: the drafter's ``feature_layers``).
- The target's input embedding, rotary embedding and LM head are used frozen and never stored:
  ``eagle_head.safetensors`` holds only ``fc.*`` and ``layer.*`` (and ``fuse.*``; float32), next to
  ``eagle_config.json`` (hidden size, vocabulary, the target's architecture / model type / layer
  count / decoder-layer class, the feature layers, training notes). Loading checks them against the target. Heads
  trained by ``train-eagle`` also carry ``draft_vocab.safetensors``: every token id ranked by its
  count in the training answers (``token_ids`` int32 ``[V]``, most frequent first, ties by smaller
  id) and those counts (``counts`` int64 ``[V]``); ``eagle_config.json`` names it
  (``"token_frequencies"``). A head without them loads with ``token_ids = None``.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec import hf
from specdec.attention import STATE_KWARG

__all__ = [
    "ATTENTION_NAME",
    "CONFIG_NAME",
    "VOCAB_NAME",
    "WEIGHTS_NAME",
    "EagleConfig",
    "EagleHead",
    "TargetParts",
    "default_feature_layers",
    "parse_feature_layers",
    "rank_tokens",
]

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "eagle_head.safetensors"
#: Token frequencies of the training answers (``token_ids`` ranked, ``counts``), beside the head.
VOCAB_NAME = "draft_vocab.safetensors"
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

    state = kwargs.pop(STATE_KWARG, None)
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
        feature_layers: None: the head reads the target's final hidden state (EAGLE-1); else the
            strictly increasing indices (``0 <= i < num_target_layers``) of the decoder layers
            whose outputs it reads, concatenated and fused (EAGLE-3; see the module doc). Absent
            from configs saved before it existed: None.
    """

    hidden_size: int
    vocab_size: int
    architecture: str
    model_type: str
    num_target_layers: int
    layer_class: str
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        layers = self.feature_layers
        if layers is None:
            return
        ok = (isinstance(layers, tuple) and len(layers) > 0
              and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_target_layers
                      for i in layers) and all(a < b for a, b in zip(layers, layers[1:])))  # fmt: skip
        if not ok:
            raise ValueError(f"feature_layers: expected None or a tuple of strictly increasing layer indices in "
                             f"[0, {self.num_target_layers}), got {layers!r}")  # fmt: skip

    @classmethod
    def from_target(cls, target, feature_layers: tuple[int, ...] | None = None) -> "EagleConfig":
        text = target.config.get_text_config()
        return cls(
            hidden_size=int(text.hidden_size),
            vocab_size=hf.vocab_size(target),
            architecture=type(target).__name__,
            model_type=str(text.model_type),
            num_target_layers=int(text.num_hidden_layers),
            layer_class=_decoder_layer_class(target).__name__,
            feature_layers=feature_layers,
        )

    def check(self, target, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` unless this head fits ``target`` (every field but the
        head's own ``feature_layers``)."""
        want = EagleConfig.from_target(target)
        for f in fields(self):
            if f.name == "feature_layers":  # the head's choice (within num_target_layers, checked when made)
                continue
            got, expected = getattr(self, f.name), getattr(want, f.name)
            if got != expected:
                raise ValueError(f"{name}: expected a head for the target's {f.name} = {expected!r}, got {got!r} "
                                 "(the head was made for another model)")  # fmt: skip


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high feature layers of a ``num_layers``-layer target: the outputs of
    layers 2, ``num_layers // 2`` and ``num_layers - 3`` (0-based), each clamped to the layers there
    are, without repeats (fewer than three for targets of fewer than 6 layers), ascending."""
    return parse_feature_layers("low,mid,high", num_layers)


#: ``parse_feature_layers``'s names: a layer index of a ``num_layers``-layer target each
_NAMED_LAYERS = {"low": lambda n: 2, "mid": lambda n: n // 2, "high": lambda n: n - 3}


def parse_feature_layers(spec: str, num_layers: int, name: str = "feature_layers") -> tuple[int, ...] | None:
    """The feature layers a spec names (``train-eagle --feature-layers``), for a ``num_layers``-layer target.

    ``"final"``: None (the final hidden state, EAGLE-1's feature). Else comma-separated items, each a
    layer index (negative: counted from the end, ``-1`` = the last layer) or one of ``low`` / ``mid``
    / ``high`` (layers 2, ``num_layers // 2``, ``num_layers - 3``: ``default_feature_layers``; names
    are clamped to ``[0, num_layers)``). Returns the distinct layers in ascending order. Raises
    ValueError naming ``name`` for an unknown item or an index outside the target.
    """
    text = spec.strip().lower()
    if text == "final":
        return None
    items = [t.strip() for t in text.split(",")]
    layers = []
    for item in items:
        if item in _NAMED_LAYERS:
            layers.append(min(max(_NAMED_LAYERS[item](num_layers), 0), num_layers - 1))
            continue
        try:
            index = int(item)
        except ValueError:
            index = None
        if index is None or not -num_layers <= index < num_layers:
            raise ValueError(f"{name}: expected 'final' or comma-separated layer indices in [{-num_layers}, "
                             f"{num_layers}) or low / mid / high, got {spec!r}")  # fmt: skip
        layers.append(index % num_layers)
    return tuple(sorted(set(layers)))


def rank_tokens(counts: torch.Tensor) -> torch.Tensor:
    """Token ids by decreasing ``counts`` (int ``[V]``, indexed by id), ties to the smaller id: the
    ranking ``draft_vocab`` (and ``train-eagle --train-vocab``) takes its N most frequent tokens from."""
    return torch.sort(-counts, stable=True).indices


class EagleHead(nn.Module):
    """EAGLE draft head: ``fc`` (2H -> H) and one decoder layer of the target's architecture; with
    ``feature_layers``, also ``fuse`` (kH -> H) of the target's k layers' outputs (EAGLE-3).

    Args:
        target: the target causal LM; only its config and decoder-layer class are read here (the
            frozen embedding / rotary / LM head are passed to ``forward`` as ``TargetParts``).
        feature_layers: None (default): the head reads the target's final hidden state; else the
            target's decoder layers whose outputs it reads (``EagleConfig.feature_layers``; e.g.
            ``default_feature_layers(L)``).

    Parameters start from PyTorch's default initialization (float32, CPU); ``.to()`` as needed.
    """

    def __init__(self, target, feature_layers: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.config = EagleConfig.from_target(target, feature_layers)
        cfg = copy.deepcopy(target.config.get_text_config())
        if getattr(cfg, "layer_types", None):  # the head's one layer always attends to everything
            cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
        _register_attention()
        cfg._attn_implementation = ATTENTION_NAME
        self.layer_config = cfg
        hidden = self.config.hidden_size
        #: ``[.., k * H] -> [.., H]``: the target's k layer features to the head's feature (None: the final one as is)
        self.fuse = None if feature_layers is None else nn.Linear(len(feature_layers) * hidden, hidden, bias=False)
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

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads (``DraftContext.hidden``'s rows): ``k * H`` with
        k feature layers, else H."""
        layers = self.config.feature_layers
        return self.config.hidden_size * (1 if layers is None else len(layers))

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input feature of the target's features ``[.., feature_width]``: ``fuse`` of them
        (``[.., H]`` in the head's dtype), or ``features`` itself for a final-feature head. Only the
        target's features go through it; the head's own outputs are already its features."""
        if self.fuse is None:
            return features
        return self.fuse(features.to(self.fuse.weight.dtype))

    def forward(self, parts: TargetParts, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                state: Any = None) -> torch.Tensor:  # fmt: skip
        """Predicted features of the pairs ``(features[b, i], input_ids[b, i])``.

        Args:
            parts: the target's frozen modules.
            input_ids: int64 ``[B, m]``, the token of each pair (``t_p``).
            features: float ``[B, m, H]`` (any dtype), the feature before it: the target's
                (``f_{p-1}``; with feature layers ``fuse_features(g_{p-1})``) or a predicted one.
            positions: int64 ``[B, m]``, the pairs' positions p (rotary embedding).
            state: None = causal self-attention over the m pairs (SDPA); else an object with
                ``attend(module, query, key, value, scaling, sliding_window, softcap)`` (e.g.
                ``specdec.attention.MaskedState`` over the head's KV cache), handed every attention call.

        Returns:
            ``[B, m, H]`` in the head's dtype: the predicted ``f_p`` (the LM head's input).
        """
        w = self.fc.weight
        emb = parts.embed(input_ids.to(parts.embed.weight.device))
        x = self.fc(torch.cat([emb.to(w.dtype), features.to(w.dtype)], dim=-1))
        pe = parts.position_embeddings(x, positions.to(x.device))
        extra = {} if state is None else {STATE_KWARG: state}
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
        """Write ``eagle_head.safetensors`` (float32, ``fc.*``, ``layer.*``, ``fuse.*`` with feature layers)
        and ``eagle_config.json``, and ``draft_vocab.safetensors`` when the head has token frequencies
        (``set_token_counts``)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # copies: a drafter fuses the head's projections, whose weights are then views of one tensor
        state = {k: v.detach().float().cpu().clone() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        layers = self.config.feature_layers
        feature = ("the target's final hidden state" if layers is None
                   else f"fuse({len(layers)}H -> H) of the outputs of the target's layers {list(layers)} (eagle-3)")
        doc = {**asdict(self.config), "head": f"eagle: fc(2H -> H) + 1 decoder layer, no final norm, on {feature}; "
               "the target's embedding, rotary embedding and LM head are used frozen and not stored",
               **meta}  # fmt: skip
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
        required = [f.name for f in fields(EagleConfig) if f.name != "feature_layers"]
        missing = [k for k in required if k not in doc]
        if missing:
            raise ValueError(f"{name}: {cfg_file} lacks the entry {missing[0]!r}")
        layers = doc.get("feature_layers")  # absent: a head saved before multi-layer features
        try:
            saved = EagleConfig(**{k: doc[k] for k in required},
                                feature_layers=None if layers is None else tuple(layers))  # fmt: skip
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: {cfg_file}: {e}") from None
        saved.check(target, name)
        head = cls(target, saved.feature_layers)
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


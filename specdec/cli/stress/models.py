"""The models of a stress run: random tiny ones built from configs, or pretrained ones loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.cli.stress.config import PAD, StressConfig
from specdec.dtypes import parse_dtype

__all__ = ["StressModels", "build_tiny_models", "load_models"]


@dataclass
class StressModels:
    """The models a run uses (built once; tests share them across runs).

    Attributes:
        target: the target causal LM (on ``device``, in ``dtype``).
        draft: the draft LM (None when no call needs it).
        heads: ``drafters.medusa.MedusaHeads`` for the target (None when no call needs them).
        description: what was loaded, for the report.
    """

    target: Any
    draft: Any = None
    heads: Any = None
    description: str = ""

    @property
    def device(self):
        from specdec import hf

        return hf.input_device(self.target)

    @property
    def vocab_size(self) -> int:
        from specdec import hf

        return hf.vocab_size(self.target)


def _tiny_config(family: str, layers: int, hidden: int, vocab: int, positions: int):
    import transformers as tf

    cls = tf.Qwen2Config if family == "qwen2" else tf.LlamaConfig
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
               tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)  # fmt: skip


def build_tiny_models(family: str = "qwen2", layers: int = 2, hidden: int = 128, vocab: int = 512,
                      positions: int = 4096, seed: int = 0, dtype=None, device=None) -> StressModels:  # fmt: skip
    """Random tiny target + draft + Medusa heads.

    The target has ``layers`` layers with N(0, 0.2) matrices (decisive argmax: no near ties); its
    layers after the first write to the residual stream at 0.3x scale. The 1-layer draft is the
    target's embeddings, first layer, final norm and LM head: it agrees with the target often
    enough for multi-token acceptances (tau ~3 at depth 3). The 4 Medusa heads are small random
    residual blocks. ``positions`` is the models' context (>= longest prompt + new tokens).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.medusa import MedusaHeads

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(_tiny_config(family, layers, hidden, vocab, positions),
                                              attn_implementation="sdpa")  # fmt: skip
    draft = AutoModelForCausalLM.from_config(_tiny_config(family, 1, hidden, vocab, positions),
                                             attn_implementation="sdpa")  # fmt: skip
    heads = MedusaHeads(hidden, 4)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
        draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        draft.lm_head.load_state_dict(target.lm_head.state_dict())
        for p in heads.parameters():
            p.normal_(0, 0.05)
    dtype = torch.float32 if dtype is None else dtype
    desc = f"tiny {family}: target {layers} layers, draft 1 layer, hidden {hidden}, vocab {vocab}, context {positions}"
    return StressModels(target.to(device, dtype).eval(), draft.to(device, dtype).eval(), heads.to(device, dtype).eval(),
                        desc)  # fmt: skip


def load_models(cfg: StressConfig) -> StressModels:
    """The models of ``cfg``: tiny ones built from configs, or pretrained ones loaded."""
    import torch

    dtype = parse_dtype(cfg.dtype)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r} requested but no CUDA device is available")
    need_draft = "model" in cfg.drafters
    need_heads = "medusa" in cfg.drafters
    if cfg.models == "tiny":
        positions = max(4096, cfg.prompt_lens[1] + cfg.new_tokens[1] + 256)
        return build_tiny_models(cfg.tiny_family, cfg.tiny_layers, cfg.tiny_hidden, cfg.tiny_vocab, positions,
                                 seed=cfg.seed, dtype=dtype, device=device)  # fmt: skip
    from specdec.models import load_model

    target = load_model(cfg.target, dtype=dtype, device=device)
    draft = load_model(cfg.draft, dtype=dtype, device=device) if need_draft else None
    heads = None
    if need_heads:
        from drafters.medusa import MedusaHeads

        if cfg.medusa_heads:
            heads = MedusaHeads.load(cfg.medusa_heads, device=device, dtype=dtype)
        else:
            hidden = target.get_output_embeddings().weight.shape[1]
            heads = MedusaHeads(hidden, 4).to(device, dtype).eval()  # identity blocks: untrained heads
    desc = f"target {cfg.target}" + (f", draft {cfg.draft}" if need_draft else "")
    if need_heads:
        desc += f", Medusa heads {cfg.medusa_heads or '(untrained)'}"
    return StressModels(target, draft, heads, desc)

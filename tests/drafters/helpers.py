"""Fixtures for drafter / CLI tests: a tiny byte-level BPE tokenizer and tiny models saved to disk."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.specdec.helpers import perturbed_copy

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Write a function to add two numbers.\n",
    "assert add(1, 2) == 3\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
]
_CHAT = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
         "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    """A 300-token byte-level BPE tokenizer (pad 0, bos 1, eos 2) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = _CHAT
    return fast


def tiny_lm(vocab: int, seed: int = 0):
    """A 2-layer Qwen2 with larger-than-default weights (decisive argmax), fp32, eval mode."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model.eval()


def save_tiny_pair(root: Path) -> tuple[Path, Path]:
    """Save a tiny target and a perturbed draft (same tokenizer) as transformers directories."""
    tok = tiny_tokenizer()
    target = tiny_lm(len(tok))
    draft = perturbed_copy(target, 0.05, seed=1)
    out = []
    for name, model in (("target", target), ("draft", draft)):
        d = Path(root) / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        out.append(d)
    return out[0], out[1]


def random_eagle_head(target, seed: int = 0, std: float = 0.2, feature_layers: tuple[int, ...] | None = None):
    """An ``EagleHead`` for ``target`` (reading ``feature_layers``' outputs, if given) with large random
    weights (normal(0, ``std``) matrices: decisive, non-trivial drafts), in eval mode."""
    from drafters.eagle import EagleHead

    torch.manual_seed(seed)
    head = EagleHead(target, feature_layers)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return head.eval()

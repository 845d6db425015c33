"""Tiny offline fixtures for the evaluation tests: a byte-level BPE tokenizer with a chat template,
random-weight target / draft models saved as transformers directories, APPS rows, a drafter factory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 300
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "Solve the following programming problem in Python 3. Your program must read the input from standard "
    "input and print the answer to standard output. Answer with the complete solution in a single ```python "
    "code block. def solve(a, b):\n    return a + b\nfor i in range(n): print(i)\n",
] * 4


def make_tokenizer():
    """A byte-level BPE tokenizer of ``VOCAB`` ids (256 bytes, specials, a few merges) + chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config():
    import transformers as tf

    return tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def make_model(seed: int = 0, noise_from=None, noise: float = 0.0):
    """A random 2-layer Qwen2 (large weights: decisive argmax), or ``noise_from`` plus relative noise."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    with torch.no_grad():
        if noise_from is None:
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.2)
        else:
            model.load_state_dict(noise_from.state_dict())
            gen = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                if p.dim() >= 2:
                    p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    return model.eval()


def save_pair(root: Path) -> tuple[Path, Path]:
    """Save target and draft (each with the tokenizer) under ``root``; return their directories."""
    tok = make_tokenizer()
    target = make_model(0)
    draft = make_model(1, noise_from=target, noise=0.05)
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1]


def apps_rows(path: Path, n: int = 3) -> Path:
    """``n`` small MapCoder-format APPS rows as JSONL."""
    rows = []
    for i in range(n):
        rows.append({
            "id": 100 + i, "name": str(100 + i), "difficulty": ["introductory", "interview"][i % 2],
            "description": f"Problem {i}: read n and print the sum of the first n odd numbers, times {i + 2}.",
            "starter_code": "def solve(n):\n\t" if i % 2 == 0 else "",
            "sample_io": [{"input": "[3]", "output": [9]}],
            "test_list": [{"input": "[3]", "output": [9]}, {"input": "[1]", "output": [1]}],
        })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_files(root: Path, n: int) -> dict[str, str]:
    """The saved pair (``save_pair``) and ``n`` APPS rows under ``root``: ``{"target", "draft", "data"}`` paths."""
    target, draft = save_pair(root)
    return {"target": str(target), "draft": str(draft), "data": str(apps_rows(root / "apps.jsonl", n=n))}


def apps_config(pair: dict[str, str], out, **over):
    """An APPS ``EvalConfig`` on ``pair_files``' models and rows: the tiny drafter at t = 4, 6 new
    tokens, fp32 on the CPU, no warm-up generation, no progress bar, every row; ``over`` replaces any field."""
    from eval.config import EvalConfig

    kw = dict(dataset="apps", target=pair["target"], draft=pair["draft"], drafters=("tests.eval.tiny:make_drafter",),
              tree_sizes=(4,), problems=None, data_path=pair["data"], max_new_tokens=6, dtype="fp32", device="cpu",
              out=str(out), attn_impl="torch", warmup=0, progress=False)  # fmt: skip
    kw.update(over)
    return EvalConfig(**kw)


def make_drafter(draft, tree_size: int | None):
    """Factory for ``--drafter tests.eval.tiny:make_drafter``: the draft model as a top-2 chain tree
    (``tree_size`` None: the engine's per-step budget, ``"auto"``)."""
    from tests.specdec.helpers import DraftModelDrafter

    return DraftModelDrafter(draft, width=2, max_depth=4 if tree_size is None else min(4, tree_size))

"""Shared fixtures for the specdec tests: tiny random-weight models, test drafters and a chi-square check."""

from __future__ import annotations

import copy
import functools
import math

import torch

from specdec.drafting import BaseDrafter, DraftContext
from specdec.hf import prepare_model
from specdec.sampling import logits_to_probs
from specdec.tree import TokenTree

VOCAB = 160

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(family: str):
    """A 2-layer config of ``family``: llama, qwen2, mistral, gemma, gemma2, gemma3."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**_COMMON)
    if family == "qwen2":
        return tf.Qwen2Config(**_COMMON)
    if family == "mistral":
        return tf.MistralConfig(**_COMMON, sliding_window=None)
    if family == "gemma":
        return tf.GemmaConfig(**_COMMON, head_dim=16)
    if family == "gemma2":  # sliding window + attention-logit soft-capping on alternating layers
        return tf.Gemma2Config(**_COMMON, head_dim=16, sliding_window=6, attn_logit_softcapping=20.0,
                               final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    if family == "gemma3":  # a small sliding window so that the windowed path matters
        return tf.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"])
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn: str | None = None,
               layers: int = 2):
    """A random ``tiny_config(family)`` model of ``layers`` decoder layers (a config's ``layer_types``
    pattern repeated)."""
    from transformers import AutoModelForCausalLM

    if attn is None:
        attn = "eager" if family == "gemma2" else "sdpa"  # Gemma 2 has no sdpa (soft-capping)
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    if layers != cfg.num_hidden_layers:
        types = getattr(cfg, "layer_types", None)
        cfg.num_hidden_layers = layers
        if types:
            cfg.layer_types = [types[i % len(types)] for i in range(layers)]
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    # Larger-than-default weights make the argmax decisive (no near-ties between code paths).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model.to(dtype).eval()


def perturbed_copy(model, scale: float, seed: int):
    """A draft model: ``model`` with Gaussian noise of relative size ``scale`` on its matrices."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return draft


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos=None) -> list[int]:
    out = model.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0].tolist()



@functools.lru_cache(maxsize=None)
def prepared_tiny_model(family: str = "qwen2"):
    """One shared ``tiny_model(family)`` after ``hf.prepare_model`` (tests must not modify it)."""
    model = tiny_model(family)
    prepare_model(model)
    return model


def random_prompt(length: int, seed: int) -> torch.Tensor:
    """int64 ``[length]`` random token ids in ``[3, VOCAB)`` (no pad / bos / eos), seeded."""
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def greedy_reference(length: int, seed: int, new: int, family: str = "qwen2") -> tuple[int, ...]:
    """HF greedy ``generate`` of ``random_prompt(length, seed)`` on ``prepared_tiny_model(family)``."""
    return tuple(hf_greedy(prepared_tiny_model(family), random_prompt(length, seed), new))

def build_tree(nodes: list[tuple[int, int]], root: int, draft_probs=None, proposal: str = "topk") -> TokenTree:
    """``nodes``: (parent, token) for nodes 1.. in creation order (parent < own index)."""
    tokens = torch.tensor([root] + [t for _, t in nodes], dtype=torch.int64)
    parents = torch.tensor([-1] + [p for p, _ in nodes], dtype=torch.int64)
    return TokenTree.from_any_order(tokens, parents, draft_probs, proposal)


class OracleDrafter(BaseDrafter):
    """Knows the target's greedy continuation; mixes it with noise nodes (also before it among siblings).

    Each step: a random number of correct chain tokens (sometimes the whole budget), noise nodes
    under random existing nodes, sometimes a wrong token in the chain after which the truth goes on.
    """

    def __init__(self, references: list[list[int]], seed: int = 0, vocab: int = VOCAB):
        self.references = references  # per sequence: prompt + the target's greedy continuation
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab

    def _rand(self, hi: int) -> int:
        return int(torch.randint(hi, (1,), generator=self.gen))

    def propose(self, ctx: DraftContext) -> TokenTree:
        at = len(ctx.tokens)
        truth = self.references[ctx.seq][at : at + ctx.tree_size]
        chain_len = len(truth) if self._rand(3) == 0 else self._rand(len(truth) + 1)
        wrong_at = self._rand(chain_len + 1) if self._rand(2) else -1
        nodes: list[tuple[int, int]] = []
        tip, k = 0, 0
        while len(nodes) < ctx.tree_size and (k < chain_len or self._rand(4)):
            if k < chain_len and self._rand(3):
                tok = truth[k] if k != wrong_at else (truth[k] + 1) % self.vocab_size
                nodes.append((tip, tok))
                tip, k = len(nodes), k + 1
            else:
                nodes.append((self._rand(len(nodes) + 1), self._rand(self.vocab_size)))
        return build_tree(nodes, int(ctx.tokens[-1]))


class RandomTreeDrafter(BaseDrafter):
    """Adversarial: a random tree of exactly ``tree_size`` nodes with random tokens."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab

    def propose(self, ctx: DraftContext) -> TokenTree:
        nodes = []
        for i in range(ctx.tree_size):
            parent = int(torch.randint(i + 1, (1,), generator=self.gen))
            nodes.append((parent, int(torch.randint(self.vocab_size, (1,), generator=self.gen))))
        return build_tree(nodes, int(ctx.tokens[-1]))


class DraftModelDrafter(BaseDrafter):
    """A small draft LM (recomputed from scratch, no cache): a chain with alternatives at each level.

    Greedy / ``topk``: at each chain node the top ``width`` tokens are children, the first continues
    the chain. ``iid`` / ``no_replacement``: ``width`` children drawn from the warped draft
    distribution (with / without replacement), the first continues the chain; ``draft_probs``
    hold that distribution.
    """

    def __init__(self, model, width: int = 2, max_depth: int = 6, proposal: str = "topk"):
        self.model = model
        self.width = width
        self.max_depth = max_depth
        self.proposal = proposal
        self.vocab_size = model.config.vocab_size

    @torch.no_grad()
    def _dist(self, ids: list[int], ctx: DraftContext) -> torch.Tensor:
        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        if ctx.sampling is None:
            return logits.softmax(-1)
        return logits_to_probs(logits, ctx.sampling)

    def propose(self, ctx: DraftContext) -> TokenTree:
        ids = ctx.tokens.tolist()
        nodes: list[tuple[int, int]] = []
        rows: dict[int, torch.Tensor] = {}
        tip = 0
        while len(nodes) < ctx.tree_size and len(rows) < self.max_depth:
            q = self._dist(ids, ctx)
            rows[tip] = q
            k = min(self.width, ctx.tree_size - len(nodes))
            if ctx.sampling is None or self.proposal == "topk":
                picks = torch.topk(q, k).indices.tolist()
            else:
                picks = torch.multinomial(q, k, replacement=self.proposal == "iid", generator=ctx.generator).tolist()
            first = len(nodes) + 1
            nodes.extend((tip, t) for t in picks)
            tip = first
            ids.append(picks[0])
        probs = None
        if ctx.sampling is not None and self.proposal != "topk":
            probs = torch.zeros(len(nodes) + 1, self.vocab_size)
            for node, q in rows.items():
                probs[node] = q
        return build_tree(nodes, int(ctx.tokens[-1]), probs, self.proposal)


def token_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """The token sequences of every root-to-node path (root token excluded), as a set."""
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(1, tree.n):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = par[j]
        out.add(tuple(reversed(path)))
    return out


def chi2_fails(counts: torch.Tensor, expected_probs: torch.Tensor, alpha_z: float = 3.719) -> bool:
    """True if the counts are implausible under ``expected_probs`` (one-sided z = 3.719: alpha = 1e-4)."""
    n = counts.sum()
    exp = expected_probs.flatten().double() * n
    obs = counts.flatten().double()
    if bool(((exp == 0) & (obs > 0)).any()):
        return True
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat > crit

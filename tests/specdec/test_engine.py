"""End to end: speculative greedy decoding is token-for-token the target's own greedy ``generate``."""

from __future__ import annotations

import functools

import pytest
import torch

import specdec
from specdec.drafting import BaseDrafter, DraftContext
from specdec import SpecDecoder, TokenTree
from tests.specdec.helpers import (
    VOCAB,
    DraftModelDrafter,
    OracleDrafter,
    RandomTreeDrafter,
    hf_greedy,
    perturbed_copy,
    tiny_config,
    tiny_model,
)

NEW = 40


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(family: str):
    return tiny_model(family)


@functools.lru_cache(maxsize=None)
def _draft(family: str):
    return perturbed_copy(_model(family), 0.05, seed=1)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _reference(family: str, length: int, seed: int, new: int = NEW) -> tuple[int, ...]:
    return tuple(hf_greedy(_model(family), _prompt(length, seed), new))


def _make_drafter(kind: str, family: str, ref):
    if kind == "none":
        return None
    if kind == "oracle":
        return OracleDrafter([list(ref)], seed=3)
    if kind == "random":
        return RandomTreeDrafter(seed=4)
    if kind == "draft_model":
        return DraftModelDrafter(_draft(family), width=3, max_depth=8)
    raise ValueError(kind)


CASES = (
    [("oracle", size) for size in (1, 4, 31, 64, 65)]
    + [("none", 0), ("oracle", 0), ("random", 4), ("random", 65), ("draft_model", 1), ("draft_model", 4), ("draft_model", 31)]
)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind,tree_size", CASES)
def test_greedy_equals_target_generate(family, kind, tree_size):
    ref = _reference(family, 10, 0)
    drafter = _make_drafter(kind, family, ref)
    dec = SpecDecoder(_model(family), drafter, tree_size=tree_size, attn_impl="torch")
    out = dec.generate(_prompt(10, 0), NEW)
    assert out.sequences[0].tolist() == list(ref)
    assert out.num_new_tokens == NEW
    assert all(p <= tree_size for s in out.steps for p in s.nodes_proposed)
    if kind == "oracle" and tree_size >= 4:
        assert len(out.steps) < NEW / 2  # the oracle's chains are mostly accepted
    if kind == "none":
        assert len(out.steps) == NEW


@pytest.mark.parametrize("family", ["mistral", "gemma", "gemma2", "gemma3"])
def test_greedy_other_families(family):
    ref = _reference(family, 9, 1, 24)
    for kind, size in (("oracle", 31), ("draft_model", 6)):
        dec = SpecDecoder(_model(family), _make_drafter(kind, family, ref), tree_size=size, attn_impl="torch")
        assert dec.generate(_prompt(9, 1), 24).sequences[0].tolist() == list(ref), kind


def test_static_shapes_and_fixed_cache_reuse():
    ref = _reference("llama", 10, 0)
    dec = SpecDecoder(_model("llama"), OracleDrafter([list(ref)], seed=5), tree_size=31, static_shapes=True,
                      max_cache_len=128, attn_impl="torch")
    for _ in range(2):  # the second call reuses the same buffers
        assert dec.generate(_prompt(10, 0), NEW).sequences[0].tolist() == list(ref)
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt \+ max_new_tokens \+ tree_size needs 131 cache slots"):
        dec.generate(_prompt(10, 0), 90)


def test_eos_stops_like_generate():
    ref = _reference("qwen2", 10, 0)
    eos = ref[10 + 15]
    first = ref.index(eos, 10)
    want = hf_greedy(_model("qwen2"), _prompt(10, 0), NEW, eos=eos)
    assert want == list(ref[: first + 1])
    dec = SpecDecoder(_model("qwen2"), OracleDrafter([list(ref)], seed=6), tree_size=8, attn_impl="torch")
    out = dec.generate(_prompt(10, 0), NEW, eos_token_id=eos)
    assert out.sequences[0].tolist() == want


def test_batch_of_different_lengths():
    lengths, seeds = (4, 1, 12), (10, 11, 12)
    refs = [list(_reference("llama", L, s, 20)) for L, s in zip(lengths, seeds)]
    prompts = [_prompt(L, s) for L, s in zip(lengths, seeds)]
    eos = refs[0][4 + 6]  # sequence 0 stops early, the others go on
    refs[0] = refs[0][: refs[0].index(eos, 4) + 1]
    for seq in (1, 2):
        if eos in refs[seq][lengths[seq]:]:
            refs[seq] = refs[seq][: refs[seq].index(eos, lengths[seq]) + 1]
    dec = SpecDecoder(_model("llama"), OracleDrafter(refs, seed=7), tree_size=6, attn_impl="torch")
    out = dec.generate(prompts, 20, eos_token_id=eos)
    for b in range(3):
        assert out.sequences[b, : out.lengths[b]].tolist() == refs[b]
        assert out.new_tokens(b).tolist() == refs[b][lengths[b]:]
    assert (out.sequences[0, out.lengths[0]:] == eos).all()  # padded with the eos id
    # The same prompts as a left-padded [B, L] tensor with an attention mask.
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    out2 = dec.generate(ids, 20, eos_token_id=eos, attention_mask=mask)
    assert torch.equal(out2.sequences, out.sequences)


@pytest.mark.parametrize("proposal", ["topk", "iid", "no_replacement"])
def test_sampling_with_one_hot_target_is_greedy(proposal):
    ref = _reference("llama", 10, 0, 16)
    drafter = DraftModelDrafter(_draft("llama"), width=3, max_depth=5, proposal=proposal)
    dec = SpecDecoder(_model("llama"), drafter, tree_size=12, attn_impl="torch")
    gen = torch.Generator().manual_seed(0)
    out = dec.generate(_prompt(10, 0), 16, do_sample=True, top_k=1, temperature=0.8, generator=gen)
    assert out.sequences[0].tolist() == list(ref)


def test_sampling_is_reproducible():
    drafter = DraftModelDrafter(_draft("llama"), width=2, max_depth=4, proposal="iid")
    dec = SpecDecoder(_model("llama"), drafter, tree_size=8, attn_impl="torch")
    runs = [dec.generate(_prompt(10, 0), 16, do_sample=True, temperature=1.5, top_p=0.95,
                         generator=torch.Generator().manual_seed(s)).sequences for s in (0, 0, 1)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


class _BatchCounting(OracleDrafter):
    """The oracle, proposing a step's sequences through ``propose_batch`` (counted)."""

    def __init__(self, refs, seed, extra: int = 0):
        super().__init__(refs, seed=seed)
        self.batch_calls: list[list[int]] = []
        self.extra = extra

    def propose_batch(self, contexts):
        self.batch_calls.append([c.seq for c in contexts])
        return [self.propose(c) for c in contexts] + [self.propose(contexts[0])] * self.extra


def test_a_batch_is_drafted_in_one_propose_batch_call_per_step():
    lengths, seeds = (4, 1, 12), (10, 11, 12)
    refs = [list(_reference("llama", L, s, 12)) for L, s in zip(lengths, seeds)]
    prompts = [_prompt(L, s) for L, s in zip(lengths, seeds)]
    drafter = _BatchCounting(refs, seed=7)
    out = SpecDecoder(_model("llama"), drafter, tree_size=6, attn_impl="torch").generate(prompts, 12)
    for b in range(3):
        assert out.sequences[b, : out.lengths[b]].tolist() == refs[b]
    assert drafter.batch_calls and all(seqs == sorted(seqs) and len(seqs) >= 2 for seqs in drafter.batch_calls)
    assert drafter.batch_calls[0] == [0, 1, 2]
    bad = SpecDecoder(_model("llama"), _BatchCounting(refs, seed=7, extra=1), tree_size=6, attn_impl="torch")
    with pytest.raises(ValueError, match=r"drafter: expected propose_batch to return 3 trees \(one per context\), got 4"):
        bad.generate(prompts, 12)


class _IidFixedDrafter(BaseDrafter):
    """Draws a depth-2 tree i.i.d. (3 children, then 2 each) from a fixed distribution ``q``."""

    def __init__(self, q: torch.Tensor, proposal: str):
        self.q = q
        self.proposal = proposal
        self.vocab_size = q.shape[0]

    def propose(self, ctx: DraftContext) -> TokenTree:
        draw = lambda k: torch.multinomial(self.q, k, replacement=self.proposal == "iid", generator=ctx.generator)
        tokens, parents = [int(ctx.tokens[-1])], [-1]
        for x in draw(3).tolist():
            me = len(tokens)
            tokens.append(x)
            parents.append(0)
            for y in draw(2).tolist():
                tokens.append(y)
                parents.append(me)
        probs = self.q.expand(len(tokens), -1)
        return TokenTree(torch.tensor(tokens), torch.tensor(parents), probs, self.proposal)


def test_sampled_tokens_follow_the_target_distribution(proposal="iid"):
    """Empirical joint of the first two sampled tokens vs the warped target (top_k=3: 9 cells)."""
    from specdec.sampling import SamplingConfig, logits_to_probs
    from tests.specdec.helpers import chi2_fails

    model, prompt, cfg = _model("llama"), _prompt(10, 0), SamplingConfig(temperature=2.0, top_k=3)
    with torch.no_grad():
        p1 = logits_to_probs(model(prompt[None]).logits[0, -1], cfg)
        first = p1.nonzero().flatten().tolist()
        p2 = {x: logits_to_probs(model(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1], cfg)
              for x in first}
    cells = sorted({(x, int(y)) for x in first for y in p2[x].nonzero().flatten()})
    expected = torch.tensor([float(p1[x] * p2[x][y]) for x, y in cells])
    support = sorted({t for c in cells for t in c} | {5, 6, 7})
    q = torch.zeros(VOCAB)
    q[support] = 1.0
    q[support[0]] = 4.0  # a skewed proposal
    q /= q.sum()
    dec = SpecDecoder(model, _IidFixedDrafter(q, proposal), tree_size=9, attn_impl="torch")
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(cells))
    index = {c: i for i, c in enumerate(cells)}
    for _ in range(1000):
        new = dec.generate(prompt, 2, do_sample=True, temperature=2.0, top_k=3, generator=gen).new_tokens(0)
        counts[index[tuple(new.tolist())]] += 1
    assert not chi2_fails(counts, expected)


def test_wrap_generate_is_drop_in():
    model = _model("qwen2")
    prompt = _prompt(10, 0)[None]
    want = model.generate(prompt, max_new_tokens=30, pad_token_id=0)
    ref = _reference("qwen2", 10, 0)
    fast = specdec.wrap(model, OracleDrafter([list(ref)], seed=8), tree_size=16, attn_impl="torch")
    got = fast.generate(prompt, max_new_tokens=30)
    assert torch.equal(got, want)
    assert fast.config is model.config  # everything else is the model's
    out = fast.generate(prompt, max_new_tokens=30, return_output=True)
    totals = out.totals()
    assert totals["new_tokens"] == want.shape[1] - 10 and totals["steps"] == len(out.steps)
    assert totals["tokens_accepted"] > 0 and out.mean_accepted > 1
    assert all(s.draft_s >= 0 and s.verify_s > 0 and s.commit_s >= 0 for s in out.steps)


def test_device_map_auto_model(tmp_path):
    from transformers import AutoModelForCausalLM

    _model("llama").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto", dtype=torch.float32).eval()
    ref = _reference("llama", 10, 0, 16)
    dec = SpecDecoder(loaded, OracleDrafter([list(ref)], seed=9), tree_size=8, attn_impl="torch")
    assert dec.generate(_prompt(10, 0), 16).sequences[0].tolist() == list(ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_generate_runs(dtype):
    model = tiny_model("qwen2", dtype=dtype)
    drafter = DraftModelDrafter(perturbed_copy(model, 0.05, seed=2), width=2, max_depth=4)
    out = SpecDecoder(model, drafter, tree_size=8, attn_impl="torch").generate(_prompt(10, 0), 16)
    assert out.num_new_tokens == 16 and out.totals()["tokens_accepted"] > 0
    sampled = SpecDecoder(model, drafter, tree_size=8, attn_impl="torch").generate(
        _prompt(10, 0), 8, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert sampled.num_new_tokens == 8


# ---------------------------------------------------------------------------- bad input


class _Fixed(BaseDrafter):
    def __init__(self, tree_fn, vocab=VOCAB):
        self.tree_fn = tree_fn
        self.vocab_size = vocab

    def propose(self, ctx: DraftContext) -> TokenTree:
        return self.tree_fn(ctx)


def test_input_errors():
    dec = SpecDecoder(_model("llama"), None, attn_impl="torch")
    with pytest.raises(ValueError, match=r"input_ids: expected a non-empty prompt"):
        dec.generate(torch.tensor([], dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"input_ids: expected a non-empty prompt, got an empty prompt for sequence 1"):
        dec.generate([torch.tensor([5, 6]), torch.tensor([], dtype=torch.long)], 5)
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt \(10 tokens\) \+ max_new_tokens \(250\) exceeds the target's context of 256"):
        dec.generate(_prompt(10, 0), 250)
    with pytest.raises(ValueError, match=r"max_new_tokens: expected an int >= 1, got 0"):
        dec.generate(_prompt(10, 0), 0)
    with pytest.raises(ValueError, match=r"input_ids: expected token ids in \[0, 160\)"):
        dec.generate(torch.tensor([5, 999]), 3)
    with pytest.raises(ValueError, match=r"input_ids: expected integer token ids"):
        dec.generate(torch.tensor([5.0, 3.0]), 3)
    with pytest.raises(ValueError, match=r"input_ids: expected shape \[L\] or \[B, L\]"):
        dec.generate(torch.zeros(1, 2, 3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"attention_mask\[0\]: expected one contiguous run of 1s"):
        dec.generate(torch.tensor([[4, 5, 6]]), 3, attention_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask: expected input_ids' shape"):
        dec.generate(torch.tensor([[4, 5, 6]]), 3, attention_mask=torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match=r"temperature: expected a finite float > 0"):
        dec.generate(_prompt(10, 0), 3, do_sample=True, temperature=0.0)


def test_construction_errors():
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig, T5Config, T5ForConditionalGeneration

    model = _model("llama")
    with pytest.raises(ValueError, match=r"drafter: expected the target's vocabulary size 160, got vocab_size=999"):
        SpecDecoder(model, RandomTreeDrafter(vocab=999))
    with pytest.raises(ValueError, match=r"drafter: expected the specdec.drafting.Drafter protocol, missing propose"):
        SpecDecoder(model, object())
    with pytest.raises(ValueError, match=r"tree_size: expected an int >= 0 or .auto., got -1"):
        SpecDecoder(model, RandomTreeDrafter(), tree_size=-1)
    with pytest.raises(ValueError, match=r"attn_impl: expected 'auto', 'triton' or 'torch'"):
        SpecDecoder(model, None, attn_impl="flash")
    with pytest.raises(ValueError, match=r"max_cache_len: expected None or an int >= 2"):
        SpecDecoder(model, None, max_cache_len=1)
    with pytest.raises(ValueError, match=r"target: expected a transformers PreTrainedModel"):
        SpecDecoder(torch.nn.Linear(2, 2), None)
    bert = AutoModelForMaskedLM.from_config(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                       num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match=r"target: expected a causal LM that can generate .* got BertForMaskedLM"):
        SpecDecoder(bert, None)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(ValueError, match=r"target: expected a decoder-only causal LM, got an encoder-decoder model"):
        SpecDecoder(t5, None)
    cfg = tiny_config("gemma3")
    cfg.use_bidirectional_attention = True
    bidir = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"target: expected causal attention, got a model configured as bidirectional"):
        SpecDecoder(bidir, None)


def test_drafter_contract_errors():
    model = _model("llama")
    prompt = _prompt(6, 0)
    too_big = _Fixed(lambda ctx: TokenTree.chain(torch.cat([ctx.tokens[-1:], torch.tensor([3, 4, 5])])))
    with pytest.raises(ValueError, match=r"drafter: expected at most tree_size = 2 nodes besides the root, got 3"):
        SpecDecoder(model, too_big, tree_size=2, attn_impl="torch").generate(prompt, 5)
    wrong_root = _Fixed(lambda ctx: TokenTree.chain(torch.tensor([int(ctx.tokens[-1]) + 1, 4])))
    with pytest.raises(ValueError, match=r"drafter: expected the tree's root token to be the last committed token"):
        SpecDecoder(model, wrong_root, tree_size=2, attn_impl="torch").generate(prompt, 5)
    not_a_tree = _Fixed(lambda ctx: [1, 2])
    with pytest.raises(ValueError, match=r"drafter: propose\(\) must return a specdec.TokenTree, got list"):
        SpecDecoder(model, not_a_tree, tree_size=2, attn_impl="torch").generate(prompt, 5)
    no_probs = _Fixed(lambda ctx: TokenTree.chain(torch.cat([ctx.tokens[-1:], torch.tensor([3])]), proposal="iid"))
    with pytest.raises(ValueError, match=r"drafter: a 'iid' tree needs draft_probs for stochastic verification"):
        SpecDecoder(model, no_probs, tree_size=2, attn_impl="torch").generate(prompt, 5, do_sample=True)
    out_of_vocab = _Fixed(lambda ctx: TokenTree.chain(torch.cat([ctx.tokens[-1:], torch.tensor([3, VOCAB])])))
    with pytest.raises(ValueError, match=rf"drafter: expected token ids < V = {VOCAB} \(the target's vocabulary\), got {VOCAB}"):
        SpecDecoder(model, out_of_vocab, tree_size=2, attn_impl="torch").generate(prompt, 5)
    small_probs = _Fixed(lambda ctx: TokenTree.chain(torch.cat([ctx.tokens[-1:], torch.tensor([3])]),
                                                     torch.full((2, VOCAB + 1), 1.0 / (VOCAB + 1)), "iid"))
    with pytest.raises(ValueError, match=rf"drafter: expected draft_probs over the target's vocabulary V = {VOCAB}, got {VOCAB + 1}"):
        SpecDecoder(model, small_probs, tree_size=2, attn_impl="torch").generate(prompt, 5, do_sample=True)


def test_cache_overflow_is_an_error_not_truncation():
    dec = SpecDecoder(_model("llama"), RandomTreeDrafter(), tree_size=8, max_cache_len=20, attn_impl="torch")
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt \+ max_new_tokens \+ tree_size needs 28 cache slots per sequence, max_cache_len is 20"):
        dec.generate(_prompt(10, 0), 10)

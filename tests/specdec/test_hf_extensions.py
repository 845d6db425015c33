"""Engine / HF extensions used by the drafters: masked forwards, final hidden states, streaming."""

from __future__ import annotations

import pytest
import torch

from specdec.drafting import BaseDrafter, DraftContext
from specdec import KVCache, SpecDecoder
from specdec.hf import masked_forward, prefill, prepare_model, tree_forward
from tests.specdec.helpers import VOCAB, OracleDrafter, hf_greedy, tiny_model
from treeattn import TreeMask


pytestmark = pytest.mark.usefixtures("one_thread")


def _fresh(model, ids: list[int]):
    """(last logits, last final hidden state) of a plain causal forward."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


def _rand(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3"])
def test_masked_forward_over_nodes_of_earlier_forwards(family):
    """Depth-by-depth expansion: queries attend to the prefix and ancestors written by earlier forwards."""
    model = tiny_model(family)
    prepare_model(model)
    prompt = _rand(9, 0)
    base = len(prompt) - 1
    cache = KVCache(1, 40)
    prefill(model, torch.tensor([prompt[:-1]]), cache)
    # forward 1: the root and two children as a small tree (root at slot base, children after it)
    toks1 = [prompt[-1], 11, 12]
    anc1 = [[0], [0, 1], [0, 2]]
    dep1 = [0, 1, 1]
    vis = torch.zeros(1, 3, base + 3, dtype=torch.bool)
    vis[0, :, :base] = True
    for q, a in enumerate(anc1):
        vis[0, q, [base + j for j in a]] = True
    kpos = torch.tensor([list(range(base)) + [base + d for d in dep1]])
    slots = torch.tensor([[base, base + 1, base + 2]])
    logits1 = masked_forward(model, torch.tensor([toks1]), base + torch.tensor([dep1]), slots, vis, cache,
                             key_positions=kpos)
    for q, path in enumerate([[prompt[-1]], [prompt[-1], 11], [prompt[-1], 12]]):
        torch.testing.assert_close(logits1[0, q], _fresh(model, prompt[:-1] + path)[0], atol=2e-5, rtol=1e-4)
    # forward 2: grandchildren under node 2 and node 1 (queries only, attending to earlier keys)
    toks2 = [13, 14]
    anc2 = [[0, 2, 3], [0, 1, 4]]
    dep = dep1 + [2, 2]
    vis = torch.zeros(1, 2, base + 5, dtype=torch.bool)
    vis[0, :, :base] = True
    for q, a in enumerate(anc2):
        vis[0, q, [base + j for j in a]] = True
    kpos = torch.tensor([list(range(base)) + [base + d for d in dep]])
    logits2, hidden2 = masked_forward(model, torch.tensor([toks2]), torch.full((1, 2), base + 2),
                                      torch.tensor([[base + 3, base + 4]]), vis, cache, key_positions=kpos,
                                      return_hidden=True)
    for q, path in enumerate([[prompt[-1], 12, 13], [prompt[-1], 11, 14]]):
        want_logits, want_hidden = _fresh(model, prompt[:-1] + path)
        torch.testing.assert_close(logits2[0, q], want_logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(hidden2[0, q], want_hidden, atol=2e-5, rtol=1e-4)


def test_masked_state_rejects_bad_visibility():
    model = tiny_model("llama")
    prepare_model(model)
    cache = KVCache(1, 8)
    with pytest.raises(ValueError, match=r"visible: expected a bool tensor of shape \[1, 2, kv_len\]"):
        masked_forward(model, torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                       torch.ones(1, 2, 2), cache)
    with pytest.raises(ValueError, match=r"visible: expected kv_len <= the cache capacity 8, got 9"):
        masked_forward(model, torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                       torch.ones(1, 2, 9, dtype=torch.bool), cache)


def test_hidden_states_from_prefill_and_tree_forward():
    model = tiny_model("llama")
    prepare_model(model)
    prompts = [_rand(7, 1), _rand(4, 2)]
    cache = KVCache(2, 20)
    ids = torch.zeros(2, 6, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p) - 1] = torch.tensor(p[:-1])
    h = prefill(model, ids, cache, hidden_at=torch.tensor([len(p) - 2 for p in prompts]))
    for b, p in enumerate(prompts):
        torch.testing.assert_close(h[b], _fresh(model, p[:-1])[1], atol=2e-5, rtol=1e-4)
    cache.lengths = [len(p) - 1 for p in prompts]
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    tokens = torch.tensor([[prompts[0][-1], 5, 6, 7], [prompts[1][-1], 8, 9, 10]])
    logits, hidden = tree_forward(model, tokens, TreeMask.from_parents(parents), torch.tensor(cache.lengths), cache,
                                  return_hidden=True)
    assert hidden.shape == (2, 4, model.config.hidden_size)
    torch.testing.assert_close(hidden[0, 3], _fresh(model, prompts[0][:-1] + [prompts[0][-1], 5, 7])[1],
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(hidden[1, 3], _fresh(model, prompts[1] + [8, 9, 10])[1], atol=2e-5, rtol=1e-4)


class _HiddenProbe(OracleDrafter):
    """Checks DraftContext.hidden against a fresh forward at every step."""

    needs_hidden_states = True

    def __init__(self, model, refs):
        super().__init__(refs, seed=5)
        self.model = model
        self.checked = 0

    def propose(self, ctx: DraftContext):
        toks = ctx.tokens.tolist()
        if len(toks) == 1:
            assert ctx.hidden is None
        else:
            assert ctx.hidden.shape == (1, self.model.config.hidden_size)  # needs_hidden_states=True: the last row
            torch.testing.assert_close(ctx.hidden[-1], _fresh(self.model, toks[:-1])[1], atol=3e-5, rtol=1e-4)
            self.checked += 1
        return super().propose(ctx)


@pytest.mark.parametrize("static", [False, True])
def test_engine_passes_hidden_state_of_the_root_predictor_and_streams(static):
    model = tiny_model("qwen2")
    prompts = [torch.tensor(_rand(6, 3)), torch.tensor(_rand(1, 4))]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    probe = _HiddenProbe(model, refs)
    dec = SpecDecoder(model, probe, tree_size=5, attn_impl="torch", static_shapes=static)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    out = dec.generate(prompts, 12, on_tokens=lambda b, toks: streamed[b].extend(toks))
    for b in range(2):
        assert out.sequences[b, : out.lengths[b]].tolist() == refs[b]
        assert streamed[b] == out.new_tokens(b).tolist()
    assert probe.checked >= len(out.steps)


def test_plain_drafters_get_no_hidden_state():
    class Probe(BaseDrafter):
        def propose(self, ctx):
            assert ctx.hidden is None
            from drafters._build import root_only

            return root_only(int(ctx.tokens[-1]))

    model = tiny_model("llama")
    SpecDecoder(model, Probe(), tree_size=3, attn_impl="torch").generate(torch.tensor(_rand(5, 6)), 3)

"""DraftModelDrafter: tree validity and size, draft-KV reuse vs recomputation, greedy equality, sampling."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from specdec.drafting import BaseDrafter, DraftContext
from drafters.draft_model import DraftModelDrafter
from specdec import SpecDecoder, TokenTree
from specdec.sampling import SamplingConfig, logits_to_probs
from tests.specdec.helpers import VOCAB, hf_greedy, perturbed_copy, tiny_model, token_paths

NEW = 30


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _target(family: str = "qwen2"):
    return tiny_model(family)


@functools.lru_cache(maxsize=None)
def _draft(family: str = "qwen2"):
    return perturbed_copy(_target(family), 0.05, seed=1)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _depths(tree: TokenTree) -> list[int]:
    depth = [0] * tree.n
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        depth[i] = depth[p] + 1
    return depth


@pytest.mark.parametrize("t", [32, 64, 128, 256, 1000])
def test_trees_have_exactly_the_requested_size(t):
    drafter = DraftModelDrafter(_draft(), depth=3, topk=8)
    prompt = _prompt(12, 0)
    drafter.reset([prompt])
    tree = drafter.propose(DraftContext(prompt, t))
    assert isinstance(tree, TokenTree)
    assert tree.n - 1 == t
    assert int(tree.tokens[0]) == int(prompt[-1])
    assert max(_depths(tree)) <= 3
    assert drafter.last_forwards == 3  # catch-up/root + one forward per further depth
    # siblings are distinct (top-k children) and every node's children are its best ones
    for kids in tree.children:
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(set(toks)) == len(toks)


def test_small_budgets_and_root_only():
    drafter = DraftModelDrafter(_draft(), depth=4, topk=4)
    prompt = _prompt(5, 1)
    for t in (0, 1, 2, 3):
        drafter.reset([prompt])
        tree = drafter.propose(DraftContext(prompt, t))
        assert tree.n - 1 == t
        assert drafter.last_forwards == min(t, 4)
    capped = DraftModelDrafter(_draft(), tree_size=5)
    capped.reset([prompt])
    assert capped.propose(DraftContext(prompt, 64)).n - 1 == 5


def _reference_tree(model, tokens: list[int], budget: int, depth: int, topk: int) -> set:
    """The same EAGLE-2 selection with every distribution from a fresh full forward (no cache)."""

    @torch.no_grad()
    def logq(ids):
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)

    depth = min(depth, budget)
    width_f = min(topk, budget)
    expanded = 1 + width_f * (depth - 1)
    w = min(VOCAB, max(width_f, math.ceil(budget / expanded)))
    pool = [((), 0.0)]  # (token path, score)
    frontier = [0]
    for d in range(1, depth + 1):
        new = []
        for f in frontier:
            path, s = pool[f]
            vals, idx = torch.topk(logq(tokens + list(path)), w)
            for v, x in zip(vals.tolist(), idx.tolist()):
                new.append(len(pool))
                pool.append((path + (x,), s + v))
        if d == depth:
            break
        frontier = sorted(new, key=lambda i: (-pool[i][1], i))[:width_f]
    ranked = sorted(range(1, len(pool)), key=lambda i: (-pool[i][1], len(pool[i][0]), i))[:budget]
    return {pool[i][0] for i in ranked}


class _Compare(BaseDrafter):
    """Runs a KV-reusing drafter, checks every tree against recomputation and the fresh reference."""

    def __init__(self, reuse, fresh, model, reference_every=3):
        self.reuse, self.fresh, self.model = reuse, fresh, model
        self.reference_every = reference_every  # 0: never compare with the (CPU) reference tree
        self.vocab_size = reuse.vocab_size
        self.steps = 0

    def reset(self, input_ids):
        self.reuse.reset(input_ids)
        self.fresh.reset(input_ids)

    def propose(self, ctx):
        a = self.reuse.propose(ctx)
        b = self.fresh.propose(ctx)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        if self.reference_every and self.steps % self.reference_every == 0:
            want = _reference_tree(self.model, ctx.tokens.tolist(), ctx.tree_size, self.reuse.depth, self.reuse.topk)
            assert token_paths(a) == want
        self.steps += 1
        return a

    def update(self, ctx, tree, verdict):
        self.reuse.update(ctx, tree, verdict)
        self.fresh.update(ctx, tree, verdict)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("tree_size,depth,topk", [(12, 3, 3), (40, 4, 4)])
def test_draft_kv_reuse_gives_the_same_proposals_as_recomputing(tree_size, depth, topk, static):
    """static: the KV-reusing drafter runs its fixed-shape forwards (padded rows, whole-cache mask)."""
    draft = _draft()
    reuse = DraftModelDrafter(draft, depth=depth, topk=topk, static_shapes=static)
    fresh = DraftModelDrafter(draft, depth=depth, topk=topk, reuse_kv=False)
    cmp = _Compare(reuse, fresh, draft)
    prompt = _prompt(9, 2)
    out = SpecDecoder(_target(), cmp, tree_size=tree_size, attn_impl="torch").generate(prompt, 24)
    assert out.sequences[0].tolist() == hf_greedy(_target(), prompt, 24)
    assert cmp.steps == len(out.steps) and cmp.steps > 3
    assert out.totals()["tokens_accepted"] > 0


@pytest.mark.parametrize("static", [False, True])
def test_draft_cache_grows_and_keeps_its_prefix(static):
    draft = _draft()
    reuse = DraftModelDrafter(draft, depth=2, topk=2, static_shapes=static)
    fresh = DraftModelDrafter(draft, depth=2, topk=2, reuse_kv=False)
    cmp = _Compare(reuse, fresh, draft)
    prompt = _prompt(240, 3)  # initial capacity 512: the tree region of later steps crosses it
    out = SpecDecoder(_target(), cmp, tree_size=6, attn_impl="torch").generate(prompt, 10)
    assert out.num_new_tokens == 10
    if static:  # the fixed-shape forward follows the grown cache
        assert reuse._states[0].fwd.cache is reuse._states[0].cache
    reuse.reset([prompt])
    reuse._ensure_capacity(reuse._states[0], 2000)
    assert reuse._states[0].cache.capacity >= 2000


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tree_size", [1, 5, 32, 64])
def test_greedy_equals_target_generate(family, tree_size):
    prompt = _prompt(10, 0)
    ref = hf_greedy(_target(family), prompt, NEW)
    drafter = DraftModelDrafter(_draft(family))
    out = SpecDecoder(_target(family), drafter, tree_size=tree_size, attn_impl="torch").generate(prompt, NEW)
    assert out.sequences[0].tolist() == ref
    if tree_size >= 5:
        assert out.mean_accepted > 1.5  # the perturbed draft agrees with the target most of the time


def test_batch_with_a_one_token_prompt():
    prompts = [_prompt(7, 4), _prompt(1, 5), _prompt(12, 6)]
    drafter = DraftModelDrafter(_draft(), depth=3, topk=4)
    out = SpecDecoder(_target(), drafter, tree_size=16, attn_impl="torch").generate(prompts, 15)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(_target(), p, 15)


@pytest.mark.parametrize("proposal", ["no_replacement", "iid"])
def test_sampled_trees_carry_their_proposal_distributions(proposal):
    drafter = DraftModelDrafter(_draft(), depth=3, topk=3, sampling_proposal=proposal)
    prompt = _prompt(8, 7)
    drafter.reset([prompt])
    cfg = SamplingConfig(temperature=1.3, top_p=0.9)
    tree = drafter.propose(DraftContext(prompt, 20, sampling=cfg, generator=torch.Generator().manual_seed(0)))
    assert tree.proposal == proposal and tree.draft_probs is not None
    assert tree.n - 1 == 20
    # the root's row is the warped draft distribution at the root
    with torch.no_grad():
        q = logits_to_probs(_draft()(prompt[None]).logits[0, -1], cfg)
    torch.testing.assert_close(tree.draft_probs[0], q, atol=1e-5, rtol=1e-4)
    for i, kids in enumerate(tree.children):
        if kids:
            torch.testing.assert_close(float(tree.draft_probs[i].sum()), 1.0, atol=1e-4, rtol=0)
            assert all(float(tree.draft_probs[i, int(tree.tokens[c])]) > 0 for c in kids)
        if proposal == "no_replacement":
            toks = [int(tree.tokens[c]) for c in kids]
            assert len(set(toks)) == len(toks)


@pytest.mark.parametrize("proposal", ["no_replacement", "topk"])
def test_sampled_tokens_follow_the_target_distribution(proposal):
    """Empirical joint of the first two sampled tokens vs the warped target (top_k=3: 9 cells)."""
    from tests.specdec.test_verify import _chi2_fails

    target, prompt = _target(), _prompt(10, 0)
    cfg = SamplingConfig(temperature=2.0, top_k=3)
    with torch.no_grad():
        p1 = logits_to_probs(target(prompt[None]).logits[0, -1], cfg)
        first = p1.nonzero().flatten().tolist()
        p2 = {x: logits_to_probs(target(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1], cfg)
              for x in first}
    cells = sorted({(x, int(y)) for x in first for y in p2[x].nonzero().flatten()})
    expected = torch.tensor([float(p1[x] * p2[x][y]) for x, y in cells])
    # a different draft: some drafts are accepted, others rejected (residuals matter); a wrong
    # draft_probs row (e.g. q**3 renormalized) fails this test
    drafter = DraftModelDrafter(perturbed_copy(target, 0.1, seed=3), depth=2, topk=2, sampling_proposal=proposal)
    dec = SpecDecoder(target, drafter, tree_size=6, attn_impl="torch")
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(cells))
    index = {c: i for i, c in enumerate(cells)}
    accepted = 0
    for _ in range(600):
        out = dec.generate(prompt, 2, do_sample=True, temperature=2.0, top_k=3, generator=gen)
        counts[index[tuple(out.new_tokens(0).tolist())]] += 1
        accepted += out.totals()["tokens_accepted"]
    assert accepted > 100
    assert not _chi2_fails(counts, expected)


@pytest.mark.parametrize("family,compile", [("llama", False), ("qwen2", False), ("qwen2", "aot_eager")])
def test_static_shapes_greedy_equals_target_generate_in_a_batch(family, compile):
    """compile: the fixed-shape draft forwards traced by torch.compile (aot_eager on CPU)."""
    prompts = [_prompt(10, 0), _prompt(3, 8)]
    drafter = DraftModelDrafter(_draft(family), depth=4, topk=3, static_shapes=True, compile=compile)
    assert drafter.static_shapes and not drafter.cuda_graphs and drafter.static_width == 5
    out = SpecDecoder(_target(family), drafter, tree_size=24, attn_impl="torch").generate(prompts, NEW)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(_target(family), p, NEW)
    assert all(st.fwd is not None and st.fwd.calls > len(out.steps) for st in drafter._states.values())
    # a new generate call reuses each sequence's fixed-shape forward (no new CUDA-graph capture)
    fwds = [st.fwd for st in drafter._states.values()]
    out2 = SpecDecoder(_target(family), drafter, tree_size=24, attn_impl="torch").generate(prompts, NEW)
    assert out2.sequences.tolist() == out.sequences.tolist()
    assert [st.fwd for st in drafter._states.values()] == fwds


def test_argument_errors():
    with pytest.raises(ValueError, match=r"static_shapes: expected None, True or False, got 1"):
        DraftModelDrafter(_draft(), static_shapes=1)
    with pytest.raises(ValueError, match=r"cuda_graphs: True needs the draft model on a CUDA device, got cpu"):
        DraftModelDrafter(_draft(), cuda_graphs=True)
    with pytest.raises(ValueError, match=r"compile: needs static_shapes, got static_shapes=False"):
        DraftModelDrafter(_draft(), compile=True)
    with pytest.raises(ValueError, match=r"depth: expected an int >= 1, got 0"):
        DraftModelDrafter(_draft(), depth=0)
    with pytest.raises(ValueError, match=r"sampling_proposal: expected one of"):
        DraftModelDrafter(_draft(), sampling_proposal="beam")
    with pytest.raises(ValueError, match=r"draft_model: expected a transformers PreTrainedModel"):
        DraftModelDrafter(object())


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_graph_draft_forwards_equal_eager_and_target_generate(family):
    """CUDA default: per-depth draft forwards replayed as graphs; same trees as the eager drafter."""
    target = tiny_model(family).to("cuda")
    draft = perturbed_copy(tiny_model(family), 0.05, seed=1).to("cuda")
    prompt = _prompt(10, 0)
    ids = prompt[None].to("cuda")
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0].tolist()  # fmt: skip
    graphed = DraftModelDrafter(draft, depth=3, topk=4)
    assert graphed.static_shapes and graphed.cuda_graphs
    eager = DraftModelDrafter(draft, depth=3, topk=4, static_shapes=False)
    cmp = _Compare(graphed, eager, draft, reference_every=0)  # the reference tree is the CPU tests' job
    out = SpecDecoder(target, cmp, tree_size=20).generate(prompt, NEW)
    assert out.sequences[0].tolist() == ref
    fwd = graphed._states[0].fwd
    assert fwd.captured and fwd.calls > len(out.steps)
    assert SpecDecoder(target, cmp, tree_size=20).generate(prompt, NEW).sequences[0].tolist() == ref
    assert graphed._states[0].fwd is fwd  # one capture serves later generate calls

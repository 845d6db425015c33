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
    st = reuse._states[0]
    assert st.cache.capacity > 256 and st.loops  # the device loops follow the grown cache
    assert all(loop.cache is st.cache for loop in st.loops.values())
    reuse.reset([prompt])
    reuse._ensure_capacity(reuse._states[0], 2000)
    assert reuse._states[0].cache.capacity >= 2000


@pytest.mark.parametrize("attention", ["sdpa", "tree"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tree_size", [1, 5, 32, 64])
def test_greedy_equals_target_generate(family, tree_size, attention):
    """fp32 greedy output = the target's; with ``attention="tree"`` t = 1 also takes the SDPA catch-up
    (a chain wider than the expanded nodes + 1)."""
    prompt = _prompt(10, 0)
    ref = hf_greedy(_target(family), prompt, NEW)
    drafter = DraftModelDrafter(_draft(family), attention=attention)
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


@pytest.mark.slow
@pytest.mark.parametrize("proposal", ["no_replacement", "topk"])
def test_sampled_tokens_follow_the_target_distribution(proposal):
    """Empirical joint of the first two sampled tokens vs the warped target (top_k=3: 9 cells)."""
    from tests.specdec.helpers import chi2_fails

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
    assert not chi2_fails(counts, expected)


@pytest.mark.parametrize("family,compile", [("llama", False), ("qwen2", False), ("qwen2", "aot_eager")])
def test_static_shapes_greedy_equals_target_generate_in_a_batch(family, compile):
    """compile: the fixed-shape draft forwards traced by torch.compile (aot_eager on CPU). The eager
    prompt prefill (``prefill_width=0``; the chunked one: ``test_chunked_prefill_proposes_the_recorded_trees``)."""
    prompts = [_prompt(10, 0), _prompt(3, 8)]
    drafter = DraftModelDrafter(_draft(family), depth=4, topk=3, static_shapes=True, compile=compile, prefill_width=0)
    assert drafter.static_shapes and not drafter.cuda_graphs and drafter.static_width == 5
    out = SpecDecoder(_target(family), drafter, tree_size=24, attn_impl="torch").generate(prompts, NEW)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(_target(family), p, NEW)
    # per proposal one device loop: after the prompt's prefill one without the catch-up stage, then
    # loops that run the catch-up chain first (no other forward)
    for st in drafter._states.values():
        first, steady = (st.loops[key] for key in sorted(st.loops, key=lambda key: key[-1]))
        assert first.chain == 0 and first.calls == 1 and steady.chain == 5 and steady.calls > 3
        assert st.fwd is None
    # the loops' first runs are the drafter's one-time work, and the steps that made them say so
    made = sum(f.build_s for st in drafter._states.values() for f in st.loops.values())
    assert drafter.captured_s == pytest.approx(made) and made > 0
    assert sum(s.capture_s for s in out.steps) == pytest.approx(made)
    assert sum(s.capture_s > 0 for s in out.steps) <= 2 * len(prompts)  # a first and a steady loop per sequence
    # a new generate call reuses each sequence's loops (no new CUDA-graph capture)
    loops = [dict(st.loops) for st in drafter._states.values()]
    out2 = SpecDecoder(_target(family), drafter, tree_size=24, attn_impl="torch").generate(prompts, NEW)
    assert out2.sequences.tolist() == out.sequences.tolist()
    assert [st.loops for st in drafter._states.values()] == loops
    assert drafter.captured_s == pytest.approx(made) and all(s.capture_s == 0.0 for s in out2.steps)


def test_layer_wise_compile_of_the_device_loop_proposes_the_uncompiled_trees(monkeypatch):
    """``compile="layers:aot_eager"`` (the layer-wise compile; aot_eager on the CPU) with the tree kernel:
    the catch-up and every level attend through ``hf.ForwardState``s that carry the backend, every
    decoder layer of the draft runs the compiled forward, and the trees equal the uncompiled loop's
    step by step; fp32 greedy output = the target's."""
    from specdec import hf

    calls = []
    compiled = hf._compiled_forward

    def counting(cls, backend):
        fn = compiled(cls, backend)
        return lambda *a, **k: calls.append(backend) or fn(*a, **k)

    monkeypatch.setattr(hf, "_compiled_forward", counting)
    prompt = _prompt(11, 3)
    draft = _draft()
    layered = DraftModelDrafter(draft, depth=3, topk=3, static_shapes=True, compile="layers:aot_eager", attention="tree")
    plain = DraftModelDrafter(draft, depth=3, topk=3, static_shapes=True, attention="tree")
    cmp = _Compare(layered, plain, draft, reference_every=0)
    out = SpecDecoder(_target(), cmp, tree_size=13, attn_impl="torch").generate(prompt, 12)
    assert out.sequences[0, : out.lengths[0]].tolist() == hf_greedy(_target(), prompt, 12)
    assert cmp.steps > 2
    loops = list(layered._states[0].loops.values())
    assert loops and all(isinstance(lp.state, hf.ForwardState) and lp.state.layer_backend == "aot_eager"
                         for lp in loops)  # fmt: skip
    assert any(lp.chain and isinstance(lp.chain_state, hf.ForwardState) for lp in loops)
    layers = hf.num_layers(draft)
    assert calls and set(calls) == {"aot_eager"} and len(calls) % layers == 0


def test_layer_wise_compile_needs_the_device_loop_with_the_tree_kernel():
    with pytest.raises(ValueError, match=r"compile: 'layers' \(each decoder layer compiled\) needs the device loop "
                                         r"with attention='tree', got device_loop=True, attention='sdpa'"):
        DraftModelDrafter(_draft(), static_shapes=True, compile="layers", attention="sdpa")
    with pytest.raises(ValueError, match=r"got device_loop=False, attention='tree'"):
        DraftModelDrafter(_draft(), static_shapes=True, compile="layers", attention="tree", device_loop=False)


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


def _cuda_pair(family: str):
    """A tiny target and a perturbed draft on CUDA, a prompt, and the target's greedy tokens from HF."""
    target = tiny_model(family).to("cuda")
    draft = perturbed_copy(tiny_model(family), 0.05, seed=1).to("cuda")
    prompt = _prompt(10, 0)
    ids = prompt[None].to("cuda")
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0].tolist()  # fmt: skip
    return target, draft, prompt, ref


@pytest.mark.cuda
@pytest.mark.parametrize("reference", [dict(static_shapes=False), dict(device_loop=False)],
                         ids=["eager-device-loop", "host-loop-graphed"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "tree"])
def test_cuda_graph_draft_forwards_equal_eager_and_target_generate(family, reference, attention):
    """CUDA default: each proposal's device loop (catch-up chain + every level) replayed as one graph;
    the same trees as the device loop run eagerly, and as the host-driven loop (one graph per depth).
    With ``attention="tree"`` the graphed loop attends through treeattn's Triton kernel."""
    target, draft, prompt, ref = _cuda_pair(family)
    graphed = DraftModelDrafter(draft, depth=3, topk=4, attention=attention)
    assert graphed.static_shapes and graphed.cuda_graphs
    eager = DraftModelDrafter(draft, depth=3, topk=4, **reference)
    cmp = _Compare(graphed, eager, draft, reference_every=0)  # the reference tree is the CPU tests' job
    out = SpecDecoder(target, cmp, tree_size=20).generate(prompt, NEW)
    assert out.sequences[0].tolist() == ref
    st = graphed._states[0]
    # one graph per proposal, every one with the catch-up stage: the prompt's KV was written in captured
    # chunks (prefill_width), so the first proposal's root is a one-token catch-up too
    (loop,) = st.loops.values()
    assert loop.captured and loop.chain and loop.calls == len(out.steps)
    assert st.fwd is None and st.prefill is not None
    loops = dict(st.loops)
    assert SpecDecoder(target, cmp, tree_size=20).generate(prompt, NEW).sequences[0].tolist() == ref
    assert graphed._states[0].loops == loops  # the captures serve later generate calls


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_layer_wise_compiled_draft_loop_gives_the_targets_greedy_output(family):
    """CUDA: ``compile="layers"`` (inductor) -- the draft's layers compiled inside its captured loop, through
    the tree kernel -- gives the target's fp32 greedy tokens, every loop's states carry the backend, and
    a second call reuses the captured loops."""
    target, draft, prompt, ref = _cuda_pair(family)
    drafter = DraftModelDrafter(draft, depth=3, topk=4, compile="layers")
    assert drafter.cuda_graphs and drafter.attention == "tree"
    out = SpecDecoder(target, drafter, tree_size=20).generate(prompt, NEW)
    assert out.sequences[0].tolist() == ref
    loops = dict(drafter._states[0].loops)
    assert loops and all(lp.captured and lp.layer_backend == "inductor" for lp in loops.values())
    assert SpecDecoder(target, drafter, tree_size=20).generate(prompt, NEW).sequences[0].tolist() == ref
    assert drafter._states[0].loops == loops


# --------------------------------------------------------------------------- recorded trees
#
# Trees proposed by the host-driven drafter of commit c74be21 (one host sync per depth, Python-built
# masks), recorded on seeded tiny configs by ``_tree_cases`` and stored in
# ``data/draft_model_trees.json``. The device loop (the default) must propose exactly the same trees:
# greedy and ``"topk"`` children are a deterministic function of the draft's logits (sampled
# proposals: ``test_device_loop_samples_as_the_host_loop_for_fixed_draws`` and the lossless suite). Re-record (only when a change is meant to alter the trees) with the old
# module: ``git show c74be21:drafters/draft_model.py > /tmp/old.py`` and ``_tree_cases(old_class)``.
# The four sampled ``"gen"`` cases were re-recorded that way when the stochastic verifier moved to
# one device-to-host copy per step (it draws a different random stream; the old module and the
# device loop still propose identical trees under it).

_TREES_FILE = __import__("pathlib").Path(__file__).parent / "data" / "draft_model_trees.json"


def _lossless_pair():
    """The 8-token vocabulary target / draft of tests/drafters/test_lossless.py (topk > vocabulary)."""
    from tests.drafters.lossless import tiny_draft, tiny_target

    return tiny_target(), tiny_draft()


class _Recorder(BaseDrafter):
    """Passes every call to ``inner`` and records each proposal (context and tree)."""

    def __init__(self, inner, out: list):
        self.inner, self.out = inner, out
        self.vocab_size = inner.vocab_size

    def reset(self, input_ids):
        self.inner.reset(input_ids)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.out.append({"seq": ctx.seq, "tokens": ctx.tokens.tolist(), "tree_size": ctx.tree_size,
                         "tree_tokens": tree.tokens.tolist(), "tree_parents": tree.parents.tolist(),
                         "proposal": tree.proposal, "forwards": self.inner.last_forwards,
                         "device_loop": getattr(self.inner, "last_device_loop", None)})
        return tree

    def update(self, ctx, tree, verdict):
        self.inner.update(ctx, tree, verdict)


#: name -> (models, drafter kwargs, what to run). "gen": SpecDecoder.generate (prompts, tree size, new
#: tokens, sampling kwargs or None); "propose": fresh proposals for each budget.
_TREE_CASES = {
    "qwen2-greedy-12-3-3": ("qwen2", dict(depth=3, topk=3), ("gen", [(9, 2)], 12, 24, None)),
    "qwen2-greedy-12-3-3-static": ("qwen2", dict(depth=3, topk=3, static_shapes=True), ("gen", [(9, 2)], 12, 24, None)),
    "qwen2-greedy-40-4-4": ("qwen2", dict(depth=4, topk=4), ("gen", [(9, 2)], 40, 24, None)),
    "qwen2-greedy-40-4-4-static": ("qwen2", dict(depth=4, topk=4, static_shapes=True), ("gen", [(9, 2)], 40, 24, None)),
    "qwen2-greedy-64-default": ("qwen2", dict(), ("gen", [(10, 0)], 64, 20, None)),
    "qwen2-greedy-batch": ("qwen2", dict(depth=3, topk=4), ("gen", [(7, 4), (1, 5), (12, 6)], 16, 15, None)),
    "qwen2-topk-sampled-top_p": ("qwen2", dict(depth=4, topk=3, sampling_proposal="topk"),
                                 ("gen", [(8, 7)], 20, 20, dict(temperature=1.3, top_p=0.9))),
    "qwen2-topk-sampled-top_k-static": ("qwen2", dict(depth=3, topk=4, sampling_proposal="topk", static_shapes=True),
                                        ("gen", [(8, 7)], 16, 20, dict(temperature=1.3, top_k=3))),
    "qwen2-propose-d4-k4": ("qwen2", dict(depth=4, topk=4), ("propose", (12, 0), [1, 2, 3, 5, 32, 100])),
    "qwen2-propose-d3-k8": ("qwen2", dict(depth=3, topk=8), ("propose", (12, 0), [7, 64, 256, 1000])),
    "llama-greedy-24-4-3": ("llama", dict(depth=4, topk=3), ("gen", [(10, 0)], 24, 24, None)),
    "llama-greedy-24-4-3-static": ("llama", dict(depth=4, topk=3, static_shapes=True), ("gen", [(10, 0)], 24, 24, None)),
    "gemma3-greedy-16-4-3": ("gemma3", dict(depth=4, topk=3), ("gen", [(12, 1)], 16, 16, None)),
    "gemma3-greedy-16-4-3-static": ("gemma3", dict(depth=4, topk=3, static_shapes=True),
                                    ("gen", [(12, 1)], 16, 16, None)),
    "vocab8-greedy-topk10": ("vocab8", dict(depth=3, topk=10), ("gen", [[1, 5, 2, 7]], 20, 12, None)),
    "vocab8-topk-sampled-top_k": ("vocab8", dict(depth=3, topk=10, sampling_proposal="topk"),
                                  ("gen", [[1, 5, 2, 7], [7]], 20, 12, dict(temperature=0.9, top_k=4))),
    "vocab8-topk-sampled-6": ("vocab8", dict(tree_size=6, sampling_proposal="topk"),
                              ("gen", [[1, 5, 2, 7]], 6, 12, dict(temperature=0.9))),
    "vocab8-propose-d4-k10": ("vocab8", dict(depth=4, topk=10), ("propose", [3, 0, 0, 6, 4], [3, 30, 200])),
}


def _case_models(kind: str):
    if kind == "vocab8":
        return _lossless_pair()
    return _target(kind), _draft(kind)


def _case_prompt(spec) -> torch.Tensor:
    return torch.tensor(spec) if isinstance(spec, list) else _prompt(*spec)


def _tree_cases(cls=DraftModelDrafter, names=None, **extra) -> dict[str, list[dict]]:
    """Run each case of ``_TREE_CASES`` with drafter class ``cls`` (``extra``: more constructor
    arguments; the prompt is prefilled eagerly unless they give a ``prefill_width``, which is how
    the trees were recorded); name -> recorded proposals."""
    if cls is DraftModelDrafter:
        extra = {"prefill_width": 0, **extra}
    out = {}
    for name in names or _TREE_CASES:
        kind, kwargs, run = _TREE_CASES[name]
        target, draft = _case_models(kind)
        records: list[dict] = []
        rec = _Recorder(cls(draft, **kwargs, **extra), records)
        if run[0] == "gen":
            _, prompts, tree_size, new, sampling = run
            prompts = [_case_prompt(p) for p in prompts]
            dec = SpecDecoder(target, rec, tree_size=tree_size, attn_impl="torch")
            if sampling is None:
                dec.generate(prompts, new)
            else:
                dec.generate(prompts, new, do_sample=True, generator=torch.Generator().manual_seed(0), **sampling)
        else:
            _, prompt, budgets = run
            prompt = _case_prompt(prompt)
            for t in budgets:
                rec.reset([prompt])
                rec.propose(DraftContext(prompt, t))
        out[name] = records
    return out


@functools.lru_cache(maxsize=None)
def _recorded_trees() -> dict:
    import json

    return json.loads(_TREES_FILE.read_text())


@pytest.mark.parametrize("name", list(_TREE_CASES))
@pytest.mark.parametrize("device_loop,attention", [(True, "sdpa"), pytest.param(True, "tree", marks=pytest.mark.slow),
                                                    (False, "sdpa")])
def test_device_loop_proposes_the_recorded_trees(name, device_loop, attention):
    """Exactly the trees of the host-driven drafter (commit c74be21), step by step, with either
    attention of the device loop; the host loop (``device_loop=False``, kept for the sampled
    proposals) still proposes them too."""
    if attention == "tree" and name.startswith("gemma3"):
        pytest.skip("sliding-window layers: attention='tree' refuses them (test_tree_attention_refuses_...)")
    want = _recorded_trees()[name]
    got = _tree_cases(names=[name], device_loop=device_loop, attention=attention)[name]
    assert len(got) == len(want)
    assert all(g["device_loop"] == device_loop for g in got)
    for step, (g, w) in enumerate(zip(got, want)):
        assert (g["seq"], g["tokens"], g["tree_size"]) == (w["seq"], w["tokens"], w["tree_size"]), step
        assert (g["tree_tokens"], g["tree_parents"], g["proposal"]) == (
            w["tree_tokens"], w["tree_parents"], w["proposal"]), step
        assert g["forwards"] == w["forwards"], step


def _fixed_draws(monkeypatch):
    """Make the sampled proposals' draws a fixed function of the distribution (both loops alike):
    without replacement, the top-k of ``logq`` + one fixed noise vector; i.i.d., inverse-CDF draws at
    fixed quantiles. The generator / uniforms each loop passes are ignored."""
    from drafters import draft_sampling as dm

    def no_replacement(logq, k, _):
        noise = torch.rand(logq.shape[-1], generator=torch.Generator().manual_seed(5)).to(logq.device)
        return torch.topk(logq + noise * 3.0, k, dim=-1).indices

    def iid(probs, k, _):
        at = ((torch.arange(k, dtype=torch.float64) * 0.37 + 0.11) % 1.0).to(probs.device)
        cdf = probs.double().cumsum(dim=-1)
        return torch.searchsorted(cdf, (at * cdf[:, -1:]).contiguous(), right=True).clamp(max=probs.shape[-1] - 1)

    monkeypatch.setattr(dm, "_gumbel_top_k", no_replacement)
    monkeypatch.setattr(dm, "_multinomial", iid)


_PREFILL_CASES = ["qwen2-greedy-40-4-4-static", "qwen2-greedy-batch", "qwen2-topk-sampled-top_k-static",
                  "qwen2-propose-d3-k8", "llama-greedy-24-4-3-static", "gemma3-greedy-16-4-3-static",
                  "vocab8-topk-sampled-6"]


@pytest.mark.parametrize("name", _PREFILL_CASES)
@pytest.mark.parametrize("width", [4, pytest.param(256, marks=pytest.mark.slow)])
def test_chunked_prefill_proposes_the_recorded_trees(name, width):
    """``prefill_width``: the prompt's KV written in fixed-shape chunks, the root as the loop's
    catch-up; the same trees as the eager prefill (recorded), and the chunks counted as forwards."""
    extra = {} if "static_shapes" in _TREE_CASES[name][1] else {"static_shapes": True}
    got = _tree_cases(names=[name], prefill_width=width, **extra)[name]
    want = _recorded_trees()[name]
    assert [(g["tree_tokens"], g["tree_parents"]) for g in got] == [(w["tree_tokens"], w["tree_parents"]) for w in want]
    first = got[0]
    chunks = -(-(len(first["tokens"]) - 1) // width)  # the prompt's tokens but the root
    levels = want[0]["forwards"] - 1  # the recorded first step: one eager prefill + the levels
    assert first["forwards"] == chunks + 1 + levels if len(first["tokens"]) > 1 else True


class _SameTrees(BaseDrafter):
    """Proposes with ``a`` and ``b`` on every context, checks that the trees are the same, and hands
    each drafter the verdict in its own tree's node indices."""

    def __init__(self, a, b):
        self.a, self.b, self.vocab_size, self.steps = a, b, a.vocab_size, 0
        self._b_trees: dict[int, TokenTree] = {}

    def reset(self, input_ids):
        self.a.reset(input_ids)
        self.b.reset(input_ids)

    @staticmethod
    def _node_paths(tree) -> list[tuple[int, ...]]:
        """Every node's token path from the root."""
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        paths: list[tuple[int, ...]] = []
        for i, p in enumerate(pars):  # depth-first: a parent comes before its children
            paths.append((toks[i],) if p < 0 else paths[p] + (toks[i],))
        return paths

    @classmethod
    def _paths(cls, tree) -> tuple[list[tuple[int, ...]], list[int]]:
        """Every node's token path from the root, sorted, and the node order that sorts them (of
        duplicate paths, the unexpanded ones -- no draft_probs row -- first)."""
        paths = cls._node_paths(tree)
        expanded = [False] * len(paths) if tree.draft_probs is None else tree.draft_probs.ne(0).any(-1).tolist()
        order = sorted(range(len(paths)), key=lambda i: (paths[i], expanded[i]))
        return [paths[i] for i in order], order

    def propose(self, ctx):
        ta, tb = self.a.propose(ctx), self.b.propose(ctx)
        assert self.a.last_device_loop and not self.b.last_device_loop
        # The same tree as a multiset of token paths. Node for node it may differ where i.i.d. draws
        # repeat a token under one parent: the duplicates' subtrees tie exactly in score, and the two
        # loops' forwards (different shapes) round their logits differently, which breaks the tie
        # for a different duplicate (seen on a vocabulary of 8 with top_k = 4, and with the tree kernel's
        # rounding on the qwen2 case): which duplicate is expanded may differ too, so duplicates are
        # matched unexpanded first.
        (pa, oa), (pb, ob) = self._paths(ta), self._paths(tb)
        assert pa == pb
        assert ta.proposal == tb.proposal
        if ta.draft_probs is None:
            assert tb.draft_probs is None
        else:  # the same rows, up to rounding (the loops' forwards have different shapes)
            torch.testing.assert_close(ta.draft_probs[oa], tb.draft_probs[ob], rtol=1e-5, atol=1e-7)
            assert torch.equal(ta.draft_probs[oa] == 0, tb.draft_probs[ob] == 0)
        assert self.a.last_depth == self.b.last_depth
        self.steps += 1
        self._b_trees[ctx.seq] = tb
        return ta

    def update(self, ctx, tree, verdict):
        from specdec.verify import Verdict

        self.a.update(ctx, tree, verdict)
        tb = self._b_trees.pop(ctx.seq)
        # the accepted nodes' token paths, followed down b's tree (where a path repeats, b's node may be
        # another duplicate than a's: its KV is the same up to rounding)
        pa, pb = self._node_paths(tree), self._node_paths(tb)
        path = [0]
        for node in verdict.path[1:]:
            path.append(next(c for c in tb.children[path[-1]] if pb[c] == pa[node]))
        self.b.update(ctx, tb, Verdict(tuple(path), verdict.bonus_token))


@pytest.mark.slow
@pytest.mark.parametrize("proposal", ["no_replacement", "iid"])
@pytest.mark.parametrize("kind,kwargs,tree_size,cfg", [
    ("qwen2", dict(depth=3, topk=3), 20, dict(temperature=1.3, top_p=0.9)),
    ("qwen2", dict(depth=4, topk=4, static_shapes=True), 40, dict(temperature=1.0, top_k=6)),
    ("vocab8", dict(depth=3, topk=10), 20, dict(temperature=0.9, top_k=4)),  # dead rows: topk > vocabulary
    ("vocab8", dict(tree_size=6), 6, dict(temperature=0.9)),  # the lossless suite's configuration
])  # fmt: skip
@pytest.mark.parametrize("attention", ["sdpa", "tree"])
def test_device_loop_samples_as_the_host_loop_for_fixed_draws(monkeypatch, proposal, kind, kwargs, tree_size, cfg,
                                                              attention):  # fmt: skip
    """Sampled proposals: with the draws fixed, the device loop (either attention) makes the host
    loop's decisions (allotment of kept draws per node, budget per level, early stops, frontier,
    draft_probs rows)."""
    _fixed_draws(monkeypatch)
    target, draft = _case_models(kind)
    dev = DraftModelDrafter(draft, sampling_proposal=proposal, attention=attention, **kwargs)
    host = DraftModelDrafter(draft, sampling_proposal=proposal, device_loop=False, **kwargs)
    same = _SameTrees(dev, host)
    prompts = [torch.tensor([1, 5, 2, 7]), torch.tensor([7])] if kind == "vocab8" else [_prompt(8, 7), _prompt(3, 1)]
    gen = torch.Generator().manual_seed(0)
    SpecDecoder(target, same, tree_size=tree_size, attn_impl="torch").generate(prompts, 12, do_sample=True,
                                                                               generator=gen, **cfg)  # fmt: skip
    assert same.steps >= 6
    for budget in (1, 2, 3, 5, 6, 13, 33):  # every cap / early-stop regime of the budget split
        same.reset([prompts[0]])
        same.propose(DraftContext(prompts[0], budget, sampling=SamplingConfig(**cfg), generator=gen))


class _HostReads(__import__("torch.utils._python_dispatch", fromlist=["TorchDispatchMode"]).TorchDispatchMode):
    """Records the aten ops that read device data on the host (a sync on CUDA) or whose output
    shape depends on data (no fixed-shape replay)."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
               "repeat_interleave", "item", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in self.SYNCING:
            self.seen.append(name)
        if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                self.seen.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("proposal,cfg", [("topk", None), ("topk", dict(temperature=1.3, top_p=0.9)),
                                          ("no_replacement", dict(temperature=1.3, top_p=0.9)),
                                          ("iid", dict(temperature=0.8, top_k=5))])  # fmt: skip
def test_device_loop_body_never_reads_device_data_on_the_host(proposal, cfg):
    """The body replayed per step (every depth's bookkeeping and forward): no ``.item()``, no
    nonzero / boolean-mask indexing; the only read is ``run``'s one copy of the packed outputs."""
    drafter = DraftModelDrafter(_draft(), depth=4, topk=4, sampling_proposal=proposal, static_shapes=True,
                                prefill_width=0)  # the loop without the catch-up stage after an eager prefill
    prompt = _prompt(12, 0)
    drafter.reset([prompt])
    sampling = None if cfg is None else SamplingConfig(**cfg)
    for _ in range(2):  # after the prefill, then with the catch-up stage (the root again)
        drafter.propose(DraftContext(prompt, 40, sampling=sampling, generator=torch.Generator().manual_seed(0)))
        assert drafter.last_device_loop and drafter.last_forwards == 4 and drafter.last_depth == 4
    loops = list(drafter._states[0].loops.values())
    assert sorted(loop.chain for loop in loops) == [0, 5]
    for loop in loops:
        with _HostReads() as reads:
            loop.forward()
        assert reads.seen == []
        assert loop.calls == 2


def test_device_loop_argument_errors():
    from drafters.draft_model_loop import DeviceLoop as _DeviceLoop
    from specdec.kv import KVCache

    draft = _draft()
    cache = KVCache(1, 64, num_layers=2)
    with pytest.raises(ValueError, match=r"depth: expected 1 \+ topk \* \(depth - 1\) <= 64 \(the cache capacity 64\), got 73"):
        _DeviceLoop(draft, cache, topk=8, width=8, depth=10)
    with pytest.raises(ValueError, match=r"depth: .* <= 63 \(the cache capacity 64 minus the scratch slot\), got 64"):
        _DeviceLoop(draft, cache, topk=9, width=8, depth=8, chain=3)
    with pytest.raises(ValueError, match=r"chain: expected an int in \[0, 64\) \(0: no catch-up stage\), got -1"):
        _DeviceLoop(draft, cache, topk=2, width=2, depth=2, chain=-1)
    with pytest.raises(ValueError, match=r"proposal: expected one of"):
        _DeviceLoop(draft, cache, topk=2, width=2, depth=2, proposal="beam")
    with pytest.raises(ValueError, match=r"sampling: a 'iid' proposal needs the sampling transform, got None"):
        _DeviceLoop(draft, cache, topk=2, width=2, depth=2, proposal="iid")
    with pytest.raises(ValueError, match=r"width: expected an int >= 1, got 0"):
        _DeviceLoop(draft, cache, topk=2, width=0, depth=2)
    loop = _DeviceLoop(draft, cache, topk=2, width=2, depth=3)
    with pytest.raises(ValueError, match=r"base: expected 0 <= base <= 59 \(cache capacity minus 5 slots\), got 60"):
        loop.load(torch.zeros(1, VOCAB), 60)
    with pytest.raises(ValueError, match=r"root_logits: expected the root's logits \[1, V\] \(the loop has no catch-up"):
        loop.load(None, 10)
    chained = _DeviceLoop(draft, cache, topk=2, width=2, depth=3, chain=4)
    with pytest.raises(ValueError, match=r"base: expected 0 <= base <= 58 \(cache capacity minus 6 slots\), got 59"):
        chained.load(None, 59, chain=[3])
    with pytest.raises(ValueError, match=r"chain: expected 1 to 4 tokens \(the loop's catch-up stage\), got 5 tokens"):
        chained.load(None, 10, chain=[3] * 5)
    with pytest.raises(ValueError, match=r"chain: expected 1 to 2 tokens \(the loop's catch-up stage\), got None"):
        chained.load(None, 1)
    with pytest.raises(ValueError, match=r"device_loop: expected True or False, got 1"):
        DraftModelDrafter(draft, device_loop=1)
    with pytest.raises(ValueError, match=r"attention: expected 'auto' or one of \('sdpa', 'tree'\), got 'flash'"):
        DraftModelDrafter(draft, attention="flash")
    with pytest.raises(ValueError, match=r"prefill_width: expected None or an int >= 0 \(0 or None: the eager prefill\), got -1"):
        DraftModelDrafter(draft, prefill_width=-1)
    with pytest.raises(ValueError, match=r"attention: expected one of \('sdpa', 'tree'\), got 'flash'"):
        _DeviceLoop(draft, cache, topk=2, width=2, depth=2, attention="flash")


def test_tree_attention_refuses_sliding_window_layers():
    """A draft with sliding-window layers (Gemma 3) and ``attention="tree"``: a ValueError naming
    the option at the first forward, not silently wrong attention."""
    drafter = DraftModelDrafter(_draft("gemma3"), depth=3, topk=3, attention="tree")
    prompt = _prompt(12, 1)
    drafter.reset([prompt])
    with pytest.raises(ValueError, match=r"attention: 'tree' has no sliding-window or soft-capped layers"):
        drafter.propose(DraftContext(prompt, 16))


def test_auto_attention_is_the_tree_kernel_on_cuda_where_the_config_allows():
    """``attention="auto"`` (the default): the tree kernel on CUDA for plain causal drafts, SDPA for
    sliding-window (Gemma 3) or soft-capped (Gemma 2) drafts and on a CPU; explicit values are kept."""
    from drafters.draft_model import pick_attention

    qwen, gemma3, gemma2 = _draft("qwen2"), _draft("gemma3"), _draft("gemma2")
    assert pick_attention("auto", qwen, torch.device("cuda")) == "tree"
    assert pick_attention("auto", gemma3, torch.device("cuda")) == "sdpa"
    assert pick_attention("auto", gemma2, torch.device("cuda")) == "sdpa"
    assert pick_attention("auto", qwen, torch.device("cpu")) == "sdpa"
    assert pick_attention("sdpa", qwen, torch.device("cuda")) == "sdpa"
    assert pick_attention("tree", gemma3, torch.device("cpu")) == "tree"
    assert DraftModelDrafter(qwen, depth=2, topk=2).attention == "sdpa"  # built on the CPU


@pytest.mark.cuda
def test_cuda_graph_chunked_prefill_equals_target_generate():
    """``prefill_width`` on CUDA: the prompt's chunks through a captured fixed-shape forward, then the
    captured loop; fp32 greedy output = the target's, and the prefill forward was captured once."""
    target = tiny_model("qwen2").to("cuda")
    draft = perturbed_copy(tiny_model("qwen2"), 0.05, seed=1).to("cuda")
    prompts = [_prompt(10, 0), _prompt(23, 3)]
    drafter = DraftModelDrafter(draft, depth=3, topk=4, prefill_width=4)
    dec = SpecDecoder(target, drafter, tree_size=20)
    for prompt in prompts:
        ids = prompt[None].to("cuda")
        ref = target.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))[0].tolist()  # fmt: skip
        assert dec.generate(prompt, NEW).sequences[0].tolist() == ref
    st = drafter._states[0]
    assert st.prefill is not None and st.prefill.captured


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["sdpa", "tree"])
@pytest.mark.parametrize("proposal", ["no_replacement", "iid", "topk"])
def test_cuda_graph_device_loop_samples_as_the_eager_loop(proposal, attention):
    """Captured device loop vs the same loop run eagerly, with the same generator seeds: the same
    trees and draft_probs; and fresh draws every replay (the uniforms are not baked into the graph)."""
    draft = perturbed_copy(tiny_model("qwen2"), 0.05, seed=1).to("cuda")
    graphed = DraftModelDrafter(draft, depth=4, topk=3, sampling_proposal=proposal, attention=attention)
    eager = DraftModelDrafter(draft, depth=4, topk=3, sampling_proposal=proposal, cuda_graphs=False,
                              attention=attention)  # fmt: skip
    assert graphed.cuda_graphs and not eager.cuda_graphs
    prompt = _prompt(10, 0)
    cfg = SamplingConfig(temperature=1.3, top_p=0.9)
    trees = []
    for drafter in (graphed, eager):
        drafter.reset([prompt])
        gen = torch.Generator("cuda").manual_seed(3)
        got = []
        for budget in (20, 20, 7):
            got.append(drafter.propose(DraftContext(prompt, budget, sampling=cfg, generator=gen)))
            assert drafter.last_device_loop
        trees.append(got)
    for a, b in zip(*trees):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        if proposal != "topk":
            torch.testing.assert_close(a.draft_probs, b.draft_probs)
    assert all(loop.captured for loop in graphed._states[0].loops.values())
    if proposal != "topk":  # two proposals of the same context drew different trees
        assert trees[0][0].tokens.tolist() != trees[0][1].tokens.tolist()


@pytest.mark.parametrize("heads,kv_heads,m,kv_len,dtype", [(4, 2, 3, 37, torch.float32), (14, 2, 8, 64, torch.float32),
                                                           (6, 6, 5, 50, torch.float32), (8, 2, 4, 70, torch.bfloat16)])
def test_grouped_masked_attention_equals_masked_state(heads, kv_heads, m, kv_len, dtype):
    """The device loop's attention (query heads folded into rows, additive mask) vs ``hf.MaskedState``'s."""
    from drafters.draft_model_loop import GroupedMaskedState as _GroupedMaskedState
    from specdec.hf import MaskedState
    from specdec.kv import KVCache

    gen = torch.Generator().manual_seed(heads * m)
    dim, cap = 16, 96
    q = torch.randn(1, heads, m, dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, m, dim, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(kv_len, generator=gen)[:m].sort().values[None]
    visible = torch.rand(1, m, kv_len, generator=gen) < 0.4
    visible[0, torch.arange(m), slots[0]] = True  # every token sees itself
    module = type("Attn", (), {"layer_idx": 0})()
    outs, caches = [], []
    for cls in (MaskedState, _GroupedMaskedState):
        cache = KVCache(1, cap)
        old = torch.randn(1, kv_heads, kv_len, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
        cache.write(0, old, old, torch.arange(kv_len)[None])  # earlier keys / values
        state = cls(cache, slots, slots, visible, None)
        outs.append(state.attend(module, q, k, v, None, None, None)[0])
        caches.append(cache.buffers(0))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    assert all(torch.equal(a, b) for a, b in zip(*caches))


def test_warmup_sizes_the_draft_caches_so_that_no_later_call_grows_them():
    """``SpecDecoder.warmup(max_len=)`` reaches the draft-model drafter: every draft cache made
    afterwards holds a request of max_len tokens, and a long history keeps the same cache (growing
    one drops its captured / compiled device loops mid-run: the stalls of the compiled draft model)."""
    target, draft = _target(), _draft()
    drafter = DraftModelDrafter(draft, depth=3, topk=4, static_shapes=True)
    SpecDecoder(target, drafter, tree_size=12, attn_impl="torch", static_shapes=True).warmup(max_len=250, log=None)
    assert drafter._min_cache == 250 + 4 * 3 + 2
    tokens = _prompt(9, 0)
    drafter.reset([tokens])
    cache = drafter._states[0].cache
    assert cache.capacity == 512
    drafter.propose(DraftContext(tokens, 12))
    long = torch.cat([tokens, _prompt(235, 1)])
    drafter.propose(DraftContext(long, 12))
    assert drafter._states[0].cache is cache
    fresh = DraftModelDrafter(draft, depth=3, topk=4, static_shapes=True)
    fresh.reset([tokens])
    fresh.propose(DraftContext(tokens, 12))
    first = fresh._states[0].cache
    fresh.propose(DraftContext(torch.cat([long, _prompt(60, 2)]), 12))
    assert first.capacity == 256 and fresh._states[0].cache.capacity == 512  # without the warm-up: grown


@pytest.mark.parametrize("prefill_width", [256, 0])
def test_warmup_makes_every_slots_loops_and_generate_makes_none(prefill_width):
    """``SpecDecoder.warmup`` hands the drafter the tree sizes it will be asked with: with static shapes
    each sequence slot makes its prefill and device loops there (its CUDA graphs on a GPU), so a call
    at a fixed tree size makes none (before, a call's first step captured them); output stays greedy."""
    prompts = [_prompt(10, 0), _prompt(3, 8)]
    drafter = DraftModelDrafter(_draft(), depth=3, topk=3, static_shapes=True, prefill_width=prefill_width)
    dec = SpecDecoder(_target(), drafter, tree_size=12, static_shapes=True, attn_impl="torch", cache_buckets=(96,))
    dec.warmup((2,), max_len=60, log=None)
    made = {b: dict(st.loops) for b, st in drafter._states.items()}
    prefills = {b: st.prefill for b, st in drafter._states.items()}
    assert sorted(made) == [0, 1] and all(len(loops) == (1 if prefill_width else 2) for loops in made.values())
    out = dec.generate(prompts, NEW)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(_target(), p, NEW)
    assert {b: dict(st.loops) for b, st in drafter._states.items()} == made  # the same loops, none new
    assert {b: st.prefill for b, st in drafter._states.items()} == prefills

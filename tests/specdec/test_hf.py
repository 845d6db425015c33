"""Tree forward through transformers' AttentionInterface, the static KV cache and its commit."""

from __future__ import annotations

import pytest
import torch

from specdec import KVCache
from specdec.hf import ForwardState, prefill, prepare_model, tree_forward
from tests.specdec.helpers import VOCAB, tiny_model
from treeattn import TreeMask
from treeattn.layout import random_tree_parents

FAMILIES = ["llama", "qwen2", "mistral", "gemma", "gemma2", "gemma3"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _fresh_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def _random_tree(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    parents = random_tree_parents(n, max_depth=6, generator=gen)
    tokens = torch.randint(3, VOCAB, (n,), generator=gen)
    return tokens, parents


def _paths(parents: list[int]) -> list[list[int]]:
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out


def _check_tree_logits(model, prompts, trees, impl="torch", static=False, atol=2e-5, num_layers=None):
    """Prefill each prompt but its last token, score its tree, compare with fresh causal forwards."""
    batch = len(prompts)
    n = max(len(t) for t, _ in trees)
    capacity = max(len(p) for p in prompts) + n + 3
    cache = KVCache(batch, capacity, num_layers=num_layers)
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(batch, longest - 1, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p) - 1] = torch.tensor(p[:-1])
    prefill(model, ids, cache, impl=impl)
    cache.lengths = [len(p) - 1 for p in prompts]
    tokens = torch.zeros(batch, n, dtype=torch.long)
    parents = torch.zeros(batch, n, dtype=torch.long)
    for b, (t, par) in enumerate(trees):
        tokens[b, : len(t)] = t
        tokens[b, 0] = prompts[b][-1]
        parents[b, : len(t)] = par
    parents[:, 0] = -1
    mask = TreeMask.from_parents(parents)
    kv_len = None if static else max(cache.lengths) + n
    logits = tree_forward(model, tokens, mask, torch.tensor(cache.lengths), cache, kv_len=kv_len, impl=impl)
    assert logits.shape == (batch, n, VOCAB)
    for b, (t, par) in enumerate(trees):
        for i, path in enumerate(_paths(par.tolist())):
            ids_i = prompts[b][:-1] + tokens[b, path].tolist()
            torch.testing.assert_close(logits[b, i], _fresh_last_logits(model, ids_i), atol=atol, rtol=1e-4)
    return cache, logits, tokens, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_equal_path_forwards(family):
    model = tiny_model(family)
    prepare_model(model)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (11,), generator=gen).tolist()
    _check_tree_logits(model, [prompt], [_random_tree(20, seed=2)])


def test_tree_crossing_word_boundary_and_batch_with_different_prefixes():
    model = tiny_model("llama")
    prepare_model(model)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (L,), generator=gen).tolist() for L in (5, 13, 1)]
    trees = [_random_tree(70, seed=4), _random_tree(9, seed=5), _random_tree(66, seed=6)]
    _check_tree_logits(model, prompts, trees, static=True)


def test_tree_logits_through_triton_interpreter():
    pytest.importorskip("triton")
    import treeattn.ops as ops

    if not ops.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 not set (tests/conftest.py sets it on CPU machines)")
    model = tiny_model("qwen2")
    prepare_model(model)
    prompt = list(range(3, 12))
    _check_tree_logits(model, [prompt], [_random_tree(7, seed=7)], impl="triton")


@pytest.mark.parametrize("stacked", [False, True])
def test_commit_equals_fresh_prefill(stacked):
    model = tiny_model("qwen2")
    prepare_model(model)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (L,), generator=gen).tolist() for L in (7, 10)]
    trees = [_random_tree(30, seed=9), _random_tree(12, seed=10)]
    layers = model.config.num_hidden_layers if stacked else None
    cache, logits, tokens, mask = _check_tree_logits(model, prompts, trees, num_layers=layers)
    assert (cache._stack is not None) == stacked
    # Accept the path to the deepest node of each tree; the second sequence commits nothing.
    depth = mask.depth
    deepest = int(depth[0].argmax())
    path0 = _paths(trees[0][1].tolist())[deepest]
    before = list(cache.lengths)
    cache.commit([path0, None])
    assert cache.lengths == [before[0] + len(path0), before[1]]
    accepted = prompts[0][:-1] + tokens[0, path0].tolist()
    # The committed KV equals a fresh prefill of the accepted sequence ...
    fresh = KVCache(1, cache.capacity)
    prefill(model, torch.tensor([accepted]), fresh)
    for layer in cache.layer_indices:
        for got, want in zip(cache.buffers(layer), fresh.buffers(layer)):
            torch.testing.assert_close(got[0, :, : len(accepted)], want[0, :, : len(accepted)], atol=2e-5, rtol=1e-4)
    # ... and the next step (a root-only tree with the next token) sees the same context.
    nxt = 17
    one = TreeMask.from_parents(torch.tensor([[-1], [-1]]))
    step = tree_forward(model, torch.tensor([[nxt], [prompts[1][-1]]]), one, torch.tensor(cache.lengths), cache)
    torch.testing.assert_close(step[0, 0], _fresh_last_logits(model, accepted + [nxt]), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(step[1, 0], _fresh_last_logits(model, prompts[1]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tree_forward(dtype):
    model = tiny_model("llama", dtype=dtype)
    prepare_model(model)
    prompt = list(range(3, 20))
    _check_tree_logits(model, [prompt], [_random_tree(10, seed=11)], atol=0.15)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ordinary_forward_unchanged(attn):
    model = tiny_model("gemma2" if attn == "eager" else "llama", attn=attn)
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        before_gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    name = prepare_model(model)
    assert name == f"specdec_tree_{attn}"
    assert prepare_model(model) == name  # idempotent
    with torch.no_grad():
        after = model(ids).logits
        after_gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert torch.equal(after_gen, before_gen)


def test_stacked_cache_commits_like_per_layer_buffers():
    """All layers in one tensor (one gather + scatter per commit) == one buffer pair per layer,
    including layers that cannot join the stack (other head count, index past num_layers)."""
    gen = torch.Generator().manual_seed(0)
    flat, stacked = KVCache(2, 12), KVCache(2, 12, num_layers=4)
    shapes = {0: (2, 3, 5, 8), 1: (2, 3, 5, 8), 2: (2, 1, 5, 8), 3: (2, 3, 5, 8), 7: (2, 3, 5, 8)}
    # [0, 1, 2]: nodes already in place (nothing moves); the others move some nodes
    for step, paths in enumerate([[[0, 2, 4], [0]], [None, [0, 1, 3, 4]], [[0, 1, 2], [0, 4]], [[0, 1], [0, 3]]]):
        for layer, shape in shapes.items():
            k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            slots = torch.tensor([[flat.lengths[b] + i for i in range(5)] for b in range(2)])
            for cache in (flat, stacked):
                cache.write(layer, k, v, slots)
        for cache in (flat, stacked):
            cache.commit(paths)
        assert flat.lengths == stacked.lengths
        for layer in shapes:
            for a, b in zip(flat.buffers(layer), stacked.buffers(layer)):
                assert torch.equal(a, b)
    assert stacked._stacked == {0, 1, 3} and stacked._stack.shape == (2, 4, 2, 3, 12, 8)
    assert stacked.buffers(1)[0].data_ptr() == stacked._stack[0, 1].data_ptr()
    with pytest.raises(ValueError, match=r"num_layers: expected None or an int >= 1, got 0"):
        KVCache(1, 4, num_layers=0)


@pytest.mark.parametrize("num_layers", [None, 3])
def test_commit_of_several_sequences_equals_one_at_a_time(num_layers):
    """Several moving sequences commit in one gather and one scatter per buffer: bitwise what
    committing each sequence alone gives (per-layer and stacked buffers, bf16 and fp32, paths in
    place, moving, empty), over steps whose trees overwrite the freed slots."""
    gen = torch.Generator().manual_seed(3)
    batch, n, cap = 6, 9, 64
    for dtype in (torch.float32, torch.bfloat16):
        together, alone = KVCache(batch, cap, num_layers=num_layers), KVCache(batch, cap, num_layers=num_layers)
        for step in range(4):
            for layer in range(3):
                k = torch.randn(batch, 2, n, 8, generator=gen).to(dtype)
                v = torch.randn(batch, 2, n, 8, generator=gen).to(dtype)
                slots = torch.tensor([[together.lengths[b] + i for i in range(n)] for b in range(batch)])
                for cache in (together, alone):
                    cache.write(layer, k, v, slots)
            paths = []
            for b in range(batch):
                keep = sorted(torch.randperm(n - 1, generator=gen)[: int(torch.randint(0, 5, (1,), generator=gen))] + 1)
                paths.append(None if b == step else [0, *[int(i) for i in keep]])
            paths[-1] = list(range(4))  # already in place: nothing moves
            together.commit(paths)
            for b in range(batch):
                alone.commit([paths[b] if i == b else None for i in range(batch)])
            assert together.lengths == alone.lengths
            for layer in range(3):
                for a, w in zip(together.buffers(layer), alone.buffers(layer)):
                    assert torch.equal(a, w)


def test_kv_cache_errors():
    with pytest.raises(ValueError, match=r"capacity: expected an int >= 1, got 0"):
        KVCache(1, 0)
    with pytest.raises(ValueError, match=r"batch_size: expected an int >= 1"):
        KVCache(0, 8)
    cache = KVCache(2, 8)
    cache.lengths = [3, 6]
    with pytest.raises(ValueError, match=r"tree: KV cache overflow: a sequence holds 6 tokens and needs 3 more slots, capacity is 8"):
        cache.check_room(3)
    with pytest.raises(ValueError, match=r"paths: expected one entry per sequence \(2\), got 1"):
        cache.commit([[0]])
    with pytest.raises(ValueError, match=r"paths\[0\]: expected the root \(node 0\) first"):
        cache.commit([[1, 2], None])
    with pytest.raises(ValueError, match=r"paths\[1\]: expected strictly increasing node indices"):
        cache.commit([None, [0, 1, 1]])
    with pytest.raises(ValueError, match=r"layer_idx: no KV buffers for layer 0"):
        cache.buffers(0)


def test_state_errors():
    cache = KVCache(1, 4)
    slots = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"impl: expected one of"):
        ForwardState(cache, slots, slots, impl="cuda")
    with pytest.raises(ValueError, match=r"tree_mask, prefix_lens: expected both"):
        ForwardState(cache, slots, slots, tree_mask=TreeMask.from_parents(torch.tensor([-1])))

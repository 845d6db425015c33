"""n sequences sharing one prompt: ``ForwardState.shared`` keeps the prompt's KV once.

The shared layout (the prompt in a batch-1 ``KVCache``, each sequence's own suffix + tree in the
per-sequence cache, ``cascade_tree_attention``) must give the logits of today's unshared layout
(the prompt copied in front of every sequence, ``tree_attention``).
"""

from __future__ import annotations

import pytest
import torch

from specdec import KVCache
from specdec.hf import ForwardState, prefill, prefill_shared, prepare_model, tree_forward
from tests.specdec.helpers import VOCAB, tiny_model
from treeattn import TreeMask
from treeattn.layout import random_tree_parents

pytestmark = pytest.mark.usefixtures("one_thread")

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str):
    if family not in _MODELS:
        model = tiny_model(family)
        prepare_model(model)
        _MODELS[family] = model
    return _MODELS[family]


def _case(n_seqs: int, prompt_len: int, tree_size: int, seed: int):
    """A random prompt, per sequence a random suffix (lengths differ, the first is 0) and a random tree
    (its mask; ``parents`` int64 ``[n_seqs, tree_size]``), and the trees' tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen)
    lens = [0] + [int(x) for x in torch.randint(1, 14, (n_seqs - 1,), generator=gen)]
    suffixes = [torch.randint(3, VOCAB, (s,), generator=gen) for s in lens]
    parents = torch.stack([random_tree_parents(tree_size, max_depth=6, generator=gen) for _ in range(n_seqs)])
    tokens = torch.randint(3, VOCAB, (n_seqs, tree_size), generator=gen)
    return prompt, suffixes, TreeMask.from_parents(parents), parents, tokens


def _unshared(model, prompt, suffixes, mask, tokens, num_layers, kv_len):
    """Today's layout: prompt + suffix prefilled into every sequence's cache; logits of the trees."""
    n, t = tokens.shape
    prompt_len, longest = len(prompt), max(len(s) for s in suffixes)
    cache = KVCache(n, prompt_len + longest + t, num_layers=num_layers)
    ids = torch.zeros(n, prompt_len + longest, dtype=torch.int64)  # right-padded
    for b, s in enumerate(suffixes):
        ids[b, : prompt_len + len(s)] = torch.cat([prompt, s])
    prefill(model, ids, cache, impl="torch")
    cache.lengths = [prompt_len + len(s) for s in suffixes]
    kv = None if kv_len is None else prompt_len + kv_len
    logits = tree_forward(model, tokens, mask, torch.tensor(cache.lengths), cache, kv_len=kv, impl="torch")
    return cache, logits


def _shared(model, prompt, suffixes, mask, tokens, num_layers, kv_len, impl="torch", capacity=None):
    """The shared layout: the prompt once; each suffix written by a chain-shaped verification
    forward over it (the way accepted tokens land after the prompt), then the trees.

    ``capacity``: the prompt in a ``KVCache(1, capacity)`` whose slots past it hold noise, its length
    passed as a device tensor (``shared_len``: the fixed-capacity form a captured graph uses)."""
    n, t = tokens.shape
    longest = max(len(s) for s in suffixes)
    if capacity is None:
        shared, shared_len = prefill_shared(model, prompt, num_layers=num_layers, impl="torch"), None
    else:
        shared, shared_len = _fixed_capacity_prompt(model, prompt, capacity, num_layers)
    cache = KVCache(n, longest + t, num_layers=num_layers)
    if longest:
        chain = torch.full((n, longest), 3, dtype=torch.int64)  # padding nodes land where the tree goes / unseen
        for b, s in enumerate(suffixes):
            chain[b, : len(s)] = s
        chain_mask = TreeMask.from_parents(torch.arange(-1, longest - 1).expand(n, longest))
        tree_forward(model, chain, chain_mask, torch.zeros(n, dtype=torch.int64), cache, kv_len=kv_len, impl=impl,
                     shared=shared, shared_len=shared_len)
    cache.lengths = [len(s) for s in suffixes]
    logits = tree_forward(model, tokens, mask, torch.tensor(cache.lengths), cache, kv_len=kv_len, impl=impl,
                          shared=shared, shared_len=shared_len)
    return shared, cache, logits


def _fixed_capacity_prompt(model, prompt, capacity, num_layers):
    """The prompt prefilled into slots ``[0, P)`` of a ``KVCache(1, capacity)``, large noise in the
    slots after it (they must never be read), and P as an int64 ``[1]`` tensor."""
    shared = KVCache(1, capacity, num_layers=num_layers)
    prefill(model, prompt[None], shared, impl="torch")
    shared.lengths = [len(prompt)]
    gen = torch.Generator().manual_seed(capacity)
    for layer in shared.layer_indices:
        for buf in shared.buffers(layer):
            buf[:, :, len(prompt):] = 50 * torch.randn(buf[:, :, len(prompt):].shape, generator=gen)
    return shared, torch.tensor([len(prompt)])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("n_seqs", [1, 3, 5])
@pytest.mark.parametrize("prompt_len, tree_size, static", [(37, 13, True), (70, 70, False)])
def test_shared_layout_equals_unshared(family, n_seqs, prompt_len, tree_size, static):
    model = _model(family)
    layers = model.config.num_hidden_layers
    prompt, suffixes, mask, parents, tokens = _case(n_seqs, prompt_len, tree_size, seed=100 * n_seqs + prompt_len)
    kv_len = None if static else max(len(s) for s in suffixes) + tree_size
    ucache, want = _unshared(model, prompt, suffixes, mask, tokens, layers, kv_len)
    shared, scache, got = _shared(model, prompt, suffixes, mask, tokens, layers, kv_len)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # The suffix KV written over the shared prompt is the unshared cache's, moved down by P.
    for layer in scache.layer_indices:
        for s_buf, u_buf in zip(scache.buffers(layer), ucache.buffers(layer)):
            for b, s in enumerate(suffixes):
                torch.testing.assert_close(s_buf[b, :, : len(s)], u_buf[b, :, prompt_len : prompt_len + len(s)],
                                           atol=2e-5, rtol=1e-5)
        for s_buf, u_buf in zip(shared.buffers(layer), ucache.buffers(layer)):
            torch.testing.assert_close(s_buf[0], u_buf[0, :, :prompt_len], atol=2e-5, rtol=1e-5)
    # And against a fresh causal forward of one path: the deepest node of the last sequence.
    b = n_seqs - 1
    node = int(mask.depth[b].argmax())
    path, j = [], node
    while j >= 0:
        path.append(j)
        j = int(parents[b, j])
    ids = torch.cat([prompt, suffixes[b], tokens[b, path[::-1]]])
    with torch.no_grad():
        fresh = model(ids[None]).logits[0, -1]
    torch.testing.assert_close(got[b, node], fresh, atol=2e-5, rtol=1e-4)


def test_shared_layout_per_sequence_cache_is_smaller():
    model = _model("qwen2")
    cfg = model.config
    layers, n_seqs, prompt_len, tree_size = cfg.num_hidden_layers, 5, 70, 13
    prompt, suffixes, mask, _, tokens = _case(n_seqs, prompt_len, tree_size, seed=7)
    ucache, _ = _unshared(model, prompt, suffixes, mask, tokens, layers, None)
    shared, scache, _ = _shared(model, prompt, suffixes, mask, tokens, layers, None)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_slot = 2 * layers * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    longest = max(len(s) for s in suffixes)
    assert shared.nbytes == per_slot * prompt_len
    assert scache.nbytes == per_slot * n_seqs * (longest + tree_size)
    assert ucache.nbytes == per_slot * n_seqs * (prompt_len + longest + tree_size)
    assert ucache.nbytes - scache.nbytes == per_slot * n_seqs * prompt_len
    assert shared.nbytes + scache.nbytes < ucache.nbytes
    print(f"\nKV bytes, {n_seqs} sequences sharing a {prompt_len}-token prompt: unshared {ucache.nbytes}, "
          f"shared {shared.nbytes} + per-sequence {scache.nbytes} = {shared.nbytes + scache.nbytes}")


def test_shared_layout_through_triton_interpreter():
    pytest.importorskip("triton")
    import treeattn.ops as ops

    if not ops.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 not set (tests/conftest.py sets it on CPU machines)")
    model = _model("llama")
    layers = model.config.num_hidden_layers
    prompt, suffixes, mask, _, tokens = _case(3, 37, 7, seed=11)
    _, want = _unshared(model, prompt, suffixes, mask, tokens, layers, None)
    _, _, got = _shared(model, prompt, suffixes, mask, tokens, layers, None, impl="triton")
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("prompt_len, capacity", [(1, 9), (37, 70), (70, 70), (130, 131)])
def test_fixed_capacity_prompt_with_device_length(impl, prompt_len, capacity):
    """The prompt in a larger buffer (noise after it) with its length as a device tensor: the logits
    of the unshared layout, the positions offset by that tensor."""
    if impl == "triton":
        pytest.importorskip("triton")
        import treeattn.ops as ops

        if not ops.interpreter_enabled():
            pytest.skip("TRITON_INTERPRET=1 not set (tests/conftest.py sets it on CPU machines)")
    model = _model("qwen2")
    layers = model.config.num_hidden_layers
    prompt, suffixes, mask, _, tokens = _case(3, prompt_len, 11, seed=prompt_len + capacity)
    _, want = _unshared(model, prompt, suffixes, mask, tokens, layers, None)
    _, _, got = _shared(model, prompt, suffixes, mask, tokens, layers, None, impl=impl, capacity=capacity)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_one_state_serves_prompts_of_any_length():
    """One ``ForwardState`` over fixed tensors (as a captured graph holds them): only the device length
    and the positions change between two prompts of different lengths in the same buffer."""
    from specdec.hf import run_state

    model = _model("llama")
    layers = model.config.num_hidden_layers
    shared, cache = KVCache(1, 80, num_layers=layers), KVCache(2, 16, num_layers=layers)
    mask = TreeMask.from_parents(torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, 2]]))
    paths = [[0, 3], [0, 2, 3]]  # node 3's root path in each tree
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    prefix = torch.zeros(2, dtype=torch.int64)
    shared_len, positions = torch.zeros(1, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)
    slots = torch.arange(4).expand(2, 4)
    state = ForwardState(cache, slots, positions, tree_mask=mask, prefix_lens=prefix, impl="torch", shared=shared,
                         shared_len=shared_len)
    for prompt_len in (50, 13):
        prompt = torch.arange(prompt_len) * 7 % 150 + 3
        prefill(model, prompt[None], shared, impl="torch")  # over the longer prompt's KV: slots past 13 are stale
        shared_len.fill_(prompt_len)
        positions.copy_(mask.position_ids(prefix + prompt_len))
        with torch.no_grad():
            got = run_state(model, tokens, positions, state)
            for b, path in enumerate(paths):
                fresh = model(torch.cat([prompt, tokens[b, path]])[None]).logits[0, -1]
                torch.testing.assert_close(got[b, 3], fresh, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("stacked", [True, False])
def test_allocate_like_gives_the_buffers_a_first_write_would(stacked):
    """The rows of a shared prompt write nothing before their first tree forward: ``allocate_like``
    makes their buffers ahead of it (zeroed, stacked like a first write's), leaving existing ones."""
    model = _model("qwen2")
    layers = model.config.num_hidden_layers
    shared = KVCache(1, 20, num_layers=layers if stacked else None)
    prefill(model, torch.arange(3, 10)[None], shared, impl="torch")
    rows, written = KVCache(3, 12, num_layers=layers if stacked else None), KVCache(3, 12, num_layers=layers)
    rows.allocate_like(shared)
    prefill(model, torch.arange(3, 9).expand(3, 6), written, impl="torch")
    assert rows.layer_indices == shared.layer_indices == written.layer_indices
    assert rows.nbytes == written.nbytes
    for layer in rows.layer_indices:
        for got, want in zip(rows.buffers(layer), written.buffers(layer)):
            assert got.shape == want.shape and got.dtype == want.dtype and not got.any()
    before = [t.data_ptr() for layer in rows.layer_indices for t in rows.buffers(layer)]
    rows.allocate_like(shared)  # nothing new
    assert [t.data_ptr() for layer in rows.layer_indices for t in rows.buffers(layer)] == before
    if stacked:
        assert rows.buffers(1)[0].data_ptr() == rows.buffers(0)[0].data_ptr() + rows.buffers(0)[0].nbytes


def _tiny_state(shared, tree_mask=True, batch=2):
    cache = KVCache(batch, 8)
    slots = torch.arange(3).expand(batch, 3)
    if not tree_mask:
        return ForwardState(cache, slots, slots, shared=shared)
    mask = TreeMask.from_parents(torch.tensor([-1, 0, 1]).expand(batch, 3))
    return ForwardState(cache, slots, slots + 5, tree_mask=mask, prefix_lens=torch.zeros(batch, dtype=torch.int64),
                        shared=shared)


def test_shared_rejects_a_prefill():
    shared = KVCache(1, 5)
    shared.lengths = [5]
    with pytest.raises(ValueError, match=r"shared: expected a verification forward .* got a prefill"):
        _tiny_state(shared, tree_mask=False)


def test_shared_rejects_batch_size_other_than_one():
    with pytest.raises(ValueError, match=r"shared: expected a KVCache of batch size 1 .* got batch size 2"):
        _tiny_state(KVCache(2, 5))


def test_shared_rejects_other_types():
    with pytest.raises(ValueError, match=r"shared: expected a KVCache or None, got Tensor"):
        _tiny_state(torch.zeros(1, 2, 5, 4))


def test_shared_rejects_length_past_capacity():
    shared = KVCache(1, 5)
    shared.lengths = [6]
    with pytest.raises(ValueError, match=r"shared: expected a prompt length 0 <= lengths\[0\] <= capacity 5, got 6"):
        _tiny_state(shared)


def test_shared_rejects_a_cache_without_the_layer():
    model = _model("llama")
    shared = KVCache(1, 4)  # nothing written
    shared.lengths = [4]
    cache = KVCache(1, 8)
    mask = TreeMask.from_parents(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match=r"shared: expected the shared prompt's KV of layer 0"):
        tree_forward(model, torch.tensor([[5, 6]]), mask, torch.zeros(1, dtype=torch.int64), cache, impl="torch",
                     shared=shared)


@pytest.mark.parametrize("family, match", [
    ("gemma2", r"shared: expected no attention-logit soft-capping .* got softcap=20.0 in layer 0"),
    ("gemma3", r"shared: expected no sliding window shorter than the context \(9 shared \+ 8 per-sequence slots\) "
               r".* got sliding_window=6 in layer 0"),
])  # fmt: skip
def test_shared_rejects_soft_capped_and_sliding_window_layers(family, match):
    model = _model(family)
    shared = prefill_shared(model, torch.arange(3, 12), impl="torch")
    cache = KVCache(2, 8)
    mask = TreeMask.from_parents(torch.tensor([-1, 0, 0]).expand(2, 3))
    with pytest.raises(ValueError, match=match):
        tree_forward(model, torch.full((2, 3), 5), mask, torch.tensor([0, 2]), cache, impl="torch", shared=shared)


def test_shared_len_needs_a_shared_prompt_and_an_int64_pair():
    shared = KVCache(1, 5)
    cache = KVCache(2, 8)
    slots = torch.arange(3).expand(2, 3)
    mask = TreeMask.from_parents(torch.tensor([-1, 0, 1]).expand(2, 3))
    common = dict(tree_mask=mask, prefix_lens=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"shared_len: expected None without a shared prompt \(shared=None\)"):
        ForwardState(cache, slots, slots, **common, shared_len=torch.zeros(1, dtype=torch.int64))
    for bad, got in ((torch.zeros(1, dtype=torch.int32), r"torch.int32 \(1,\)"), (torch.zeros(2, dtype=torch.int64),
                     r"torch.int64 \(2,\)"), (3, "int")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"shared_len: expected None or an int64 tensor of shape \[1\], "
                                             rf"got {got}"):
            ForwardState(cache, slots, slots, **common, shared=shared, shared_len=bad)


def test_device_length_bounds_a_sliding_window_by_the_capacity():
    """With the length on the device, only the buffer's capacity bounds the prompt on the host."""
    model = _model("gemma3")
    shared = KVCache(1, 5, num_layers=model.config.num_hidden_layers)
    prefill(model, torch.arange(3, 5)[None], shared, impl="torch")
    shared.lengths = [2]
    mask = TreeMask.from_parents(torch.tensor([-1, 0]).expand(2, 2))
    cache = KVCache(2, 2)
    args = (model, torch.full((2, 2), 5), mask, torch.zeros(2, dtype=torch.int64), cache)
    tree_forward(*args, impl="torch", shared=shared)  # 2 + 2 positions: inside the 6-position window
    with pytest.raises(ValueError, match=r"shared: expected no sliding window shorter than the context \(5 shared \+ "
                                         r"2 per-sequence slots\)"):
        tree_forward(*args, impl="torch", shared=shared, shared_len=torch.tensor([2]))


def test_prefill_shared_rejects_a_batch():
    model = _model("llama")
    with pytest.raises(ValueError, match=r"prompt_ids: expected shape \[1, P\] or \[P\] with P >= 1, got \(2, 4\)"):
        prefill_shared(model, torch.ones(2, 4, dtype=torch.int64))



@pytest.mark.slow
def test_shared_layout_under_torch_compile():
    """Under torch.compile the cascade runs outside the graph (``torch.compiler.disable``): same logits."""
    from specdec.hf import run_state

    model = _model("llama")
    prompt, suffixes, mask, _, tokens = _case(3, 37, 9, seed=3)
    shared, cache, want = _shared(model, prompt, suffixes, mask, tokens, model.config.num_hidden_layers, None)
    suffix_lens = torch.tensor(cache.lengths)
    positions = mask.position_ids(suffix_lens + len(prompt))
    slots = suffix_lens[:, None] + torch.arange(tokens.shape[1])
    state = ForwardState(cache, slots, positions, tree_mask=mask, prefix_lens=suffix_lens, impl="torch",
                         shared=shared)
    torch._dynamo.reset()
    body = torch.compile(lambda: run_state(model, tokens, positions, state), backend="eager", dynamic=False)
    with torch.no_grad():
        got = body()
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=0, rtol=0)

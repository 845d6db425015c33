"""``specdec.graphs.GraphedForward``: fixed-buffer tree forwards, eager replay on CPU, CUDA graphs on GPU.

CPU (CI): the input packing against ``TreeMask.from_parents``, the eager-replay mode (the same
buffers and body the graph captures) against ``hf.tree_forward`` over several steps with changing
prefix lengths and trees, and the engine on that path against HF ``generate``. CUDA only (skipped
here; run on a GPU with ``pytest tests/specdec -k graph``): real captures and replays on tiny models
against eager forwards and HF ``generate``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from specdec.drafting import DraftContext
from specdec import KVCache, SpecDecoder, TokenTree
from specdec.graphs import GraphedForward, GraphedMaskedForward, InputLayout, capture_warmup, graph_capture, pack_trees
from specdec.hf import masked_forward, prefill, prepare_model, tree_forward
from tests.specdec.helpers import VOCAB, OracleDrafter, RandomTreeDrafter, hf_greedy, tiny_model
from treeattn import TreeMask
from treeattn.layout import random_tree_parents

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(n: int, seed: int, root: int = 5) -> TokenTree:
    gen = torch.Generator().manual_seed(seed)
    parents = random_tree_parents(n, max_depth=6, generator=gen)
    tokens = torch.randint(3, VOCAB, (n,), generator=gen)
    tokens[0] = root
    return TokenTree(tokens, parents)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _model(family: str):
    model = tiny_model(family)
    prepare_model(model)
    return model


# ---------------------------------------------------------------------------- input packing (CPU)


@pytest.mark.parametrize("n", [1, 2, 17, 63, 64, 65, 128, 129, 200])
def test_graph_inputs_pack_like_treemask(n):
    """Tokens, positions, slots, depths and ancestor words equal TreeMask.from_parents' layout (also
    when the same tree shapes come again with other tokens and prefixes: per-shape inputs are cached)."""
    for tokens_seed, prefix in ((n, [11, 0, 40]), (n + 100, [3, 7, 0])):
        trees = [_tree(n, seed=n), _tree(max(1, n // 3), seed=n + 1, root=7), _tree(1, 0, root=9)]
        trees = [TokenTree(torch.randint(3, VOCAB, (t.n,), generator=torch.Generator().manual_seed(tokens_seed)),
                           t.parents) for t in trees]  # fmt: skip
        _check_packed(trees, prefix, n)


def _check_packed(trees, prefix, n):
    layout = InputLayout(len(trees), n)
    flat = torch.frombuffer(pack_trees(trees, prefix, layout), dtype=torch.int64)
    assert flat.numel() == layout.size
    tokens = torch.zeros(3, n, dtype=torch.int64)
    parents = torch.zeros(3, n, dtype=torch.int64)  # padding nodes hang off the root
    for b, t in enumerate(trees):
        tokens[b, : t.n] = t.tokens
        parents[b, : t.n] = t.parents
    parents[:, 0] = -1
    mask = TreeMask.from_parents(parents)
    pl = torch.tensor(prefix)
    assert torch.equal(layout.view(flat, "tokens"), tokens)
    assert torch.equal(layout.view(flat, "words"), mask.words)
    assert torch.equal(layout.view(flat, "depth"), mask.depth)
    assert torch.equal(layout.view(flat, "positions"), mask.position_ids(pl))
    assert torch.equal(layout.view(flat, "slots"), pl[:, None] + torch.arange(n))
    assert torch.equal(layout.view(flat, "prefix_lens"), pl)


def test_graph_input_layout_is_aligned_and_contiguous():
    layout = InputLayout(3, 65)
    flat = torch.zeros(layout.size, dtype=torch.int64)
    for name, shape in layout.shapes.items():
        assert layout.offsets[name] % 8 == 0
        view = layout.view(flat, name)
        assert tuple(view.shape) == shape and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    spans = sorted((layout.offsets[k], layout.offsets[k] + layout.view(flat, k).numel()) for k in layout.shapes)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # segments never overlap
    assert spans[-1][1] <= layout.size


def test_graph_inputs_carry_a_shared_prompt_length():
    """With a shared prompt the layout has a ``shared_len`` segment and positions start after it;
    slots and prefix lengths stay those of the sequences' own cache."""
    trees = [_tree(9, seed=1), _tree(4, seed=2, root=7)]
    layout = InputLayout(2, 9, shared=True)
    assert layout.shapes["shared_len"] == (1,) and layout.offsets["shared_len"] % 8 == 0
    assert layout.size == InputLayout(2, 9).size + 8
    flat = torch.frombuffer(pack_trees(trees, [3, 0], layout, shared_len=41), dtype=torch.int64)
    plain = torch.frombuffer(pack_trees(trees, [3, 0], InputLayout(2, 9)), dtype=torch.int64)
    assert layout.view(flat, "shared_len").tolist() == [41]
    assert torch.equal(layout.view(flat, "positions"), InputLayout(2, 9).view(plain, "positions") + 41)
    for name in ("tokens", "slots", "depth", "words", "prefix_lens"):
        assert torch.equal(layout.view(flat, name), InputLayout(2, 9).view(plain, name))
    with pytest.raises(ValueError, match=r"shared_len: expected 0 for a layout without a shared prompt, got 41"):
        pack_trees(trees, [3, 0], InputLayout(2, 9), shared_len=41)


# ---------------------------------------------------------------------------- eager replay (CPU)


def _pointers(gf: GraphedForward) -> list[int]:
    ptrs = [gf.tokens.data_ptr(), gf.positions.data_ptr(), gf.slots.data_ptr(), gf.prefix_lens.data_ptr(),
            gf.tree_mask.words.data_ptr(), gf.tree_mask.depth.data_ptr()]
    for layer in gf.cache.layer_indices:
        ptrs += [t.data_ptr() for t in gf.cache.buffers(layer)]
    return ptrs


@pytest.mark.parametrize("impl,compile", [("torch", False), ("triton", False), ("torch", "aot_eager"),
                                          ("torch", "layers:aot_eager")])
def test_graph_eager_replay_over_a_shared_prompt(impl, compile):
    """``GraphedForward(shared=)``: one forward, prompts of several lengths prefilled in turn into the
    same fixed-capacity cache (stale KV after the shorter ones), the sequences' caches and trees
    changing each step: the logits of ``hf.tree_forward(shared=)`` over exactly that prompt.
    compile: traced once for every prompt length, in one graph (the cascade is one opaque op, no
    graph break)."""
    if impl == "triton":
        pytest.importorskip("triton")
        from treeattn.ops import interpreter_enabled

        if not interpreter_enabled():
            pytest.skip("TRITON_INTERPRET=1 not set (tests/conftest.py sets it on CPU machines)")
    model = _model("qwen2")
    layers = model.config.num_hidden_layers
    batch, n = 3, 9
    shared, cache = KVCache(1, 70, num_layers=layers), KVCache(batch, 40, num_layers=layers)
    gf = GraphedForward(model, cache, batch, n, impl=impl, shared=shared, compile=compile)
    graphs_before = counters["stats"]["unique_graphs"]
    # the prompt length the attention reads lives in the input vector, refilled by every load
    assert gf.state.shared_len.data_ptr() == gf.layout.view(gf._flat, "shared_len").data_ptr()
    outputs = None
    for step, (prompt_len, lengths) in enumerate([(70, [0, 0, 0]), (37, [5, 0, 12]), (1, [3, 30, 8]), (55, [0, 7, 2])]):
        prefill(model, _prompt(prompt_len, step)[None], shared, impl="torch")
        shared.lengths = [prompt_len]
        cache.allocate_like(shared)  # as the engine: no allocation inside the (compiled) forward
        trees = [_tree(n, 10 * step + b) for b in range(batch - 1)] + [_tree(4, 10 * step + 9)]
        logits, _ = gf.run(trees, lengths)
        outputs = logits if outputs is None else outputs
        assert logits is outputs
        got = logits.clone()
        tokens = torch.zeros(batch, n, dtype=torch.int64)
        parents = torch.zeros(batch, n, dtype=torch.int64)
        for b, t in enumerate(trees):
            tokens[b, : t.n], parents[b, : t.n] = t.tokens, t.parents
        parents[:, 0] = -1
        exact = KVCache(1, prompt_len, num_layers=layers)
        prefill(model, _prompt(prompt_len, step)[None], exact, impl="torch")
        exact.lengths = [prompt_len]
        want = tree_forward(model, tokens, TreeMask.from_parents(parents), torch.tensor(lengths), cache, impl="torch",
                            shared=exact)  # fmt: skip
        for b, t in enumerate(trees):
            torch.testing.assert_close(got[b, : t.n], want[b, : t.n], atol=5e-5, rtol=1e-4)
    assert gf.calls == 4
    assert counters["stats"]["unique_graphs"] - graphs_before == (1 if compile else 0)


def test_graph_shared_prompt_length_is_checked_at_load():
    model = _model("qwen2")
    shared = KVCache(1, 8)
    gf = GraphedForward(model, KVCache(2, 16), 2, 3, impl="torch", shared=shared)
    shared.lengths = [9]
    with pytest.raises(ValueError, match=r"shared: expected a prompt length 0 <= lengths\[0\] <= capacity 8, got 9"):
        gf.load([_tree(3, 1), _tree(2, 2)], [0, 0])
    with pytest.raises(ValueError, match=r"shared: expected a KVCache of batch size 1 .* got batch size 2"):
        GraphedForward(model, KVCache(2, 16), 2, 3, impl="torch", shared=KVCache(2, 8))


@pytest.mark.parametrize("family,hidden,compile", [("llama", False, False), ("qwen2", True, False), ("gemma3", False, False),
                                                   ("qwen2", True, "aot_eager"), ("gemma3", False, "aot_eager"),
                                                   ("qwen2", True, "layers:aot_eager"),
                                                   ("gemma3", False, "layers:aot_eager")])
def test_graph_eager_replay_equals_tree_forward_over_steps(family, hidden, compile):
    """Several steps, changing prefix lengths and trees (some padded): same logits as hf.tree_forward.
    compile: the body traced by torch.compile (aot_eager: the tracing and functionalization that
    inductor starts from, without code generation), once for all steps; "layers:aot_eager": each
    decoder layer through one forward traced once for all layers of its kind."""
    model = _model(family)
    batch, n, capacity = 2, 33, 96
    prompts = [_prompt(20, 1), _prompt(9, 2)]
    cache = KVCache(batch, capacity)
    ids = torch.zeros(batch, 20, dtype=torch.int64)
    ids[0], ids[1, :9] = prompts[0], prompts[1]
    prefill(model, ids, cache, impl="torch")
    gf = GraphedForward(model, cache, batch, n, impl="torch", return_hidden=hidden, compile=compile)
    graphs_before = counters["stats"]["unique_graphs"]
    lengths = [19, 8]
    pointers = None
    outputs = None
    for step, sizes in enumerate([(33, 1), (5, 33), (12, 20), (1, 1), (33, 33)]):
        trees = [_tree(sizes[0], 10 * step, root=int(prompts[0][-1])), _tree(sizes[1], 10 * step + 1)]
        logits, hid = gf.run(trees, lengths)
        if outputs is None:
            outputs = (logits, hid)
            pointers = _pointers(gf)
        assert logits is outputs[0] and hid is outputs[1]  # fixed output tensors
        assert _pointers(gf) == pointers  # fixed inputs and cache buffers
        assert logits.shape == (batch, n, VOCAB)
        got_logits = logits.clone()
        got_hidden = None if hid is None else hid.clone()
        width = max(t.n for t in trees)
        tokens = torch.zeros(batch, width, dtype=torch.int64)
        parents = torch.zeros(batch, width, dtype=torch.int64)
        for b, t in enumerate(trees):
            tokens[b, : t.n], parents[b, : t.n] = t.tokens, t.parents
        parents[:, 0] = -1
        want = tree_forward(model, tokens, TreeMask.from_parents(parents), torch.tensor(lengths), cache,
                            kv_len=max(lengths) + width, impl="torch", return_hidden=hidden)
        want_logits, want_hidden = want if hidden else (want, None)
        for b, t in enumerate(trees):
            torch.testing.assert_close(got_logits[b, : t.n], want_logits[b, : t.n], atol=2e-5, rtol=1e-5)
            assert torch.equal(got_logits[b, : t.n].argmax(-1), want_logits[b, : t.n].argmax(-1))
            if hidden:
                torch.testing.assert_close(got_hidden[b, : t.n], want_hidden[b, : t.n], atol=2e-5, rtol=1e-5)
        lengths = [lengths[0] + 1 + step, lengths[1] + 2 * step]  # the next step's prefixes (data, not shapes)
    assert gf.calls == 5 and not gf.captured
    # no recompiles; layer-wise: one graph per kind of layer (Gemma 3's sliding-window and full layers)
    kinds = len(set(getattr(model.config, "layer_types", None) or ["full_attention"]))
    want_graphs = 0 if not compile else kinds if compile.startswith("layers") else 1
    assert counters["stats"]["unique_graphs"] - graphs_before == want_graphs


def test_graph_forward_argument_errors():
    model = _model("llama")
    cache = KVCache(1, 16)
    with pytest.raises(ValueError, match=r"capture: CUDA graphs need the model on a CUDA device, got cpu"):
        GraphedForward(model, cache, 1, 4, capture=True)
    with pytest.raises(ValueError, match=r"cache: expected batch size 2, got a cache of batch size 1"):
        GraphedForward(model, cache, 2, 4)
    with pytest.raises(ValueError, match=r"n: expected at most the cache capacity 16, got 17"):
        GraphedForward(model, cache, 1, 17)
    with pytest.raises(ValueError, match=r"n: expected an int >= 1, got 0"):
        GraphedForward(model, cache, 1, 0)
    gf = GraphedForward(model, cache, 1, 4, impl="torch")
    with pytest.raises(ValueError, match=r"trees\[0\]: expected at most n = 4 nodes, got 5"):
        gf.load([_tree(5, 0)], [0])
    with pytest.raises(ValueError, match=r"prefix_lens: expected 0 <= prefix_len and prefix_len \+ n <= 16"):
        gf.load([_tree(3, 0)], [13])
    with pytest.raises(ValueError, match=r"trees, prefix_lens: expected 1 of each, got 2 and 1"):
        gf.load([_tree(3, 0), _tree(3, 1)], [0])
    with pytest.raises(ValueError, match=r"trees\[0\]: expected a specdec.TokenTree, got list"):
        gf.load([[1, 2]], [0])


# ---------------------------------------------------------------------------- the engine on that path (CPU)


@pytest.mark.parametrize("kind,tree_size", [("none", 0), ("oracle", 8), ("oracle", 64), ("random", 7)])
def test_graph_path_engine_equals_hf_generate(kind, tree_size):
    """static_shapes without capture: the fixed-buffer path the graphs replay, token for token HF greedy."""
    model = _model("qwen2")
    prompt = _prompt(10, 0)
    ref = hf_greedy(model, prompt, 30)
    drafter = {"none": None, "oracle": OracleDrafter([ref], seed=3), "random": RandomTreeDrafter(seed=4)}[kind]
    dec = SpecDecoder(model, drafter, tree_size=tree_size, static_shapes=True, cuda_graphs=False,
                      max_cache_len=128, attn_impl="torch")  # fmt: skip
    assert not dec.cuda_graphs and dec.static_shapes
    steps = 0
    for _ in range(2):  # the second call reuses the same cache and forward
        out = dec.generate(prompt, 30)
        assert out.sequences[0].tolist() == ref
        steps += len(out.steps)
    assert len(dec._graphs) == 1
    (gf,) = dec._graphs.values()
    assert gf.n == dec.tree_size + 1 and not gf.captured
    chunks = list(dec._chunks.values())  # plain decoding: 3 chunks of 8 steps per call, then 6 single steps
    assert [c.calls for c in chunks] == ([6] if kind == "none" else [])
    assert gf.calls + sum(c.calls * c.steps for c in chunks) == steps
    assert all(s.forward_s > 0 and s.forward_s <= s.verify_s for s in out.steps)
    assert out.prefill_s > 0 and out.totals()["forward_s"] > 0


def test_graph_path_batch_eos_and_new_batch_size():
    model = _model("llama")
    lengths, seeds = (4, 1, 12), (10, 11, 12)
    prompts = [_prompt(L, s) for L, s in zip(lengths, seeds)]
    refs = [hf_greedy(model, p, 16) for p in prompts]
    eos = refs[0][4 + 5]
    for b in range(3):
        if eos in refs[b][lengths[b]:]:
            refs[b] = refs[b][: refs[b].index(eos, lengths[b]) + 1]
    dec = SpecDecoder(model, OracleDrafter(refs, seed=7), tree_size=6, static_shapes=True, attn_impl="torch")
    out = dec.generate(prompts, 16, eos_token_id=eos)
    for b in range(3):
        assert out.sequences[b, : out.lengths[b]].tolist() == refs[b]
    single = dec.generate(prompts[2], 16, eos_token_id=eos)  # a new batch size: a new cache and forward
    assert single.sequences[0].tolist() == refs[2]
    cap = dec.cache_buckets[0]  # the tiny model's only default bucket: its context + tree_size
    assert cap == 256 + 6 and list(dec.forwards) == [(3, cap, 7), (1, cap, 7)]  # both kept
    assert list(dec.caches) == [(3, cap), (1, cap)]
    dec.release(batch_size=3)
    assert list(dec.forwards) == [(1, cap, 7)] and list(dec.caches) == [(1, cap)]


@pytest.mark.parametrize("static", [False, True])
def test_graph_path_cut_paths_commit_only_kept_tokens(static):
    """A step whose accepted path runs past max_new_tokens commits only the kept part, so a finished
    sequence still fits the exactly sized cache while the others go on (regression)."""
    model = _model("qwen2")
    prompts = [_prompt(7, 3), _prompt(15, 4)]
    refs = [hf_greedy(model, p, 14) for p in prompts]
    dec = SpecDecoder(model, OracleDrafter(refs, seed=5), tree_size=5, static_shapes=static, attn_impl="torch")
    out = dec.generate(prompts, 14)
    for b in range(2):
        assert out.sequences[b, : out.lengths[b]].tolist() == refs[b]
    assert any(e < a + 1 for s in out.steps for a, e in zip(s.tokens_accepted, s.tokens_emitted) if e)  # a cut path


class _HiddenRecorder(OracleDrafter):
    needs_hidden_states = True

    def __init__(self, refs):
        super().__init__(refs, seed=5)
        self.seen: list[torch.Tensor | None] = []

    def propose(self, ctx: DraftContext):
        self.seen.append(None if ctx.hidden is None else ctx.hidden.detach().cpu().clone())
        return super().propose(ctx)


def test_graph_path_hidden_states_equal_dynamic_path():
    model = _model("qwen2")
    prompt = _prompt(7, 3)
    ref = hf_greedy(model, prompt, 14)
    runs = []
    for static in (False, True):
        rec = _HiddenRecorder([ref])
        out = SpecDecoder(model, rec, tree_size=5, static_shapes=static, attn_impl="torch").generate(prompt, 14)
        assert out.sequences[0].tolist() == ref
        runs.append(rec.seen)
    assert len(runs[0]) == len(runs[1]) > 1
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_commit_copies_nothing_for_paths_already_in_place(monkeypatch):
    """A first-child chain (0, 1, ..., k) stays where the forward wrote it: only lengths grow;
    otherwise one copy per moving sequence covers every (stacked) layer."""
    model = _model("llama")
    cache = KVCache(2, 32, num_layers=model.config.num_hidden_layers)
    prefill(model, _prompt(12, 0)[None].expand(2, -1), cache, impl="torch")
    cache.lengths = [5, 7]
    calls = []
    real = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: calls.append(a[0]) or real(self, *a))
    cache.commit([(0, 1, 2), None])
    assert cache.lengths == [8, 7] and not calls
    cache.commit([(0,), (0, 2)])
    assert cache.lengths == [9, 9] and len(calls) == 1


def test_cuda_graphs_argument_errors():
    model = _model("llama")
    with pytest.raises(ValueError, match=r"cuda_graphs: True needs the target on a CUDA device, got cpu"):
        SpecDecoder(model, None, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs: expected None, True or False, got 'yes'"):
        SpecDecoder(model, None, cuda_graphs="yes")
    assert SpecDecoder(model, None).cuda_graphs is False  # CPU default: off, dynamic shapes
    assert SpecDecoder(model, None, static_shapes=True).cuda_graphs is False
    with pytest.raises(ValueError, match=r"compile: needs static_shapes, got static_shapes=False"):
        SpecDecoder(model, None, compile=True)
    with pytest.raises(ValueError, match=r"compile: expected a bool or a torch.compile backend name, got ''"):
        SpecDecoder(model, None, static_shapes=True, compile="")
    with pytest.raises(ValueError, match=r"compile: expected 'layers' or 'layers:BACKEND' with a plain backend"):
        SpecDecoder(model, None, static_shapes=True, compile="layers:max-autotune")


def test_compiled_forward_called_again_without_a_load_compiles_once():
    """A capture's forwards (the first run, the warm-up runs, the recording) and a greedy chunk's steps
    call the compiled body again and again without a ``load`` in between: they must not trace it again.
    (The state used to fill its per-device dict during the first call; dynamo guarded on it and the
    second call compiled the whole model again: the capture's 7.3 s in PERF.md v18's first token.)"""
    model = _model("qwen2")
    prompt = _prompt(12, 4)
    cache = KVCache(1, 48)
    prefill(model, prompt[None, :11], cache, impl="torch")
    gf = GraphedForward(model, cache, 1, 5, impl="torch", compile="aot_eager")
    gf.load([_tree(5, 2, root=int(prompt[-1]))], [11])
    before = counters["stats"]["unique_graphs"]
    first = gf.forward()[0].clone()
    for _ in range(3):
        assert torch.equal(gf.forward()[0], first)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("compile", ["aot_eager", "layers:aot_eager"])
@pytest.mark.parametrize("kind,tree_size", [("oracle", 8), ("random", 31)])
def test_compiled_engine_equals_hf_generate(kind, tree_size, compile):
    """SpecDecoder(compile=...) on CPU (aot_eager; layer-wise: each decoder layer through one traced
    forward): the traced forward gives HF's greedy tokens, and the model's own generate still does."""
    model = _model("qwen2")
    prompt = _prompt(10, 0)
    ref = hf_greedy(model, prompt, 24)
    drafter = {"oracle": OracleDrafter([ref], seed=3), "random": RandomTreeDrafter(seed=4)}[kind]
    dec = SpecDecoder(model, drafter, tree_size=tree_size, static_shapes=True, attn_impl="torch", compile=compile)
    assert dec.generate(prompt, 24).sequences[0].tolist() == ref
    (gf,) = dec._graphs.values()
    assert gf.compile == "aot_eager" and (gf._compiled is None) == gf.compile_layers == compile.startswith("layers")
    assert hf_greedy(model, prompt, 24) == ref


def _post_grad_recorder():
    """An inductor post-grad pass that only records the graphs it is given, and the list it fills."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    graphs = []

    class Record(CustomGraphPass):
        def __call__(self, graph):
            graphs.append(graph)

        def uuid(self):
            return "record-post-grad-graph"

    return Record(), graphs


@pytest.mark.slow
@pytest.mark.parametrize("compile", ["inductor", True])
def test_inductor_forward_writes_the_cache_in_place(compile):
    """compile="inductor" (the whole forward; C++ code on the CPU): after inductor's post-grad passes every layer stores
    its new keys and values with one in-place ``index_put_`` each, and no cache buffer is copied back.
    (A traced ``scatter_`` became a clone of the whole buffer, a scatter and a ``copy_`` back: work in
    the cache's capacity, kernels a layer on the GPU; PERF.md v19.) Nothing clones the attention
    op's output on its way to o_proj (it comes laid out as the layer reshapes it). Same logits as the
    uncompiled body. True (= ``"layers"``): one graph, of one decoder layer, serves both layers."""
    from torch._inductor import config as inductor_config

    model = _model("qwen2")
    layers = model.config.num_hidden_layers
    prompt = _prompt(30, 3)
    record, graphs = _post_grad_recorder()
    outputs = []
    for how in (False, compile):
        cache = KVCache(1, 80, num_layers=layers)
        prefill(model, prompt[None, :29], cache, impl="torch")
        gf = GraphedForward(model, cache, 1, 9, impl="torch", compile=how)
        with inductor_config.patch(post_grad_custom_post_pass=record, force_disable_caches=True):
            logits, _ = gf.run([_tree(9, 7, root=int(prompt[-1]))], [29])
        outputs.append((logits.clone(), cache.buffers(0)[0][0, :, 29:38].clone()))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=2e-6, rtol=1e-6)  # the tree's keys, same slots
    (graph,) = graphs
    nodes = [node for node in graph.nodes if node.op == "call_function"]
    ops = [node.target for node in nodes]
    aten = torch.ops.aten
    layers = 1 if compile is True else layers  # True = "layers": the graph of one decoder layer
    assert ops.count(aten.index_put_.default) == 2 * layers
    assert not [op for op in ops if op in (aten.copy_.default, aten.scatter.src, aten.scatter_.src, aten.index_put.default)]
    views = (aten.permute.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int)
    attention = [node for node in nodes if node.target == torch.ops.treeattn.tree_attention.default]
    assert len(attention) == layers
    for node in attention:
        users = list(node.users)
        while users:
            user = users.pop()
            assert user.target != aten.clone.default, f"a clone of {node.name} on its way to o_proj"
            if user.target in views:
                users += list(user.users)


# ---------------------------------------------------------------------------- CUDA graphs (GPU only)


def _cuda_model(family: str, dtype=torch.float32):
    model = tiny_model(family, dtype=dtype).to("cuda")
    prepare_model(model)
    return model


def _hf_greedy_cuda(model, prompt: torch.Tensor, new: int) -> list[int]:
    ids = prompt[None].to("cuda")
    out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))  # fmt: skip
    return out[0].tolist()


# ---------------------------------------------------------------------------- masked forward (draft model)


def _masked_inputs(prefix: int, m: int, seed: int):
    """m tokens after a prefix: each sees the prefix and a random subset of the earlier new tokens + itself."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (1, m), generator=g)
    slots = (prefix + torch.arange(m))[None]
    positions = prefix + torch.randint(0, 4, (1, m), generator=g)
    vis = torch.zeros(1, m, prefix + m, dtype=torch.bool)
    vis[:, :, :prefix] = True
    tree = torch.rand(m, m, generator=g) < 0.4
    vis[0, :, prefix:] = torch.tril(tree, -1) | torch.eye(m, dtype=torch.bool)
    key_positions = torch.cat([torch.arange(prefix), positions[0]])[None]
    return tokens, positions, slots, vis, key_positions


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_graph_masked_forward_eager_replay_equals_masked_forward(family):
    """Padded fixed-shape forwards over the whole cache give masked_forward's logits, call after call."""
    model = _model(family)
    prompt = _prompt(20, 3)[None]
    cache_a, cache_b = KVCache(1, 64), KVCache(1, 64)
    for cache in (cache_a, cache_b):
        prefill(model, prompt, cache, impl="torch")
    fixed = GraphedMaskedForward(model, cache_a, 1, 6)
    first = None
    for step, m in enumerate([6, 1, 3, 6]):
        inputs = _masked_inputs(20 + 2 * step, m, seed=step)
        want = masked_forward(model, *inputs[:4], cache_b, key_positions=inputs[4])
        fixed.load(*inputs)
        logits, hidden = fixed.forward()
        assert hidden is None and logits.shape[:2] == (1, 6)
        first = first or logits.data_ptr()
        assert logits.data_ptr() == first
        torch.testing.assert_close(logits[:, :m], want, atol=1e-5, rtol=1e-5)
        # the rows' KV went to the same slots in both caches; padding touched only the scratch slot
        k_a, _ = cache_a.buffers(0)
        k_b, _ = cache_b.buffers(0)
        torch.testing.assert_close(k_a[:, :, :63], k_b[:, :, :63])
    assert fixed.calls == 4


def test_graph_masked_forward_argument_errors():
    model = _model("qwen2")
    cache = KVCache(1, 32)
    with pytest.raises(ValueError, match=r"m: expected fewer tokens than the cache capacity 32 \(one slot is scratch\), got 32"):
        GraphedMaskedForward(model, cache, 1, 32)
    with pytest.raises(ValueError, match=r"capture: CUDA graphs need the model on a CUDA device, got cpu"):
        GraphedMaskedForward(model, cache, 1, 4, capture=True)
    fixed = GraphedMaskedForward(model, cache, 1, 4)
    tokens, positions, slots, vis, keypos = _masked_inputs(10, 3, 0)
    with pytest.raises(ValueError, match=r"tokens: expected shape \[1, 1..4\], got \(1, 5\)"):
        fixed.load(torch.zeros(1, 5, dtype=torch.long), positions, slots, vis)
    with pytest.raises(ValueError, match=r"slots: expected values in \[0, 30\] \(slot 31 is scratch\), got \[10, 31\]"):
        fixed.load(tokens, positions, torch.tensor([[10, 11, 31]]), vis)
    with pytest.raises(ValueError, match=r"visible: expected shape \[1, 3, kv_len <= 31\], got \(1, 3, 32\)"):
        fixed.load(tokens, positions, slots, torch.ones(1, 3, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_positions: expected shape \[1, 13\], got \(1, 12\)"):
        fixed.load(tokens, positions, slots, vis, keypos[:, :12])


@pytest.mark.cuda
def test_cuda_graph_masked_forward_replay_equals_eager():
    model = _cuda_model("qwen2")
    prompt = _prompt(20, 3)[None].to("cuda")
    caches = [KVCache(1, 64), KVCache(1, 64)]
    for cache in caches:
        prefill(model, prompt, cache, impl="torch")
    graphed = GraphedMaskedForward(model, caches[0], 1, 6, capture=True)
    eager = GraphedMaskedForward(model, caches[1], 1, 6, capture=False)
    for step, m in enumerate([6, 1, 3, 6]):
        inputs = _masked_inputs(20 + 2 * step, m, seed=step)
        eager.load(*inputs)
        want = eager.forward()[0].clone()
        graphed.load(*inputs)
        logits, _ = graphed.forward()
        assert graphed.captured
        torch.testing.assert_close(logits[:, :m], want[:, :m], atol=1e-5, rtol=1e-5)
    assert graphed.calls == 4


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_cuda_graph_over_a_shared_prompt_serves_every_length(impl):
    """One capture of ``GraphedForward(shared=)``, replayed over prompts of several lengths prefilled
    in turn into the same buffer: the eager replay's logits each time."""
    model = _cuda_model("qwen2")
    layers = model.config.num_hidden_layers
    batch, n = 3, 17
    shared, cache = KVCache(1, 100, num_layers=layers), KVCache(batch, 60, num_layers=layers)
    prefill(model, _prompt(90, 0)[None].to("cuda"), shared, impl="torch")  # buffers exist before the capture
    shared.lengths = [90]
    graphed = GraphedForward(model, cache, batch, n, impl=impl, capture=True, shared=shared)
    eager = GraphedForward(model, cache, batch, n, impl=impl, capture=False, shared=shared)
    for step, (prompt_len, lengths) in enumerate([(90, [0, 0, 0]), (37, [5, 0, 12]), (1, [3, 30, 8]),
                                                  (100, [0, 7, 2])]):  # fmt: skip
        prefill(model, _prompt(prompt_len, step)[None].to("cuda"), shared, impl="torch")
        shared.lengths = [prompt_len]
        trees = [_tree(n, 10 * step + b) for b in range(batch - 1)] + [_tree(5, 10 * step + 9)]
        want = eager.run(trees, lengths)[0].clone()
        logits, _ = graphed.run(trees, lengths)
        assert graphed.captured
        for b, t in enumerate(trees):
            torch.testing.assert_close(logits[b, : t.n], want[b, : t.n], atol=1e-5, rtol=1e-5)
    assert graphed.calls == 4


@pytest.mark.cuda
def test_cuda_graph_engine_shares_the_prompt_across_lengths():
    """The CUDA engine's defaults (static shapes, CUDA graphs, the shared layout) on a shared prompt:
    HF's greedy rows for two prompt lengths of one bucket, through one captured forward."""
    model = _cuda_model("qwen2")
    dec = SpecDecoder(model, RandomTreeDrafter(seed=0), tree_size=8)
    assert dec.static_shapes and dec.cuda_graphs and dec.shared_prefix
    for length, seed in ((70, 1), (37, 2)):
        prompt = _prompt(length, seed)
        out = dec.generate(prompt, 20, num_return_sequences=3)
        want = _hf_greedy_cuda(model, prompt, 20)
        assert [out.sequences[b].tolist() for b in range(3)] == [want] * 3
    (graphed,) = dec.shared_forwards.values()
    assert graphed.captured and dict(dec.forwards) == {}


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("family,hidden", [("llama", False), ("qwen2", True)])
def test_cuda_graph_replay_equals_eager(family, hidden, impl):
    """Captured replays give the eager forward's logits over steps with new prefixes and trees."""
    model = _cuda_model(family)
    batch, n = 2, 65
    cache = KVCache(batch, 160)
    ids = torch.stack([_prompt(30, 1), _prompt(30, 2)]).to("cuda")
    prefill(model, ids, cache, impl=impl)
    graphed = GraphedForward(model, cache, batch, n, impl=impl, return_hidden=hidden, capture=True)
    eager = GraphedForward(model, cache, batch, n, impl=impl, return_hidden=hidden, capture=False)
    lengths = [30, 12]
    first = None
    for step, sizes in enumerate([(65, 1), (3, 65), (40, 17), (1, 1), (65, 64)]):
        trees = [_tree(sizes[0], 10 * step), _tree(sizes[1], 10 * step + 1)]
        want_logits, want_hidden = (t.clone() if t is not None else None for t in eager.run(trees, lengths))
        logits, hid = graphed.run(trees, lengths)
        assert graphed.captured
        if first is None:
            first = (logits.data_ptr(), None if hid is None else hid.data_ptr())
        assert (logits.data_ptr(), None if hid is None else hid.data_ptr()) == first
        for b, t in enumerate(trees):
            torch.testing.assert_close(logits[b, : t.n], want_logits[b, : t.n], atol=1e-5, rtol=1e-5)
            if hidden:
                torch.testing.assert_close(hid[b, : t.n], want_hidden[b, : t.n], atol=1e-5, rtol=1e-5)
        lengths = [lengths[0] + 3, lengths[1] + 5 + step]
    assert graphed.calls == 5


@pytest.mark.cuda
@pytest.mark.parametrize("kind,tree_size", [("none", 0), ("oracle", 8), ("oracle", 64), ("random", 31)])
def test_cuda_graph_engine_equals_hf_generate(kind, tree_size):
    model = _cuda_model("qwen2")
    prompt = _prompt(10, 0)
    ref = _hf_greedy_cuda(model, prompt, 30)
    drafter = {"none": None, "oracle": OracleDrafter([ref], seed=3), "random": RandomTreeDrafter(seed=4)}[kind]
    dec = SpecDecoder(model, drafter, tree_size=tree_size)
    assert dec.cuda_graphs and dec.static_shapes  # the CUDA default
    for _ in range(2):
        assert dec.generate(prompt, 30).sequences[0].tolist() == ref
    (gf,) = dec._graphs.values()
    assert gf.captured
    eager = SpecDecoder(model, drafter, tree_size=tree_size, cuda_graphs=False)
    assert eager.generate(prompt, 30).sequences[0].tolist() == ref


@pytest.mark.cuda
@pytest.mark.parametrize("compile", ["inductor", True, "layers"])
def test_cuda_graph_of_the_inductor_compiled_forward_equals_eager(compile):
    """compile="inductor" (the whole forward) or True = "layers" (each decoder layer through one compiled
    forward) + capture: the replayed compiled forward gives HF's greedy tokens."""
    model = _cuda_model("qwen2")
    prompt = _prompt(10, 0)
    ref = _hf_greedy_cuda(model, prompt, 30)
    dec = SpecDecoder(model, RandomTreeDrafter(seed=4), tree_size=31, compile=compile)
    assert dec.generate(prompt, 30).sequences[0].tolist() == ref
    (gf,) = dec._graphs.values()
    assert gf.captured and gf.compile == "inductor" and gf.compile_layers == (compile != "inductor")
    assert gf.warmup == capture_warmup() and 0 <= gf.capture_warmup_s <= gf.capture_s


@pytest.mark.cuda
@pytest.mark.parametrize("one_stream", ["1", "0"])
def test_cuda_capture_of_a_compiled_forward_compiles_once(monkeypatch, one_stream):
    """The capture's forwards (first run, warm-up, recording; with ``$SPECDEC_CAPTURE_ONE_STREAM=1``,
    PERF.md v9's candidate, all on one side stream) compile the body once: as many dynamo graphs as one
    eager-replay (uncaptured) call of the same forward. The 2026-11-24 run measured 2 with one stream; the
    second was the state's per-device dict, filled by the first call (fixed in v19, CPU-tested by
    ``test_compiled_forward_called_again_without_a_load_compiles_once``; passed on an H100 on 2026-11-27)."""
    from specdec.graphs import ONE_STREAM_ENV

    monkeypatch.setenv(ONE_STREAM_ENV, one_stream)
    model = _cuda_model("qwen2")

    def graphs_made(capture: bool, capacity: int, n: int) -> int:  # new shapes each: a compile of their own
        cache = KVCache(1, capacity, num_layers=2)
        prefill(model, torch.tensor([[3, 4, 5]], device="cuda"), cache, impl="torch")  # the engine prefills first
        cache.lengths = [3]
        gf = GraphedForward(model, cache, 1, n, capture=capture, compile="inductor")
        before = counters["stats"]["unique_graphs"]
        gf.run([TokenTree.chain(torch.tensor([6, 7, 8]))], [3])
        assert gf.captured == capture
        return counters["stats"]["unique_graphs"] - before

    assert graphs_made(True, 64, 8) == graphs_made(False, 72, 9) >= 1


@pytest.mark.cuda
def test_cuda_graph_default_can_be_turned_off_by_environment(monkeypatch):
    model = _cuda_model("llama")
    assert SpecDecoder(model, None).cuda_graphs
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "0")
    dec = SpecDecoder(model, None)
    assert not dec.cuda_graphs and dec.static_shapes
    assert SpecDecoder(model, None, cuda_graphs=True).cuda_graphs  # an explicit True still wins


@pytest.mark.cuda
def test_cuda_graph_batch_hidden_states_and_recapture():
    model = _cuda_model("qwen2")
    prompts = [_prompt(7, 3), _prompt(15, 4)]
    refs = [_hf_greedy_cuda(model, p, 14) for p in prompts]
    seen = []
    for graphs in (False, True):
        rec = _HiddenRecorder(refs)
        dec = SpecDecoder(model, rec, tree_size=5, cuda_graphs=graphs)  # cache sized per call
        out = dec.generate(prompts, 14)
        for b in range(2):
            assert out.sequences[b, : out.lengths[b]].tolist() == refs[b]
        one = dec.generate(prompts[1], 14)  # batch 1: a new cache and a new capture
        assert one.sequences[0].tolist() == refs[1]
        seen.append(rec.seen)
    for a, b in zip(*seen):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_graph_bf16_and_sampling():
    model = _cuda_model("llama", dtype=torch.bfloat16)
    prompt = _prompt(12, 5)
    outs = []
    for graphs in (False, True):
        dec = SpecDecoder(model, RandomTreeDrafter(seed=1), tree_size=16, cuda_graphs=graphs, max_cache_len=64)
        assert dec.generate(prompt, 20).num_new_tokens == 20
        runs = []
        for _ in range(2):  # the same drafter and generator state: the same samples
            dec.drafter = RandomTreeDrafter(seed=1)
            runs.append(dec.generate(prompt, 20, do_sample=True, temperature=1.3,
                                     generator=torch.Generator(device="cuda").manual_seed(0)).sequences)
        assert torch.equal(runs[0], runs[1])
        outs.append(runs[0])
    assert outs[0].shape == outs[1].shape


@pytest.mark.cuda
def test_cuda_graph_bench_engine_runs(tmp_path):
    """bench-engine on CUDA with tiny saved models: captured rows, well-formed JSON."""
    import json

    from specdec.cli import bench as bench_engine
    from tests.eval.tiny import apps_rows, save_pair

    target, draft = save_pair(tmp_path)
    data = apps_rows(tmp_path / "apps.jsonl", 2)
    out = tmp_path / "engine.json"
    cfg = bench_engine.BenchConfig(target=str(target), draft=str(draft), data=str(data), problems=2, max_new_tokens=10,
                                   tree_sizes=(1, 8, 64), spec_tree_size=8, reps=3, device="cuda", dtype="fp32",
                                   plain_methods=("hf", "engine-eager", "engine-graph"), progress=False,
                                   out=str(out))  # fmt: skip
    bench_engine.run_bench(cfg, log=lambda msg: None)
    res = json.loads(out.read_text())
    graph_row = next(r for r in res["plain"] if r["method"] == "engine-graph")
    assert graph_row["captured"] and "error" not in graph_row and graph_row["identical"] == 2
    assert all(r["graph_captured"] and r["max_abs_logit_diff"] < 1e-3 for r in res["verify"]["rows"])
    assert all("error" not in r and r["identical"] == 2 for r in res["spec"])


def _qwen_like(layers: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Qwen2.5-Coder-1.5B's attention shapes (12 query heads, 2 KV heads, d = 128), few layers,
    random weights (a large LM head: decisive argmax) on CUDA: the tree-attention kernel runs
    with the real model's configs."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=1536, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.2)
    return model.to("cuda", dtype).eval()


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "nographs"])
@pytest.mark.parametrize("grow", [False, True], ids=["same-capacity", "cache-grows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_batch_sequence_around_hf_static_generate(grow, graphs, dtype):
    """The crash sequence of 2026-11-23 (Medusa drafter, CUDA graphs, one process): batch 2 x 8 tokens,
    batch 4 x 128 tokens, the target's own HF generate with the static cache on those 4 prompts
    (left-padded), batch 4 more prompts -- no CUDA error, and every row equal to the same prompt
    decoded alone by a fresh decoder (fp32; bf16 runs the sequence only: batched and solo
    forwards round differently)."""
    from drafters.medusa import MedusaDrafter, MedusaHeads

    vocab = 512
    target = _qwen_like(2, vocab, dtype)
    torch.manual_seed(1)
    heads = MedusaHeads(1536, 4).to("cuda", dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, vocab, (n,), generator=gen)  # noqa: E731
    first = [prompt(n) for n in (12, 20)]
    second = [prompt(n) for n in (412, 987, 655, 1320)]
    # grow: the longest prompt needs a larger cache bucket than the second call's (2048 -> 4160 slots)
    third = [prompt(n) for n in ((2000, 300, 870, 1100) if grow else (1000, 300, 870, 1100))]
    dec = SpecDecoder(target, MedusaDrafter(target, heads), tree_size=64, cuda_graphs=graphs)
    outs = [dec.generate(first, 8), dec.generate(second, 128)]
    torch.cuda.synchronize()
    width = max(len(p) for p in second)
    ids = torch.zeros(4, width, dtype=torch.int64)
    mask = torch.zeros(4, width, dtype=torch.int64)
    for b, p in enumerate(second):  # left padding, as HF expects for batched generate
        ids[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=128, do_sample=False,
                    cache_implementation="static", pad_token_id=0)
    torch.cuda.synchronize()
    outs.append(dec.generate(third, 128))
    torch.cuda.synchronize()
    if dtype != torch.float32:
        return
    solo = SpecDecoder(target, MedusaDrafter(target, heads), tree_size=64, cuda_graphs=graphs)
    for prompts, out in zip((first, second, third), outs):
        for b, p in enumerate(prompts):
            alone = solo.generate([p], out.lengths[b] - len(p))
            assert out.sequences[b, : out.lengths[b]].tolist() == alone.sequences[0].tolist()


@pytest.mark.cuda
def test_cuda_graph_replay_after_cublas_workspaces_are_cleared():
    """The cause of that crash without HF in the way: a graph captured after another one
    whose capture had allocated the cuBLAS workspace, the first graph destroyed, the workspace
    cache cleared (as torch.compile's CUDA-graph trees do) and the memory released -- replaying the
    second graph must not touch freed memory, and must still equal an eager forward."""
    target = _qwen_like(2, 512, torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = lambda *ns: [torch.randint(3, 512, (n,), generator=gen) for n in ns]  # noqa: E731
    dec = SpecDecoder(target, RandomTreeDrafter(seed=0, vocab=512), tree_size=16)
    dec.generate(prompts(10, 14), 4)  # batch 2: its graph's capture allocates the workspace
    second = prompts(300, 200, 250)
    dec.generate(second, 4)  # batch 3: a new cache and graph
    dec.release(batch_size=2)  # the batch-2 graph is dropped
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    out = dec.generate(second, 24)  # replays the batch-3 graph
    torch.cuda.synchronize()
    eager = SpecDecoder(target, RandomTreeDrafter(seed=0, vocab=512), tree_size=16, cuda_graphs=False)
    assert out.sequences.tolist() == eager.generate(second, 24).sequences.tolist()


def test_capture_warmup_count(monkeypatch):
    """Side-stream forwards before a capture: 2 by default, ``$SPECDEC_CAPTURE_WARMUP``, or the argument."""
    from specdec.graphs import CAPTURE_WARMUP_ENV, capture_warmup

    monkeypatch.delenv(CAPTURE_WARMUP_ENV, raising=False)
    assert capture_warmup() == 2 and capture_warmup(0) == 0 and capture_warmup(3) == 3
    monkeypatch.setenv(CAPTURE_WARMUP_ENV, "1")
    assert capture_warmup() == 1 and capture_warmup(0) == 0
    model = tiny_model("llama")
    prepare_model(model, "target")
    cache = KVCache(1, 32, num_layers=2)
    assert GraphedForward(model, cache, 1, 4).warmup == 1
    assert GraphedForward(model, cache, 1, 4, warmup=0).warmup == 0
    monkeypatch.setenv(CAPTURE_WARMUP_ENV, "two")
    with pytest.raises(ValueError, match=r"SPECDEC_CAPTURE_WARMUP: expected an int >= 0, got 'two'"):
        GraphedForward(model, cache, 1, 4)
    monkeypatch.delenv(CAPTURE_WARMUP_ENV)
    with pytest.raises(ValueError, match=r"warmup: expected None or an int >= 0, got -1"):
        GraphedForward(model, cache, 1, 4, warmup=-1)
    gf = GraphedForward(model, cache, 1, 4)
    assert gf.warmup == 2 and gf.capture_s is None and gf.capture_warmup_s is None


def test_compile_fixed_shapes_modes(monkeypatch):
    """True / "inductor": inductor's default mode; "max-autotune": inductor timing GEMM templates,
    without its own CUDA graphs (the forwards capture theirs); another string: that backend."""
    from specdec import graphs

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(graphs, "configure_compile_cache", lambda: "/tmp/unused")
    for backend in (True, "inductor", "max-autotune", "aot_eager"):
        graphs.compile_fixed_shapes(len, backend)
    assert [(c["backend"], c["mode"]) for c in calls] == [
        ("inductor", None), ("inductor", None), ("inductor", "max-autotune-no-cudagraphs"), ("aot_eager", None)]
    assert all(c["dynamic"] is False for c in calls)


def test_layer_compile_options(monkeypatch):
    """The layer-wise compile: one ``torch.compile`` per (layer class, backend), with inductor's
    combo kernels (``hf.LAYER_INDUCTOR_OPTIONS``) for inductor and no options for another backend."""
    from specdec import hf

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(hf, "_COMPILED_FORWARDS", {})

    class Layer(torch.nn.Module):
        pass

    for backend in ("inductor", "inductor", "aot_eager"):
        hf._compiled_forward(Layer, backend)
    assert [(c["backend"], c["options"]) for c in calls] == [("inductor", {"combo_kernels": True}), ("aot_eager", None)]
    assert all(c["dynamic"] is False for c in calls)


def test_compile_plan_values_and_errors():
    """``compile=``: False, a backend name (the whole forward), True = ``"layers"`` / ``"layers:BACKEND"``
    (each decoder layer through one compiled forward); the errors name the argument. A masked forward
    compiles whole: True is inductor there."""
    from specdec.graphs import compile_plan, uses_inductor

    assert compile_plan(False) == (None, False) and compile_plan(True) == ("inductor", True)
    assert compile_plan("inductor") == ("inductor", False)
    assert compile_plan("aot_eager") == ("aot_eager", False) and compile_plan("max-autotune") == ("max-autotune", False)
    assert compile_plan("layers") == ("inductor", True) and compile_plan("layers:aot_eager") == ("aot_eager", True)
    assert [uses_inductor(c) for c in (False, True, "layers", "layers:aot_eager", "max-autotune")] == [
        False, True, True, False, True]
    for bad in ("", 3, None, "layers:max-autotune", "layers:layers"):
        with pytest.raises(ValueError, match="compile: expected"):
            compile_plan(bad)
    model = _model("qwen2")
    with pytest.raises(ValueError, match="compile: expected a bool or a backend name for a masked forward, got 'layers'"):
        GraphedMaskedForward(model, KVCache(1, 16), 1, 4, compile="layers")
    masked = GraphedMaskedForward(model, KVCache(1, 16), 1, 4, compile=True)
    assert masked.compile == "inductor" and not masked.compile_layers


def test_compile_layers_leaves_the_model_alone_outside_specdec():
    """``hf.compile_layers``: every decoder layer gets the dispatching forward (idempotent); the model's
    own forward gives the same logits as before; a deep copy's layers dispatch to the copy; a module
    without decoder layers is refused; a layer-wise forward over a cache with no buffers is refused."""
    import copy

    from specdec.hf import ForwardState, compile_layers

    model = tiny_model("llama", seed=5)
    prepare_model(model)
    ids = _prompt(12, 5)[None]
    before = model(ids).logits
    assert compile_layers(model) == compile_layers(model) == model.config.num_hidden_layers
    forwards = [layer.__dict__["forward"] for layer in model.model.layers]
    assert [f.layer_idx for f in forwards] == list(range(model.config.num_hidden_layers))
    assert [f.layer for f in forwards] == list(model.model.layers)
    assert torch.equal(model(ids).logits, before)
    twin = copy.deepcopy(model)
    assert [layer.__dict__["forward"].layer for layer in twin.model.layers] == list(twin.model.layers)
    assert torch.equal(twin(ids).logits, before)
    with pytest.raises(ValueError, match="model: expected decoder layers"):
        compile_layers(torch.nn.Linear(2, 2))
    state = ForwardState(KVCache(1, 16), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64),
                         layer_backend="aot_eager")  # fmt: skip
    with pytest.raises(ValueError, match=r"cache: expected KV buffers for layer 0 \(a prefill writes them\)"):
        state.for_layer(0)
    with pytest.raises(ValueError, match="layer_backend: expected None or a torch.compile backend name, got ''"):
        ForwardState(KVCache(1, 16), state.slots, state.positions, layer_backend="")


@pytest.mark.parametrize("enabled", [True, False])
def test_graph_capture_keeps_the_collector_off_inside(monkeypatch, enabled):
    """Inside ``graph_capture`` automatic collection is off (a collection there may free a captured
    graph, which invalidates the capture); after it, on success or error, it is as before."""
    import contextlib
    import gc

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, stream=None, capture_error_mode="global"):
        seen.append((gc.isenabled(), capture_error_mode))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with graph_capture(object()):
            seen.append(gc.isenabled())
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError, match="inside"):
            with graph_capture(object()):
                raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [(False, "thread_local"), False, (False, "thread_local")]


@pytest.mark.cuda
def test_graph_capture_survives_garbage_graphs_on_cuda():
    """A captured graph left in a reference cycle, and the collector's threshold at 1 (it would
    run at the capture's first allocations): ``graph_capture`` records and replays correctly."""
    import gc

    x = torch.arange(8.0, device="cuda")
    for _ in range(3):  # cycles owning captured graphs
        holder: dict = {}
        holder["self"] = holder
        holder["graph"] = torch.cuda.CUDAGraph()
        with graph_capture(holder["graph"]):
            holder["out"] = x * 2
        del holder
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            ys = [[x + i] for i in range(64)]  # Python objects: the collector would run here
            y = torch.stack([v[0] for v in ys]).sum(0)
    finally:
        gc.set_threshold(*threshold)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, 64 * x + sum(range(64)))

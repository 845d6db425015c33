"""The fixed-shape chunked prompt prefill (``SpecDecoder(prefill_width=...)``, static shapes).

CPU: static shapes without capture (eager replay of the same fixed buffers a CUDA graph would
replay). A small width W exercises many chunks cheaply; every prefill is checked against the
eager one (``hf.prefill``, SDPA) -- cache KV at the committed slots and the hidden state that
predicted the first root -- and every generate against the target's own HF greedy decoding (fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

import specdec.engine as engine
from specdec import SpecDecoder, hf
from specdec.engine import DEFAULT_PREFILL_WIDTH
from specdec.graphs import prefill_chunks
from specdec.graphs import GraphedForward
from specdec.hf import prepare_model
from specdec.kv import KVCache
from tests.specdec.helpers import VOCAB, OracleDrafter, greedy_reference, prepared_tiny_model, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

W = 8
TREE = 6
NEW = 12
BUCKETS = (48, 96, 192)  # the tiny models have 256 positions


_model, _prompt = prepared_tiny_model, random_prompt


def _ref(length: int, seed: int, new: int = NEW, family: str = "qwen2") -> tuple[int, ...]:
    return greedy_reference(length, seed, new, family)


class _HiddenOracle(OracleDrafter):
    """An oracle that reads the target's hidden state (as Medusa heads do) and records it."""

    needs_hidden_states = True

    def __init__(self, refs):
        super().__init__(refs, seed=5)
        self.seen: list[torch.Tensor | None] = []

    def propose(self, ctx):
        self.seen.append(None if ctx.hidden is None else ctx.hidden.detach().cpu().clone())
        return super().propose(ctx)


def _decoder(width=W, family="qwen2", drafter=None, tree_size=TREE, **kwargs) -> SpecDecoder:
    kwargs.setdefault("cache_buckets", BUCKETS)
    drafter = OracleDrafter([], seed=3) if drafter is None else drafter
    return SpecDecoder(_model(family), drafter, tree_size=tree_size, static_shapes=True, attn_impl="torch",
                       prefill_width=width, **kwargs)  # fmt: skip


def _generate(dec: SpecDecoder, shapes: list[tuple[int, int]], new: int = NEW, family: str = "qwen2"):
    """Decode prompts of (length, seed) as one batch; check every row against HF greedy."""
    refs = [list(_ref(length, seed, new, family)) for length, seed in shapes]
    dec.drafter.references = refs
    out = dec.generate([_prompt(length, seed) for length, seed in shapes], new)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : out.lengths[b]].tolist() == ref, f"row {b} (prompt length {shapes[b][0]})"
    return out


@pytest.fixture
def loads(monkeypatch):
    """The prefix lengths of every prefill-forward load (one list per chunk): the loads of
    forwards of W or 16 nodes (the tests' tree forwards have other sizes)."""
    seen: list[list[int]] = []
    real = GraphedForward.load

    def load(self, trees, prefix_lens):
        if self.n in (W, 16):
            seen.append([int(p) for p in prefix_lens])
        return real(self, trees, prefix_lens)

    monkeypatch.setattr(GraphedForward, "load", load)
    return seen


@pytest.fixture
def built(monkeypatch):
    """Every GraphedForward the engine constructs, as (batch, capacity, n)."""
    made: list[tuple[int, int, int]] = []

    class CountedForward(engine.GraphedForward):
        def __init__(self, model, cache, batch, n, **kwargs):
            super().__init__(model, cache, batch, n, **kwargs)
            made.append((batch, cache.capacity, n))

    monkeypatch.setattr(engine, "GraphedForward", CountedForward)
    return made


# ---------------------------------------------------------------------------- the chunking rule


def test_prefill_chunks_rule():
    assert DEFAULT_PREFILL_WIDTH == 256
    assert prefill_chunks(0, 8, 48) == []
    assert prefill_chunks(1, 8, 48) == [(0, 1)]
    assert prefill_chunks(8, 8, 48) == [(0, 8)]
    assert prefill_chunks(9, 8, 48) == [(0, 8), (8, 9)]
    assert prefill_chunks(19, 8, 48) == [(0, 8), (8, 16), (16, 19)]
    assert prefill_chunks(250, 256, 262) == [(0, 250)]  # one chunk: it fits at prefix 0
    # W-aligned starts until one would pass capacity - W (= 28): clamped, the chunk before is shorter.
    assert prefill_chunks(33, 16, 44) == [(0, 16), (16, 28), (28, 33)]
    assert prefill_chunks(44, 16, 44) == [(0, 16), (16, 28), (28, 44)]
    assert prefill_chunks(262, 256, 262) == [(0, 6), (6, 262)]
    for capacity in range(1, 40):
        for width in range(1, capacity + 1):
            for total in range(capacity + 1):
                chunks = prefill_chunks(total, width, capacity)
                at = 0
                for start, stop in chunks:
                    assert start == at and 0 < stop - start <= width and start + width <= capacity
                    at = stop
                assert at == total and len(chunks) <= math.ceil(total / width) + 1
    with pytest.raises(ValueError, match=r"width, total: expected 1 <= width <= capacity 8"):
        prefill_chunks(4, 9, 8)
    with pytest.raises(ValueError, match=r"width, total: expected .* got width 4, total 9"):
        prefill_chunks(9, 4, 8)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("length", [1, 2, W - 1, W, W + 1, 2 * W + 3, 5 * W + 1])
def test_chunked_prefill_greedy_equals_hf(length, loads):
    dec = _decoder()
    out = _generate(dec, [(length, length)])
    ((_, capacity),) = dec.caches
    assert loads == [[start] for start in range(0, length - 1, W)]  # none for a one-token prompt
    assert list(dec.prefill_forwards) == ([] if length == 1 else [(1, capacity)])
    if length > 1:
        gf = dec.prefill_forwards[(1, capacity)]
        assert gf.n == W and gf.calls == len(loads) and not gf.captured and gf.compile is None
        assert tuple(gf.logits.shape) == (1, 1, VOCAB) and gf.hidden is None  # KV only: one logits row
    assert out.prefill_s > 0


def test_prefill_near_a_full_bucket_clamps_the_last_chunk(loads):
    """A prompt that nearly fills its bucket: a W-aligned chunk would run past the cache, so the
    chunk before it stops early and the last one starts at capacity - W."""
    dec = _decoder(width=16, tree_size=3, cache_buckets=(44, 96))
    length, new = 37, 4  # 37 + 4 + 3 = 44 slots: the first bucket; positions [0, 36) to prefill
    out = _generate(dec, [(length, 5)], new=new)
    assert list(dec.caches) == [(1, 44)]
    assert loads == [[0], [16], [28]]
    assert out.sequences.shape[1] == length + new
    # Batched: the short row is done after the first chunk and gets dummy trees at its own length.
    loads.clear()
    _generate(dec, [(37, 5), (3, 6), (20, 7)], new=new)
    assert loads == [[0, 0, 0], [16, 2, 16], [28, 2, 19]]


def test_batch_of_different_lengths(loads):
    shapes = [(1, 1), (W + 1, 2), (2 * W + 3, 3), (2, 4), (W, 5)]
    dec = _decoder()
    _generate(dec, shapes)
    # Chunks at 0, 8, 16; finished rows sit at their own length (0 for the one-token prompt).
    assert loads == [[0, 0, 0, 0, 0], [0, 8, 8, 1, 7], [0, 8, 16, 1, 7]]
    _generate(dec, [(3, 8), (2 * W + 3, 3)])  # a new batch size: its own prefill forward
    assert sorted(dec.prefill_forwards) == [(2, 48), (5, 48)]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_other_families(family):
    """Soft-capping (Gemma 2, eager attention) and sliding windows of 6 < W (Gemma 3) too."""
    dec = _decoder(family=family)
    _generate(dec, [(2 * W + 3, 0), (5, 1)], family=family)


# ---------------------------------------------------------------------------- equal to the eager prefill


def _both_prefills(lens: list[int], drafter_cls=OracleDrafter, family: str = "qwen2", width: int = W):
    """The chunked and the eager prefill of the same prompts into same-sized caches."""
    seqs = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        seqs[b, :n] = _prompt(n, 10 + b)
    results = []
    for w in (width, 0):
        dec = _decoder(width=w, family=family, drafter=drafter_cls([]))
        cache = dec._cache_for(len(lens), 48)
        hidden = dec._prefill(cache, seqs, lens)
        assert cache.lengths == [n - 1 for n in lens]
        results.append((dec, cache, hidden))
    return results


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_cache_kv_equals_eager_prefill(family):
    lens = [2 * W + 3, 1, W, W + 1, 2, 4 * W + 1]  # rows finish in different chunks: dummies must not clobber
    (chunked, c_cache, _), (eager, e_cache, _) = _both_prefills(lens, family=family)
    assert list(chunked.prefill_forwards) == [(len(lens), 48)] and not eager.prefill_forwards
    assert c_cache.layer_indices == e_cache.layer_indices == list(range(2))
    for layer in c_cache.layer_indices:
        for got, want in zip(c_cache.buffers(layer), e_cache.buffers(layer)):
            for b, n in enumerate(lens):
                torch.testing.assert_close(got[b, :, : n - 1], want[b, :, : n - 1], atol=1e-5, rtol=1e-5)


def test_hidden_state_equals_eager_prefill():
    lens = [2 * W + 3, 1, W, W + 1, 2, 3 * W, W + 2]  # position lens - 2 at chunks' first and last nodes too
    (chunked, _, got), (_, _, want) = _both_prefills(lens, drafter_cls=_HiddenOracle)
    gf = chunked.prefill_forwards[(len(lens), 48)]
    assert gf.return_hidden == "all" and tuple(gf.hidden.shape) == (len(lens), W, 64)
    # the LM head runs on one row a sequence: nobody reads a prompt chunk's logits
    assert gf.logits_to_keep == 1 and gf.logits.shape[:2] == (len(lens), 1)
    for b, n in enumerate(lens):
        if n == 1:
            assert got[b] is None and want[b] is None
        else:
            assert got[b].shape == (1, 64)
            torch.testing.assert_close(got[b], want[b], atol=1e-5, rtol=1e-5)
            assert got[b].data_ptr() != gf.hidden.data_ptr()  # a copy, not a view of the output buffer


def test_hidden_state_drafter_end_to_end():
    """A drafter reading hidden states sees (up to rounding) what it sees after an eager prefill."""
    shapes = [(2 * W + 3, 0), (W, 1), (1, 2)]
    refs = [list(_ref(L, s)) for L, s in shapes]
    seen = []
    for width in (W, 0):
        rec = _HiddenOracle(refs)
        dec = _decoder(width=width, drafter=rec)
        out = dec.generate([_prompt(L, s) for L, s in shapes], NEW)
        for b, ref in enumerate(refs):
            assert out.sequences[b, : out.lengths[b]].tolist() == ref
        seen.append(rec.seen)
    assert len(seen[0]) == len(seen[1]) > len(shapes)
    for a, b in zip(*seen):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- when it is used


def test_eager_prefill_when_off_dynamic_or_cache_too_small(monkeypatch):
    calls = []
    real = hf.prefill
    monkeypatch.setattr(hf, "prefill", lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))
    for dec in (_decoder(width=0), _decoder(width=None)):
        assert dec.prefill_width == 0
        _generate(dec, [(W + 3, 0)])
        assert not dec.prefill_forwards
    dynamic = SpecDecoder(_model(), OracleDrafter([], seed=3), tree_size=TREE, attn_impl="torch", prefill_width=W)
    assert not dynamic.static_shapes and dynamic.prefill_width == 0  # ignored with dynamic shapes
    _generate(dynamic, [(W + 3, 0)])
    assert calls == [W + 2] * 3
    calls.clear()
    big = _decoder(width=64)  # bucket 48 < 64 slots: eager there; 96 >= 64: chunked
    _generate(big, [(W + 3, 0)])
    assert calls == [W + 2] and not big.prefill_forwards
    _generate(big, [(60, 1)])  # 60 + 12 + 6 slots -> 96
    assert calls == [W + 2] and list(big.prefill_forwards) == [(1, 96)]
    default = SpecDecoder(_model(), None, static_shapes=True)
    assert default.prefill_width == DEFAULT_PREFILL_WIDTH and default.cache_buckets == (256,)


def test_prefill_forward_is_compiled_only_with_compile_prefill():
    """By default the prefill's chunks run uncompiled beside compiled tree forwards; with
    ``compile_prefill`` through the same compile, the same greedy tokens (``_generate`` checks them)."""
    dec = _decoder(compile="aot_eager")
    _generate(dec, [(2 * W + 3, 0)])
    (tree,) = dec.forwards.values()
    (pre,) = dec.prefill_forwards.values()
    assert tree.compile == "aot_eager" and tree._compiled is not None
    assert not dec.compile_prefill and pre.compile is None and pre._compiled is None
    both = _decoder(compile="aot_eager", compile_prefill=True)
    _generate(both, [(2 * W + 3, 0), (W + 1, 1)])
    (pre,) = both.prefill_forwards.values()
    assert both.compile_prefill and pre.compile == "aot_eager" and pre._compiled is not None
    layers = _decoder(compile="layers:aot_eager", compile_prefill=True)  # what compile=True is: layer-wise
    _generate(layers, [(2 * W + 3, 0), (W + 1, 1)])  # a fresh cache: its buffers made before the first chunk
    (pre,) = layers.prefill_forwards.values()
    assert pre.compile_layers and pre.calls == 3
    assert not _decoder(compile_prefill=True).compile_prefill  # nothing to compile it with
    with pytest.raises(ValueError, match=r"compile_prefill: expected True or False, got 1"):
        _decoder(compile_prefill=1)


def test_release_drops_prefill_forwards():
    dec = _decoder()
    _generate(dec, [(10, 0)])
    _generate(dec, [(10, 0), (W + 1, 1)])
    assert sorted(dec.prefill_forwards) == [(1, 48), (2, 48)]
    dec.release(batch_size=2)
    assert list(dec.prefill_forwards) == [(1, 48)]
    dec.release()
    assert not dec.prefill_forwards and not dec.forwards and not dec.caches


# ---------------------------------------------------------------------------- warmup


def test_warmup_builds_the_prefill_forward_and_generate_builds_nothing(built):
    dec = _decoder()
    messages: list[str] = []
    # 60 + 6 slots -> up to 96; batches of distinct prompts only: no forward over a shared prompt
    report = dec.warmup(batch_sizes=(2, 1), max_len=60, shared=False, log=messages.append)
    n = TREE + 1
    assert sorted(built) == sorted([(b, c, w) for b in (1, 2) for c in (48, 96) for w in (n, W)])
    assert sorted(dec.prefill_forwards) == [(1, 48), (1, 96), (2, 48), (2, 96)]
    for e in report.entries:
        assert e.built and e.prefill_built and e.prefill_n == W
        assert 0 < e.prefill_first_run_s <= e.prefill_s < e.seconds and e.prefill_capture_s is None
        assert dec.prefill_forwards[(e.batch_size, e.capacity)].calls == 1
    assert all(c.lengths == [0] * c.batch_size for c in dec.caches.values())
    assert "prompt prefill in chunks of 8 tokens" in "\n".join(messages)
    built.clear()
    for shapes in ([(10, 0)], [(45, 1)], [(10, 0), (45, 1)], [(1, 2), (W + 1, 4)]):
        _generate(dec, shapes)  # every prompt + 12 new tokens <= 60
    assert built == []
    assert all(g.calls > 1 for g in dec.prefill_forwards.values())
    again = dec.warmup(batch_sizes=(1,), max_len=60, log=None)
    assert [(e.built, e.prefill_built, e.prefill_first_run_s) for e in again.entries] == [(False, False, None)] * 2
    assert built == []


def test_warmup_entries_without_a_prefill_forward(built):
    dec = _decoder(width=64)
    report = dec.warmup(max_len=60, log=None)  # buckets 48 (< 64: eager prefill) and 96
    got = [(e.capacity, e.prefill_n, e.prefill_built, e.prefill_first_run_s is not None) for e in report.entries]
    assert got == [(48, None, False, False), (96, 64, True, True)]
    dynamic = SpecDecoder(_model(), OracleDrafter([], seed=3), tree_size=TREE, attn_impl="torch")
    (entry,) = dynamic.warmup(max_len=30, log=None).entries
    assert entry.prefill_n is None and not entry.prefill_built and entry.prefill_capture_s is None


# ---------------------------------------------------------------------------- argument errors


def test_prefill_width_argument_errors():
    model = _model()
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"prefill_width: expected None or an int >= 0 \(0 or None: the eager "
                                             r"prefill\), got "):  # fmt: skip
            SpecDecoder(model, None, static_shapes=True, prefill_width=bad)
    cache = KVCache(1, 16)
    with pytest.raises(ValueError, match=r"logits_to_keep: expected an int in \[0, n = 4\], got 5"):
        GraphedForward(model, cache, 1, 4, logits_to_keep=5)
    with pytest.raises(ValueError, match=r"logits_to_keep: expected an int in \[0, n = 4\], got -1"):
        GraphedForward(model, cache, 1, 4, logits_to_keep=-1)


# ---------------------------------------------------------------------------- CUDA graphs (GPU only)


@pytest.mark.cuda
def test_cuda_graph_prefill_equals_hf_and_captures_once(monkeypatch):
    model = tiny_model("qwen2").to("cuda")
    prepare_model(model)
    lengths = (1, 7, 8, 9, 40, 100)
    refs = {}
    for length in lengths:
        ids = _prompt(length, length)[None].to("cuda")
        refs[length] = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                      attention_mask=torch.ones_like(ids))[0].tolist()  # fmt: skip
    no_graphs = SpecDecoder(model, None, cuda_graphs=False, prefill_width=16)
    assert no_graphs.static_shapes and no_graphs.prefill_width == 0  # eager chunks would cost more: eager prefill
    dec = SpecDecoder(model, OracleDrafter([], seed=3), tree_size=TREE, cache_buckets=BUCKETS, prefill_width=16)
    assert dec.cuda_graphs and dec.prefill_width == 16
    report = dec.warmup(batch_sizes=(1, 2), max_len=120, log=None)
    assert all(e.prefill_built and e.prefill_capture_s is not None for e in report.entries)
    assert all(g.captured for g in dec.prefill_forwards.values())
    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *a, **k: captures.append(self) or begin(self, *a, **k))  # fmt: skip
    for length in lengths:
        dec.drafter.references = [refs[length]]
        assert dec.generate(_prompt(length, length), NEW).sequences[0].tolist() == refs[length]
    dec.drafter.references = [refs[100], refs[9]]
    out = dec.generate([_prompt(100, 100), _prompt(9, 9)], NEW)
    assert out.sequences[0].tolist() == refs[100] and out.sequences[1, : out.lengths[1]].tolist() == refs[9]
    assert captures == []

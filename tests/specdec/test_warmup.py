"""KV capacity buckets, ``SpecDecoder.warmup`` / ``release``, torch.compile's on-disk cache, step timing.

CPU: the fixed-shape path runs as eager replay (``static_shapes=True``, no capture), so "built"
means a ``GraphedForward`` (or ``KVCache``) was constructed -- counted by patching the engine's
classes; compiled variants use the ``aot_eager`` backend (dynamo's graph counter shows a compile),
and one test runs inductor itself for its on-disk cache. CUDA only (skipped here): after a
warm-up, longer and shorter prompts within the warmed buckets capture no CUDA graph.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch._dynamo.utils import counters

import specdec.engine as engine
import specdec.graphs as graphs
from specdec import SpecDecoder
from specdec.engine import MIN_CACHE_BUCKET, default_cache_buckets
from specdec.hf import prepare_model
from specdec.sampling import SamplingConfig
from specdec.timing import PhaseTimer
from tests.specdec.helpers import (OracleDrafter, RandomTreeDrafter, greedy_reference, prepared_tiny_model,
                                    random_prompt, tiny_model)

pytestmark = pytest.mark.usefixtures("one_thread")

BUCKETS = (48, 96, 192)  # the tiny models have 256 positions
TREE = 8
NEW = 20


_model, _prompt = prepared_tiny_model, random_prompt


def _ref(length: int, seed: int, new: int = NEW) -> tuple[int, ...]:
    return greedy_reference(length, seed, new)


def _decoder(compile: bool | str = False, **kwargs) -> SpecDecoder:
    kwargs.setdefault("cache_buckets", BUCKETS)
    return SpecDecoder(_model(), OracleDrafter([], seed=3), tree_size=TREE, static_shapes=True, attn_impl="torch",
                       compile=compile, **kwargs)  # fmt: skip


def _generate(dec: SpecDecoder, shapes: list[tuple[int, int]]):
    """Decode prompts of (length, seed) as one batch; check every row against HF greedy."""
    refs = [list(_ref(length, seed)) for length, seed in shapes]
    dec.drafter.references = refs
    out = dec.generate([_prompt(length, seed) for length, seed in shapes], NEW)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : out.lengths[b]].tolist() == ref
    return out


@pytest.fixture
def built(monkeypatch):
    """Every GraphedForward ((batch, capacity, n), and the shared prompt's capacity for one over a
    shared prompt) and KVCache ((batch, capacity)) the engine constructs."""
    made: dict[str, list[tuple[int, ...]]] = {"forwards": [], "caches": []}

    class CountedForward(engine.GraphedForward):
        def __init__(self, model, cache, batch, n, **kwargs):
            super().__init__(model, cache, batch, n, **kwargs)
            shared = kwargs.get("shared")
            made["forwards"].append((batch, cache.capacity, n) + (() if shared is None else (shared.capacity,)))

    class CountedCache(engine.KVCache):
        def __init__(self, batch_size, capacity, num_layers=None):
            super().__init__(batch_size, capacity, num_layers)
            made["caches"].append((batch_size, capacity))

    monkeypatch.setattr(engine, "GraphedForward", CountedForward)
    monkeypatch.setattr(engine, "KVCache", CountedCache)
    return made


# ---------------------------------------------------------------------------- buckets


def test_default_cache_buckets():
    assert MIN_CACHE_BUCKET == 1024
    assert default_cache_buckets(32768, 64) == (1024, 2048, 4096, 8192, 16384, 32832)  # Qwen2.5
    assert default_cache_buckets(4096, 64) == (1024, 2048, 4160)
    assert default_cache_buckets(8000, 0) == (1024, 2048, 4096, 8000)
    assert default_cache_buckets(1024, 8) == (1032,)
    assert default_cache_buckets(256, 6) == (262,)
    unbounded = default_cache_buckets(None, 64)
    assert unbounded[0] == 1024 and unbounded[-1] == 2**20
    assert all(b == 2 * a for a, b in zip(unbounded, unbounded[1:]))
    model = _model()
    assert SpecDecoder(model, RandomTreeDrafter(), tree_size=TREE, static_shapes=True).cache_buckets == (256 + TREE,)
    assert SpecDecoder(model, None, static_shapes=True).cache_buckets == (256,)
    assert SpecDecoder(model, None).cache_buckets is None  # dynamic shapes: a cache sized per call
    assert SpecDecoder(model, None, static_shapes=True, max_cache_len=64).cache_buckets is None
    assert _decoder(cache_buckets=[192, 48, 96, 48]).cache_buckets == BUCKETS  # sorted, deduplicated


def test_bucket_selection_reuses_caches_and_forwards(built):
    """A request takes the smallest bucket it fits; a shorter one after a longer one goes back to
    the small bucket's very cache and forward: nothing new is constructed."""
    dec = _decoder()
    n = TREE + 1
    _generate(dec, [(10, 0)])  # 10 + 20 + 8 = 38 slots -> 48
    small_cache, small_fwd = dec.caches[(1, 48)], dec.forwards[(1, 48, n)]
    assert built["forwards"] == [(1, 48, n)] and built["caches"] == [(1, 48)]
    _generate(dec, [(60, 1)])  # 88 slots -> 96
    assert built["forwards"] == [(1, 48, n), (1, 96, n)] and built["caches"] == [(1, 48), (1, 96)]
    calls = small_fwd.calls
    _generate(dec, [(20, 2)])  # exactly 48 slots: the small bucket again
    _generate(dec, [(10, 0)])
    assert len(built["forwards"]) == 2 and len(built["caches"]) == 2  # no new construction
    assert dec.caches[(1, 48)] is small_cache and dec.forwards[(1, 48, n)] is small_fwd
    assert small_fwd.calls > calls and small_fwd.cache is small_cache
    _generate(dec, [(21, 2)])  # 49 slots -> 96, already there
    assert len(built["forwards"]) == 2
    _generate(dec, [(10, 0), (21, 2)])  # a new batch size: its own cache and forward
    assert built["forwards"][-1] == (2, 96, n) and built["caches"][-1] == (2, 96)
    assert sorted(dec.forwards) == [(1, 48, n), (1, 96, n), (2, 96, n)]
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt \+ max_new_tokens \+ tree_size needs 208 cache "
                                         r"slots per sequence, the largest of cache_buckets is 192"):  # fmt: skip
        dec.generate(_prompt(180, 3), NEW)


def test_explicit_buckets_with_dynamic_shapes_keep_caches(built):
    model = _model()
    dec = SpecDecoder(model, OracleDrafter([], seed=3), tree_size=TREE, cache_buckets=BUCKETS, attn_impl="torch")
    assert not dec.static_shapes
    for _ in range(2):
        _generate(dec, [(10, 0)])
    assert built["caches"] == [(1, 48)] and built["forwards"] == [] and not dec.forwards


def test_release_drops_kept_state(built):
    dec = _decoder()
    _generate(dec, [(10, 0)])
    _generate(dec, [(10, 0), (60, 1)])
    assert sorted(dec.caches) == [(1, 48), (2, 96)]
    assert all(c.nbytes > 0 for c in dec.caches.values())
    layers, heads, dim = 2, 2, 16
    assert dec.caches[(2, 96)].nbytes == 2 * layers * 2 * heads * 96 * dim * 4  # fp32 K and V of every layer
    dec.release(batch_size=2)
    assert list(dec.caches) == [(1, 48)] and list(dec.forwards) == [(1, 48, TREE + 1)]
    dec.release()
    assert not dec.caches and not dec.forwards
    _generate(dec, [(10, 0)])  # made again
    assert built["forwards"].count((1, 48, TREE + 1)) == 2


# ---------------------------------------------------------------------------- warmup


@pytest.mark.parametrize("compile", [False, pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_warmup_builds_every_forward_and_generate_builds_none(built, compile):
    dec = _decoder(compile)
    n = TREE + 1
    messages: list[str] = []
    report = dec.warmup(batch_sizes=(2, 1), max_len=80, log=messages.append)  # 80 + 8 slots -> up to 96
    want = [(1, 48, n), (1, 96, n), (2, 48, n), (2, 96, n)]
    shared = [(2, 48, n, 48), (2, 96, n, 96)]  # B = 2 over a prompt shared through the (1, S) cache
    assert sorted(built["forwards"]) == sorted(want + shared) and sorted(built["caches"]) == [k[:2] for k in want]
    assert sorted(dec.forwards) == want and sorted(dec.shared_forwards) == shared
    assert [(e.batch_size, e.capacity, e.n) for e in report.entries] == want
    assert [e.shared_built for e in report.entries] == [False, False, True, True]
    for e in report.entries:
        assert e.built and e.seconds > 0 and 0 < e.prefill_s < e.seconds and 0 < e.first_run_s < e.seconds
        assert e.capture_s is None  # no CUDA graphs on CPU
    assert report.drafter_s == 0.0 and report.total_s >= sum(e.seconds for e in report.entries)
    assert report.compile_cache is None  # aot_eager: no inductor cache
    assert all(c.nbytes > 0 and c.lengths == [0] * c.batch_size for c in dec.caches.values())
    text = "\n".join(messages)
    assert "specdec warmup:" in text and "B=2 S=96 n=9" in text and "done in" in text
    built["forwards"].clear()
    built["caches"].clear()
    graphs_before = counters["stats"]["unique_graphs"]
    for shapes in ([(10, 0)], [(60, 1)], [(10, 0), (60, 1)], [(20, 2), (9, 4)], [(10, 0)]):
        _generate(dec, shapes)  # every prompt + 20 new tokens <= 80
    assert built["forwards"] == [] and built["caches"] == []
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing compiled after the warm-up
    assert all(g.calls > 1 for g in dec.forwards.values())
    again = dec.warmup(batch_sizes=(1,), max_len=80, log=None)  # everything exists: nothing new
    assert [e.built for e in again.entries] == [False, False] and built["forwards"] == []
    assert all(e.first_run_s is None for e in again.entries)


def test_warmup_limits_and_other_cache_modes(built):
    dec = _decoder()
    assert [e.capacity for e in dec.warmup(max_len=40, log=None).entries] == [48]  # 48 slots: the first bucket
    assert [e.capacity for e in dec.warmup(log=None).entries] == list(BUCKETS)  # None: every bucket
    fixed = _decoder(cache_buckets=None, max_cache_len=64)
    report = fixed.warmup(batch_sizes=(1, 3), log=None)
    assert [(e.batch_size, e.capacity) for e in report.entries] == [(1, 64), (3, 64)]
    assert sorted(fixed.caches) == [(1, 64), (3, 64)]
    with pytest.raises(ValueError, match=r"max_len: max_len \+ tree_size needs 68 cache slots per sequence, "
                                         r"max_cache_len is 64"):  # fmt: skip
        fixed.warmup(max_len=60, log=None)
    built["forwards"].clear()
    dynamic = SpecDecoder(_model(), OracleDrafter([], seed=3), tree_size=TREE, attn_impl="torch")
    report = dynamic.warmup(batch_sizes=(2,), max_len=30, log=None)
    entries = [(e.batch_size, e.capacity, e.n, e.built, e.first_run_s) for e in report.entries]
    assert entries == [(2, 38, 9, False, None)]  # a cache of exactly max_len + tree_size, not kept
    assert not dynamic.caches and not dynamic.forwards and built["forwards"] == []
    _generate(dynamic, [(10, 0), (4, 5)])


def test_warmup_of_one_request_builds_only_its_bucket(built):
    """min_len = max_len = prompt + max_new_tokens (bench-stalls --mode first-token): the one bucket
    generate then uses (the smallest holding prompt + max_new_tokens + tree_size), nothing else; the
    request builds nothing more. A shorter request later builds its own smaller bucket (the trade-off)."""
    n = TREE + 1
    for length, want in ((20, 48), (21, 96), (68, 96), (69, 192)):  # 20 + 20 + 8 = 48 fits 48; 21 does not
        dec = _decoder()
        built["forwards"].clear()
        need = length + NEW
        report = dec.warmup(batch_sizes=(1,), max_len=need, min_len=need, log=None)
        assert [e.capacity for e in report.entries] == [want] and built["forwards"] == [(1, want, n)]
        assert dec._capacity(need + TREE) == want  # the rule generate applies
        _generate(dec, [(length, 1)])
        assert built["forwards"] == [(1, want, n)]  # the request built nothing more
    _generate(dec, [(10, 2)])  # 10 + 20 + 8 = 38 slots: the 48 bucket, not warmed -> built now
    assert built["forwards"] == [(1, 192, n), (1, 48, n)]
    # a range: from the bucket of min_len to the bucket of max_len
    dec = _decoder()
    assert [e.capacity for e in dec.warmup(max_len=150, min_len=50, log=None).entries] == [96, 192]
    assert [e.capacity for e in _decoder().warmup(min_len=50, log=None).entries] == [96, 192]  # no max_len: to the top
    fixed = _decoder(cache_buckets=None, max_cache_len=64)
    assert [e.capacity for e in fixed.warmup(max_len=40, min_len=40, log=None).entries] == [64]
    dynamic = SpecDecoder(_model(), OracleDrafter([], seed=3), tree_size=TREE, attn_impl="torch")
    assert [e.capacity for e in dynamic.warmup(max_len=30, min_len=30, log=None).entries] == [38]
    with pytest.raises(ValueError, match=r"min_len: expected None or an int >= 2 \(prompt \+ max_new_tokens\), got 1"):
        dec.warmup(min_len=1, log=None)
    with pytest.raises(ValueError, match=r"min_len: expected at most max_len = 40, got 41"):
        dec.warmup(max_len=40, min_len=41, log=None)


def _shared_generate(dec: SpecDecoder, length: int, seed: int, copies: int = 3):
    """``num_return_sequences=copies`` of one prompt; every row checked against HF greedy."""
    ref = list(_ref(length, seed))
    dec.drafter.references = [ref] * copies
    out = dec.generate(_prompt(length, seed), NEW, num_return_sequences=copies)
    assert out.shared_prompt
    assert [out.sequences[b, : out.lengths[b]].tolist() for b in range(copies)] == [ref] * copies
    return out


def test_warmup_with_new_tokens_builds_every_shared_pair(built):
    """``new_tokens``: the rows of a shared prompt get the bucket of 1 + NEW + TREE = 29 slots (48),
    each prompt the bucket of its P = length - 1 tokens (48, 96, 192 for prompts of 30 .. 120 tokens):
    every such pair's forward, the batch-1 prompt caches and their fixed-shape prefill forwards are
    built by the warm-up; calls with prompts in three buckets then build nothing."""
    dec = _decoder(prefill_width=32)
    n = TREE + 1
    messages: list[str] = []
    report = dec.warmup(batch_sizes=(1, 3), max_len=120 + NEW, min_len=30 + NEW, new_tokens=NEW, log=messages.append)
    copy = [(1, 96, n), (1, 192, n), (3, 96, n), (3, 192, n)]  # the copy layout's buckets of min_len .. max_len
    pairs = [(3, 48, n, 48), (3, 48, n, 96), (3, 48, n, 192)]
    assert sorted(dec.forwards) == copy and sorted(dec.shared_forwards) == pairs
    assert sorted(dec.prefill_forwards) == [(1, 48), (1, 96), (1, 192), (3, 96), (3, 192)]
    assert sorted(dec.caches) == [(1, 48), (1, 96), (1, 192), (3, 48), (3, 96), (3, 192)]
    got = [(e.batch_size, e.capacity, e.prompt_capacity) for e in report.entries]
    assert got == [(1, 96, None), (1, 192, None), (3, 96, None), (3, 192, None), (3, 48, 48), (3, 48, 96), (3, 48, 192)]
    for e in report.entries[:4]:  # the copy layout: no equal-bucket shared forward with new_tokens
        assert e.built and not e.shared_built and e.shared_first_run_s is None and e.first_run_s > 0
    for e in report.entries[4:]:
        assert not e.built and e.first_run_s is None and e.capture_s is None and e.capture_warmup_s is None
        assert e.shared_built and 0 < e.shared_first_run_s < e.seconds and e.shared_capture_s is None
        assert e.prefill_n == 32 and 0 < e.prefill_s < e.seconds
    # the (1, 48) prompt cache's prefill forward is new here; those of 96 and 192 came with B = 1
    assert [(e.prefill_built, e.prefill_first_run_s is not None) for e in report.entries[4:]] == [
        (True, True), (False, False), (False, False)]
    text = "\n".join(messages)
    assert "shared prompts: rows of 48 slots (20 new tokens) over prompt caches of [48, 96, 192] slots" in text
    assert "B=3 S=48 n=9 shared prompt C=96: " in text
    kept = (dict(dec.forwards), dict(dec.shared_forwards), dict(dec.prefill_forwards), dict(dec.caches))
    built["forwards"].clear()
    built["caches"].clear()
    for length, seed in ((30, 1), (70, 2), (120, 3), (45, 4)):  # prompt caches of 48, 96, 192, 48
        _shared_generate(dec, length, seed)
    assert built["forwards"] == [] and built["caches"] == []
    assert (dict(dec.forwards), dict(dec.shared_forwards), dict(dec.prefill_forwards), dict(dec.caches)) == kept
    assert all(dec.shared_forwards[p].calls > 1 for p in pairs)
    again = dec.warmup(batch_sizes=(3,), max_len=120 + NEW, min_len=30 + NEW, new_tokens=NEW, log=None)
    assert [e.shared_built or e.built or e.prefill_built for e in again.entries] == [False] * 5
    assert built["forwards"] == [] and built["caches"] == []


def test_compiled_warmup_with_new_tokens_leaves_nothing_to_compile(built):
    """``compile`` (aot_eager): each shared pair's forward is traced by the warm-up, once; calls with
    prompts in both prompt buckets trace nothing more."""
    dec = _decoder("aot_eager", prefill_width=32)
    report = dec.warmup(batch_sizes=(3,), max_len=70 + NEW, new_tokens=NEW, shared="only", log=None)
    assert [(e.prompt_capacity, e.shared_built, e.shared_first_run_s > 0) for e in report.entries] == [
        (48, True, True), (96, True, True)]
    built["forwards"].clear()
    graphs_before = counters["stats"]["unique_graphs"]
    for length, seed in ((25, 5), (70, 6)):
        _shared_generate(dec, length, seed)
    assert built["forwards"] == [] and counters["stats"]["unique_graphs"] == graphs_before


def test_warmup_shared_only_skips_the_copy_layout_of_several_rows(built):
    """``shared="only"``: batches of several rows are all samples of one prompt: no ``[3, S]`` caches
    or forwards of the copy layout (the memory the shared layout saves); batch size 1 as always. Two
    calls with prompts in two buckets build nothing; the default (no ``new_tokens``) is unchanged."""
    dec = _decoder(prefill_width=32)
    n = TREE + 1
    report = dec.warmup(batch_sizes=(3,), max_len=70 + NEW, new_tokens=NEW, shared="only", log=None)
    assert [(e.batch_size, e.capacity, e.prompt_capacity) for e in report.entries] == [(3, 48, 48), (3, 48, 96)]
    assert dict(dec.forwards) == {} and sorted(dec.shared_forwards) == [(3, 48, n, 48), (3, 48, n, 96)]
    assert sorted(dec.caches) == [(1, 48), (1, 96), (3, 48)]  # no (3, 96): the rows' cache only
    assert sorted(dec.prefill_forwards) == [(1, 48), (1, 96)]
    assert [e.prefill_built for e in report.entries] == [True, True]
    built["forwards"].clear()
    built["caches"].clear()
    for length, seed in ((25, 5), (70, 6)):  # P = 24 -> 48; P = 69 -> 96
        out = _shared_generate(dec, length, seed)
        assert out.prefill_s > 0
    assert built["forwards"] == [] and built["caches"] == []
    # batch size 1 too, and a tighter range: min_len skips the smaller prompt bucket
    one = _decoder(prefill_width=32)
    report = one.warmup(batch_sizes=(1, 3), max_len=60 + NEW, min_len=50 + NEW, new_tokens=NEW, shared="only",
                        log=None)  # fmt: skip
    assert [(e.batch_size, e.capacity, e.prompt_capacity) for e in report.entries] == [(1, 96, None), (3, 48, 96)]
    assert report.entries[1].prefill_built is False  # B = 1 made the (1, 96) prefill forward
    # the copy layout when shared_prefix is off: what those calls use
    off = _decoder(prefill_width=32, shared_prefix=False)
    report = off.warmup(batch_sizes=(3,), max_len=40 + NEW, new_tokens=NEW, shared="only", log=None)
    assert [(e.batch_size, e.capacity, e.prompt_capacity) for e in report.entries] == [(3, 48, None), (3, 96, None)]
    assert dict(off.shared_forwards) == {}
    # one-token prompts only (max_len = new_tokens + 1): nothing to share
    assert _decoder().warmup(batch_sizes=(3,), max_len=NEW + 1, new_tokens=NEW, shared="only", log=None).entries == ()
    with pytest.raises(ValueError, match=r"new_tokens: expected None or an int >= 1 \(the calls' max_new_tokens\), "
                                         r"got 0"):  # fmt: skip
        dec.warmup(new_tokens=0, log=None)
    with pytest.raises(ValueError, match=r"new_tokens: expected None or an int >= 1"):
        dec.warmup(new_tokens=True, log=None)
    with pytest.raises(ValueError, match=r"new_tokens: expected less than max_len = 40 \(prompts of at least one "
                                         r"token\), got 40"):  # fmt: skip
        dec.warmup(max_len=40, new_tokens=40, log=None)
    with pytest.raises(ValueError, match=r"shared: 'only' needs new_tokens"):
        dec.warmup(shared="only", log=None)
    with pytest.raises(ValueError, match=r"shared: expected True, False or 'only', got 'all'"):
        dec.warmup(shared="all", log=None)
    with pytest.raises(ValueError, match=r"new_tokens: 1 \+ new_tokens \+ tree_size \(a shared prompt's rows\) needs "
                                         r"209 cache slots per sequence, the largest of cache_buckets is 192"):  # fmt: skip
        dec.warmup(batch_sizes=(3,), new_tokens=200, log=None)


def test_warmup_calls_the_drafters_warmup():
    class WarmDrafter(RandomTreeDrafter):
        def __init__(self):
            super().__init__(seed=0)
            self.calls = []

        def warmup(self, *, batch_sizes, max_len, log):
            self.calls.append((batch_sizes, max_len, log))
            time.sleep(0.01)

    drafter = WarmDrafter()
    dec = SpecDecoder(_model(), drafter, tree_size=TREE, static_shapes=True, cache_buckets=BUCKETS, attn_impl="torch")
    report = dec.warmup(batch_sizes=(2, 1, 2), max_len=40, log=None)
    assert drafter.calls == [((1, 2), 40, None)] and report.drafter_s >= 0.01
    prompt = _prompt(10, 0)
    assert dec.generate(prompt, NEW).sequences[0].tolist() == list(_ref(10, 0))

    class SampledWarmDrafter(WarmDrafter):  # a drafter whose warm-up takes the calls' sampling gets it
        def warmup(self, *, batch_sizes, max_len, log, sampling=None):
            self.calls.append((batch_sizes, sampling))

    sampled, config = SampledWarmDrafter(), SamplingConfig(0.8, top_p=0.9)
    dec = SpecDecoder(_model(), sampled, tree_size=TREE, static_shapes=True, cache_buckets=BUCKETS, attn_impl="torch")
    dec.warmup(batch_sizes=(1,), max_len=40, sampling=config)
    dec.warmup(batch_sizes=(1,), max_len=40)
    assert sampled.calls == [((1,), config), ((1,), None)]


def test_wrapped_model_warmup(built):
    import specdec

    fast = specdec.wrap(_model(), None, static_shapes=True, cache_buckets=BUCKETS, attn_impl="torch")
    report = fast.warmup(max_len=30, log=None)
    assert [(e.batch_size, e.capacity, e.n) for e in report.entries] == [(1, 48, 1)]  # plain decoding: n = 1
    built["forwards"].clear()
    want = _model().generate(_prompt(10, 0)[None], max_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(fast.generate(_prompt(10, 0)[None], max_new_tokens=NEW), want)
    assert built["forwards"] == []


def test_bucket_and_warmup_argument_errors():
    model = _model()
    least = r"cache_buckets: expected a non-empty sequence of ints >= 10 \(tree_size \+ 2\), got "
    with pytest.raises(ValueError, match=least + r"\[\]"):
        SpecDecoder(model, RandomTreeDrafter(), tree_size=TREE, static_shapes=True, cache_buckets=[])
    with pytest.raises(ValueError, match=least + r"\(64, 9\)"):
        SpecDecoder(model, RandomTreeDrafter(), tree_size=TREE, static_shapes=True, cache_buckets=(64, 9))
    with pytest.raises(ValueError, match=r"cache_buckets: expected a non-empty sequence of ints >= 2"):
        SpecDecoder(model, None, static_shapes=True, cache_buckets="64")
    with pytest.raises(ValueError, match=r"cache_buckets: expected a non-empty sequence of ints >= 2"):
        SpecDecoder(model, None, static_shapes=True, cache_buckets=(64.0,))
    with pytest.raises(ValueError, match=r"cache_buckets: expected None when max_cache_len is given, got \(64,\)"):
        SpecDecoder(model, None, static_shapes=True, cache_buckets=(64,), max_cache_len=64)
    dec = _decoder()
    for bad in ((), (0,), 2, (1, True), "1"):
        with pytest.raises(ValueError, match=r"batch_sizes: expected a non-empty sequence of ints >= 1"):
            dec.warmup(batch_sizes=bad, log=None)
    with pytest.raises(ValueError, match=r"max_len: expected None or an int >= 2 \(prompt \+ max_new_tokens\), got 1"):
        dec.warmup(max_len=1, log=None)
    with pytest.raises(ValueError, match=r"max_len: expected at most the target's context of 256 positions, got 300"):
        dec.warmup(max_len=300, log=None)
    with pytest.raises(ValueError, match=r"max_len: max_len \+ tree_size needs 258 cache slots per sequence, the "
                                         r"largest of cache_buckets is 192"):  # fmt: skip
        dec.warmup(max_len=250, log=None)
    with pytest.raises(ValueError, match=r"log: expected a callable or None, got str"):
        dec.warmup(log="stderr")
    with pytest.raises(ValueError, match=r"batch_size: expected None or an int >= 1, got 0"):
        dec.release(batch_size=0)
    assert not dec.caches  # nothing was warmed by the failed calls


# ---------------------------------------------------------------------------- step timing


def test_phase_timer_syncs_at_each_phase_end_and_nests():
    syncs = []
    timer = PhaseTimer(lambda: syncs.append(time.perf_counter()))
    with timer("verify"):
        time.sleep(0.01)
        with timer("forward"):
            time.sleep(0.02)
    with timer("draft"):
        pass
    with timer("draft"):
        time.sleep(0.01)
    assert len(syncs) == 4
    assert timer.seconds["verify"] >= timer.seconds["forward"] + 0.01 and timer.seconds["forward"] >= 0.02
    assert timer.seconds["draft"] >= 0.01 and timer.seconds["commit"] == 0.0


@pytest.mark.parametrize("static", [False, True])
def test_step_stats_phases(static):
    """draft / verify / commit cover the step's work, forward inside verify; the streaming
    callback is in no phase."""
    dec = SpecDecoder(_model(), OracleDrafter([list(_ref(10, 0))], seed=3), tree_size=TREE, static_shapes=static,
                      attn_impl="torch")  # fmt: skip
    seen = []
    start = time.perf_counter()
    out = dec.generate(_prompt(10, 0), NEW, on_tokens=lambda b, toks: seen.append(toks) or time.sleep(0.2))
    wall = time.perf_counter() - start
    assert out.sequences[0].tolist() == list(_ref(10, 0)) and sum(map(len, seen)) == NEW
    for s in out.steps:
        assert 0 < s.forward_s <= s.verify_s and s.draft_s > 0 and s.commit_s > 0
        assert s.draft_s + s.verify_s + s.commit_s < 0.2  # the sleeping callback is not in a phase
    phases = sum(s.draft_s + s.verify_s + s.commit_s for s in out.steps) + out.prefill_s
    assert phases < wall - 0.2 * len(out.steps) + 1e-3


# ---------------------------------------------------------------------------- torch.compile's on-disk cache


@pytest.fixture
def fresh_compile_cache(monkeypatch, tmp_path):
    """No compile-cache setting and no compiled code yet in this process: SPECDEC_HOME=tmp_path/home, no
    TORCHINDUCTOR_CACHE_DIR, dynamo reset and an empty layer-wise registry (``hf._COMPILED_FORWARDS`` is
    process-wide). The settings and the registry are restored afterwards; dynamo's cache is not (later
    calls recompile).

    The two torch settings are restored with torch's own ``config.patch``, never ``monkeypatch.setattr``:
    a torch config module serves its settings through ``__getattr__``, so pytest >= 9 finds no old value
    in the module's ``__dict__`` and undoes the patch with ``delattr`` -- which hides the setting for the
    rest of the process (``torch._inductor.config.fx_graph_cache does not exist`` in the next test)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from specdec import hf

    torch._dynamo.reset()
    monkeypatch.setattr(hf, "_COMPILED_FORWARDS", {})
    monkeypatch.setattr(graphs, "_compile_cache_dir", None)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.setenv(var, "x")  # remembers the current state ...
        monkeypatch.delenv(var)  # ... then unsets it
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    with inductor_config.patch(fx_graph_cache=inductor_config.fx_graph_cache), \
            functorch_config.patch(enable_autograd_cache=functorch_config.enable_autograd_cache):
        yield tmp_path


def test_compile_cache_directory(monkeypatch, fresh_compile_cache):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    tmp_path = fresh_compile_cache
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    want = str(tmp_path / "home" / "compile-cache")
    assert graphs.configure_compile_cache() == want
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == want
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "other"))
    assert graphs.configure_compile_cache() == want  # once per process
    monkeypatch.setattr(graphs, "_compile_cache_dir", None)
    assert graphs.configure_compile_cache() == str(tmp_path / "other")  # the user's choice wins
    monkeypatch.setattr(graphs, "_compile_cache_dir", None)
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    inductor_config.fx_graph_cache = False  # restored by the fixture
    graphs.configure_compile_cache()
    assert not inductor_config.fx_graph_cache  # the environment decides


def test_importing_sets_no_compile_cache():
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = "import os, specdec, specdec.engine, specdec.graphs; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor needs a C++ compiler on CPU")  # fmt: skip
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit modules inductor imports on CPU
def test_inductor_compile_fills_and_reuses_the_persistent_cache(fresh_compile_cache):
    """compile=True: the first compiled forward points inductor at $SPECDEC_HOME/compile-cache; after
    dynamo forgets it (as a new process would), the same shape is loaded from that cache."""
    tmp_path = fresh_compile_cache
    model = _model()
    ref = list(_ref(6, 7, 8))

    def make():
        return SpecDecoder(model, None, static_shapes=True, compile=True, max_cache_len=24, attn_impl="torch")

    misses, hits = counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
    report = make().warmup(max_len=14, log=None)
    want = str(tmp_path / "home" / "compile-cache")
    assert report.compile_cache == want and os.environ["TORCHINDUCTOR_CACHE_DIR"] == want
    # compiled (a miss each): one graph alone in a process, 3 after some earlier tests of the suite (not
    # traced down; the property under test is that the second warm-up compiles none of them anew)
    assert counters["inductor"]["fxgraph_cache_miss"] > misses
    assert any((tmp_path / "home" / "compile-cache").rglob("*"))
    misses = counters["inductor"]["fxgraph_cache_miss"]
    torch._dynamo.reset()
    dec = make()
    dec.warmup(max_len=14, log=None)
    assert counters["inductor"]["fxgraph_cache_hit"] > hits  # loaded from the cache ...
    assert counters["inductor"]["fxgraph_cache_miss"] == misses  # ... and nothing compiled anew
    assert dec.generate(_prompt(6, 7), 8).sequences[0].tolist() == ref


# ---------------------------------------------------------------------------- CUDA graphs (GPU only)


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
def test_cuda_graph_warmup_then_prompts_within_the_buckets_capture_nothing(monkeypatch, compile):
    model = tiny_model("qwen2").to("cuda")
    prepare_model(model)
    lengths = (10, 60, 100, 10, 35)  # + 20 new + 8 tree slots: 48, 96, 192, 48, 96
    refs = {}
    for length in lengths:
        ids = _prompt(length, length)[None].to("cuda")
        refs[length] = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                      attention_mask=torch.ones_like(ids))[0].tolist()  # fmt: skip
    dec = SpecDecoder(model, RandomTreeDrafter(seed=0), tree_size=TREE, cache_buckets=BUCKETS, compile=compile)
    assert dec.cuda_graphs and dec.static_shapes
    report = dec.warmup(batch_sizes=(1,), max_len=120, log=None)
    assert [e.capacity for e in report.entries] == list(BUCKETS)
    assert all(e.built and e.capture_s is not None and e.first_run_s is not None for e in report.entries)
    assert all(0 <= e.capture_warmup_s <= e.capture_s for e in report.entries)  # the split of the capture (v9)
    assert all(g.captured for g in dec.forwards.values())
    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *a, **k: captures.append(self) or begin(self, *a, **k))  # fmt: skip
    graphs_before = counters["stats"]["unique_graphs"]
    forwards = dict(dec.forwards)
    for length in lengths:
        out = dec.generate(_prompt(length, length), NEW)
        assert out.sequences[0].tolist() == refs[length]
    assert captures == [] and counters["stats"]["unique_graphs"] == graphs_before
    assert dict(dec.forwards) == forwards and all(g.calls > 1 for g in forwards.values())
    dec.generate(_prompt(10, 10), NEW, do_sample=True, generator=torch.Generator(device="cuda").manual_seed(0))
    dec.generate([_prompt(10, 10), _prompt(30, 30)], NEW)  # batch 2 was not warmed: captured now
    assert len(captures) == 1

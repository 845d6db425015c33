"""``specdec.graphs.GreedyChunk`` and ``SpecDecoder(decode_chunk=)``: greedy plain decoding, several
steps per replay with the device feeding each step's argmax to the next.

CPU (CI): the chunk's eager mode (the body a CUDA graph records) against HF greedy ``generate`` in
fp32, token for token: batches of prompts of different lengths, eos inside a chunk, budgets that
no chunk size divides, a shared prompt, streaming, warm-up, and the argument checks. CUDA only:
the captured chunk against the same engine one step at a time.
"""

from __future__ import annotations

import pytest
import torch

from specdec import KVCache, SpecDecoder
from specdec.graphs import GraphedForward, GreedyChunk
from tests.specdec.helpers import hf_greedy, prepared_tiny_model, random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _decoder(model, chunk: int, **kwargs) -> SpecDecoder:
    kwargs.setdefault("max_cache_len", 96)
    return SpecDecoder(model, None, static_shapes=True, cuda_graphs=False, attn_impl="torch", decode_chunk=chunk,
                       **kwargs)  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_plain_decoding_equals_hf_greedy(family, chunk):
    """Three prompts of different lengths in one batch, 19 new tokens (no chunk size divides it):
    every row equals HF greedy, and the steps' statistics are one token per row and step."""
    model = prepared_tiny_model(family)
    prompts = [random_prompt(L, seed) for L, seed in ((5, 1), (13, 2), (1, 3))]
    refs = [hf_greedy(model, p, 19) for p in prompts]
    dec = _decoder(model, chunk)
    out = dec.generate(prompts, 19)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : len(ref)].tolist() == ref
    assert len(out.steps) == 19
    assert all(s.tokens_emitted == (1, 1, 1) and s.nodes_proposed == (0, 0, 0) for s in out.steps)
    (c,) = dec._chunks.values()
    assert c.steps == chunk and c.calls == 19 // chunk  # then 19 % chunk single steps
    (gf,) = dec._graphs.values()
    assert gf.calls == 19 % chunk


@pytest.mark.parametrize("chunk", [4, 8])
def test_eos_inside_a_chunk_ends_that_row_only(chunk):
    """Row 0's eos falls inside a chunk: it keeps its tokens up to the eos and stops; the other rows go
    on to the budget, equal to HF greedy with the same eos (which never appears in their output)."""
    model = prepared_tiny_model("qwen2")
    prompts = [random_prompt(L, seed) for L, seed in ((7, 10), (4, 11), (9, 12))]
    plain = [hf_greedy(model, p, 24) for p in prompts]
    eos = plain[0][7 + 5]  # row 0's 6th new token
    refs = [hf_greedy(model, p, 24, eos=eos) for p in prompts]
    dec = _decoder(model, chunk)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    out = dec.generate(prompts, 24, eos_token_id=eos, pad_token_id=0,
                       on_tokens=lambda b, toks: streamed[b].extend(toks))  # fmt: skip
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        new = ref[len(p) :]
        assert out.new_tokens(b).tolist()[: len(new)] == new
        assert streamed[b] == new  # every token streamed once, in order
        got = out.lengths[b] - out.prompt_lengths[b]
        assert got == (new.index(eos) + 1 if eos in new else 24)
    assert out.lengths[0] - out.prompt_lengths[0] == 6
    emitted = [sum(s.tokens_emitted[b] for s in out.steps) for b in range(3)]
    assert emitted == [n - p for n, p in zip(out.lengths, out.prompt_lengths)]
    # a chunk whose step comes after row 0's eos emits nothing for row 0
    assert all(s.tokens_emitted[0] == 0 for s in out.steps[6:])


def test_chunk_path_matches_one_step_at_a_time_and_off_switch():
    """decode_chunk=0 never makes a chunk; both give the same tokens over two calls of one decoder
    (the second reuses the chunk and its forward)."""
    model = prepared_tiny_model("llama")
    prompt = random_prompt(11, 4)
    off = _decoder(model, 0)
    on = _decoder(model, 5)
    for new in (17, 10):
        a = off.generate(prompt, new).sequences[0].tolist()
        b = on.generate(prompt, new).sequences[0].tolist()
        assert a == b == hf_greedy(model, prompt, new)
    assert not off._chunks
    (c,) = on._chunks.values()
    assert c.calls == 17 // 5 + 10 // 5


def test_sampling_and_drafters_do_not_chunk():
    model = prepared_tiny_model("qwen2")
    dec = _decoder(model, 4)
    dec.generate(random_prompt(6, 5), 12, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert not dec._chunks  # sampling: one step at a time


def test_shared_prompt_rows_decode_in_chunks():
    """num_return_sequences = 3 of one prompt over the shared layout: three equal greedy rows."""
    model = prepared_tiny_model("qwen2")
    prompt = random_prompt(12, 6)
    ref = hf_greedy(model, prompt, 14)
    dec = _decoder(model, 4, shared_prefix=True, max_cache_len=None, cache_buckets=(32, 64))
    out = dec.generate(prompt, 14, num_return_sequences=3)
    assert out.shared_prompt
    for b in range(3):
        assert out.sequences[b].tolist() == ref
    (c,) = dec._chunks.values()
    assert c.forward.shared is not None and c.calls == 3


def test_warmup_runs_the_chunk_of_every_bucket():
    model = prepared_tiny_model("qwen2")
    dec = _decoder(model, 4, max_cache_len=None, cache_buckets=(32, 64))
    report = dec.warmup(batch_sizes=(1, 2), shared=False, log=None)
    assert sorted(dec._chunks) == [(1, 32, 0), (1, 64, 0), (2, 32, 0), (2, 64, 0)]
    assert all(c.calls == 1 for c in dec._chunks.values())
    assert all(e.chunk_capture_s is None for e in report.entries)  # eager on CPU: nothing captured
    calls = {k: c.calls for k, c in dec._chunks.items()}
    prompt = random_prompt(9, 7)
    assert dec.generate(prompt, 12).sequences[0].tolist() == hf_greedy(model, prompt, 12)
    assert dec._chunks[(1, 32, 0)].calls == calls[(1, 32, 0)] + 3  # the warmed chunk, no new one
    assert len(dec._chunks) == 4


def test_greedy_chunk_checks_its_arguments():
    model = prepared_tiny_model("qwen2")
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=r"decode_chunk: expected an int >= 0"):
            _decoder(model, bad)
    cache = KVCache(1, 16)
    with pytest.raises(ValueError, match=r"forward: expected a GraphedForward of n = 1, got GraphedForward of n = 3"):
        GreedyChunk(GraphedForward(model, cache, 1, 3, impl="torch"), 2)
    with pytest.raises(ValueError, match=r"forward: expected a GraphedForward of n = 1, got str"):
        GreedyChunk("forward", 2)
    fwd = GraphedForward(model, cache, 1, 1, impl="torch")
    for bad in (0, False, 1.5):
        with pytest.raises(ValueError, match=r"steps: expected an int >= 1"):
            GreedyChunk(fwd, bad)
    chunk = GreedyChunk(fwd, 4)
    with pytest.raises(ValueError, match=r"prefix_lens: expected prefix_len \+ steps \(4\) <= the cache capacity 16, got 13"):
        chunk.run([3], [13])
    with pytest.raises(ValueError, match=r"roots: expected 1 root tokens, got 2"):
        chunk.run([3, 4], [0])


@cuda_only
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_captured_chunk_equals_one_step_at_a_time(compile):
    """The captured chunk (8 steps, one replay) gives the engine's tokens one step at a time, in fp32,
    batch 2, with eos in one row; a warm-up captures it, and later calls capture nothing."""
    from tests.specdec.helpers import tiny_model
    from specdec.hf import prepare_model

    model = tiny_model("qwen2").cuda()
    prepare_model(model)
    prompts = [random_prompt(L, seed) for L, seed in ((30, 1), (7, 2))]
    kw = dict(static_shapes=True, cuda_graphs=True, compile=compile, max_cache_len=128)
    step = SpecDecoder(model, None, decode_chunk=0, **kw)
    ref = step.generate([p.cuda() for p in prompts], 40)
    eos = ref.new_tokens(1).tolist()[11]
    ref = step.generate([p.cuda() for p in prompts], 40, eos_token_id=eos)
    dec = SpecDecoder(model, None, decode_chunk=8, **kw)
    report = dec.warmup(batch_sizes=(2,), log=None)
    assert any(e.chunk_capture_s is not None for e in report.entries)
    out = dec.generate([p.cuda() for p in prompts], 40, eos_token_id=eos)
    assert out.sequences.tolist() == ref.sequences.tolist()
    # The warm-up also captures the shared-prompt variant (key (B, capacity, shared capacity)); these
    # prompts differ, so the call ran the copy layout's chunk.
    (c,) = [c for key, c in dec._chunks.items() if key[2] == 0]
    assert c.graph is not None and c.calls == 1 + 5

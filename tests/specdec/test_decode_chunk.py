"""``specdec.decode_chunk.DecodeChunk`` and ``SpecDecoder(decode_chunk=)``: plain decoding, several steps
per replay with the device feeding each step's argmax (greedy) or sampled token to the next.

CPU (CI): the chunk's eager mode (the body a CUDA graph records) against HF greedy ``generate`` in
fp32, token for token: batches of prompts of different lengths, eos inside a chunk, budgets that
no chunk size divides, a shared prompt, streaming, warm-up, and the argument checks; sampled
chunks against the target's exact distributions (chi-square over the rows of one call, so
independence between rows is tested too) and, with ``top_k=1``, against greedy. CUDA only: the
captured chunk against the same engine one step at a time (greedy), and the captured sampled chunk
against exact distributions.
"""

from __future__ import annotations

import pytest
import torch

from specdec import KVCache, SamplingConfig, SpecDecoder, logits_to_probs
from specdec.decode_chunk import DecodeChunk
from specdec.graphs import GraphedForward
from tests.specdec.helpers import chi2_fails, hf_greedy, prepared_tiny_model, random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_drafters_do_not_chunk():
    from tests.specdec.helpers import RandomTreeDrafter

    model = prepared_tiny_model("qwen2")
    dec = SpecDecoder(model, RandomTreeDrafter(seed=1), tree_size=4, static_shapes=True, cuda_graphs=False,
                      attn_impl="torch", decode_chunk=4, max_cache_len=96)  # fmt: skip
    dec.generate(random_prompt(6, 5), 12, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert not dec._chunks  # drafting: one step (one tree) at a time


def _exact(model, ids: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """float64 ``[V]``: the target's warped next-token distribution after ``ids`` (fp32 HF forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return logits_to_probs(logits, sampling).double()


def _binned(counts: torch.Tensor, probs: torch.Tensor, bins: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``bins - 1`` likeliest tokens each a bin of their own, every other token one more bin (no
    bin of a few expected draws, where the chi-square approximation fails)."""
    top = probs.topk(bins - 1).indices
    rest = torch.ones_like(probs, dtype=torch.bool)
    rest[top] = False
    return (torch.cat([counts[top], counts[rest].sum()[None]]),
            torch.cat([probs[top], probs[rest].sum()[None]]))  # fmt: skip


def _sample_rows(dec, prompt, new: int, sampling: SamplingConfig, rows: int, calls: int, seed: int,
                 device="cpu") -> list[list[int]]:  # fmt: skip
    """``calls`` x ``rows`` sampled continuations of ``prompt`` (num_return_sequences rows a call)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(calls):
        res = dec.generate(prompt.to(device), new, do_sample=True, temperature=sampling.temperature,
                           top_k=sampling.top_k, top_p=sampling.top_p, num_return_sequences=rows, generator=gen)
        out += [res.new_tokens(b).tolist() for b in range(rows)]
    return out


def _assert_lossless(model, prompt, samples: list[list[int]], sampling: SamplingConfig) -> None:
    """The first token's marginal and the second's given the likeliest first are the target's."""
    vocab = model.config.vocab_size
    p1 = _exact(model, prompt.tolist(), sampling)
    first = torch.bincount(torch.tensor([s[0] for s in samples]), minlength=vocab).double()
    assert not chi2_fails(*_binned(first, p1))
    mode = int(first.argmax())
    after = [s[1] for s in samples if s[0] == mode]
    assert len(after) >= 300  # enough draws to test the conditional
    p2 = _exact(model, prompt.tolist() + [mode], sampling)
    second = torch.bincount(torch.tensor(after), minlength=vocab).double()
    assert not chi2_fails(*_binned(second, p2))


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=20, top_p=0.9)],
                         ids=["t1", "t0.7-topk-topp"])  # fmt: skip
@pytest.mark.parametrize("shared", [True, False])
def test_sampled_chunks_draw_from_the_target(sampling, shared):
    """Sampled plain decoding in chunks of 2 (3 new tokens: a chunk for the first two, then one step)
    over the shared prompt or a copy per row: 2,400 rows of 8 calls; the first token's marginal and
    the second's conditional on the likeliest first match the target's warped distributions."""
    model = prepared_tiny_model("qwen2")
    prompt = random_prompt(9, 21)
    dec = _decoder(model, 2, shared_prefix=shared, max_cache_len=None, cache_buckets=(32, 64))
    samples = _sample_rows(dec, prompt, 3, sampling, rows=300, calls=8, seed=5)
    _assert_lossless(model, prompt, samples, sampling)
    (c,) = dec._chunks.values()
    assert c.sampling == sampling and c.calls == 8 and (c.forward.shared is not None) == shared


def test_sampled_chunk_with_top_k_1_is_greedy_and_checks_its_arguments():
    """top_k = 1 leaves one token per row: chunks of 3 over 17 new tokens give HF greedy's tokens, for
    a batch of prompts; a sampling argument that is no SamplingConfig is a ValueError."""
    model = prepared_tiny_model("llama")
    prompts = [random_prompt(L, seed) for L, seed in ((5, 31), (12, 32))]
    dec = _decoder(model, 3)
    out = dec.generate(prompts, 17, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0))
    for b, p in enumerate(prompts):
        ref = hf_greedy(model, p, 17)
        assert out.sequences[b, : len(ref)].tolist() == ref
    (c,) = dec._chunks.values()
    assert c.sampling == SamplingConfig(1.0, top_k=1) and c.calls == 17 // 3
    fwd = GraphedForward(model, KVCache(1, 16), 1, 1, impl="torch")
    with pytest.raises(ValueError, match=r"sampling: expected None \(greedy\) or a specdec.SamplingConfig, got dict"):
        DecodeChunk(fwd, 2, {"temperature": 1.0})


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
    assert sorted(dec._chunks) == [(1, 32, 0, None), (1, 64, 0, None), (2, 32, 0, None), (2, 64, 0, None)]
    assert all(c.calls == 1 for c in dec._chunks.values())
    assert all(e.chunk_capture_s is None for e in report.entries)  # eager on CPU: nothing captured
    calls = {k: c.calls for k, c in dec._chunks.items()}
    prompt = random_prompt(9, 7)
    assert dec.generate(prompt, 12).sequences[0].tolist() == hf_greedy(model, prompt, 12)
    assert dec._chunks[(1, 32, 0, None)].calls == calls[(1, 32, 0, None)] + 3  # the warmed chunk, no new one
    assert len(dec._chunks) == 4


def test_warmup_with_sampling_runs_the_sampled_chunks_too():
    """warmup(sampling=) runs the sampled chunk of every warmed forward beside the greedy one, so
    sampled calls over prompts of both prompt buckets make no chunk (and so, on CUDA, no capture)."""
    model = prepared_tiny_model("qwen2")
    dec = _decoder(model, 4, shared_prefix=True, max_cache_len=None, cache_buckets=(32, 64))
    sampling = SamplingConfig(0.8)
    dec.warmup(batch_sizes=(3,), max_len=60, new_tokens=12, shared="only", sampling=sampling, log=None)
    assert {key[3] for key in dec._chunks} == {None, sampling}
    assert {key[2] for key in dec._chunks if key[3] == sampling} == {32, 64}  # both prompt capacities
    before = dict(dec._chunks)
    gen = torch.Generator().manual_seed(3)
    for length in (9, 40):
        dec.generate(random_prompt(length, 40 + length), 12, do_sample=True, temperature=0.8, num_return_sequences=3,
                     generator=gen)  # fmt: skip
    assert dec._chunks == before
    with pytest.raises(ValueError, match=r"sampling: expected None or a specdec.SamplingConfig, got float"):
        dec.warmup(batch_sizes=(1,), max_len=20, sampling=0.8, log=None)


def test_decode_chunk_checks_its_arguments():
    model = prepared_tiny_model("qwen2")
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=r"decode_chunk: expected an int >= 0"):
            _decoder(model, bad)
    cache = KVCache(1, 16)
    with pytest.raises(ValueError, match=r"forward: expected a GraphedForward of n = 1, got GraphedForward of n = 3"):
        DecodeChunk(GraphedForward(model, cache, 1, 3, impl="torch"), 2)
    with pytest.raises(ValueError, match=r"forward: expected a GraphedForward of n = 1, got str"):
        DecodeChunk("forward", 2)
    fwd = GraphedForward(model, cache, 1, 1, impl="torch")
    for bad in (0, False, 1.5):
        with pytest.raises(ValueError, match=r"steps: expected an int >= 1"):
            DecodeChunk(fwd, bad)
    chunk = DecodeChunk(fwd, 4)
    with pytest.raises(ValueError, match=r"prefix_lens: expected prefix_len \+ steps \(4\) <= the cache capacity 16, got 13"):
        chunk.run([3], [13])
    with pytest.raises(ValueError, match=r"roots: expected 1 root tokens, got 2"):
        chunk.run([3, 4], [0])


@pytest.mark.cuda
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
    # The warm-up also captures the shared-prompt variant (key (B, capacity, shared capacity, None)); these
    # prompts differ, so the call ran the copy layout's chunk.
    (c,) = [c for key, c in dec._chunks.items() if key[2] == 0]
    assert c.graph is not None and c.calls == 1 + 5
    assert all(s.capture_s == 0.0 for s in out.steps)  # captured by the warm-up, not in the call
    # without a warm-up the call's first chunk captures: its steps carry the capture's share (the budget
    # rule leaves them out), the later ones nothing
    cold = SpecDecoder(model, None, decode_chunk=8, **kw).generate([p.cuda() for p in prompts], 40, eos_token_id=eos)
    assert cold.sequences.tolist() == ref.sequences.tolist()
    assert all(s.capture_s > 0 for s in cold.steps[:8]) and all(s.capture_s == 0.0 for s in cold.steps[8:])


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_captured_sampled_chunk_draws_from_the_target(compile):
    """The captured sampled chunk (one replay of 2 steps) over a shared prompt, fp32, a CUDA
    generator: the first token's marginal and the second's conditional are the target's."""
    from tests.specdec.helpers import tiny_model
    from specdec.hf import prepare_model

    model = tiny_model("qwen2").cuda()
    prepare_model(model)
    prompt = random_prompt(9, 21)
    sampling = SamplingConfig(0.8)
    dec = SpecDecoder(model, None, decode_chunk=2, static_shapes=True, cuda_graphs=True, compile=compile,
                      cache_buckets=(32, 64))  # fmt: skip
    samples = _sample_rows(dec, prompt, 3, sampling, rows=400, calls=6, seed=7, device="cuda")
    _assert_lossless(model.cpu(), prompt, samples, sampling)
    (c,) = [c for key, c in dec._chunks.items() if key[3] == sampling]
    assert c.graph is not None and c.calls == 6


@pytest.mark.cuda
def test_cuda_warmup_with_sampling_captures_every_sampled_chunk():
    """On CUDA the warm-up with ``sampling`` captures the sampled chunks of both prompt buckets; the
    sampled calls that follow capture nothing (the one stall of 164 HumanEval calls of the 2026-11-27 run `e993e6d`: the
    first prompt of the smaller bucket captured its sampled chunk mid-run)."""
    from tests.specdec.helpers import tiny_model
    from specdec.hf import prepare_model

    model = tiny_model("qwen2").cuda()
    prepare_model(model)
    sampling = SamplingConfig(0.8)
    dec = SpecDecoder(model, None, decode_chunk=4, static_shapes=True, cuda_graphs=True, cache_buckets=(32, 64))
    dec.warmup(batch_sizes=(3,), max_len=60, new_tokens=12, shared="only", sampling=sampling, log=None)
    sampled = {key: c for key, c in dec._chunks.items() if key[3] == sampling}
    assert {key[2] for key in sampled} == {32, 64} and all(c.graph is not None for c in sampled.values())
    before = dict(dec._chunks)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for length in (9, 40):
        dec.generate(random_prompt(length, 40 + length).cuda(), 12, do_sample=True, temperature=0.8,
                     num_return_sequences=3, generator=gen)  # fmt: skip
    assert dec._chunks == before and [c.calls for c in sampled.values()] == [1 + 3, 1 + 3]  # 12 tokens: 3 chunks


def test_release_drops_the_chunks_with_their_graphs():
    """A chunk holds a CUDA graph of its own (with a tensor-parallel target, of NCCL collectives, which
    keep the communicator from being destroyed): ``release`` drops it with the forwards."""
    model = prepared_tiny_model("qwen2")
    dec = _decoder(model, 4, max_cache_len=None, cache_buckets=(32, 64))
    dec.warmup(batch_sizes=(1, 2), shared=False, log=None)
    dec.release(batch_size=2)
    assert sorted(dec._chunks) == [(1, 32, 0, None), (1, 64, 0, None)]
    dec.release()
    assert not dec._chunks
